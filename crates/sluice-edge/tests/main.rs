//! The integration tests of `sluice-edge`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/redis_server.rs"]
mod redis_server;
mod support;

mod alerts;
mod algorithms;
mod leased_rules_and_buckets;
mod leases;
mod near_limit;
mod plans;
mod shadow;
mod tokens;
mod turns;
mod usage_export;
