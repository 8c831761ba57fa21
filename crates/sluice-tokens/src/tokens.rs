//! Token estimates before sending: a real tokenizer (OpenAI's BPE
//! encodings, compiled into the binary, loaded once on first use and shared;
//! feature `tokenizer`, on by default)
//! over the parts of a request a provider counts, plus the completion budget
//! it reserves (`max_tokens` / `max_completion_tokens`).
//!
//! Counting follows OpenAI's published recipe for chat messages (3 tokens
//! of framing per message, 1 per `name`, 3 to prime the answer). Parts that
//! are not text count as fixed placeholders ([`IMAGE_TOKENS_OPENAI`],
//! [`IMAGE_TOKENS_ANTHROPIC`]). Anthropic does not publish its tokenizer: its
//! messages are counted with the same encoding, which is close for English
//! text; the pacer's reconciliation with the answer's `usage` corrects the
//! books afterwards.

use serde_json::Value;

use crate::api::{ApiStyle, DEFAULT_MAX_TOKENS};

/// An image part on OpenAI: a `high`/`auto` detail 1024×1024 image (85 + 4
/// tiles × 170); `low` detail counts 85.
pub const IMAGE_TOKENS_OPENAI: u32 = 765;
/// An image (or document page) on Anthropic: the cap of its
/// `width × height / 750` rule for images it does not downscale further.
pub const IMAGE_TOKENS_ANTHROPIC: u32 = 1_600;

/// A BPE encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Encoding {
    /// GPT-4o, GPT-4.1, o-series.
    #[serde(rename = "o200k_base")]
    O200kBase,
    /// GPT-4, GPT-3.5.
    #[serde(rename = "cl100k_base")]
    Cl100kBase,
}

impl Encoding {
    /// `o200k_base` or `cl100k_base`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "o200k_base" => Some(Encoding::O200kBase),
            "cl100k_base" => Some(Encoding::Cl100kBase),
            _ => None,
        }
    }

    /// The shared tokenizer (built on first use, then reused by every
    /// thread).
    #[cfg(feature = "tokenizer")]
    fn tokenizer(self) -> &'static bpe_openai::Tokenizer {
        match self {
            Encoding::O200kBase => bpe_openai::o200k_base(),
            Encoding::Cl100kBase => bpe_openai::cl100k_base(),
        }
    }

    /// Tokens in `text`: counted with the encoding (feature `tokenizer`, on
    /// by default), else estimated as one token per 3 bytes of UTF-8,
    /// rounded up — more than the encodings give for English text, so the
    /// pacer reserves too much rather than too little until the answer's
    /// usage corrects it.
    pub fn count(self, text: &str) -> u32 {
        if text.is_empty() {
            return 0;
        }
        #[cfg(feature = "tokenizer")]
        let n = self.tokenizer().count(text);
        #[cfg(not(feature = "tokenizer"))]
        let n = text.len().div_ceil(3);
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Builds the tokenizer now (a server warms it at start so the first
    /// request does not pay for it); nothing without feature `tokenizer`.
    pub fn warm(self) {
        #[cfg(feature = "tokenizer")]
        let _ = self.tokenizer();
    }
}

/// A request's estimated cost: what the provider counts against TPM when it
/// arrives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenEstimate {
    /// Input tokens (messages, system, tools).
    pub prompt: u32,
    /// The completion budget reserved (`max_tokens` × `n`).
    pub completion: u32,
}

impl TokenEstimate {
    /// Prompt plus completion budget.
    pub fn total(&self) -> u32 {
        self.prompt.saturating_add(self.completion)
    }
}

/// How to estimate: [`EstimateOptions::default`], then set the fields to
/// change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EstimateOptions {
    /// Tokenizer.
    pub encoding: Encoding,
    /// Completion budget when the request sets none.
    pub default_max_tokens: u32,
}

impl Default for EstimateOptions {
    fn default() -> Self {
        EstimateOptions {
            encoding: Encoding::O200kBase,
            default_max_tokens: DEFAULT_MAX_TOKENS,
        }
    }
}

