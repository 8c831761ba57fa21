//! The integration tests of `sluice-batch`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/redis_server.rs"]
mod redis_server;

#[cfg(feature = "durable")]
mod batch;
#[cfg(all(feature = "durable", feature = "lane"))]
mod lane;
