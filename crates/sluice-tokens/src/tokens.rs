//! Token estimates before sending: a real tokenizer (OpenAI's BPE
//! encodings, compiled into the binary, loaded once on first use and shared;
//! feature `tokenizer`, on by default)
//! over the parts of a request a provider counts, plus the completion budget
//! it reserves (`max_tokens` / `max_completion_tokens` / `max_output_tokens`).
//!
//! For a model whose tokenizer is not known ([`Encoding::for_model`] says
//! `None`), count conservatively: [`count_conservative`] (set
//! [`EstimateOptions::conservative`]) gives one token per byte of UTF-8,
//! never fewer tokens than a byte-level BPE tokenizer gives.
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

/// A BPE encoding: pick one by model name with [`Encoding::for_model`].
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

    /// The encoding of an OpenAI model, by its name: `o200k_base` for
    /// `gpt-4o*`, `gpt-4.1*`, `gpt-5*`, `o1*`, `o3*`, `o4*` and
    /// `chatgpt-4o*`; `cl100k_base` for the other `gpt-4*`, `gpt-3.5*` and
    /// `text-embedding-*`; the same for a fine-tune of one of them
    /// (`ft:gpt-4o-mini:…`). `None` for any other model (another provider's,
    /// or one not known here): count it with [`count_conservative`] instead
    /// ([`EstimateOptions::for_model`] does this choice).
    pub fn for_model(model: &str) -> Option<Self> {
        let m = model.strip_prefix("ft:").unwrap_or(model);
        const O200K: [&str; 7] = ["gpt-4o", "gpt-4.1", "gpt-5", "o1", "o3", "o4", "chatgpt-4o"];
        const CL100K: [&str; 3] = ["gpt-4", "gpt-3.5", "text-embedding-"];
        if O200K.iter().any(|p| m.starts_with(p)) {
            Some(Encoding::O200kBase)
        } else if CL100K.iter().any(|p| m.starts_with(p)) {
            Some(Encoding::Cl100kBase)
        } else {
            None
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
        let n = crate::count_cache::count(self, text, |text| self.tokenize(text));
        #[cfg(not(feature = "tokenizer"))]
        let n = text.len().div_ceil(3);
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Tokens in `text` by the encoding: ASCII text split without the
    /// encoding's regular expression ([`crate::ascii_split`], the same pieces),
    /// its short pieces' counts kept per thread ([`crate::piece_memo`]); any
    /// other text by the encoding itself.
    #[cfg(feature = "tokenizer")]
    fn tokenize(self, text: &str) -> usize {
        use crate::ascii_split::{Split, pieces};
        let tokenizer = self.tokenizer();
        if !text.is_ascii() {
            return tokenizer.count(text);
        }
        let split = match self {
            Encoding::O200kBase => Split::O200k,
            Encoding::Cl100kBase => Split::Cl100k,
        };
        crate::piece_memo::with(|memo| {
            let mut n = 0;
            pieces(text.as_bytes(), split, |piece| {
                n += memo.count(self, piece, |p| tokenizer.bpe.count(p));
            });
            n
        })
    }

    /// Builds the tokenizer now (a server warms it at start so the first
    /// request does not pay for it); nothing without feature `tokenizer`.
    pub fn warm(self) {
        #[cfg(feature = "tokenizer")]
        let _ = self.tokenizer();
    }
}

/// Tokens in `text` for any tokenizer, counted without one: its length in
/// bytes of UTF-8. A byte-level BPE token (OpenAI's, and as far as is known
/// every other provider's) is at least one byte, so this is never fewer
/// tokens than a real tokenizer gives; for English text it is about four
/// times as many. For a model whose tokenizer is unknown
/// ([`Encoding::for_model`] gives `None`).
pub fn count_conservative(text: &str) -> u32 {
    u32::try_from(text.len()).unwrap_or(u32::MAX)
}

/// What counts the text of a request: the options' encoding, or bytes.
#[derive(Clone, Copy)]
struct Counter {
    encoding: Encoding,
    conservative: bool,
}

impl Counter {
    fn of(opts: &EstimateOptions) -> Self {
        Counter {
            encoding: opts.encoding,
            conservative: opts.conservative,
        }
    }

    fn count(self, text: &str) -> u32 {
        if self.conservative {
            count_conservative(text)
        } else {
            self.encoding.count(text)
        }
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

/// How to estimate: [`EstimateOptions::default`] (or
/// [`EstimateOptions::new`], [`EstimateOptions::for_model`]), then set the
/// fields to change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EstimateOptions {
    /// Tokenizer (unused when [`conservative`](Self::conservative)).
    pub encoding: Encoding,
    /// Completion budget when the request sets none.
    pub default_max_tokens: u32,
    /// Count text with [`count_conservative`] (one token per byte) instead
    /// of [`encoding`](Self::encoding): for a model whose tokenizer is
    /// unknown. Off by default.
    pub conservative: bool,
}

impl Default for EstimateOptions {
    fn default() -> Self {
        EstimateOptions {
            encoding: Encoding::O200kBase,
            default_max_tokens: DEFAULT_MAX_TOKENS,
            conservative: false,
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
            conservative: false,
        }
    }

    /// The defaults, counting with `model`'s encoding
    /// ([`Encoding::for_model`]), or conservatively when it has none known.
    pub fn for_model(model: &str) -> Self {
        match Encoding::for_model(model) {
            Some(encoding) => EstimateOptions {
                encoding,
                ..EstimateOptions::default()
            },
            None => EstimateOptions {
                conservative: true,
                ..EstimateOptions::default()
            },
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

/// The largest completion budget (`max_tokens` and its kin) a request may
/// name for [`estimate_body`]: ten million, far above any model's output.
pub const MAX_COMPLETION_BUDGET: u64 = 10_000_000;

/// The fields that name a request's completion budget.
pub const BUDGET_KEYS: [&str; 4] = [
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "max_tokens_to_sample",
];

/// Why [`estimate_body`] found a body not to be an LLM request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadLlmBody {
    /// The body is not JSON (or nests deeper than the JSON parser's limit
    /// of 128).
    #[error("the request body is not JSON")]
    NotJson,
    /// The body is JSON, but not an object.
    #[error("the request body is not a JSON object")]
    NotAnObject,
    /// `model` is present but not a string.
    #[error("the request's `model` is not a string")]
    ModelNotAString,
    /// A completion budget (`max_tokens`, `max_completion_tokens`,
    /// `max_output_tokens` or `max_tokens_to_sample`) is present, not
    /// `null`, and not an integer from 0 to [`MAX_COMPLETION_BUDGET`].
    #[error("the request's `{field}` is not an integer from 0 to 10000000")]
    BadMaxTokens {
        /// The field's name.
        field: &'static str,
    },
    /// None of `messages`, `prompt` or `input` is present (or all are
    /// `null`).
    #[error("the request has no `messages`, `prompt` or `input`")]
    NoInput,
    /// `n` (how many choices to generate) is present, not `null`, and not an
    /// integer from 1 to [`MAX_CHOICES`]: a server that reads `8.0` or `"8"`
    /// as 8 would generate more than was counted.
    #[error("the request's `n` is not an integer from 1 to 128")]
    BadChoices,
    /// `stream` is present, not `null`, and not a boolean, or `stream_options`
    /// (or its `include_usage`) is not what OpenAI's API takes: a server that
    /// reads `1` or `"true"` as true would stream an answer sluice did not ask
    /// the usage of, and would be charged only its reservation.
    #[error(
        "the request's `stream` is not a boolean, or its `stream_options` not an object with a boolean `include_usage`"
    )]
    BadStream,
    /// An object of the body names a key twice: parsers differ on which value
    /// counts (`max_tokens`, `model`), so the upstream may read another call
    /// than the one estimated.
    #[error("the request body names a key twice in one object")]
    DuplicateKey,
}

/// The most choices (`n`) a request may ask for, as OpenAI's API allows.
pub const MAX_CHOICES: u64 = 128;

impl BadLlmBody {
    /// A short machine-readable name: `not_json`, `not_an_object`,
    /// `model_not_a_string`, `bad_max_tokens`, `no_input`, `bad_n`,
    /// `bad_stream` or `duplicate_key`.
    pub fn reason(&self) -> &'static str {
        match self {
            BadLlmBody::NotJson => "not_json",
            BadLlmBody::NotAnObject => "not_an_object",
            BadLlmBody::ModelNotAString => "model_not_a_string",
            BadLlmBody::BadMaxTokens { .. } => "bad_max_tokens",
            BadLlmBody::NoInput => "no_input",
            BadLlmBody::DuplicateKey => "duplicate_key",
            BadLlmBody::BadChoices => "bad_n",
            BadLlmBody::BadStream => "bad_stream",
        }
    }
}

/// The request's `model`, when it is a string.
pub fn model_of(body: &Value) -> Option<&str> {
    body.get("model").and_then(Value::as_str)
}

/// [`estimate`] from a request's raw `body` bytes, checking first that they
/// are an LLM request: a JSON object, whose `model` (if any) is a string,
/// whose completion budget (if any) is an integer from 0 to
/// [`MAX_COMPLETION_BUDGET`], and which has `messages`, `prompt` or `input`.
///
/// Counts with `opts` as given: the caller picks the encoding by the
/// request's model ([`model_of`], then [`EstimateOptions::for_model`]).
/// JSON nesting is bounded by the JSON parser's limit (128 levels, beyond
/// which the body is [`BadLlmBody::NotJson`]); a caller that bounds depth
/// lower checks that before.
///
/// # Errors
/// [`BadLlmBody`], with the first reason found in the order above.
pub fn estimate_body(
    style: ApiStyle,
    path: &str,
    body: &[u8],
    opts: &EstimateOptions,
) -> Result<TokenEstimate, BadLlmBody> {
    let v = check_body(body)?;
    Ok(estimate(style, path, &v, opts))
}

/// The checks of [`estimate_body`] alone: `body` read as an LLM request (a
/// JSON object, a string `model` if any, completion budgets that are
/// integers from 0 to [`MAX_COMPLETION_BUDGET`], and `messages`, `prompt` or
/// `input`), for a caller that estimates it more than one way.
///
/// # Errors
/// [`BadLlmBody`], as [`estimate_body`].
pub fn check_body(body: &[u8]) -> Result<Value, BadLlmBody> {
    let v: Value = serde_json::from_slice(body).map_err(|_| BadLlmBody::NotJson)?;
    check_value(v)
}

/// [`check_body`] of a body already read as JSON `v` (e.g. by a reader that
/// refuses a key named twice, as sluice's gateway does).
///
/// # Errors
/// As [`check_body`], but [`BadLlmBody::NotJson`].
pub fn check_value(v: Value) -> Result<Value, BadLlmBody> {
    let obj = v.as_object().ok_or(BadLlmBody::NotAnObject)?;
    if obj.get("model").is_some_and(|m| !m.is_string()) {
        return Err(BadLlmBody::ModelNotAString);
    }
    check_counts(obj)?;
    let has_input = ["messages", "prompt", "input"]
        .iter()
        .any(|k| obj.get(*k).is_some_and(|x| !x.is_null()));
    if !has_input {
        return Err(BadLlmBody::NoInput);
    }
    Ok(v)
}

/// The checks of [`check_value`] on what a request asks to be generated, alone:
/// its completion budgets ([`BUDGET_KEYS`], integers from 0 to
/// [`MAX_COMPLETION_BUDGET`]), `n` (an integer from 1 to [`MAX_CHOICES`]) and
/// `stream` / `stream_options` (booleans), each absent or `null` too. A server
/// that reads `"900"`, `900.0` or `8.0` as a number would generate more than an
/// estimate that took such a value as absent: for a reader that must not
/// under-count (the gateway, the pacer) they are refused.
///
/// # Errors
/// [`BadLlmBody::BadMaxTokens`], [`BadLlmBody::BadChoices`] or
/// [`BadLlmBody::BadStream`].
pub fn check_counts(obj: &serde_json::Map<String, Value>) -> Result<(), BadLlmBody> {
    for field in BUDGET_KEYS {
        let ok = match obj.get(field) {
            None | Some(Value::Null) => true,
            Some(n) => n.as_u64().is_some_and(|n| n <= MAX_COMPLETION_BUDGET),
        };
        if !ok {
            return Err(BadLlmBody::BadMaxTokens { field });
        }
    }
    if obj.get("n").is_some_and(|n| {
        !n.is_null() && !n.as_u64().is_some_and(|n| (1..=MAX_CHOICES).contains(&n))
    }) {
        return Err(BadLlmBody::BadChoices);
    }
    if !stream_fields_are_openais(obj) {
        return Err(BadLlmBody::BadStream);
    }
    Ok(())
}

/// True when `stream` is absent, `null` or a boolean, and `stream_options` is
/// absent, `null`, or an object whose `include_usage` is absent, `null` or a
/// boolean: the shapes sluice can read, and rewrite to ask a stream for its
/// usage.
fn stream_fields_are_openais(obj: &serde_json::Map<String, Value>) -> bool {
    let boolean = |v: Option<&Value>| matches!(v, None | Some(Value::Null | Value::Bool(_)));
    boolean(obj.get("stream"))
        && match obj.get("stream_options") {
            None | Some(Value::Null) => true,
            Some(Value::Object(options)) => boolean(options.get("include_usage")),
            Some(_) => false,
        }
}

/// True when `path` (a request's path, as the client sent it) is the endpoint
/// `name` (e.g. `responses`): its last segment, trailing slashes aside and in
/// any case, as the routes match it (`/v1/Responses/` is `responses`).
pub fn endpoint_is(path: &str, name: &str) -> bool {
    let path = path.trim_end_matches('/').as_bytes();
    let Some(start) = path.len().checked_sub(name.len()) else {
        return false;
    };
    start > 0 && path[start - 1] == b'/' && path[start..].eq_ignore_ascii_case(name.as_bytes())
}

/// True when the request `body` names its own completion budget (one of
/// [`BUDGET_KEYS`], not `null`).
pub fn names_completion_budget(body: &Value) -> bool {
    BUDGET_KEYS
        .iter()
        .any(|k| body.get(*k).is_some_and(|v| !v.is_null()))
}

fn add(a: u32, b: u32) -> u32 {
    a.saturating_add(b)
}

fn json_tokens(v: &Value, enc: Counter) -> u32 {
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
    let enc = Counter::of(opts);
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
    let responses = endpoint_is(path, "responses") || body.get("max_output_tokens").is_some();
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

fn openai_message_tokens(m: &Value, enc: Counter) -> u32 {
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

fn openai_content_tokens(v: &Value, enc: Counter) -> u32 {
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

fn openai_input_tokens(v: &Value, enc: Counter) -> u32 {
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

fn openai_tools_tokens(body: &Value, enc: Counter) -> u32 {
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
    if endpoint_is(path, "count_tokens") {
        return TokenEstimate::default();
    }
    let enc = Counter::of(opts);
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

fn anthropic_content_tokens(v: &Value, enc: Counter) -> u32 {
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

    #[cfg(feature = "tokenizer")]
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// The count of any text, ASCII (split without the expression) or not,
        /// is the encoding's own.
        #[test]
        fn c2_counts_are_the_encodings_own(parts in proptest::collection::vec(
            proptest::sample::select(vec!["Hello", " world", "'s", "\n\n", "  ", "42", "é", "日本", "?!", "/", "I'M", "naïve"]),
            0..40,
        )) {
            let text = parts.concat();
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                proptest::prop_assert_eq!(
                    encoding.count(&text) as usize,
                    encoding.tokenizer().count(text.as_str())
                );
            }
        }
    }

    #[test]
    fn encoding_by_model_name() {
        for m in [
            "gpt-4o",
            "gpt-4o-mini-2024-07-18",
            "gpt-4.1-nano",
            "gpt-5",
            "o1-mini",
            "o3",
            "o4-mini",
            "chatgpt-4o-latest",
            "ft:gpt-4o-mini:acme::abc",
        ] {
            assert_eq!(Encoding::for_model(m), Some(Encoding::O200kBase), "{m}");
        }
        for m in [
            "gpt-4",
            "gpt-4-turbo",
            "gpt-3.5-turbo",
            "text-embedding-3-small",
        ] {
            assert_eq!(Encoding::for_model(m), Some(Encoding::Cl100kBase), "{m}");
        }
        for m in ["claude-sonnet-4", "llama-3", "", "GPT-4O"] {
            assert_eq!(Encoding::for_model(m), None, "{m}");
        }
        assert!(!EstimateOptions::for_model("gpt-4").conservative);
        assert_eq!(
            EstimateOptions::for_model("gpt-4").encoding,
            Encoding::Cl100kBase
        );
        assert!(EstimateOptions::for_model("claude-sonnet-4").conservative);
    }

    #[test]
    fn conservative_counts_bytes_never_fewer_than_the_tokenizer() {
        assert_eq!(count_conservative(""), 0);
        assert_eq!(count_conservative("hello world"), 11);
        assert_eq!(count_conservative("héllo"), 6);
        for text in [
            "hello world",
            "tiktoken is great!",
            "日本語のテキスト",
            "  \n\t{}[]",
        ] {
            assert!(count_conservative(text) >= Encoding::O200kBase.count(text));
            assert!(count_conservative(text) >= Encoding::Cl100kBase.count(text));
        }
        let body = json!({"messages":[{"role":"user","content":"hello world"}],"max_tokens":5});
        let mut o = opts();
        let real = estimate(ApiStyle::OpenAi, "/chat/completions", &body, &o);
        o.conservative = true;
        let bytes = estimate(ApiStyle::OpenAi, "/chat/completions", &body, &o);
        // 3 priming + 3 framing + "user" + "hello world", in bytes.
        assert_eq!(bytes.prompt, 3 + 3 + 4 + 11);
        assert!(bytes.prompt > real.prompt);
        assert_eq!(bytes.completion, 5);
    }

    fn body_estimate(style: ApiStyle, path: &str, body: &str) -> Result<TokenEstimate, BadLlmBody> {
        estimate_body(style, path, body.as_bytes(), &opts())
    }

    #[test]
    fn estimate_body_of_a_chat_request() {
        let raw = r#"{"model":"gpt-4o","messages":[
            {"role":"system","content":"You are terse."},
            {"role":"user","content":"hello world","name":"bob"}
        ],"max_tokens":50}"#;
        let e = body_estimate(ApiStyle::OpenAi, "/chat/completions", raw).unwrap();
        let v: Value = serde_json::from_str(raw).unwrap();
        assert_eq!(
            e,
            estimate(ApiStyle::OpenAi, "/chat/completions", &v, &opts())
        );
        assert_eq!(e.completion, 50);
        assert_eq!(model_of(&v), Some("gpt-4o"));
        assert_eq!(model_of(&json!({"model": 4})), None);
        assert_eq!(model_of(&json!([])), None);
        // The limits are accepted; null is no budget; no model is fine.
        let raw = r#"{"messages":[],"max_completion_tokens":10000000,"max_tokens":null}"#;
        let e = body_estimate(ApiStyle::OpenAi, "/chat/completions", raw).unwrap();
        assert_eq!(e.completion, 10_000_000);
        let raw =
            r#"{"model":"claude","max_tokens":0,"messages":[{"role":"user","content":"hi"}]}"#;
        let e = body_estimate(ApiStyle::Anthropic, "/v1/messages", raw).unwrap();
        assert_eq!(e.completion, 0);
        let raw = r#"{"model":"gpt-4.1","input":"hi","max_output_tokens":7}"#;
        let e = body_estimate(ApiStyle::OpenAi, "/v1/responses", raw).unwrap();
        assert_eq!(e.completion, 7);
    }

    /// `stream` and `stream_options` in a shape a lax server reads as a stream,
    /// but sluice cannot ask the usage of, are refused (SPEC T2: never forwarded
    /// uncounted); `null` is absent, as OpenAI reads it.
    #[test]
    fn t2_a_stream_field_that_is_not_a_boolean_is_refused() {
        let call = |extra: &str| {
            body_estimate(
                ApiStyle::OpenAi,
                "/v1/chat/completions",
                &format!(r#"{{"model":"gpt-4o","messages":[]{extra}}}"#),
            )
            .map(|_| ())
        };
        for bad in [
            r#","stream":1"#,
            r#","stream":"true""#,
            r#","stream":[true]"#,
            r#","stream":true,"stream_options":"x""#,
            r#","stream":true,"stream_options":[]"#,
            r#","stream":true,"stream_options":{"include_usage":1}"#,
        ] {
            assert_eq!(call(bad), Err(BadLlmBody::BadStream), "{bad}");
        }
        assert_eq!(BadLlmBody::BadStream.reason(), "bad_stream");
        for good in [
            "",
            r#","stream":null"#,
            r#","stream":false"#,
            r#","stream":true,"stream_options":null"#,
            r#","stream":true,"stream_options":{"include_usage":null,"other":1}"#,
        ] {
            assert_eq!(call(good), Ok(()), "{good}");
        }
    }

    #[test]
    fn endpoint_is_reads_the_last_segment_as_routes_match_it() {
        assert!(endpoint_is("/v1/responses", "responses"));
        assert!(endpoint_is("/v1/Responses//", "responses"));
        assert!(endpoint_is("/RESPONSES", "responses"));
        assert!(!endpoint_is("/v1/myresponses", "responses"));
        assert!(!endpoint_is("responses", "responses"));
        assert!(!endpoint_is("/v1/responses/x", "responses"));
        // Not a character boundary where the name would start: no panic.
        assert!(!endpoint_is(
            "/v1/\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}",
            "responses"
        ));
        assert!(!endpoint_is("/\u{1F600}\u{1F600}", "responses"));
    }

    #[test]
    fn estimate_body_says_why_a_body_is_not_an_llm_request() {
        let reason = |style, body: &str| {
            let e = body_estimate(style, "/chat/completions", body).unwrap_err();
            assert!(!e.to_string().is_empty());
            e.reason()
        };
        let oa = ApiStyle::OpenAi;
        assert_eq!(reason(oa, ""), "not_json");
        assert_eq!(reason(oa, "{\"messages\":["), "not_json");
        assert_eq!(reason(oa, "\u{feff}{}"), "not_json");
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(reason(oa, &deep), "not_json");
        assert_eq!(reason(oa, "[]"), "not_an_object");
        assert_eq!(reason(oa, "\"messages\""), "not_an_object");
        assert_eq!(reason(oa, "null"), "not_an_object");
        assert_eq!(
            reason(oa, r#"{"model":["gpt-4o"],"messages":[]}"#),
            "model_not_a_string"
        );
        assert_eq!(
            reason(oa, r#"{"model":null,"messages":[]}"#),
            "model_not_a_string"
        );
        for bad in [
            r#"{"messages":[],"max_tokens":-1}"#,
            r#"{"messages":[],"max_tokens":1.5}"#,
            r#"{"messages":[],"max_tokens":100.0}"#,
            r#"{"messages":[],"max_tokens":"100"}"#,
            r#"{"messages":[],"max_completion_tokens":10000001}"#,
            r#"{"messages":[],"max_completion_tokens":1e30}"#,
            r#"{"input":"x","max_output_tokens":18446744073709551616}"#,
            r#"{"prompt":"x","max_tokens_to_sample":true}"#,
        ] {
            assert_eq!(reason(oa, bad), "bad_max_tokens", "{bad}");
        }
        assert_eq!(
            body_estimate(
                oa,
                "/chat/completions",
                r#"{"messages":[],"max_tokens":-1}"#
            ),
            Err(BadLlmBody::BadMaxTokens {
                field: "max_tokens"
            })
        );
        assert_eq!(reason(oa, "{}"), "no_input");
        assert_eq!(
            reason(oa, r#"{"model":"gpt-4o","max_tokens":5}"#),
            "no_input"
        );
        assert_eq!(
            reason(ApiStyle::Anthropic, r#"{"messages":null,"system":"x"}"#),
            "no_input"
        );
        // The first reason found wins.
        assert_eq!(
            reason(oa, r#"{"model":1,"max_tokens":-1}"#),
            "model_not_a_string"
        );
    }
}
