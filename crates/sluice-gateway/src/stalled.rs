//! `sluice_stalled_clients_total{cut}`: the clients cut for taking nothing of their
//! answer for the send timeout ([`SEND_TIMEOUT`](crate::h1::SEND_TIMEOUT), 60 s), so
//! an operator sees how often it happens and which way.

/// What was cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    /// A connection whose socket took no byte (HTTP/1.1, or an HTTP/2 connection
    /// whose client stopped reading altogether): it is closed.
    Connection,
    /// One HTTP/2 stream held at a window of 0 by its client's flow control: its
    /// body is dropped and the stream reset; the connection stays.
    Stream,
}

impl Cut {
    /// The `cut` label's value.
    const fn label(self) -> &'static str {
        match self {
            Cut::Connection => "connection",
            Cut::Stream => "stream",
        }
    }
}

/// Counts one cut.
pub(crate) fn count(cut: Cut) {
    metrics::counter!("sluice_stalled_clients_total", "cut" => cut.label()).increment(1);
}
