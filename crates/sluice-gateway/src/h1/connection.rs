//! Each request on a fast-path connection through the edge's phases (see
//! `sluice_edge::Intake` and `sluice_edge::exchange`): head, body, plan,
//! admission, then the exchange with the upstream.

use std::io;
use std::sync::Arc;

use bytes::{Buf as _, Bytes};
use http::{Method, Response};
use sluice_edge::{Forward, Limiter, RequestId};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::proxy::{Failure, upstream_failure};
use crate::store::AnyStore;
use sluice_h1::response;

use super::MAX_BUFFERED_BODY;
use super::access::Access;
use super::buffers::{Connection, Next, Timers, may_end_head, read_more};
use super::encode::{own, push_date, push_field};
use super::exchange::{Exchanged, REPLACED_FIELDS, Relay};
use super::request;
use super::settle::Settlement;

/// A request admitted on the fast path, to be forwarded (see
/// [`Connection::forward`]).
struct Admitted {
    /// The connection closes after it.
    close: bool,
    head_request: bool,
    /// It may be sent again on a new connection when a kept-alive one fails.
    repeatable: bool,
    id: RequestId,
    access: Option<Access>,
    in_flight: crate::metered::InFlight,
    /// The body whole in its own buffer; empty when it is in `from_client`.
    held: Bytes,
    /// Where the body is in `from_client` when it is there.
    body: std::ops::Range<usize>,
    /// Bytes of `from_client` the request takes up.
    consumed: usize,
    /// An OpenAI stream sluice asked for its usage: the usage-only chunk is not the
    /// client's.
    hide_usage: bool,
}

