//! A call's request body as tonic reads it, within the service's bounds on
//! unfinished messages.
//!
//! A `ShouldRateLimit` call carries one message: a 5-byte prefix (a
//! compression flag and the length) and that many bytes. tonic reserves the
//! length as soon as it reads the prefix and holds what has come until the
//! message is whole, so a client that sends most of a large message and then
//! nothing would hold its memory for as long as it likes. Read through
//! [`Message`]:
//!
//! - a length past [`MAX_MESSAGE_BYTES`] is refused with `RESOURCE_EXHAUSTED`
//!   before tonic reserves anything;
//! - a call that waits for the rest of its message (or for its end) holds at
//!   least [`UNFINISHED_CALL_BYTES`], and the message's length once the prefix
//!   is read, leased from its connection's bound
//!   ([`MAX_UNFINISHED_BYTES_PER_CONNECTION`]) and from the process's one bound
//!   on buffered request bytes (`--max-buffered-bytes`, with its per-address
//!   share, as the gateway's bodies): past either, `RESOURCE_EXHAUSTED`;
//! - a message not whole within [`MESSAGE_TIMEOUT`] of the first wait for it
//!   is refused with `DEADLINE_EXCEEDED`;
//! - a second message in one call is refused (`INTERNAL`, as gRPC's own
//!   servers do), so a call cannot keep the decoder busy.
//!
//! Each refusal ends the call at once: its answer goes out, the stream is reset
//! (the client stops sending) and what it held is released. A call whose
//! message has come whole when it is first read (Envoy sends a call's headers
//! and message at once) leases nothing and arms no timer.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use sluice_edge::{BufferBudget, BufferLease, Holder};
use tonic::Status;

/// The largest request message read: a larger one is refused with
/// `RESOURCE_EXHAUSTED` from its prefix, before any of it is held.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Bytes the unfinished messages of one connection hold at most (two whole
/// messages of [`MAX_MESSAGE_BYTES`], or every one of its calls at
/// [`UNFINISHED_CALL_BYTES`]): past it a call is refused with
/// `RESOURCE_EXHAUSTED`.
pub const MAX_UNFINISHED_BYTES_PER_CONNECTION: usize = 2 * MAX_MESSAGE_BYTES;

/// What an unfinished call is counted as holding at least: tonic's read
/// buffer (8 KiB) and its request's header list (at most
/// [`MAX_HEADER_LIST_BYTES`](crate::MAX_HEADER_LIST_BYTES)).
pub const UNFINISHED_CALL_BYTES: usize = 16 * 1024;

/// How long a call's message may take to come whole after its headers.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);

/// gRPC's message prefix: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

/// What the calls of one connection hold while their messages are unfinished,
/// and whom the process-wide bound charges them to.
#[derive(Debug)]
pub(crate) struct Unfinished {
    /// Bytes held by this connection's unfinished messages.
    held: AtomicUsize,
    /// The bound on request bytes held in memory, shared with the gateway.
    buffers: Arc<BufferBudget>,
    /// The connection's peer, as the bound's per-address share counts it.
    holder: Holder,
    /// `sluice_rls_unfinished_bytes`: bytes held by unfinished messages.
    gauge: metrics::Gauge,
}

impl Unfinished {
    /// A connection's, charged to `holder` in `buffers`.
    pub(crate) fn new(buffers: Arc<BufferBudget>, holder: Holder, gauge: metrics::Gauge) -> Self {
        Unfinished {
            held: AtomicUsize::new(0),
            buffers,
            holder,
            gauge,
        }
    }

    /// Bytes this connection's unfinished messages hold now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

/// A call's request body, read within the bounds (see the module docs).
pub(crate) struct Message<B> {
    body: B,
    /// The connection's account; `None` counts nothing (a call that came
    /// without one).
    connection: Option<Arc<Unfinished>>,
    timeout: Duration,
    /// The prefix, as far as it has come.
    prefix: [u8; PREFIX],
    /// Bytes of the call read so far (prefix and message).
    read: usize,
    /// The prefix and the message: how many bytes make the call whole, once
    /// the prefix has come.
    whole: Option<usize>,
    /// Bytes leased from the connection's bound (and `lease` from the
    /// process's).
    held: usize,
    lease: Option<BufferLease>,
    /// Armed when the message was first found unfinished.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<B> Message<B> {
    /// Reads `body` within the bounds, leasing from `connection`; the message
    /// is due whole within `timeout` of the first wait for it.
    pub(crate) fn new(body: B, connection: Option<Arc<Unfinished>>, timeout: Duration) -> Self {
        Message {
            body,
            connection,
            timeout,
            prefix: [0; PREFIX],
            read: 0,
            whole: None,
            held: 0,
            lease: None,
            deadline: None,
        }
    }