impl EstimateOptions {
    /// Counts with `encoding`, reserves `default_max_tokens` when a request
    /// sets no completion budget.
    pub fn new(encoding: Encoding, default_max_tokens: u32) -> Self {
        EstimateOptions {
            encoding,
            default_max_tokens,
        }
    }
}

/// Estimates a request to `path` (the part after the base URL, e.g.
/// `/chat/completions`) with JSON `body`, in the provider's `style`.
pub fn estimate(
    style: ApiStyle,
    path: &str,
    body: &Value,
    opts: &EstimateOptions,
) -> TokenEstimate {
    match style {
        ApiStyle::OpenAi => estimate_openai(path, body, opts),
        ApiStyle::Anthropic => estimate_anthropic(path, body, opts),
    }
}

fn add(a: u32, b: u32) -> u32 {
    a.saturating_add(b)
}

fn json_tokens(v: &Value, enc: Encoding) -> u32 {
    match v {
        Value::Null => 0,
        Value::String(s) => enc.count(s),
        other => enc.count(&other.to_string()),
    }
}

fn completion_budget(body: &Value, keys: &[&str], default: u32) -> u32 {
    let max = keys
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64))
        .map_or(default, |n| u32::try_from(n).unwrap_or(u32::MAX));
    let n = body
        .get("n")
        .and_then(Value::as_u64)
        .map_or(1, |n| u32::try_from(n.max(1)).unwrap_or(u32::MAX));
    max.saturating_mul(n)
}

/// OpenAI-style requests: chat completions (`messages`), the Responses API
/// (`input` with `max_output_tokens` or on `/responses`), legacy
/// completions (`prompt`) and embeddings (`input`, no completion).
pub fn estimate_openai(path: &str, body: &Value, opts: &EstimateOptions) -> TokenEstimate {
    let enc = opts.encoding;
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        let mut prompt = 3u32; // every reply is primed with <|start|>assistant<|message|>
        for m in messages {
            prompt = add(prompt, openai_message_tokens(m, enc));
        }
        prompt = add(prompt, openai_tools_tokens(body, enc));
        let completion = completion_budget(
            body,
            &["max_completion_tokens", "max_tokens"],
            opts.default_max_tokens,
        );
        return TokenEstimate { prompt, completion };
    }
    let responses = path.ends_with("/responses") || body.get("max_output_tokens").is_some();
    if let Some(input) = body.get("input") {
        let mut prompt = openai_input_tokens(input, enc);
        if responses {
            prompt = add(
                prompt,
                json_tokens(body.get("instructions").unwrap_or(&Value::Null), enc),
            );
            prompt = add(prompt, openai_tools_tokens(body, enc));
            let completion =
                completion_budget(body, &["max_output_tokens"], opts.default_max_tokens);
            return TokenEstimate { prompt, completion };
        }
        return TokenEstimate {
            prompt,
            completion: 0,
        };
    }
    if let Some(prompt) = body.get("prompt") {
        let completion = completion_budget(body, &["max_tokens"], opts.default_max_tokens);
        return TokenEstimate {
            prompt: openai_input_tokens(prompt, enc),
            completion,
        };
    }
    TokenEstimate::default()
}

fn openai_message_tokens(m: &Value, enc: Encoding) -> u32 {
    let mut n = 3u32;
    let Some(obj) = m.as_object() else {
        return add(n, json_tokens(m, enc));
    };
    for (k, v) in obj {
        match k.as_str() {
            "content" => n = add(n, openai_content_tokens(v, enc)),
            "name" => n = add(n, add(1, json_tokens(v, enc))),
            "tool_calls" => {
                for call in v.as_array().into_iter().flatten() {
                    let f = call.get("function").unwrap_or(call);
                    n = add(n, 3);
                    n = add(n, json_tokens(f.get("name").unwrap_or(&Value::Null), enc));
                    n = add(
                        n,
                        json_tokens(f.get("arguments").unwrap_or(&Value::Null), enc),
                    );
                }
            }
            "function_call" => n = add(n, json_tokens(v, enc)),
            "tool_call_id" | "refusal" => {}
            _ => n = add(n, json_tokens(v, enc)),
        }
    }
    n
}

