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

/// A recorder of this thread's `sluice_stalled_clients_total` counts, for tests on
/// a current-thread runtime (every task of the test on the thread that made it).
#[cfg(test)]
pub(crate) struct Counted {
    recorder: metrics_util::debugging::DebuggingRecorder,
}

#[cfg(test)]
impl Counted {
    /// A recorder; [`Counted::install`] makes it this thread's.
    pub(crate) fn new() -> Self {
        Counted {
            recorder: metrics_util::debugging::DebuggingRecorder::new(),
        }
    }

    /// Records this thread's metrics while the guard lives.
    pub(crate) fn install(&self) -> metrics::LocalRecorderGuard<'_> {
        metrics::set_default_local_recorder(&self.recorder)
    }

    /// The count of `cut` so far.
    pub(crate) fn of(&self, cut: Cut) -> u64 {
        use metrics_util::debugging::DebugValue;
        self.recorder
            .snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .find_map(|(key, _, _, value)| {
                let key = key.key();
                let labelled = key
                    .labels()
                    .any(|l| l.key() == "cut" && l.value() == cut.label());
                match value {
                    DebugValue::Counter(n)
                        if key.name() == "sluice_stalled_clients_total" && labelled =>
                    {
                        Some(n)
                    }
                    _ => None,
                }
            })
            .unwrap_or(0)
    }
}
