//! What the edge tests share: a limiter on the memory store and a fake clock, and
//! requests driven through the phase contract (`sluice_edge::exchange`).

#![allow(dead_code, unreachable_pub)]

use std::net::IpAddr;

use http::request::Parts;
use sluice_core::{FakeClock, Timestamp};
use sluice_edge::Limiter;
use sluice_policy::Policy;
use sluice_store::{MemoryConfig, MemoryStore};

/// 2025-11-30T00:00:00Z; the clock stands at T0 + 1, well inside one window.
pub const T0: u64 = 1_764_460_800;

/// The client address of every request.
pub const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 7));

/// A limiter on the memory store, its clock at T0 + 1.
pub fn limiter(policy: Policy) -> Limiter<MemoryStore<FakeClock>> {
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    Limiter::new(
        policy,
        MemoryStore::with_clock(MemoryConfig::default(), clock),
    )
}

/// A request with the credential `key` in `X-API-Key`.
pub fn request_as(key: &str, method: &str, path: &str) -> Parts {
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("x-api-key", key)
        .body(())
        .expect("request");
    request.into_parts().0
}

/// A request with the credential `k`.
pub fn request(method: &str, path: &str) -> Parts {
    request_as("k", method, path)
}

/// What the limiter answers `n` requests of `key`: the status of each (200
/// forwarded), with `X-RateLimit-Remaining` of each forwarded one.
pub async fn send_as<S: sluice_store::BudgetStore>(
    limiter: &Limiter<S>,
    key: &str,
    method: &str,
    path: &str,
    n: usize,
) -> Vec<(u16, Option<u32>)> {
    let mut answers = Vec::new();
    for _ in 0..n {
        let parts = request_as(key, method, path);
        let route = limiter.route(&parts).map_err(|e| e.to_string());
        let route = route.expect("route");
        let intake = limiter.intake(Ok(route), PEER);
        let planned = intake.planned(&parts.headers, None, None);
        answers.push(match planned.admit(None).await {
            Ok(forward) => {
                let mut headers = http::HeaderMap::new();
                forward.response_head(200, &mut headers).await;
                let remaining = headers
                    .get("x-ratelimit-remaining")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                (200, remaining)
            }
            Err(answer) => (answer.status().as_u16(), None),
        });
    }
    answers
}

/// [`send_as`] with the credential `k`.
pub async fn send<S: sluice_store::BudgetStore>(
    limiter: &Limiter<S>,
    method: &str,
    path: &str,
    n: usize,
) -> Vec<(u16, Option<u32>)> {
    send_as(limiter, "k", method, path, n).await
}

/// The statuses of `answers`.
pub fn statuses(answers: &[(u16, Option<u32>)]) -> Vec<u16> {
    answers.iter().map(|(s, _)| *s).collect()
}
