//! What a provider's API looks like to the client: [`ApiStyle`] and
//! [`DEFAULT_MAX_TOKENS`] (from `sluice-tokens`, which reads requests and
//! answers in each style) and the header a key goes in ([`ApiStyleExt`]).
//! Users reach them through the `config` module, which re-exports them.

use http::HeaderName;
pub use sluice_tokens::{ApiStyle, DEFAULT_MAX_TOKENS};

/// The client's knowledge of an [`ApiStyle`] beyond its bodies: where the
/// key goes.
pub trait ApiStyleExt {
    /// The header the key goes in by default: `Authorization` (as
    /// `Bearer`) for OpenAI, `x-api-key` for Anthropic.
    fn default_auth_header(self) -> HeaderName;
}

impl ApiStyleExt for ApiStyle {
    fn default_auth_header(self) -> HeaderName {
        match self {
            ApiStyle::OpenAi => http::header::AUTHORIZATION,
            ApiStyle::Anthropic => HeaderName::from_static("x-api-key"),
        }
    }
}
