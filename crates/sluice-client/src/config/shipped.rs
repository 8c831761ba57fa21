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
    /// Where its API lives. A `{resource}` in it is the user's to fill in
    /// (Azure OpenAI's host names the user's resource): such a provider
    /// needs `baseUrl` in the config.
    pub base_url: &'static str,
    /// Its request and response shapes.
    pub style: ApiStyle,
    /// Conservative mid-tier defaults; 0 = unlimited.
    pub limits: ProviderLimits,
    /// The header its key goes in when not its style's default
    /// (Azure OpenAI's `api-key`, the key as is).
    pub auth_header: Option<&'static str>,
}

impl ShippedProvider {
    /// Whether [`ShippedProvider::base_url`] holds a placeholder the user
    /// fills in (`{resource}`).
    pub fn base_url_is_template(&self) -> bool {
        self.base_url.contains('{')
    }

    const fn auth(mut self, header: &'static str) -> Self {
        self.auth_header = Some(header);
        self
    }
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
        auth_header: None,
    }
}

use ApiStyle::{Anthropic, OpenAi};

/// The shipped providers and their suggested defaults.
#[rustfmt::skip]
pub const SHIPPED_PROVIDERS: [ShippedProvider; 15] = [
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
    // One deployment's quota (Standard): 6 RPM per 1,000 TPM, Azure's ratio. The
    // host names the user's resource: `baseUrl` is required.
    p("azure", "Azure OpenAI (one deployment)", "https://{resource}.openai.azure.com/openai/v1", OpenAi, 30_000, 180, 0).auth("api-key"),
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
        assert_eq!(l("azure"), Some(ProviderLimits::new(30_000, 180, 0)));
        assert_eq!(l("ollama"), Some(ProviderLimits::UNLIMITED));
        assert_eq!(l("lmstudio"), Some(ProviderLimits::UNLIMITED));
        assert_eq!(shipped("nope"), None);
    }

    #[test]
    fn c1_azure_is_shipped_with_its_key_header_and_no_base_url() {
        let azure = shipped("azure").unwrap();
        assert_eq!(azure.auth_header, Some("api-key"));
        assert_eq!(azure.style, ApiStyle::OpenAi);
        assert!(azure.base_url_is_template());
        // RPM is 6 per 1,000 TPM, as Azure assigns them.
        assert_eq!(azure.limits.rpm * 1000, azure.limits.tpm * 6);
        assert!(
            SHIPPED_PROVIDERS
                .iter()
                .filter(|p| p.name != "azure")
                .all(|p| !p.base_url_is_template() && p.auth_header.is_none())
        );
    }
}
