//! sluice's client pacer: keeps calls to LLM providers inside
//! their tokens-per-minute, requests-per-minute and requests-per-day limits.
//!
//! Before a request goes, its tokens are estimated with a real tokenizer
//! ([`tokens`]) and reserved against a rolling 60 s window; if they do not
//! fit, the request waits — first come, first served, though a smaller one
//! may go ahead of it where that delays it not at all — exactly until they
//! do ([`Pacer`]). Requests are spaced evenly under the RPM limit. When the
//! answer arrives, its actual `usage` replaces the reservation, and its
//! rate-limit headers correct the books ([`headers`]). 429s and 5xx are
//! retried with the provider's `Retry-After` or a jittered backoff
//! ([`backoff`]). A request larger than the whole TPM is refused at once;
//! one that would wait too long can have its oldest context dropped
//! ([`shrink`], opt-in).
//!
//! Providers do not count one budget per provider: a request is paced by its
//! model's limits ([`config::ModelLimits`]) and the provider-wide ones, with
//! input and output tokens apart where the provider counts them so (`itpm`,
//! `otpm`), goes with the key that can send it soonest
//! ([`config::ApiKey`]), and may be a batch request that uses only what
//! interactive ones leave ([`AcquireOptions`], [`Priority`]).
//!
//! Forms: the [`Pacer`] API, a tower layer ([`PacerLayer`]), a
//! reqwest-middleware (`PacerMiddleware`) and the `sluice pace` proxy
//! (`proxy::run_proxy`).
//!
//! # Features
//!
//! | feature | default | what it adds | what it costs |
//! | --- | --- | --- | --- |
//! | `tokenizer` | on | OpenAI's BPE encodings for estimates (without it: one token per 3 bytes, rounded up) | `bpe-openai`; the vocabularies are compiled in, loaded once on first use |
//! | `reqwest` | on | `PacerMiddleware` for `reqwest-middleware` clients | `reqwest` (rustls), `reqwest-middleware` |
//! | `proxy` | off | the `sluice pace` proxy (`proxy` module) | `axum` and a hyper server, plus `reqwest` |
//! | `simulator` | off | a provider that enforces strict windows (`simulator` module), for tests and benchmarks | a hyper server |
//!
//! With no features the crate is the [`Pacer`] and the tower layer; the
//! dependency counts per feature set are in the repository's `docs/library.md`.
//!
//! ```
//! use std::time::Duration;
//! use sluice_client::Pacer;
//! use sluice_client::config::{PaceConfig, ProviderConfig, ProviderLimits};
//! use sluice_client::tokens::TokenEstimate;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let limits = ProviderLimits::new(1_000, 0, 0);
//! let config = PaceConfig::from_providers([ProviderConfig::new("openai", "https://api.openai.com/v1", limits)]);
//! let pacer = Pacer::from_config(config);
//!
//! // 800 tokens fit at once; the answer used only 500.
//! let permit = pacer.acquire("openai", TokenEstimate { prompt: 300, completion: 500 }).await.unwrap();
//! assert_eq!(permit.waited(), Duration::ZERO);
//! permit.reconcile(500).await.unwrap();
//!
//! // 600 more do not fit until the first request's tokens leave the window:
//! // 60 s + the 1 s arrival margin + the rest of its 250 ms slot.
//! let permit = pacer.acquire("openai", 600u32).await.unwrap();
//! assert!(permit.waited() >= Duration::from_secs(61));
//! assert!(permit.waited() <= Duration::from_millis(61_250));
//!
//! // More than the whole TPM never fits: an error at once, not a wait.
//! assert!(pacer.acquire("openai", 1_001u32).await.is_err());
//! # }
//! ```
//!
//! (The example runs on tokio's paused clock: the pacer reads time through
//! tokio, so the minute's wait takes no real time here. In a program it is a
//! real wait.)

/// The side-by-side snippets of `docs/`, run as doc tests.
#[cfg(all(doctest, feature = "reqwest"))]
#[doc = include_str!("../../../docs/vs-reqwest-retry.md")]
struct VsReqwestRetry;

mod api;
pub mod backoff;
mod call;
mod clock;
pub mod config;
mod error;
pub mod headers;
mod layer;
#[cfg(feature = "reqwest")]
mod middleware;
mod pacer;
pub mod priority;
#[cfg(feature = "proxy")]
pub mod proxy;
#[cfg(feature = "reqwest")]
mod redirect;
mod route;
pub mod shrink;
#[cfg(feature = "simulator")]
pub mod simulator;
mod window;

pub use call::IDEMPOTENCY_KEY;
pub use clock::{TEST_EPOCH, TokioClock};
/// The config a [`Pacer`] paces by (also at [`config::PaceConfig`], with the
/// rest of the config).
pub use config::PaceConfig;
pub use error::PaceError;
/// Rate-limit headers as the pacer reads them (also at
/// [`headers::RateLimitHeaders`]).
pub use headers::RateLimitHeaders;
pub use layer::{BoxError, PacedBody, PacerLayer, PacerService};
#[cfg(feature = "reqwest")]
pub use middleware::{PaceProvider, PacerMiddleware};
pub use pacer::{InputRatioReading, Pacer, PacerOptions, Permit, ProviderStats, WindowReading};
pub use priority::{AcquireOptions, PRIORITY_HEADER, Priority};
#[cfg(feature = "reqwest")]
pub use redirect::{MAX_REDIRECTS, same_origin_redirects};
/// Token estimates before sending (the `sluice-tokens` crate's `tokens`
/// module).
pub use sluice_tokens::tokens;
/// The tokens an answer actually used (the `sluice-tokens` crate's `usage`
/// module).
pub use sluice_tokens::usage;