impl<'f> Connection<'f> {
    /// Serves one request.
    pub(super) async fn one_request(
        &mut self,
        client: &mut TcpStream,
        draining: &mut watch::Receiver<bool>,
        timers: &mut Timers,
        max_head: usize,
    ) -> io::Result<Next> {
        let fast = self.fast;
        // The policy of this request, whatever a reload does meanwhile.
        let current = fast.limiter.load_full();
        let limiter = &*current;
        let head = match self
            .read_head(client, draining, timers, max_head, limiter)
            .await?
        {
            Ok(head) => head,
            Err(next) => return Ok(next),
        };

        let id = head.request_id;
        let policy = limiter.policy();
        // What the access line says of the request (copied only when it is kept).
        let access = fast
            .access_log
            .then(|| Access::new(&head.method, &self.from_client, self.peer));
        let head_request = head.method == Method::HEAD;
        let body_len = usize::try_from(head.body_len).unwrap_or(usize::MAX);
        let (head_len, end) = (head.len, head.len.saturating_add(body_len));
        // Phase 1 done (see `sluice_edge::Intake`): the edge owns what follows
        // until the request is planned; this path does only its own reading.
        let mut intake = limiter.intake(head.route, self.peer);
        // A batch lane's endpoints are answered by the service stack's batch lanes.
        if intake.route().is_some_and(|r| r.batch.is_some()) {
            return Ok(Next::Elsewhere);
        }
        // An LLM route's endpoints count their bodies each their own way.
        if let Some(path) = &head.llm_path {
            intake.set_path(path);
        }
        // A refused head is answered at once, as the service stack answers it; its
        // body is skipped when it is here already, else the connection closes.
        if let Some(answer) = intake.refused(Some(&id)) {
            let in_flight = fast.stats.request();
            let close = head.close || end > self.from_client.len();
            if !close {
                self.from_client.advance(end);
            }
            return self
                .answer_own(client, answer, close, head_request, in_flight, &id, access)
                .await;
        }
        // Phase 2: a body the route is classified by is taken in whole within the
        // policy's bound (one announced past it is not read: decided, then 413);
        // any other up to what the fast path holds, a longer one streaming through
        // hyper (both ways at once).
        let needs_body = intake.body_bound().is_some();
        let too_large = intake.too_large(head.body_len);
        if !needs_body && head.body_len > MAX_BUFFERED_BODY as u64 {
            return Ok(Next::Elsewhere);
        }
        // Counted from its head, as the service stack counts a request.
        let in_flight = fast.stats.request();
        let held = if too_large {
            Ok(None)
        } else {
            self.read_body(client, timers, (head_len, end), &mut intake)
                .await
        };
        let held = match held {
            Ok(held) => held,
            // It stopped coming, came too slowly, the client left, or the bound (or
            // the client's share) is full: answered (when it still can be) as the
            // service stack answers, and the connection closes with the rest unread.
            Err(failure) => {
                let answer = intake.body_refusal(failure);
                return self
                    .answer_own(client, answer, true, head_request, in_flight, &id, access)
                    .await;
            }
        };
        // The body: in place after the head, or whole in its own buffer (nothing
        // of one past the bound was read).
        let (body, consumed) = match (&held, too_large) {
            (_, true) => (head_len..head_len, head_len),
            (None, false) => (head_len..end, end),
            (Some(whole), false) => (0..whole.len(), head_len),
        };
        let held = held.unwrap_or_default();
        let body_bytes: &[u8] = if held.is_empty() {
            &self.from_client[body.clone()]
        } else {
            &held
        };
        // A batch lane's tool call is answered by the service stack's batch lanes:
        // the request goes there whole (nothing of it was answered or decided).
        let jsonrpc = intake
            .route()
            .is_some_and(|r| r.class == sluice_policy::RouteClass::JsonRpc);
        if jsonrpc && !too_large && sluice_edge::may_call_batch_tool(policy, body_bytes) {
            in_flight.handed_over();
            // hyper reads the request again from the bytes read: the head, then this.
            self.from_client.extend_from_slice(&held);
            return Ok(Next::Elsewhere);
        }
        // Phases 3 and 4: planned and admitted; a request that cannot be counted
        // (refused before anything is decided), a refusal, a body past the bound,
        // or a limiter that cannot decide, is answered here.
        let planned = intake.planned(&self.identity, None, Some(body_bytes));
        // A call waiting for its lane's place waits while its client is there:
        // one that hangs up leaves the line (its place, start, budgets and the
        // upstream's work are nobody's), and the connection closes.
        let admitted = if planned.plan().is_ok_and(|p| p.lane.is_some()) {
            let admit = planned.admit(Some(&id));
            tokio::pin!(admit);
            tokio::select! {
                admitted = &mut admit => admitted,
                // Returning drops the waiting call, and with it its place in line.
                () = client_gone(client) => return Ok(Next::Close),
            }
        } else {
            planned.admit(Some(&id)).await
        };
        let forward = match admitted {
            Ok(forward) => forward,
            Err(answer) => {
                self.from_client.advance(consumed);
                return self
                    .answer_own(
                        client,
                        answer,
                        head.close || too_large,
                        head_request,
                        in_flight,
                        &id,
                        access,
                    )
                    .await;
            }
        };

        // An OpenAI stream that does not ask for its usage is asked for it, so its
        // token budgets settle at the truth; the client does not see it (SPEC T3).
        let asked = match (&head.llm_path, forward.plan().llm) {
            (Some(path), Some(sluice_policy::LlmFormat::OpenAi)) => {
                sluice_edge::tokens::ask_stream_usage(path, body_bytes)
            }
            _ => None,
        };
        let hide_usage = asked.is_some();
        let (held, body) = match asked {
            Some(asked) => {
                super::request::set_content_length(&mut self.to_upstream, asked.len());
                let len = asked.len();
                (Bytes::from(asked), 0..len)
            }
            None => (held, body),
        };
        let admitted = Admitted {
            hide_usage,
            close: head.close,
            head_request,
            repeatable: head.method.is_idempotent(),
            id,
            access,
            in_flight,
            held,
            body,
            consumed,
        };
        self.forward(client, timers, &current, forward, admitted)
            .await
    }

