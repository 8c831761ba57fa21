//! The exchange with the upstream: the request written (head and body at once), the
//! response head read and rewritten for the client (with the rate-limit fields, the
//! weighted budgets settled), and the response body relayed as it comes.

use std::io;

use bytes::Buf as _;
use http::HeaderName;
use sluice_edge::{Forward, Limiter, RequestId};
use tokio::net::TcpStream;

use crate::proxy::Failure;
use crate::store::AnyStore;
use sluice_h1::chunked::ChunkedEnd;
use sluice_h1::response::{self, Framing};

use super::READ_CHUNK;
use super::body::read_body;
use super::buffers::{Connection, may_end_head, read_more};
use super::encode::{push_chunk, push_date, push_field, push_rate_limit_fields};
use super::settle::Settlement;

/// The upstream's answer: its head (the client's form in the head buffer) and the
/// connection its body comes on.
pub(super) struct Relay {
    pub(super) head: response::Head,
    pub(super) conn: TcpStream,
    /// The upstream took the whole request. When it did not (it stopped taking it,
    /// having answered first), neither connection carries another request.
    pub(super) whole: bool,
    /// The answer of an LLM call is a stream of server-sent events (its `usage`
    /// is read from them, not from one JSON document).
    pub(super) event_stream: bool,
}

/// What the exchange with the upstream needs of the request besides its bytes.
pub(super) struct Exchanged<'a> {
    /// How the client's head is made from the upstream's.
    pub(super) rewrite: response::Rewrite<'a>,
    /// The request may be sent again on a new connection.
    pub(super) repeatable: bool,
    /// The admitted request: its decision, its plan, and the weighted budgets it
    /// settles from the response head.
    pub(super) forward: &'a Forward<'a, AnyStore>,
    /// The limiter that decided the request.
    pub(super) limiter: &'a Limiter<AnyStore>,
    /// The request's id, returned to the client.
    pub(super) request_id: &'a RequestId,
    /// The request body, written after `to_upstream` (empty when it is in there).
    pub(super) body: &'a [u8],
}

/// The fields the gateway sets itself: the upstream's `X-Sluice-Cost` (a signal for
/// sluice, never relayed), `X-Request-Id` (the request's own is returned), then the
/// rate-limit fields in the order
/// [`sluice_edge::for_each_rate_limit_header`] writes them: the legacy three, then the
/// IETF draft's two. The upstream's own fields of these names are dropped, as the
/// service stack drops or replaces them. A `static`: a `const` array of names would
/// be built and dropped at each use, once a request.
pub(super) static REPLACED_FIELDS: [HeaderName; 7] = [
    sluice_edge::X_SLUICE_COST,
    sluice_edge::X_REQUEST_ID,
    sluice_edge::X_RATELIMIT_LIMIT,
    sluice_edge::X_RATELIMIT_REMAINING,
    sluice_edge::X_RATELIMIT_RESET,
    sluice_edge::RATELIMIT_POLICY,
    sluice_edge::RATELIMIT,
];

/// Why an exchange with the upstream failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Exchange {
    /// Nothing of a response arrived (the connection closed or failed).
    NoAnswer,
    /// The exchange broke after it had started, or the response cannot be relayed.
    Broken,
}

/// Longest upstream response head relayed, as for request heads.
pub(super) const MAX_RESPONSE_HEAD: usize = 64 * 1024;

