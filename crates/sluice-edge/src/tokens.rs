//! Token budgets at the edge (SPEC T2, T3): what an LLM call reserves before it
//! is forwarded, estimated from its body, and what it is charged once the
//! upstream's `usage` says what it spent.

use sluice_policy::{LlmFormat, TokenBudget};
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
}

impl Reservation {
    /// The reservation of a call to `path` on a route speaking `format`, from
    /// its whole `body`.
    ///
    /// # Errors
    /// [`Refused::LlmBody`] for a body that does not read as `format` says.
    pub fn of(format: LlmFormat, path: &str, body: &[u8]) -> Result<Self, Refused> {
        let value = sluice_tokens::check_body(body)?;
        let style = match format {
            LlmFormat::OpenAi => ApiStyle::OpenAi,
            LlmFormat::Anthropic => ApiStyle::Anthropic,
        };
        let mut opts =
            EstimateOptions::for_model(sluice_tokens::model_of(&value).unwrap_or_default());
        // Unnamed, the output is each budget's own default: estimated as none here.
        opts.default_max_tokens = 0;
        let estimate = sluice_tokens::estimate(style, path, &value, &opts);
        let named = sluice_tokens::names_completion_budget(&value) || path.ends_with("/embeddings");
        Ok(Reservation {
            input: estimate.prompt,
            output: named.then_some(estimate.completion),
        })
    }

    /// Units `budget` reserves for this call: its weights over the input and
    /// the output budget (the request's, else the budget's default).
    pub fn units(&self, budget: &TokenBudget) -> u32 {
        budget.charge(
            self.input,
            0,
            self.output.unwrap_or(budget.default_max_output),
        )
    }
}

/// Units `budget` charges a call that reported `usage`.
pub fn settled_units(budget: &TokenBudget, usage: &Usage) -> u32 {
    budget.charge(usage.prompt, usage.cached_input, usage.completion)
}
