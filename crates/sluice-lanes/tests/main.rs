//! The integration tests of `sluice-lanes`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/redis_server.rs"]
mod redis_server;
mod support;

mod batch;
mod breaker;
mod ledger;
#[cfg(feature = "redis")]
mod ledger_conformance;
mod limits;
mod plans;
mod property;
#[cfg(feature = "redis")]
mod redis;
mod shared;
