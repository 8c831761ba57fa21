//! Token budgets at the edge (SPEC T2, T3): what an LLM call reserves before it
//! is forwarded, estimated from its body, and what it is charged once the
//! upstream's `usage` says what it spent.

use sluice_policy::{LlmFormat, Price, TokenBudget};
use sluice_tokens::{ApiStyle, EstimateOptions, Usage};

use crate::Refused;

/// Set on an answer sluice made for an upstream that failed once the call was
/// sent to it (no response head, or none in time): the upstream may have
/// generated, so an LLM call's reservation stands (SPEC T3 gives it back only
/// for an error answered before generation, or a call that never reached the
/// upstream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpstreamMayHaveRun;

/// The output an estimate gives a call that names no output budget: past any
/// it can name, so that the two are told apart.
const UNNAMED: u32 = u32::MAX;

/// What an LLM call is estimated to spend, before it is forwarded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reservation {
    /// Input tokens: by the real tokenizer of the model's encoding when sluice
    /// knows the model, else one per byte of text (never fewer than a tokenizer
    /// gives).
    pub input: u32,
    /// The output budget the request names (`max_tokens` and kin, times `n`),
    /// or `None` when it names none (each budget then reserves its own
    /// `default_max_output`, times [`Reservation::choices`]).
    pub output: Option<u32>,
    /// How many choices the call asks for (`n`, 1 when it names none).
    pub choices: u32,
    /// The index of the call's model's price in the policy's `prices:`.
    pub price: Option<u16>,
}

impl Reservation {
    /// The reservation of a call to `path` on a route speaking `format`, from
    /// its whole `body`; its tokens estimated only when `counted` (the route
    /// has a token or money budget: else only its model's price is read, and
    /// the tokenizer is not run).
    ///
    /// # Errors
    /// [`Refused::LlmBody`] for a body that does not read as `format` says.
    pub fn of(
        format: LlmFormat,
        path: &str,
        body: &[u8],
        (prices, counted): (&[Price], bool),
    ) -> Result<Self, Refused> {
        // Read as every reader reads it: a key named twice is refused.
        let value = match sluice_policy::json::parse_unique(body) {
            Ok(value) => sluice_tokens::check_value(value)?,
            Err(sluice_policy::json::NotUnique::NotJson) => {
                return Err(sluice_tokens::BadLlmBody::NotJson.into());
            }
            Err(sluice_policy::json::NotUnique::DuplicateKey) => {
                return Err(sluice_tokens::BadLlmBody::DuplicateKey.into());
            }
        };
        let model = sluice_tokens::model_of(&value);
        let price = model
            .and_then(|m| prices.iter().position(|p| p.matches(m)))
            .and_then(|i| u16::try_from(i).ok());
        let choices = value
            .get("n")
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(1)
            .max(1);
        if !counted {
            return Ok(Reservation {
                input: 0,
                output: None,
                choices,
                price,
            });
        }
        let style = match format {
            LlmFormat::OpenAi => ApiStyle::OpenAi,
            LlmFormat::Anthropic => ApiStyle::Anthropic,
        };
        let mut opts = EstimateOptions::for_model(model.unwrap_or_default());
        // Unnamed, the output is each budget's own default: the estimate says
        // so by this default, which no named budget reaches (at most
        // 10,000,000 times 128 choices), read from the keys of the body's own
        // shape (a chat's `max_output_tokens` names nothing a chat server reads).
        opts.default_max_tokens = UNNAMED;
        let estimate = sluice_tokens::estimate(style, path, &value, &opts);
        Ok(Reservation {
            input: estimate.prompt,
            output: match estimate.completion {
                UNNAMED => None,
                // No output for an `input` the shape does not cap (an
                // embedding's): only the embeddings path is taken at its word.
                0 if !sluice_tokens::endpoint_is(path, "embeddings")
                    && !sluice_tokens::names_completion_budget(&value) =>
                {
                    None
                }
                named => Some(named),
            },
            choices,
            price,
        })
    }

    /// Units `budget` reserves for this call: its weights over the input and
    /// the output budget (the request's, else the budget's default); a money
    /// budget's, the model's price of them (`prices`: the policy's).
    pub fn units(&self, budget: &TokenBudget, prices: &[Price]) -> u32 {
        let output = self
            .output
            .unwrap_or_else(|| budget.default_max_output.saturating_mul(self.choices));
        if budget.priced {
            return price_of(prices, self.price)
                .map_or(u32::MAX, |p| p.cost(self.input, 0, output));
        }
        budget.charge(self.input, 0, output)
    }
}