impl<'f> Connection<'f> {
    /// Sends the request (head and body in `to_upstream`) and reads the response head,
    /// whose client form it leaves in `to_client`. A kept-alive connection that gives
    /// no answer at all is replaced by a new one once, for a request that may be
    /// repeated.
    pub(super) async fn exchange(&mut self, request: &Exchanged<'_>) -> Result<Relay, Failure> {
        let fast = self.fast;
        let mut reused = fast.pool.checkout();
        loop {
            let was_reused = reused.is_some();
            let mut conn = match reused.take() {
                Some(conn) => conn,
                // Boxed: the connect future is large and rarely needed, and the
                // exchange's future, moved into the deadline's `select!` each
                // request, would otherwise carry its size.
                None => Box::pin(fast.pool.connect())
                    .await
                    .map_err(|_| Failure::Unreachable)?,
            };
            self.from_upstream.clear();
            match self.send_and_read_head(&mut conn, request).await {
                Ok((head, whole, event_stream)) => {
                    return Ok(Relay {
                        head,
                        conn,
                        whole,
                        event_stream,
                    });
                }
                // Nothing came back on a connection that had served before: it may
                // have been closed as the request was sent. Once more, on a new one.
                Err(Exchange::NoAnswer) if was_reused && request.repeatable => {}
                Err(_) => return Err(Failure::NoAnswer),
            }
        }
    }

    /// Writes the request in `to_upstream` (and `body` after it) to `conn`: true once
    /// all of it is written; false when the upstream stopped taking it: its connection failed or closed, or
    /// it refused first (a final head of 4xx or 5xx, or one that cannot be relayed,
    /// from an upstream that may read no further). What it answered is left in
    /// `from_upstream`, to be read as the head. An upstream that accepts early (it
    /// streams its answer as it reads) gets the whole request; interim heads are
    /// skipped.
    pub(super) async fn send_request(&mut self, conn: &TcpStream, body: &[u8]) -> bool {
        let mut at = 0;
        let mut watching = true;
        let head = self.to_upstream.len();
        while at < head + body.len() {
            tokio::select! {
                biased;
                ready = conn.writable() => {
                    if ready.is_err() {
                        return false;
                    }
                    let written = if at < head {
                        let parts = [io::IoSlice::new(&self.to_upstream[at..]), io::IoSlice::new(body)];
                        conn.try_write_vectored(&parts)
                    } else {
                        conn.try_write(&body[at - head..])
                    };
                    match written {
                        Ok(n) => at += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => return false,
                    }
                }
                ready = conn.readable(), if watching => {
                    if ready.is_err() {
                        return false;
                    }
                    self.from_upstream.reserve(READ_CHUNK);
                    match conn.try_read_buf(&mut self.from_upstream) {
                        Ok(0) => return false,
                        Ok(_) => match response::final_status(&self.from_upstream) {
                            Some(status) if !(200..400).contains(&status) => return false,
                            // Accepted: the rest of its answer waits until the request
                            // is all written.
                            Some(_) => watching = false,
                            None if self.from_upstream.len() >= MAX_RESPONSE_HEAD => {
                                return false;
                            }
                            None => {}
                        },
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => return false,
                    }
                }
            }
        }
        true
    }

