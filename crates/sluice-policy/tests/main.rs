//! The integration tests of `sluice-policy`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/edit.rs"]
mod edit;

mod alerts;
mod algorithms;
mod classes;
mod domains;
mod leased;
mod plans;
mod policy;
mod tenants;
mod turns;