/// The price at `index` of `prices`.
fn price_of(prices: &[Price], index: Option<u16>) -> Option<&Price> {
    prices.get(usize::from(index?))
}

/// True when `policy` has LLM routes: their calls are estimated by the
/// tokenizers, which [`warm`] builds.
pub fn has_llm_routes(policy: &sluice_policy::Policy) -> bool {
    policy.routes.iter().any(|r| r.llm.is_some())
}

/// Builds the tokenizers now, so that the first LLM call does not wait for them
/// (tens of milliseconds, once per process): a server with LLM routes calls it
/// at start, off its request threads.
pub fn warm() {
    sluice_tokens::Encoding::O200kBase.warm();
    sluice_tokens::Encoding::Cl100kBase.warm();
}

/// Units `budget` charges a call of the model priced at `price` (an index into
/// the policy's `prices`) that reported `usage`; `None` for a money budget
/// without a price (never: such a call is refused before it is counted).
pub fn settled_units(
    budget: &TokenBudget,
    usage: &Usage,
    prices: &[Price],
    price: Option<u16>,
) -> Option<u32> {
    if budget.priced {
        return price_of(prices, price)
            .map(|p| p.cost(usage.prompt, usage.cached_input, usage.completion));
    }
    Some(budget.charge(usage.prompt, usage.cached_input, usage.completion))
}

/// The body to forward for an OpenAI streaming call (`"stream": true`) to `path`
/// that does not ask for its usage: the same request asking for it
/// (`stream_options.include_usage: true`), so that its token budgets settle at
/// the truth; the stream's usage-only chunk is then removed before the client
/// sees it ([`hides_usage_chunk`]). `None` for any other body (forwarded as it
/// came). The Responses API reports its usage in every stream, embeddings do
/// not stream.
pub fn ask_stream_usage(path: &str, body: &[u8]) -> Option<Vec<u8>> {
    if sluice_tokens::endpoint_is(path, "responses")
        || sluice_tokens::endpoint_is(path, "embeddings")
    {
        return None;
    }
    // Most calls do not stream: no second parse of their body. A key spelled
    // with escapes (`"str\u0065am"`) is `stream` to every JSON reader, so a
    // body with a `\u` escape is read too.
    if memchr::memmem::find(body, b"\"stream\"").is_none()
        && memchr::memmem::find(body, b"\\u").is_none()
    {
        return None;
    }
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    if value.get("stream") != Some(&serde_json::Value::Bool(true)) {
        return None;
    }
    let object = value.as_object_mut()?;
    let options = object
        .entry("stream_options")
        .or_insert_with(|| serde_json::json!({}));
    if options.is_null() {
        // OpenAI reads `null` as absent.
        *options = serde_json::json!({});
    }
    let options = options.as_object_mut()?;
    if options.get("include_usage") == Some(&serde_json::Value::Bool(true)) {
        return None;
    }
    options.insert("include_usage".to_owned(), serde_json::Value::Bool(true));
    serde_json::to_vec(&value).ok()
}

/// True when a server-sent `event` (its lines, up to the blank line that ends
/// it) is OpenAI's usage-only chunk: a `data:` line holding a JSON object with
/// an empty `choices` and a `usage` object.
pub fn hides_usage_chunk(event: &[u8]) -> bool {
    event.split(|&b| b == b'\n').any(|line| {
        let Some(data) = line.strip_prefix(b"data:") else {
            return false;
        };
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(data.trim_ascii()) else {
            return false;
        };
        value
            .get("choices")
            .and_then(serde_json::Value::as_array)
            .is_some_and(Vec::is_empty)
            && value.get("usage").is_some_and(serde_json::Value::is_object)
    })
}

/// The longest server-sent event [`UsageChunkFilter`] holds whole to look at;
/// past it, the rest of the stream passes as it comes.
pub const MAX_HELD_EVENT: usize = 1 << 20;

