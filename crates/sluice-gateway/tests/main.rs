//! The integration tests of `sluice-gateway`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/one_request.rs"]
mod one_request;

mod admin_cookie;
mod buffers;
mod intake;
mod lanes;
mod store_spec;
mod tokens;
mod turns;
mod upstream_tls;
