//! The fast path's `sluice::access` line, one per request.

use std::net::IpAddr;

use http::Method;
use sluice_edge::RequestId;

/// What an access line says of a request on the fast path (kept only while the
/// access log is on).
pub(super) struct Access {
    pub(super) method: Method,
    /// The path, without the query (which may hold a credential).
    pub(super) path: String,
    pub(super) peer: IpAddr,
    pub(super) began: std::time::Instant,
}

impl Access {
    /// The request whose head starts `buf`.
    pub(super) fn new(method: &Method, buf: &[u8], peer: IpAddr) -> Access {
        let target = buf
            .split(|&b| b == b' ')
            .nth(1)
            .unwrap_or_default()
            .split(|&b| b == b'?')
            .next()
            .unwrap_or_default();
        Access {
            method: method.clone(),
            path: String::from_utf8_lossy(target).into_owned(),
            peer,
            began: std::time::Instant::now(),
        }
    }

    /// The line, once the answer is sent (`whole`: all of it reached the client).
    pub(super) fn log(self, id: &RequestId, status: u16, whole: bool) {
        crate::access::log(
            id,
            self.method.as_str(),
            &self.path,
            status,
            self.began.elapsed(),
            self.peer,
            whole,
        );
    }
}