/// Passes an answer's server-sent events on whole, but OpenAI's usage-only
/// chunk ([`hides_usage_chunk`]): for a stream sluice asked for its usage
/// ([`ask_stream_usage`]) and the client did not. An unfinished event is held
/// until its blank line (at most [`MAX_HELD_EVENT`] bytes, then the stream
/// passes as it comes). Every transport filters with this one.
#[derive(Debug, Default)]
pub struct UsageChunkFilter {
    pending: Vec<u8>,
    /// Bytes of `pending` known to hold no event's end.
    scanned: usize,
    passthrough: bool,
}

impl UsageChunkFilter {
    /// Appends to `out` the events that end in `data` (with what was held
    /// before), but a usage-only chunk; an unfinished event is held.
    pub fn push(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.passthrough {
            out.extend_from_slice(data);
            return;
        }
        self.pending.extend_from_slice(data);
        let mut start = 0;
        while let Some(end) = event_end(&self.pending[start..], self.scanned) {
            let event = &self.pending[start..start + end];
            if !hides_usage_chunk(event) {
                out.extend_from_slice(event);
            }
            start += end;
            self.scanned = 0;
        }
        self.pending.drain(..start);
        // An event's end may straddle the next read: look again at its last 3 bytes.
        self.scanned = self.pending.len().saturating_sub(3);
        if self.pending.len() > MAX_HELD_EVENT {
            self.passthrough = true;
            out.append(&mut self.pending);
        }
    }

    /// Appends to `out` what is held at the end of the stream (an event with no
    /// blank line after it).
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        out.append(&mut self.pending);
        self.scanned = 0;
    }
}

