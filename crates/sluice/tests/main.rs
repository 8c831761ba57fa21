//! The integration tests of `sluice`, built as one binary: each module is one
//! area of the crate, and its helpers are shared.

#[path = "../../../tests/support/edit.rs"]
mod edit;
#[path = "../../../tests/support/one_request.rs"]
mod one_request;
#[path = "../../../tests/support/python_venv.rs"]
mod python_venv;
mod support;

mod alerts;
mod batches;
mod bypass;
mod check;
mod cluster;
mod doors;
mod flood;
mod http1;
mod idle;
mod lanes;
mod leased;
mod limits;
mod logs;
mod optimizer;
mod otel;
mod pace;
mod quotas;
mod recovery;
mod redis_tls_sentinel;
mod reload;
mod replicas;
mod rls;
mod serve;
mod tenants;
mod tls;
mod tokens_durable;
mod tokens_pace;
mod tokens_sdk;
mod usage_export;