fn openai_content_tokens(v: &Value, enc: Encoding) -> u32 {
    match v {
        Value::Array(parts) => parts.iter().fold(0u32, |n, part| {
            let t = part.get("type").and_then(Value::as_str).unwrap_or("");
            let c = match t {
                "text" | "input_text" | "output_text" => {
                    json_tokens(part.get("text").unwrap_or(&Value::Null), enc)
                }
                "image_url" | "input_image" => {
                    let detail = part
                        .get("image_url")
                        .and_then(|i| i.get("detail"))
                        .or_else(|| part.get("detail"))
                        .and_then(Value::as_str);
                    if detail == Some("low") {
                        85
                    } else {
                        IMAGE_TOKENS_OPENAI
                    }
                }
                "input_audio" | "file" | "input_file" => IMAGE_TOKENS_OPENAI,
                _ => json_tokens(part, enc),
            };
            add(n, c)
        }),
        other => json_tokens(other, enc),
    }
}

fn openai_input_tokens(v: &Value, enc: Encoding) -> u32 {
    match v {
        Value::String(s) => enc.count(s),
        Value::Array(items) => items.iter().fold(0u32, |n, item| {
            let c = match item {
                Value::String(s) => enc.count(s),
                // Pre-tokenised input: one token per integer.
                Value::Number(_) => 1,
                Value::Array(a) if a.iter().all(Value::is_number) => {
                    u32::try_from(a.len()).unwrap_or(u32::MAX)
                }
                Value::Object(_) => openai_message_tokens(item, enc),
                other => json_tokens(other, enc),
            };
            add(n, c)
        }),
        other => json_tokens(other, enc),
    }
}

fn openai_tools_tokens(body: &Value, enc: Encoding) -> u32 {
    let mut n = 0u32;
    for key in ["tools", "functions"] {
        if let Some(tools) = body.get(key).and_then(Value::as_array) {
            // A fixed preamble for the tool namespace plus each definition.
            n = add(n, 12);
            for t in tools {
                n = add(n, add(8, json_tokens(t, enc)));
            }
        }
    }
    if let Some(rf) = body
        .get("response_format")
        .filter(|v| v.get("json_schema").is_some())
    {
        n = add(n, json_tokens(rf, enc));
    }
    n
}

/// Anthropic Messages requests: `system` (string or text blocks), `tools`,
/// and `messages` whose content is a string or blocks (text, image,
/// document, tool use and results, thinking). `/messages/count_tokens`
/// costs nothing.
pub fn estimate_anthropic(path: &str, body: &Value, opts: &EstimateOptions) -> TokenEstimate {
    if path.ends_with("/count_tokens") {
        return TokenEstimate::default();
    }
    let enc = opts.encoding;
    let mut prompt = 0u32;
    if let Some(system) = body.get("system") {
        prompt = add(prompt, add(3, anthropic_content_tokens(system, enc)));
    }
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        prompt = add(prompt, 12);
        for t in tools {
            prompt = add(prompt, add(8, json_tokens(t, enc)));
        }
    }
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        prompt = add(prompt, 4);
        prompt = add(
            prompt,
            anthropic_content_tokens(m.get("content").unwrap_or(&Value::Null), enc),
        );
    }
    if body.get("messages").is_none() && body.get("prompt").is_some() {
        prompt = add(
            prompt,
            json_tokens(body.get("prompt").unwrap_or(&Value::Null), enc),
        );
    }
    let prompt = add(prompt, 3);
    let completion = completion_budget(
        body,
        &["max_tokens", "max_tokens_to_sample"],
        opts.default_max_tokens,
    );
    TokenEstimate { prompt, completion }
}

