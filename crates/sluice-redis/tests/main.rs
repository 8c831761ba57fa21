//! The integration tests of `sluice-redis`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/redis_server.rs"]
mod redis_server;

mod redis;