    /// [`Connection::send_request`], then the response head: the head, whether the
    /// upstream took the whole request, and whether an LLM call's answer is a stream
    /// of events.
    pub(super) async fn send_and_read_head(
        &mut self,
        conn: &mut TcpStream,
        request: &Exchanged<'_>,
    ) -> Result<(response::Head, bool, bool), Exchange> {
        let policy = request.limiter.policy();
        // An upstream that stops taking the request may have answered first (a 413,
        // say): what it answered is still read, and the client's connection closes
        // after it.
        let sent = self.send_request(conn, request.body).await;
        let rewrite = response::Rewrite {
            close: request.rewrite.close || !sent,
            ..request.rewrite
        };
        let mut checked = 0;
        loop {
            if may_end_head(&self.from_upstream, checked) {
                loop {
                    let parsed = response::parse(
                        &self.from_upstream,
                        &rewrite,
                        &mut self.to_client,
                        |out, dated| {
                            push_rate_limit_fields(
                                out,
                                request.forward.decision(),
                                request.forward.plan(),
                                policy,
                            );
                            push_field(out, b"x-request-id", request.request_id.as_bytes());
                            if !dated {
                                push_date(out);
                            }
                        },
                    )
                    .map_err(|_| Exchange::Broken)?;
                    // The weighted budgets are charged what the upstream says the
                    // call cost, and the head is written again with their standing
                    // after the charge.
                    // Sent more than once, the largest cost counts (as on the
                    // hyper path, `sluice_edge::take_cost`).
                    let mut cost = None;
                    if matches!(parsed, response::Parsed::Final(_)) && request.forward.settles() {
                        response::each_field(&self.from_upstream, b"x-sluice-cost", |v| {
                            cost = cost.max(sluice_edge::parse_cost(v));
                        });
                    }
                    let event_stream = matches!(parsed, response::Parsed::Final(_))
                        && request.forward.plan().llm.is_some()
                        && response::field(&self.from_upstream, b"content-type")
                            .is_some_and(sluice_tokens::usage::is_event_stream);
                    match parsed {
                        response::Parsed::Final(_) if cost.is_some() => {
                            let settled = request.forward.settle(cost).await;
                            let again = response::parse(
                                &self.from_upstream,
                                &rewrite,
                                &mut self.to_client,
                                |out, dated| {
                                    push_rate_limit_fields(
                                        out,
                                        &settled,
                                        request.forward.plan(),
                                        policy,
                                    );
                                    push_field(out, b"x-request-id", request.request_id.as_bytes());
                                    if !dated {
                                        push_date(out);
                                    }
                                },
                            )
                            .map_err(|_| Exchange::Broken)?;
                            let response::Parsed::Final(head) = again else {
                                return Err(Exchange::Broken);
                            };
                            self.from_upstream.advance(head.len);
                            return Ok((head, sent, event_stream));
                        }
                        response::Parsed::Final(head) => {
                            self.from_upstream.advance(head.len);
                            return Ok((head, sent, event_stream));
                        }
                        response::Parsed::Interim { len } => self.from_upstream.advance(len),
                        response::Parsed::Partial => {
                            checked = self.from_upstream.len();
                            break;
                        }
                    }
                }
            }
            if self.from_upstream.len() >= MAX_RESPONSE_HEAD {
                return Err(Exchange::Broken);
            }
            let read = read_more(conn, &mut self.from_upstream).await;
            if !matches!(read, Ok(n) if n > 0) {
                return Err(if self.from_upstream.is_empty() {
                    Exchange::NoAnswer
                } else {
                    Exchange::Broken
                });
            }
        }
    }

    /// Writes the response head and relays the body; true when the upstream connection
    /// can serve another request.
    pub(super) async fn relay_body(
        &mut self,
        client: &mut TcpStream,
        head: response::Head,
        conn: &mut TcpStream,
    ) -> io::Result<bool> {
        let upstream = &mut self.from_upstream;
        let out = &mut self.to_client;
        let pipelined = &mut self.from_client;
        match head.framing {
            Framing::Empty => {
                super::buffers::send(client, out).await?;
                Ok(head.reusable && upstream.is_empty())
            }
            Framing::Length(n) => {
                let mut left = n;
                let take = usize::try_from(left)
                    .unwrap_or(usize::MAX)
                    .min(upstream.len());
                out.extend_from_slice(&upstream[..take]);
                upstream.advance(take);
                left -= take as u64;
                super::buffers::send(client, out).await?;
                while left > 0 {
                    upstream.clear();
                    if read_body(conn, upstream, client, pipelined).await? == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let take = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(upstream.len());
                    super::buffers::send(client, &upstream[..take]).await?;
                    upstream.advance(take);
                    left -= take as u64;
                }
                Ok(head.reusable && upstream.is_empty())
            }
            Framing::Chunked => {
                let mut end = ChunkedEnd::new();
                let used = end
                    .feed(upstream)
                    .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                out.extend_from_slice(&upstream[..used]);
                upstream.advance(used);
                super::buffers::send(client, out).await?;
                while !end.is_done() {
                    upstream.clear();
                    if read_body(conn, upstream, client, pipelined).await? == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let used = end
                        .feed(upstream)
                        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                    super::buffers::send(client, &upstream[..used]).await?;
                    upstream.advance(used);
                }
                Ok(head.reusable && upstream.is_empty())
            }
            Framing::UntilClose => {
                // Each read goes out as one chunk, the close as the last chunk.
                push_chunk(out, upstream);
                upstream.clear();
                super::buffers::send(client, out).await?;
                loop {
                    upstream.clear();
                    let n = read_body(conn, upstream, client, pipelined).await?;
                    out.clear();
                    push_chunk(out, upstream);
                    if n == 0 {
                        out.extend_from_slice(b"0\r\n\r\n");
                    }
                    super::buffers::send(client, out).await?;
                    if n == 0 {
                        return Ok(false);
                    }
                }
            }
        }
    }

