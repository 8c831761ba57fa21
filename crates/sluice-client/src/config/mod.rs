//! The pace config: YAML → [`RawConfig`] → [`validate`] →
//! [`PaceConfig`], with `${ENV}` substitution, the shipped provider defaults,
//! the settings page's overrides file and hot reload ([`ConfigWatcher`]).
//!
//! ```yaml
//! providers:
//!   openai:
//!     apiKey: ${OPENAI_API_KEY}
//!     rateLimits: { tpm: 150000, rpm: 60, rpd: 0 }   # 0 = unlimited
//!   anthropic:
//!     apiKey: ${ANTHROPIC_API_KEY}                    # limits: shipped defaults
//!   local:
//!     baseUrl: http://127.0.0.1:8080/v1
//!     rateLimits: { tpm: 0, rpm: 0, rpd: 0 }
//!     shrink: true
//!     maxWaitSeconds: 10
//! ```
//!
//! The module's rooms: `limits`, `provider` and `pace` hold the checked
//! types; `defaults` and `shipped` what a config falls back to; `raw` the
//! file's shape; `load` reading and parsing; `validate` the checks; `env`
//! the `${ENV}` substitution; `keys` and `models` a provider's keys and model
//! groups; `watch` hot reload and the settings page's file.

mod defaults;
mod env;
mod keys;
mod limits;
mod load;
mod models;
mod pace;
mod provider;
pub mod raw;
mod shipped;
mod validate;
mod watch;

pub use defaults::{
    DEFAULT_ARRIVAL_MARGIN, DEFAULT_INTERACTIVE_RESERVE, DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAIT,
};
pub use keys::ApiKey;
pub use limits::{LimitsOrigin, ProviderLimits};
pub use load::{ConfigError, load, load_with_env, overrides_path, parse_str, parse_str_with_env};
pub use models::{ModelLimits, glob_matches, globs_overlap, model_entry};
pub use pace::{PaceConfig, PacerSettings};
pub use provider::ProviderConfig;
pub use raw::{RawApiKey, RawConfig, RawLimits, RawModel, RawOverrides, RawProvider};
pub use shipped::{SHIPPED_PROVIDERS, ShippedProvider, shipped};
pub use validate::validate;
pub use watch::{ConfigWatcher, LimitsSource, StaticLimits};

pub use crate::api::{ApiStyle, ApiStyleExt, DEFAULT_MAX_TOKENS};

