//! The integration tests of `sluice-tower`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/edit.rs"]
mod edit;
mod support;

mod edge;
mod lanes;
mod outage;
mod peer;
mod quotas;
mod shared_lanes;