fn anthropic_content_tokens(v: &Value, enc: Encoding) -> u32 {
    match v {
        Value::Array(blocks) => blocks.iter().fold(0u32, |n, b| {
            let t = b.get("type").and_then(Value::as_str).unwrap_or("");
            let c = match t {
                "text" => json_tokens(b.get("text").unwrap_or(&Value::Null), enc),
                "image" | "document" => IMAGE_TOKENS_ANTHROPIC,
                "tool_use" | "server_tool_use" => add(
                    json_tokens(b.get("name").unwrap_or(&Value::Null), enc),
                    json_tokens(b.get("input").unwrap_or(&Value::Null), enc),
                ),
                "tool_result" => add(
                    3,
                    anthropic_content_tokens(b.get("content").unwrap_or(&Value::Null), enc),
                ),
                "thinking" => json_tokens(b.get("thinking").unwrap_or(&Value::Null), enc),
                "redacted_thinking" => 0,
                _ => json_tokens(b, enc),
            };
            add(n, c)
        }),
        other => json_tokens(other, enc),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn opts() -> EstimateOptions {
        EstimateOptions::new(Encoding::O200kBase, 100)
    }

    #[test]
    fn counts_with_a_real_tokenizer() {
        assert_eq!(Encoding::O200kBase.count(""), 0);
        assert_eq!(Encoding::O200kBase.count("hello world"), 2);
        assert_eq!(Encoding::Cl100kBase.count("hello world"), 2);
        assert!(Encoding::O200kBase.count("tiktoken is great!") >= 4);
    }

    #[test]
    fn c2_openai_chat_matches_the_published_recipe() {
        // OpenAI's cookbook: 3 per message + content + role, +3 priming.
        let body = json!({"model":"gpt-4o","messages":[
            {"role":"system","content":"You are terse."},
            {"role":"user","content":"hello world","name":"bob"}
        ],"max_tokens":50});
        let e = estimate(ApiStyle::OpenAi, "/chat/completions", &body, &opts());
        let c = |s| Encoding::O200kBase.count(s);
        let expected = 3
            + (3 + c("system") + c("You are terse."))
            + (3 + c("user") + c("hello world") + 1 + c("bob"));
        assert_eq!(e.prompt, expected);
        assert_eq!(e.completion, 50);
        assert_eq!(e.total(), expected + 50);
    }

    #[test]
    fn c2_completion_budget_prefers_max_completion_tokens_and_defaults() {
        let b = json!({"messages":[],"max_tokens":10,"max_completion_tokens":20,"n":2});
        assert_eq!(
            estimate_openai("/chat/completions", &b, &opts()).completion,
            40
        );
        let b = json!({"messages":[]});
        assert_eq!(
            estimate_openai("/chat/completions", &b, &opts()).completion,
            100
        );
        let b = json!({"input":["a b c"]});
        assert_eq!(estimate_openai("/embeddings", &b, &opts()).completion, 0);
    }

    #[test]
    fn c2_openai_parts_tools_and_images() {
        let text_only =
            json!({"messages":[{"role":"user","content":[{"type":"text","text":"describe"}]}]});
        let with_image = json!({"messages":[{"role":"user","content":[
            {"type":"text","text":"describe"},
            {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]});
        let a = estimate_openai("/chat/completions", &text_only, &opts()).prompt;
        let b = estimate_openai("/chat/completions", &with_image, &opts()).prompt;
        assert_eq!(b - a, IMAGE_TOKENS_OPENAI);
        let tools = json!({"messages":[],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]});
        assert!(estimate_openai("/chat/completions", &tools, &opts()).prompt > 20);
    }

    #[test]
    fn c2_anthropic_system_tools_and_blocks() {
        let body = json!({"model":"claude","max_tokens":300,
        "system":"Be brief.",
        "tools":[{"name":"lookup","description":"find","input_schema":{"type":"object"}}],
        "messages":[
            {"role":"user","content":"hi there"},
            {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"lookup","input":{"q":"x"}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"found"},
                                       {"type":"image","source":{"type":"base64","data":"AAAA"}}]}
        ]});
        let e = estimate(ApiStyle::Anthropic, "/messages", &body, &opts());
        assert_eq!(e.completion, 300);
        assert!(e.prompt > IMAGE_TOKENS_ANTHROPIC + 20, "{e:?}");
        let free = estimate(
            ApiStyle::Anthropic,
            "/messages/count_tokens",
            &body,
            &opts(),
        );
        assert_eq!(free.total(), 0);
    }
}