/// One thing wrong with a pace config, at a key path such as
/// `providers.openai.rateLimits.tpm` (the same shape as a policy's problems).
pub use sluice_core::Problem;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use super::*;

    fn env(name: &str) -> Option<String> {
        (name == "OPENAI_API_KEY").then(|| "sk-test".to_owned())
    }

    fn parse(text: &str) -> Result<PaceConfig, ConfigError> {
        parse_str_with_env(text, Path::new("pace.yaml"), &env)
    }

    #[test]
    fn c1_seed_config_shape_parses() {
        let c = parse(
            "providers:\n  openai:\n    apiKey: ${OPENAI_API_KEY}\n    rateLimits:\n      tpm: 150000\n      rpm: 60\n      rpd: 0\n",
        )
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.api_key.as_deref(), Some("sk-test"));
        assert_eq!(o.base_url, "https://api.openai.com/v1");
        assert_eq!(o.limits, ProviderLimits::new(150_000, 60, 0));
        assert_eq!(o.origin, LimitsOrigin::Config);
        assert_eq!(o.auth_value("k"), "Bearer k");
        assert!(!format!("{o:?}").contains("sk-test"));
    }

    #[test]
    fn c1_the_azure_preset_sends_api_key_and_asks_for_the_resource() {
        let c = parse(
            "providers:\n  azure:\n    apiKey: k\n    baseUrl: https://contoso.openai.azure.com/openai/v1\n",
        )
        .unwrap();
        let a = c.provider("azure").unwrap();
        assert_eq!(a.base_url, "https://contoso.openai.azure.com/openai/v1");
        assert_eq!(a.auth_header.as_str(), "api-key");
        assert_eq!(a.auth_value("k"), "k");
        assert_eq!(a.limits, ProviderLimits::new(30_000, 180, 0));
        assert_eq!(a.origin, LimitsOrigin::Shipped);
        // The deployments form, with the user's own limits and header.
        let c = parse(
            "providers:\n  azure:\n    baseUrl: https://contoso.openai.azure.com/openai/deployments/gpt-4o/\n    authHeader: Authorization\n    rateLimits: {tpm: 450000, rpm: 2700}\n",
        )
        .unwrap();
        let a = c.provider("azure").unwrap();
        assert_eq!(
            a.base_url,
            "https://contoso.openai.azure.com/openai/deployments/gpt-4o"
        );
        assert_eq!(a.auth_value("t"), "Bearer t");
        // No base URL: the resource is the user's to name.
        let e = parse("providers:\n  azure:\n    apiKey: k\n").unwrap_err();
        let p = &e.problems()[0];
        assert_eq!(p.path, "providers.azure.baseUrl");
        assert!(p.message.contains("{resource}"), "{}", p.message);
        // In code, too: the template is kept for the caller to fill in.
        let p = ProviderConfig::shipped("azure").unwrap();
        assert_eq!(p.auth_header.as_str(), "api-key");
    }

    #[test]
    fn c1_tpd_in_rate_limits_keys_and_json() {
        let c = parse(
            "providers:\n  groq:\n    rateLimits: {tpd: 500000}\n    apiKeys:\n      - {key: a}\n      - {key: b, rateLimits: {tpd: 100000}}\n  mine:\n    baseUrl: http://127.0.0.1:1/v1\n    rateLimits: {tpm: 0, rpm: 0, rpd: 0}\n",
        )
        .unwrap();
        let g = c.provider("groq").unwrap();
        assert_eq!(
            g.limits,
            ProviderLimits::new(30_000, 30, 14_400).with_tpd(500_000)
        );
        assert_eq!(g.api_keys[0].limits.tpd, 500_000, "follows the provider");
        assert_eq!(g.api_keys[1].limits.tpd, 100_000, "its own");
        assert_eq!(c.provider("mine").unwrap().limits.tpd, 0, "unlimited");
        let j = c.limits_json();
        assert_eq!(j["providers"]["groq"]["tpd"], 500_000);
        assert_eq!(j["providers"]["groq"]["apiKeys"][1]["tpd"], 100_000);
        assert!(parse("providers:\n  groq:\n    rateLimits: {tpd: -1}\n").is_err());
        let e = parse("providers:\n  groq:\n    rateLimits: {tpd: 5000000000}\n").unwrap_err();
        assert_eq!(e.problems()[0].path, "providers.groq.rateLimits.tpd");
    }

    #[test]
    fn c1_shipped_defaults_fill_missing_limits() {
        let c = parse("providers:\n  groq:\n  anthropic:\n    rateLimits: {tpm: 1000}\n").unwrap();
        let g = c.provider("groq").unwrap();
        assert_eq!(g.limits, ProviderLimits::new(30_000, 30, 14_400));
        assert_eq!(g.origin, LimitsOrigin::Shipped);
        let a = c.provider("anthropic").unwrap();
        assert_eq!(a.limits, ProviderLimits::new(1000, 50, 0));
        assert_eq!(a.style, ApiStyle::Anthropic);
        assert_eq!(a.auth_header.as_str(), "x-api-key");
        assert_eq!(a.auth_value("k"), "k");
    }

    #[test]
    fn c1_missing_env_names_variable_and_key_path() {
        let e = parse("providers:\n  anthropic:\n    apiKey: ${ANTHROPIC_API_KEY}\n").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("pace.yaml"), "{text}");
        assert!(text.contains("providers.anthropic.apiKey"), "{text}");
        assert!(text.contains("ANTHROPIC_API_KEY"), "{text}");
    }

    #[test]
    fn c1_unknown_fields_and_bad_values_are_refused_with_paths() {
        let e = parse("providers:\n  openai:\n    rateLimit: {tpm: 1}\n").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("rateLimit") && text.contains("line"),
            "{text}"
        );
        let e = parse("providers:\n  mine:\n    rateLimits: {tpm: 1}\n").unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.mine.baseUrl",
                "providers.mine.rateLimits.rpm",
                "providers.mine.rateLimits.rpd"
            ]
        );
        let e = parse("providers:\n  x:\n    baseUrl: ftp://a\n    rateLimits: {tpm: 0, rpm: 0, rpd: 0}\n    style: grpc\n").unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["providers.x.style", "providers.x.baseUrl"]);
    }

    #[test]
    fn m1_models_parse_with_patterns_and_shared_groups() {
        let c = parse(
            "providers:\n  openai:\n    models:\n      gpt-4o: {rateLimits: {tpm: 30000, rpm: 500}}\n      \"gpt-4o-mini*\": {shared: small, rateLimits: {tpm: 200000}}\n      \"gpt-3.5*\": {shared: small}\n",
        )
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(
            o.limits,
            ProviderLimits::new(150_000, 60, 0),
            "provider-wide stay"
        );
        let m = o.model("gpt-4o").unwrap();
        assert_eq!(m.limits, ProviderLimits::new(30_000, 500, 0));
        assert_eq!(o.model("gpt-3.5-turbo").unwrap().group, "small");
        assert_eq!(
            o.model("gpt-3.5-turbo").unwrap().limits,
            ProviderLimits::new(200_000, 0, 0)
        );
        assert!(o.model("o1").is_none());
        let j = c.limits_json();
        assert_eq!(j["providers"]["openai"]["models"]["small"]["tpm"], 200_000);
        assert_eq!(
            j["providers"]["openai"]["models"]["small"]["patterns"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn m1_two_patterns_matching_one_model_with_different_limits_are_an_error() {
        let e = parse(
            "providers:\n  openai:\n    models:\n      \"gpt-4o*\": {rateLimits: {tpm: 30000}}\n      \"gpt*mini\": {rateLimits: {tpm: 1000}}\n      \"claude*\": {rateLimits: {tpm: 5}}\n",
        )
        .unwrap_err();
        let p = e.problems();
        assert_eq!(p.len(), 1, "{e}");
        assert!(p[0].path.starts_with("providers.openai.models."), "{e}");
        assert!(
            p[0].message.contains("gpt-4o*") && p[0].message.contains("gpt*mini"),
            "{e}"
        );
        // Same limits, or one shared group: fine.
        parse("providers:\n  openai:\n    models:\n      \"gpt-4o*\": {rateLimits: {tpm: 1}}\n      \"*mini\": {rateLimits: {tpm: 1}}\n").unwrap();
        parse("providers:\n  openai:\n    models:\n      \"gpt-4o*\": {shared: g, rateLimits: {tpm: 1}}\n      \"*mini\": {shared: g}\n").unwrap();
    }

    #[test]
    fn m1_bad_model_entries_are_named() {
        let e = parse(
            "providers:\n  openai:\n    models:\n      a: {}\n      b: {shared: nobody}\n      c: {shared: g, rateLimits: {tpm: 1}}\n      d: {shared: g, rateLimits: {tpm: 2}}\n      e: {rateLimits: {tpm: 1, bogus: 2}}\n",
        );
        // An unknown key is a parse error naming it.
        assert!(e.unwrap_err().to_string().contains("bogus"));
        let e = parse(
            "providers:\n  openai:\n    models:\n      a: {}\n      b: {shared: nobody}\n      c: {shared: g, rateLimits: {tpm: 1}}\n      d: {shared: g, rateLimits: {tpm: 2}}\n",
        )
        .unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.openai.models.a",
                "providers.openai.models.d.rateLimits",
                "providers.openai.models.b.shared"
            ],
            "{e}"
        );
    }

    #[test]
    fn m2_itpm_and_otpm_parse_and_an_otpm_alone_is_refused_where_both_are_counted() {
        let c = parse(
            "providers:\n  anthropic:\n    rateLimits: {tpm: 0, itpm: 40000, otpm: 8000}\n    models:\n      \"claude-*-haiku*\": {rateLimits: {itpm: 100000, otpm: 20000}}\n",
        )
        .unwrap();
        let a = c.provider("anthropic").unwrap();
        assert_eq!(
            a.limits,
            ProviderLimits::new(0, 50, 0).with_io(40_000, 8_000)
        );
        assert_eq!(
            a.model("claude-3-5-haiku-latest").unwrap().limits,
            ProviderLimits::new(0, 0, 0).with_io(100_000, 20_000)
        );
        let e = parse(
            "providers:\n  anthropic:\n    rateLimits: {otpm: 8000}\n    models:\n      m: {rateLimits: {otpm: 1}}\n",
        )
        .unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.anthropic.rateLimits.otpm",
                "providers.anthropic.models.m.rateLimits.otpm"
            ],
            "{e}"
        );
        // A provider counting tokens together may cap output alone.
        parse("providers:\n  openai:\n    rateLimits: {otpm: 8000}\n").unwrap();
    }

    #[test]
    fn m4_api_keys_parse_with_their_limits_and_an_unset_variable_is_named() {
        let c = parse(
            "providers:\n  openai:\n    rateLimits: {tpm: 1000, rpm: 10}\n    apiKeys:\n      - key: ${OPENAI_API_KEY}\n        name: main\n      - key: sk-literal\n        rateLimits: {tpm: 5000}\n",
        )
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.api_keys.len(), 2);
        assert_eq!(o.api_keys[0].name, "main");
        assert_eq!(o.api_keys[0].limits, ProviderLimits::new(1000, 10, 0));
        assert_eq!(o.api_keys[1].name, "key2");
        assert_eq!(o.api_keys[1].limits, ProviderLimits::new(5000, 10, 0));
        let shown = format!("{o:?} {}", c.limits_json());
        assert!(
            !shown.contains("sk-test") && !shown.contains("sk-literal"),
            "{shown}"
        );
        let e = parse(
            "providers:\n  openai:\n    apiKey: x\n    apiKeys:\n      - key: ${NOT_SET_ANYWHERE}\n      - key: a\n        name: main\n      - key: b\n        name: main\n",
        )
        .unwrap_err();
        let text = e.to_string();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.openai.apiKeys",
                "providers.openai.apiKeys[0].key",
                "providers.openai.apiKeys[2].name"
            ],
            "{text}"
        );
        assert!(text.contains("NOT_SET_ANYWHERE"), "{text}");
    }

    #[test]
    fn m1_the_example_pace_config_parses() {
        let text = include_str!("../../../../examples/pace.yaml");
        let c = parse_str_with_env(text, Path::new("examples/pace.yaml"), &|name| {
            name.ends_with("_API_KEY").then(|| "sk-example".to_owned())
        })
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.model("gpt-3.5-turbo-0125").unwrap().group, "small");
    }

    #[test]
    fn m3_interactive_reserve_seconds_parses_and_is_bounded() {
        let c = parse("providers:\n  openai:\n    interactiveReserveSeconds: 10\n").unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.interactive_reserve, Duration::from_secs(10));
        let c = parse("providers:\n  openai:\n").unwrap();
        assert_eq!(
            c.provider("openai").unwrap().interactive_reserve,
            DEFAULT_INTERACTIVE_RESERVE
        );
        let e = parse("providers:\n  openai:\n    interactiveReserveSeconds: -1\n").unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["providers.openai.interactiveReserveSeconds"]);
    }

    #[test]
    fn m2_the_settings_page_s_overrides_keep_itpm_and_otpm() {
        let dir = std::env::temp_dir().join(format!("sluice-m2-overrides-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pace.yaml");
        std::fs::write(
            &file,
            "providers:\n  anthropic:\n    rateLimits: {tpm: 0, itpm: 40000, otpm: 8000}\n",
        )
        .unwrap();
        // An overrides file of before the axes: the config's itpm/otpm stay.
        std::fs::write(
            overrides_path(&file),
            "providers:\n  anthropic:\n    rateLimits: { tpm: 0, rpm: 10, rpd: 0 }\n",
        )
        .unwrap();
        let c = load_with_env(&file, &env).unwrap();
        let a = c.provider("anthropic").unwrap();
        assert_eq!(
            a.limits,
            ProviderLimits::new(0, 10, 0).with_io(40_000, 8_000)
        );
        // An edit saved by the page keeps them too.
        let watcher = ConfigWatcher::open(&file).unwrap();
        watcher
            .save_limits(
                "anthropic",
                ProviderLimits::new(0, 20, 0).with_io(30_000, 6_000),
            )
            .unwrap();
        let c = load_with_env(&file, &env).unwrap();
        assert_eq!(
            c.provider("anthropic").unwrap().limits,
            ProviderLimits::new(0, 20, 0).with_io(30_000, 6_000)
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn m4_keys_follow_the_settings_page_on_the_axes_they_do_not_set() {
        let c = parse(
            "providers:\n  openai:\n    rateLimits: {tpm: 1000, rpm: 10}\n    apiKeys:\n      - key: a\n      - key: b\n        rateLimits: {tpm: 5000}\n",
        )
        .unwrap();
        let source = StaticLimits::new(c);
        source
            .save_limits("openai", ProviderLimits::new(2000, 20, 0))
            .unwrap();
        let c = source.current();
        let keys = &c.provider("openai").unwrap().api_keys;
        assert_eq!(keys[0].limits, ProviderLimits::new(2000, 20, 0));
        assert_eq!(keys[1].limits, ProviderLimits::new(5000, 20, 0));
    }
}