/// The length of the first whole event in `buf` (through the blank line that
/// ends it: `\n\n` or `\r\n\r\n`), looking from byte `from` on.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let tail = buf.get(from..)?;
    let lf = tail
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|i| from + i + 2);
    let crlf = tail
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| from + i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(default_max_output: u32) -> TokenBudget {
        TokenBudget {
            input_milli: 1000,
            output_milli: 1000,
            cached_input_milli: 1000,
            default_max_output,
            monthly: false,
            priced: false,
        }
    }

    fn reserve(path: &str, body: serde_json::Value) -> Result<Reservation, Refused> {
        Reservation::of(
            LlmFormat::OpenAi,
            path,
            body.to_string().as_bytes(),
            (&[], true),
        )
    }

    /// SPEC T2: the output a call reserves is the budget its own shape names
    /// (a chat's `max_completion_tokens` or `max_tokens`, the Responses API's
    /// `max_output_tokens`), times its choices; a key of another shape names
    /// nothing (a chat server does not read `max_output_tokens`), so the
    /// budget's default is reserved, times the choices too.
    #[test]
    fn t2_the_output_reserved_is_what_the_shape_names_times_its_choices() {
        let chat = |extra: serde_json::Value| {
            let mut body = serde_json::json!({
                "model": "gpt-4o",
                "messages": [{ "role": "user", "content": "Say hi." }],
            });
            if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
                b.extend(e.clone());
            }
            reserve("/v1/chat/completions", body).expect("a chat call")
        };
        let b = budget(100);
        let named = chat(serde_json::json!({ "max_tokens": 50, "n": 2 }));
        assert_eq!(named.output, Some(100));
        let other_shape = chat(serde_json::json!({ "max_output_tokens": 0 }));
        assert_eq!(
            other_shape.output, None,
            "a chat names no max_output_tokens"
        );
        assert_eq!(other_shape.units(&b, &[]), other_shape.input + 100);
        let four = chat(serde_json::json!({ "n": 4 }));
        assert_eq!(
            four.units(&b, &[]),
            four.input + 400,
            "the default, per choice"
        );
        for bad in [
            serde_json::json!(8.0),
            serde_json::json!("8"),
            serde_json::json!(0),
            serde_json::json!(129),
            serde_json::json!(-1),
        ] {
            let mut body = serde_json::json!({
                "model": "gpt-4o",
                "messages": [{ "role": "user", "content": "Say hi." }],
            });
            body["n"] = bad.clone();
            assert!(
                reserve("/v1/chat/completions", body).is_err(),
                "n = {bad} is refused, never counted as one choice"
            );
        }
        let responses = reserve(
            "/v1/responses",
            serde_json::json!({ "model": "gpt-4o", "input": "hi", "max_output_tokens": 30 }),
        )
        .expect("a Responses API call");
        assert_eq!(responses.output, Some(30));
        let embeddings = reserve(
            "/v1/embeddings",
            serde_json::json!({ "model": "text-embedding-3-small", "input": "hi" }),
        )
        .expect("an embeddings call");
        assert_eq!(embeddings.output, Some(0), "no output to reserve");
        let stray = reserve(
            "/v1/chat/completions",
            serde_json::json!({ "model": "gpt-4o", "input": "hi" }),
        )
        .expect("an input on the chat path");
        assert_eq!(
            stray.output, None,
            "not taken for an embedding: the default"
        );
    }

    #[test]
    fn t3_an_openai_stream_is_asked_for_its_usage_once() {
        let asked = ask_stream_usage(
            "/v1/chat/completions",
            br#"{"model":"m","stream":true,"messages":[]}"#,
        )
        .expect("rewritten");
        let v: serde_json::Value = serde_json::from_slice(&asked).expect("JSON");
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(
            ask_stream_usage("/v1/chat/completions", &asked),
            None,
            "asked already"
        );
        assert_eq!(
            ask_stream_usage("/v1/chat/completions", br#"{"stream":false}"#),
            None
        );
        assert_eq!(
            ask_stream_usage("/v1/responses", br#"{"stream":true}"#),
            None
        );
        for spelling in ["/v1/responses/", "/V1/Responses", "/v1/embeddings//"] {
            assert_eq!(
                ask_stream_usage(spelling, br#"{"stream":true}"#),
                None,
                "{spelling} is the endpoint its route matched"
            );
        }
    }

    /// A body every JSON reader takes as a stream is asked for its usage, however it
    /// spells it: a key written with escapes, `stream_options: null` (OpenAI reads it
    /// as absent). Before, both went upstream as they came, got no usage chunk, and
    /// the call was charged only its reservation.
    #[test]
    fn t3_every_spelling_of_a_stream_is_asked_for_its_usage() {
        for body in [
            &br#"{"model":"m","str\u0065am":true,"messages":[]}"#[..],
            br#"{"model":"m","\u0073\u0074\u0072\u0065\u0061\u006d":true,"messages":[]}"#,
            br#"{"model":"m","stream":true,"stream_options":null,"messages":[]}"#,
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":null}}"#,
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":false}}"#,
        ] {
            let asked = ask_stream_usage("/v1/chat/completions", body)
                .unwrap_or_else(|| panic!("not asked: {}", String::from_utf8_lossy(body)));
            let v: serde_json::Value = serde_json::from_slice(&asked).expect("JSON");
            assert_eq!(v["stream"], true);
            assert_eq!(v["stream_options"]["include_usage"], true, "{v}");
        }
        assert_eq!(
            ask_stream_usage(
                "/v1/chat/completions",
                br#"{"model":"m","content":"caf\u00e9","messages":[]}"#
            ),
            None,
            "an escape elsewhere: read, not a stream"
        );
    }

    #[test]
    fn t3_only_the_usage_only_chunk_is_hidden() {
        assert!(hides_usage_chunk(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n"
        ));
        assert!(!hides_usage_chunk(
            b"data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"prompt_tokens\":1}}\n\n"
        ));
        assert!(!hides_usage_chunk(b"data: [DONE]\n\n"));
        assert!(!hides_usage_chunk(b": keep-alive\n\n"));
    }

    #[test]
    fn t3_the_filter_hides_a_usage_chunk_split_across_reads() {
        let stream: &[u8] = b"data: {\"choices\":[{\"delta\":{}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\r\n\r\ndata: [DONE]\n\n";
        let expected: &[u8] = b"data: {\"choices\":[{\"delta\":{}}]}\n\ndata: [DONE]\n\n";
        for split in 1..stream.len() {
            let (mut filter, mut out) = (UsageChunkFilter::default(), Vec::new());
            for piece in stream.chunks(split) {
                filter.push(piece, &mut out);
            }
            filter.finish(&mut out);
            assert_eq!(out, expected, "pieces of {split} bytes");
        }
        let (mut filter, mut out) = (UsageChunkFilter::default(), Vec::new());
        filter.push(b"data: unfinished", &mut out);
        assert!(out.is_empty());
        filter.finish(&mut out);
        assert_eq!(
            out, b"data: unfinished",
            "an unfinished last event goes on as it came"
        );
    }
}
