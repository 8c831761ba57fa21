//! The defaults a config falls back to where it says nothing.

use std::time::Duration;

/// Default longest wait for room before a request is shrunk or refused.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(90);
/// Default allowance for the provider counting a request when it arrives.
pub const DEFAULT_ARRIVAL_MARGIN: Duration = Duration::from_secs(1);
/// Default attempts per request (the first included).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default time of interactive traffic held back from batch requests.
pub const DEFAULT_INTERACTIVE_RESERVE: Duration = Duration::from_secs(2);
/// Default largest request body the proxy reads: 32 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;
