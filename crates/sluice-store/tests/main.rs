//! The integration tests of `sluice-store`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/redis_server.rs"]
mod redis_server;

#[cfg(feature = "durable")]
mod durable;
mod flood;
mod keyed;
mod lease_parity;
mod memory;
mod parity;
mod redis;
mod side_by_side;