    /// Reads until the buffer holds a complete request head the fast path serves
    /// (`Ok(Ok)`), or says what follows instead: the connection left to hyper (a head
    /// it does not serve, or none within `max_head`), or closed (the head timeout, a
    /// drain between requests, the client gone).
    async fn read_head<'l>(
        &mut self,
        client: &mut TcpStream,
        draining: &mut watch::Receiver<bool>,
        timers: &mut Timers,
        max_head: usize,
        limiter: &'l Limiter<AnyStore>,
    ) -> io::Result<Result<request::Head<'l>, Next>> {
        let fast = self.fast;
        // An agent run's endpoint (SPEC T7) is answered by the service stack.
        let run_endpoint = std::sync::atomic::AtomicBool::new(false);
        let route =
            |method: &Method, hosts: &mut dyn Iterator<Item = &[u8]>, path: Result<&str, _>| {
                if let Ok(p) = path
                    && limiter.policy().turns.endpoint(p).is_some()
                {
                    run_endpoint.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                limiter.route_head(method, http::Version::HTTP_11, hosts, path, None)
            };
        let cx = request::Context {
            upstream: &fast.config.upstream,
            route: &route,
            paths: limiter.policy().paths,
            identity_headers: limiter.read_header_names(),
            peer: &self.forwarded_peer,
            counted_credential: limiter
                .policy()
                .identity
                .counted
                .map(|_| &limiter.policy().identity),
            traced: sluice_edge::trace::is_on(),
        };

        // A complete head.
        timers
            .head
            .set(tokio::time::Instant::now() + timers.head_timeout);
        let mut checked = 0;
        loop {
            if may_end_head(&self.from_client, checked) {
                self.identity.clear();
                match request::parse(
                    &self.from_client,
                    &cx,
                    &mut self.to_upstream,
                    &mut self.identity,
                ) {
                    request::Parsed::Ready(head)
                        if head.len <= max_head
                            && !run_endpoint.load(std::sync::atomic::Ordering::Relaxed) =>
                    {
                        return Ok(Ok(head));
                    }
                    request::Parsed::Ready(_) | request::Parsed::Elsewhere => {
                        return Ok(Err(Next::Elsewhere));
                    }
                    request::Parsed::Partial => checked = self.from_client.len(),
                }
            }
            if self.from_client.len() >= max_head {
                // No head within the bound: hyper refuses it (431).
                return Ok(Err(Next::Elsewhere));
            }
            // Between requests the drain wins: no request is cut.
            let idle = self.from_client.is_empty();
            let n = tokio::select! {
                biased;
                n = read_more(client, &mut self.from_client) => n?,
                () = timers.head.passed() => return Ok(Err(Next::Close)),
                _ = draining.wait_for(|d| *d), if idle => return Ok(Err(Next::Close)),
            };
            if n == 0 {
                return Ok(Err(Next::Close));
            }
        }
    }

    /// Forwards an admitted request (phases 5 and 6): the head with who the request
    /// is from and the body in one write, the answer's head settled and its body
    /// relayed; a failed or late upstream answered with sluice's own 502 or 504.
    async fn forward(
        &mut self,
        client: &mut TcpStream,
        timers: &mut Timers,
        current: &Arc<Limiter<AnyStore>>,
        mut forward: Forward<'_, AnyStore>,
        admitted: Admitted,
    ) -> io::Result<Next> {
        let fast = self.fast;
        let limiter = &**current;
        let Admitted {
            close,
            head_request,
            repeatable,
            id,
            access,
            in_flight,
            held,
            body,
            consumed,
            hide_usage,
        } = admitted;
        // Forwarded: the head with who the request is from, and the body, in one
        // write: a body in the connection's buffer is copied after the head, one held
        // whole in its own buffer is written from there (never a second copy of it).
        self.to_upstream.truncate(self.to_upstream.len() - 2);
        // Phase 5: the upstream head.
        forward.for_each_upstream_header(|name, value| {
            push_field(&mut self.to_upstream, name.as_str().as_bytes(), value);
        });
        push_field(&mut self.to_upstream, b"x-request-id", id.as_bytes());
        self.to_upstream.extend_from_slice(b"\r\n");
        if held.is_empty() {
            self.to_upstream.extend_from_slice(&self.from_client[body]);
        }
        self.from_client.advance(consumed);
        let replaced = match (
            forward.decision().binding().is_some(),
            limiter.policy().ietf_headers,
        ) {
            (false, _) => &REPLACED_FIELDS[..2],
            (true, false) => &REPLACED_FIELDS[..5],
            (true, true) => &REPLACED_FIELDS[..],
        };
        // An LLM call's token fields are sluice's too (SPEC T5).
        let with_tokens: Vec<http::HeaderName>;
        let replaced = match forward.plan().llm {
            Some(format) => {
                with_tokens = replaced
                    .iter()
                    .chain(sluice_edge::dialect::token_header_names(format))
                    .cloned()
                    .collect();
                &with_tokens[..]
            }
            None => replaced,
        };
        let request = Exchanged {
            rewrite: response::Rewrite {
                head_request,
                close,
                replaced,
                // The upstream's signals to sluice never reach the client.
                dropped_prefix: b"x-sluice-",
                rechunk: hide_usage,
            },
            // Sent again on a new connection when a kept-alive one fails before any
            // answer: only a request that may be repeated.
            repeatable,
            forward: &forward,
            limiter,
            request_id: &id,
            body: &held,
        };

        // On the runtime's clock, as the deadlines are.
        let started = tokio::time::Instant::now();
        // A call through a guarded lane may take the lane's time.
        let header_timeout = forward.upstream_timeout(fast.config.header_timeout);
        timers.upstream.set(started + header_timeout);
        // Pinned where it is made: `select!` then holds a pointer to it rather than
        // a copy of the whole exchange (a few hundred bytes of state each request).
        let answer = {
            let mut exchange = std::pin::pin!(self.exchange(&request));
            tokio::select! {
                biased;
                answer = &mut exchange => answer,
                () = timers.upstream.passed() => Err(Failure::Timeout),
            }
        };
        let elapsed = started.elapsed();
        let (head_sent, conn, whole, event_stream) = match answer {
            Ok(Relay {
                head: sent_head,
                conn,
                whole,
                event_stream,
            }) => {
                fast.upstream_seconds[0].record(elapsed);
                // Phase 6: settled as the head was read (see `send_and_read_head`).
                forward.finish(Some(sent_head.status));
                (sent_head, conn, whole, event_stream)
            }
            Err(failure) => {
                fast.upstream_seconds[if failure == Failure::Timeout { 2 } else { 1 }]
                    .record(elapsed);
                if let Some((plan, decision)) = forward.settlement() {
                    // SPEC T3: a call that never reached the upstream gives its
                    // reservation back; one that did (no head, or none in
                    // time) may have been generated: it stands, counted.
                    let failed = failure == Failure::Unreachable;
                    Box::pin(current.settle_usage(&plan, decision, None, failed)).await;
                }
                let mut answer = upstream_failure(failure, header_timeout);
                forward.upstream_failed(answer.headers_mut());
                return self
                    .answer_own(client, answer, close, head_request, in_flight, &id, access)
                    .await;
            }
        };

        // Counted once the head is there, as the service stack counts a response.
        in_flight.answered(Some(head_sent.status));
        let mut conn = conn;
        let status = head_sent.status;
        // An LLM call settles its token budgets at its answer's `usage`.
        let relayed = match forward.settlement() {
            // Boxed, as `answer_own` is: out of the path other requests run.
            Some(settlement) => {
                Box::pin(async {
                    let content_type = event_stream.then_some("text/event-stream");
                    let mut settlement = Settlement::new(
                        Arc::clone(current),
                        settlement,
                        status,
                        content_type,
                        hide_usage,
                    );
                    let relayed = self
                        .relay_llm_body(client, head_sent, &mut conn, &mut settlement)
                        .await;
                    // One cut short is settled with what was seen of it.
                    settlement.settle().await;
                    relayed
                })
                .await
            }
            None => self.relay_body(client, head_sent, &mut conn).await,
        };
        if let Some(access) = access {
            access.log(&id, status, relayed.is_ok());
        }
        if relayed? && whole {
            fast.pool.checkin(conn);
        }
        Ok(if close || !whole {
            Next::Close
        } else {
            Next::Request
        })
    }

    /// Answers with a response of sluice's own (a refusal, an upstream that failed)
    /// out of line: the future is boxed, so the request path's state machine holds
    /// neither its state nor its code (the path every forwarded request runs stays
    /// denser in the instruction cache).
    #[allow(clippy::too_many_arguments)]
    fn answer_own<'a, B>(
        &'a mut self,
        client: &'a mut TcpStream,
        answer: Response<B>,
        close: bool,
        head_request: bool,
        in_flight: crate::metered::InFlight,
        id: &'a RequestId,
        access: Option<Access>,
    ) -> std::pin::Pin<Box<dyn Future<Output = io::Result<Next>> + Send + 'a>>
    where
        B: http_body::Body<Data = Bytes> + Send + 'a,
    {
        Box::pin(async move {
            let answer = own(answer).await;
            self.write_own(client, answer, close, head_request, in_flight, id, access)
                .await
        })
    }

    /// Writes an answer of sluice's own (its body left out for a HEAD request), with
    /// the request's id.
    #[allow(clippy::too_many_arguments)]
    async fn write_own(
        &mut self,
        client: &mut TcpStream,
        answer: Response<Bytes>,
        close: bool,
        head_request: bool,
        in_flight: crate::metered::InFlight,
        id: &RequestId,
        access: Option<Access>,
    ) -> io::Result<Next> {
        let out = &mut self.to_client;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(
            itoa::Buffer::new()
                .format(answer.status().as_u16())
                .as_bytes(),
        );
        out.push(b' ');
        out.extend_from_slice(answer.status().canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        for (name, value) in answer.headers() {
            push_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
        push_field(out, b"x-request-id", id.as_bytes());
        push_date(out);
        push_field(
            out,
            b"content-length",
            itoa::Buffer::new().format(answer.body().len()).as_bytes(),
        );
        if close {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if !head_request {
            out.extend_from_slice(answer.body());
        }
        in_flight.answered(Some(answer.status().as_u16()));
        let written = super::buffers::send(client, out).await;
        if let Some(access) = access {
            access.log(id, answer.status().as_u16(), written.is_ok());
        }
        written?;
        Ok(if close { Next::Close } else { Next::Request })
    }
}

/// Resolves when the client hangs up (its side closed or reset); never while it
/// is there, nor once it sent more (a pipelined request: then there is no
/// telling, and the call waits on as before).
async fn client_gone(client: &TcpStream) {
    let mut byte = [0u8; 1];
    match client.peek(&mut byte).await {
        Ok(0) | Err(_) => {}
        Ok(_) => std::future::pending().await,
    }
}
