//! The integration tests of `sluice-client`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[cfg(all(feature = "proxy", feature = "simulator"))]
#[path = "../../../tests/support/python_venv.rs"]
mod python_venv;
mod support;

mod dialects;
mod layer;
#[cfg(feature = "simulator")]
mod matrix;
mod models;
#[cfg(all(feature = "proxy", feature = "simulator"))]
mod openai_sdk;
mod pacer;
#[cfg(all(feature = "proxy", feature = "simulator"))]
mod proxy;
#[cfg(feature = "proxy")]
mod proxy_keys;
#[cfg(feature = "simulator")]
mod simulator;
