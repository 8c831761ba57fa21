//! The providers sluice knows, with suggested limits and their public
//! OpenAI-compatible (or native) base URLs: used when a config entry leaves
//! them out.

use super::limits::ProviderLimits;
use crate::api::ApiStyle;

/// One shipped provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShippedProvider {
    /// The config key (`providers.<name>`).
    pub name: &'static str,
    /// The provider's name in a pace config (`openai`, `anthropic`, …).
    pub title: &'static str,
    /// Where its API lives.
    pub base_url: &'static str,
    /// Its request and response shapes.
    pub style: ApiStyle,
    /// Conservative mid-tier defaults; 0 = unlimited.
    pub limits: ProviderLimits,
}

const fn p(
    name: &'static str,
    title: &'static str,
    base_url: &'static str,
    style: ApiStyle,
    tpm: u32,
    rpm: u32,
    rpd: u32,
) -> ShippedProvider {
    ShippedProvider {
        name,
        title,
        base_url,
        style,
        limits: ProviderLimits::new(tpm, rpm, rpd),
    }
}

use ApiStyle::{Anthropic, OpenAi};

/// The shipped providers and their suggested defaults.
#[rustfmt::skip]
pub const SHIPPED_PROVIDERS: [ShippedProvider; 14] = [
    p("openai", "OpenAI (GPT-4o tier)", "https://api.openai.com/v1", OpenAi, 150_000, 60, 0),
    p("anthropic", "Anthropic (Claude 3.5)", "https://api.anthropic.com/v1", Anthropic, 120_000, 50, 0),
    p("google", "Google (Gemini 1.5 Pro)", "https://generativelanguage.googleapis.com/v1beta/openai", OpenAi, 250_000, 100, 0),
    p("groq", "Groq", "https://api.groq.com/openai/v1", OpenAi, 30_000, 30, 14_400),
    p("deepseek", "DeepSeek", "https://api.deepseek.com/v1", OpenAi, 60_000, 60, 0),
    p("openrouter", "OpenRouter", "https://openrouter.ai/api/v1", OpenAi, 200_000, 200, 0),
    p("mistral", "Mistral", "https://api.mistral.ai/v1", OpenAi, 150_000, 50, 0),
    p("cohere", "Cohere", "https://api.cohere.ai/compatibility/v1", OpenAi, 100_000, 100, 0),
    p("together", "Together AI", "https://api.together.xyz/v1", OpenAi, 80_000, 60, 0),
    p("fireworks", "Fireworks AI", "https://api.fireworks.ai/inference/v1", OpenAi, 80_000, 60, 0),
    p("perplexity", "Perplexity", "https://api.perplexity.ai", OpenAi, 50_000, 50, 0),
    p("ai21", "AI21", "https://api.ai21.com/studio/v1", OpenAi, 60_000, 50, 0),
    p("ollama", "Ollama (local)", "http://localhost:11434/v1", OpenAi, 0, 0, 0),
    p("lmstudio", "LM Studio (local)", "http://localhost:1234/v1", OpenAi, 0, 0, 0),
];

/// The shipped entry for `name`, if sluice ships one.
pub fn shipped(name: &str) -> Option<&'static ShippedProvider> {
    SHIPPED_PROVIDERS.iter().find(|p| p.name == name)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn c1_seed_table_of_defaults() {
        let l = |n: &str| shipped(n).map(|p| p.limits);
        assert_eq!(l("openai"), Some(ProviderLimits::new(150_000, 60, 0)));
        assert_eq!(l("anthropic"), Some(ProviderLimits::new(120_000, 50, 0)));
        assert_eq!(l("google"), Some(ProviderLimits::new(250_000, 100, 0)));
        assert_eq!(l("groq"), Some(ProviderLimits::new(30_000, 30, 14_400)));
        assert_eq!(l("deepseek"), Some(ProviderLimits::new(60_000, 60, 0)));
        assert_eq!(l("openrouter"), Some(ProviderLimits::new(200_000, 200, 0)));
        assert_eq!(l("mistral"), Some(ProviderLimits::new(150_000, 50, 0)));
        assert_eq!(l("cohere"), Some(ProviderLimits::new(100_000, 100, 0)));
        assert_eq!(l("together"), Some(ProviderLimits::new(80_000, 60, 0)));
        assert_eq!(l("fireworks"), Some(ProviderLimits::new(80_000, 60, 0)));
        assert_eq!(l("perplexity"), Some(ProviderLimits::new(50_000, 50, 0)));
        assert_eq!(l("ai21"), Some(ProviderLimits::new(60_000, 50, 0)));
        assert_eq!(l("ollama"), Some(ProviderLimits::UNLIMITED));
        assert_eq!(l("lmstudio"), Some(ProviderLimits::UNLIMITED));
        assert_eq!(shipped("nope"), None);
    }
}
