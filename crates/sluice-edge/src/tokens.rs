//! Token budgets at the edge (SPEC T2, T3): what an LLM call reserves before it
//! is forwarded, estimated from its body, and what it is charged once the
//! upstream's `usage` says what it spent.

use sluice_policy::{LlmFormat, Price, TokenBudget};
use sluice_tokens::{ApiStyle, EstimateOptions, Usage};

use crate::Refused;

/// What an LLM call is estimated to spend, before it is forwarded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reservation {
    /// Input tokens: by the real tokenizer of the model's encoding when sluice
    /// knows the model, else one per byte of text (never fewer than a tokenizer
    /// gives).
    pub input: u32,
    /// The output budget the request names (`max_tokens` and kin, times `n`),
    /// or `None` when it names none (each budget then reserves its own
    /// `default_max_output`).
    pub output: Option<u32>,
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
        let value = sluice_tokens::check_body(body)?;
        let model = sluice_tokens::model_of(&value);
        let price = model
            .and_then(|m| prices.iter().position(|p| p.matches(m)))
            .and_then(|i| u16::try_from(i).ok());
        if !counted {
            return Ok(Reservation {
                input: 0,
                output: None,
                price,
            });
        }
        let style = match format {
            LlmFormat::OpenAi => ApiStyle::OpenAi,
            LlmFormat::Anthropic => ApiStyle::Anthropic,
        };
        let mut opts = EstimateOptions::for_model(model.unwrap_or_default());
        // Unnamed, the output is each budget's own default: estimated as none here.
        opts.default_max_tokens = 0;
        let estimate = sluice_tokens::estimate(style, path, &value, &opts);
        let named = sluice_tokens::names_completion_budget(&value) || path.ends_with("/embeddings");
        Ok(Reservation {
            input: estimate.prompt,
            output: named.then_some(estimate.completion),
            price,
        })
    }

    /// Units `budget` reserves for this call: its weights over the input and
    /// the output budget (the request's, else the budget's default); a money
    /// budget's, the model's price of them (`prices`: the policy's).
    pub fn units(&self, budget: &TokenBudget, prices: &[Price]) -> u32 {
        let output = self.output.unwrap_or(budget.default_max_output);
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
    if path.ends_with("/responses") || path.ends_with("/embeddings") {
        return None;
    }
    // Most calls do not stream: no second parse of their body.
    memchr::memmem::find(body, b"\"stream\"")?;
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    if value.get("stream") != Some(&serde_json::Value::Bool(true)) {
        return None;
    }
    let options = value
        .as_object_mut()?
        .entry("stream_options")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()?;
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
        assert_eq!(
            ask_stream_usage(
                "/v1/chat/completions",
                br#"{"stream":true,"stream_options":null}"#
            ),
            None,
            "a shape it does not know is forwarded as it came"
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
