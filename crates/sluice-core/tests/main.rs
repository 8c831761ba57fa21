//! The integration tests of `sluice-core`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

mod support;

mod algorithms;
mod lease;
mod properties;