    /// Takes in a data frame: the prefix (refusing a length past the bound),
    /// then the message (refusing anything past it).
    fn take_in(&mut self, data: &[u8]) -> Result<(), Status> {
        let mut rest = data;
        if self.whole.is_none() {
            let n = (PREFIX - self.read).min(rest.len());
            self.prefix[self.read..self.read + n].copy_from_slice(&rest[..n]);
            self.read += n;
            rest = &rest[n..];
            if self.read == PREFIX {
                let [_, a, b, c, d] = self.prefix;
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if len > MAX_MESSAGE_BYTES {
                    return Err(refused(
                        "message_too_large",
                        Status::resource_exhausted(format!(
                            "a request message of {len} bytes: the rate-limit service reads at most {MAX_MESSAGE_BYTES}"
                        )),
                    ));
                }
                self.whole = Some(PREFIX + len);
            }
        }
        self.read += rest.len();
        if self.whole.is_some_and(|whole| self.read > whole) {
            return Err(refused(
                "second_message",
                Status::internal("more than one request message in a unary call"),
            ));
        }
        Ok(())
    }

    /// Holds what the call needs while it waits for the rest of its message
    /// (or for its end): at least [`UNFINISHED_CALL_BYTES`], and its whole
    /// length once known (what tonic has reserved for it).
    fn hold_unfinished(&mut self) -> Result<(), Status> {
        let bytes = self.whole.unwrap_or(0).max(UNFINISHED_CALL_BYTES);
        let more = bytes.saturating_sub(self.held);
        let Some(connection) = &self.connection else {
            return Ok(());
        };
        if more == 0 {
            return Ok(());
        }
        let before = connection.held.fetch_add(more, Ordering::Relaxed);
        if before + more > MAX_UNFINISHED_BYTES_PER_CONNECTION {
            connection.held.fetch_sub(more, Ordering::Relaxed);
            return Err(refused(
                "connection_unfinished_bytes",
                Status::resource_exhausted(format!(
                    "this connection's unfinished messages would hold more than {MAX_UNFINISHED_BYTES_PER_CONNECTION} bytes"
                )),
            ));
        }
        let leased = match &mut self.lease {
            Some(lease) => lease.try_grow_for(more),
            None => connection
                .buffers
                .try_lease_for(connection.holder, more)
                .map(|lease| self.lease = Some(lease)),
        };
        if leased.is_err() {
            connection.held.fetch_sub(more, Ordering::Relaxed);
            return Err(refused(
                "buffered_bytes",
                Status::resource_exhausted(
                    "the rate-limit service holds its bound of unfinished request bytes (--max-buffered-bytes, or this address's share of it)",
                ),
            ));
        }
        self.held += more;
        connection.gauge.increment(more as f64);
        Ok(())
    }
}

/// Counts a refusal under `reason` (`sluice_rls_refused_total`) and returns it.
fn refused(reason: &'static str, status: Status) -> Status {
    metrics::counter!("sluice_rls_refused_total", "reason" => reason).increment(1);
    status
}

impl<B> Body for Message<B>
where
    B: Body<Data = Bytes, Error = Status> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if let Some(deadline) = &mut this.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Some(Err(overdue(this.timeout))));
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Err(status) = this.take_in(data)
                {
                    return Poll::Ready(Some(Err(status)));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                // The call waits for the rest of its message, or for its end.
                if let Err(status) = this.hold_unfinished() {
                    return Poll::Ready(Some(Err(status)));
                }
                if this.deadline.is_none() {
                    let mut deadline = Box::pin(tokio::time::sleep(this.timeout));
                    if deadline.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Some(Err(overdue(this.timeout))));
                    }
                    this.deadline = Some(deadline);
                }
                Poll::Pending
            }
            ended => ended,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The refusal of a message not whole in time.
fn overdue(timeout: Duration) -> Status {
    refused(
        "message_timeout",
        Status::deadline_exceeded(format!(
            "the request message was not whole within {} s",
            timeout.as_secs_f64()
        )),
    )
}

impl<B> Drop for Message<B> {
    fn drop(&mut self) {
        if let Some(connection) = &self.connection
            && self.held > 0
        {
            connection.held.fetch_sub(self.held, Ordering::Relaxed);
            connection.gauge.decrement(self.held as f64);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use http_body_util::BodyExt as _;

    /// A body that yields `frames`, then waits for ever (a client that sent
    /// them and nothing more).
    struct Stalled(std::collections::VecDeque<Bytes>);

    impl Body for Stalled {
        type Data = Bytes;
        type Error = Status;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            match self.0.pop_front() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => Poll::Pending,
            }
        }
    }

    fn prefix(len: u32) -> Bytes {
        let mut p = vec![0];
        p.extend_from_slice(&len.to_be_bytes());
        Bytes::from(p)
    }

    /// The holder of a client at 192.0.2.1.
    pub(crate) fn holder() -> Holder {
        let policy = sluice_policy::default_policy().expect("the default policy");
        Holder::of(
            &policy
                .identity
                .client_ip([192, 0, 2, 1].into(), &http::HeaderMap::new()),
        )
    }

