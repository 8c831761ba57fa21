//! What a provider's API looks like: the shapes of its requests and
//! answers ([`ApiStyle`]) and the completion budget assumed when a request
//! names none ([`DEFAULT_MAX_TOKENS`]).

/// Default completion budget when a request sets no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: u32 = 4_096;

/// Request and response shapes of a provider's API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApiStyle {
    /// OpenAI-compatible: `messages` with system turns (or `input`,
    /// `prompt`), `usage.prompt_tokens`.
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic Messages: top-level `system`, `usage.input_tokens`.
    Anthropic,
}

impl ApiStyle {
    /// `openai` or `anthropic` (the names it serializes to).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "openai" => Some(ApiStyle::OpenAi),
            "anthropic" => Some(ApiStyle::Anthropic),
            _ => None,
        }
    }
}
