//! What a provider's API looks like to the client: the shapes of its
//! requests and answers ([`ApiStyle`]) and the completion budget assumed
//! when a request names none. Shared by the config, the token estimates, the
//! shrinking of requests and the simulator; users reach both through the
//! `config` module, which re-exports them.

use http::HeaderName;

/// Default completion budget when a request sets no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: u32 = 4_096;

/// Request and response shapes of a provider's API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApiStyle {
    /// OpenAI-compatible: `messages` with system turns, `usage.prompt_tokens`,
    /// `Authorization: Bearer`.
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic Messages: top-level `system`, `usage.input_tokens`,
    /// `x-api-key`.
    Anthropic,
}

impl ApiStyle {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "openai" => Some(ApiStyle::OpenAi),
            "anthropic" => Some(ApiStyle::Anthropic),
            _ => None,
        }
    }

    /// The header the key goes in by default.
    pub fn default_auth_header(self) -> HeaderName {
        match self {
            ApiStyle::OpenAi => http::header::AUTHORIZATION,
            ApiStyle::Anthropic => HeaderName::from_static("x-api-key"),
        }
    }
}