    fn connection(max: usize) -> Arc<Unfinished> {
        Arc::new(Unfinished::new(
            BufferBudget::with_share(max, 1.0),
            holder(),
            metrics::Gauge::noop(),
        ))
    }

    /// Reads frames until the body fails or `wait` passes.
    async fn read_until_refused(body: &mut Message<Stalled>, wait: Duration) -> Option<Status> {
        let read = async {
            loop {
                match body.frame().await {
                    Some(Ok(_)) => {}
                    Some(Err(status)) => return Some(status),
                    None => return None,
                }
            }
        };
        tokio::time::timeout(wait, read).await.ok().flatten()
    }

    /// R1 bounds: a length past the bound is refused from the prefix, as
    /// `RESOURCE_EXHAUSTED` (tonic's own check says `OUT_OF_RANGE`).
    #[tokio::test]
    async fn r1_a_message_past_the_bound_is_resource_exhausted_from_its_prefix() {
        let frames = [prefix(5_000_000)].into();
        let mut body = Message::new(Stalled(frames), Some(connection(64 << 20)), MESSAGE_TIMEOUT);
        let status = read_until_refused(&mut body, Duration::from_secs(5))
            .await
            .expect("refused");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    }

    /// R1 bounds: an unfinished message holds its length, leased from its
    /// connection's bound and the process's; past the connection's, the next is
    /// refused; dropped, everything comes back.
    #[tokio::test(start_paused = true)]
    async fn r1_unfinished_messages_are_held_within_the_connections_bound() {
        let account = connection(64 << 20);
        let len = 4_000_000_u32;
        let part = Bytes::from(vec![0_u8; 100_000]);
        let open = |account: &Arc<Unfinished>| {
            Message::new(
                Stalled([prefix(len), part.clone()].into()),
                Some(Arc::clone(account)),
                MESSAGE_TIMEOUT,
            )
        };
        let (mut first, mut second, mut third) = (open(&account), open(&account), open(&account));
        for body in [&mut first, &mut second] {
            assert!(
                read_until_refused(body, Duration::from_millis(1))
                    .await
                    .is_none()
            );
        }
        let whole = PREFIX + len as usize;
        assert_eq!(account.held(), 2 * whole);
        assert_eq!(account.buffers.used(), 2 * whole);
        let status = read_until_refused(&mut third, Duration::from_millis(1))
            .await
            .expect("a third is past the connection's bound");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(account.held(), 2 * whole, "the refused one holds nothing");
        drop((first, second, third));
        assert_eq!((account.held(), account.buffers.used()), (0, 0));
    }

    /// R1 bounds: the process's bound (or the address's share of it) refuses
    /// an unfinished message too, whatever its connection's room.
    #[tokio::test(start_paused = true)]
    async fn r1_the_process_bound_on_buffered_bytes_refuses_an_unfinished_message() {
        let account = connection(UNFINISHED_CALL_BYTES * 3);
        let mut calls: Vec<_> = (0..4)
            .map(|_| {
                Message::new(
                    Stalled([prefix(100)].into()),
                    Some(Arc::clone(&account)),
                    MESSAGE_TIMEOUT,
                )
            })
            .collect();
        let mut refused = 0;
        for call in &mut calls {
            if let Some(status) = read_until_refused(call, Duration::from_millis(1)).await {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                refused += 1;
            }
        }
        assert_eq!(refused, 1, "three calls of 16 KiB fit, the fourth does not");
    }

    /// R1 bounds: a message not whole in time is refused and what it held
    /// released; a whole one leases nothing and arms no timer.
    #[tokio::test(start_paused = true)]
    async fn r1_a_message_not_whole_in_time_is_refused_and_released() {
        let account = connection(64 << 20);
        let mut slow = Message::new(
            Stalled([prefix(1000), Bytes::from(vec![0_u8; 10])].into()),
            Some(Arc::clone(&account)),
            MESSAGE_TIMEOUT,
        );
        let status = read_until_refused(&mut slow, MESSAGE_TIMEOUT * 2)
            .await
            .expect("refused once overdue");
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        drop(slow);
        assert_eq!(account.held(), 0);

        let mut whole = Message::new(
            Stalled([prefix(3), Bytes::from_static(b"abc")].into()),
            Some(Arc::clone(&account)),
            MESSAGE_TIMEOUT,
        );
        assert!(whole.frame().await.is_some() && whole.frame().await.is_some());
        assert_eq!(whole.whole, Some(whole.read), "whole");
        assert_eq!(account.held(), 0, "a whole message holds nothing");
        assert!(whole.deadline.is_none(), "and arms no timer");
        let mut extra = Message::new(
            Stalled([prefix(3), Bytes::from_static(b"abcdef")].into()),
            None,
            MESSAGE_TIMEOUT,
        );
        let status = read_until_refused(&mut extra, Duration::from_secs(1))
            .await
            .expect("a second message");
        assert_eq!(status.code(), tonic::Code::Internal);
    }
}
