//! sluice's LLM token accounting, shared by the client pacer and the
//! gateway's edge: how many tokens a request will cost before it goes
//! ([`tokens`]), and how many the answer actually used ([`usage`]).
//!
//! A request's estimate is its input counted with a real tokenizer (OpenAI's
//! BPE encodings, [`Encoding`]) plus the completion budget it reserves
//! (`max_tokens` and its kin, times `n`). [`estimate`] reads a parsed JSON
//! body; [`estimate_body`] reads raw bytes and says why a body is not an LLM
//! request ([`BadLlmBody`]). Pick the encoding by model name with
//! [`Encoding::for_model`] (or [`EstimateOptions::for_model`]); for a model
//! whose tokenizer is unknown, count conservatively ([`count_conservative`]:
//! one token per byte, never fewer than a real tokenizer gives).
//!
//! An answer's [`Usage`] is read from its `usage` in OpenAI's or Anthropic's
//! shape, in one JSON document ([`usage_from_json`]) or across the events of
//! a stream ([`UsageScanner`], and [`UsageTap`], a body that reads it as the
//! answer passes unchanged). [`Usage::prompt`] is always the whole input and
//! [`Usage::cached_input`] the part of it read from a cache, so a budget can
//! weigh the two apart.
//!
//! ```
//! use sluice_tokens::{ApiStyle, EstimateOptions, estimate_body, usage_from_json};
//!
//! let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":50}"#;
//! let opts = EstimateOptions::for_model("gpt-4o");
//! let est = estimate_body(ApiStyle::OpenAi, "/chat/completions", body, &opts).unwrap();
//! assert_eq!(est.completion, 50);
//!
//! let answer = serde_json::json!({"usage": {"prompt_tokens": 1_200, "completion_tokens": 40,
//!     "prompt_tokens_details": {"cached_tokens": 1_024}}});
//! let used = usage_from_json(&answer).unwrap();
//! assert_eq!((used.prompt, used.cached_input, used.completion), (1_200, 1_024, 40));
//! ```
//!
//! # Features
//!
//! | feature | default | what it adds | what it costs |
//! | --- | --- | --- | --- |
//! | `tokenizer` | on | OpenAI's BPE encodings (without it: one token per 3 bytes, rounded up) | `bpe-openai`; the vocabularies are compiled in, loaded once on first use |
//! | `body` | on | [`UsageTap`], an `http_body::Body` | `bytes`, `http-body` |

mod api;
#[cfg(feature = "tokenizer")]
mod ascii_split;
#[cfg(feature = "tokenizer")]
mod count_cache;
#[cfg(feature = "tokenizer")]
mod piece_memo;
pub mod tokens;
pub mod usage;

pub use api::{ApiStyle, DEFAULT_MAX_TOKENS};
pub use tokens::{
    BUDGET_KEYS, BadLlmBody, Encoding, EstimateOptions, MAX_COMPLETION_BUDGET, TokenEstimate,
    check_body, check_counts, check_value, count_conservative, endpoint_is, estimate,
    estimate_body, model_of, names_completion_budget,
};
#[cfg(feature = "body")]
pub use usage::{OnUsage, UsageTap};
pub use usage::{Usage, UsageScanner, usage_from_json};