    /// [`Connection::relay_body`] for an LLM call: its body read for its `usage` as
    /// it passes (its chunks' data, not their framing), the usage-only chunk sluice
    /// asked for taken out (the client then gets the body chunked: the upstream's
    /// length is no longer its length), and the call settled before the body's last
    /// bytes are written. A body that breaks off is settled by the caller with what
    /// was seen of it.
    pub(super) async fn relay_llm_body(
        &mut self,
        client: &mut TcpStream,
        head: response::Head,
        conn: &mut TcpStream,
        settlement: &mut Settlement,
    ) -> io::Result<bool> {
        let upstream = &mut self.from_upstream;
        let out = &mut self.to_client;
        let pipelined = &mut self.from_client;
        let mut chunked = ChunkedEnd::new();
        let mut left = match head.framing {
            Framing::Length(n) => n,
            _ => 0,
        };
        // The body's data as the client gets it, when the usage-only chunk is taken out.
        let mut passed = Vec::new();
        let mut closed = false;
        loop {
            // What of `upstream` belongs to the body, and whether the body ends there.
            let (used, ended) = match head.framing {
                Framing::Empty => (0, true),
                Framing::Length(_) => {
                    let take = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(upstream.len());
                    left -= take as u64;
                    (take, left == 0)
                }
                Framing::Chunked => {
                    let hide = &mut settlement.hide;
                    let scanner = &mut settlement.scanner;
                    let used = chunked
                        .feed_with(upstream, |data| {
                            scanner.feed(data);
                            if let Some(hide) = hide.as_mut() {
                                hide.push(data, &mut passed);
                            }
                        })
                        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                    (used, chunked.is_done())
                }
                Framing::UntilClose => (upstream.len(), closed),
            };
            let data = &upstream[..used];
            if head.framing != Framing::Chunked {
                settlement.scanner.feed(data);
                if let Some(hide) = settlement.hide.as_mut() {
                    hide.push(data, &mut passed);
                }
            }
            match settlement.hide.as_mut() {
                Some(hide) if head.framing != Framing::Empty => {
                    if ended {
                        hide.finish(&mut passed);
                    }
                    push_chunk(out, &passed);
                    passed.clear();
                    if ended {
                        out.extend_from_slice(b"0\r\n\r\n");
                    }
                }
                _ if head.framing == Framing::UntilClose => {
                    push_chunk(out, data);
                    if ended {
                        out.extend_from_slice(b"0\r\n\r\n");
                    }
                }
                _ => out.extend_from_slice(data),
            }
            upstream.advance(used);
            if ended {
                // Settled before the client has the whole answer.
                settlement.settle().await;
                super::buffers::send(client, out).await?;
                return Ok(head.reusable && !closed && upstream.is_empty());
            }
            if !out.is_empty() {
                super::buffers::send(client, out).await?;
                out.clear();
            }
            upstream.clear();
            if read_body(conn, upstream, client, pipelined).await? == 0 {
                if head.framing != Framing::UntilClose {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                closed = true;
            }
        }
    }
}
