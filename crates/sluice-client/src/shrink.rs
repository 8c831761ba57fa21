//! Auto-shrink (opt-in per provider): when a request will not fit
//! within its maximum wait, drop the lowest-priority context until it does —
//! the oldest conversation turns first; never a system (or developer)
//! message, never the last user turn or anything after it. A turn goes as a
//! whole (a user message and the answers, tool calls and tool results that
//! follow it), so no tool result is left without its call.

use serde_json::Value;

use crate::api::ApiStyle;
use crate::tokens::{EstimateOptions, TokenEstimate, estimate};

/// The response header saying what was dropped: `tokens=1234; messages=6`.
pub const SHRINK_HEADER: &str = "x-sluice-shrink";

/// What a shrink dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ShrinkReport {
    /// Estimated tokens removed.
    pub tokens_dropped: u32,
    /// Messages removed.
    pub messages_dropped: u32,
}

impl ShrinkReport {
    /// The value of [`SHRINK_HEADER`].
    pub fn header_value(&self) -> String {
        format!(
            "tokens={}; messages={}",
            self.tokens_dropped, self.messages_dropped
        )
    }

    fn add(&mut self, other: ShrinkReport) {
        self.tokens_dropped += other.tokens_dropped;
        self.messages_dropped += other.messages_dropped;
    }
}

/// What the pacer asks of a request: its cost, and optionally to get
/// smaller.
pub trait Demand: Send {
    /// Estimated tokens (prompt + completion budget).
    fn tokens(&self) -> u32;

    /// Drops context until [`Demand::tokens`] ≤ `target` or nothing more
    /// may go; returns whether anything was dropped.
    fn shrink_to(&mut self, target: u32) -> bool {
        let _ = target;
        false
    }

    /// The estimate as input and output (what an ITPM and an OTPM count);
    /// by default all of it input.
    fn split(&self) -> TokenEstimate {
        TokenEstimate {
            prompt: self.tokens(),
            completion: 0,
        }
    }

    /// The model the request names, if it names one.
    fn model(&self) -> Option<&str> {
        None
    }
}

impl Demand for TokenEstimate {
    fn tokens(&self) -> u32 {
        self.total()
    }

    fn split(&self) -> TokenEstimate {
        *self
    }
}

impl Demand for u32 {
    fn tokens(&self) -> u32 {
        *self
    }
}

/// A JSON request body the pacer may shrink: the body, its estimate, and
/// what was dropped so far.
#[derive(Clone, Debug)]
pub struct PacedRequest {
    style: ApiStyle,
    path: String,
    body: Value,
    opts: EstimateOptions,
    estimate: TokenEstimate,
    report: Option<ShrinkReport>,
}

impl PacedRequest {
    /// Estimates `body`, a request to `path` in `style`.
    pub fn new(style: ApiStyle, path: &str, body: Value, opts: EstimateOptions) -> Self {
        let estimate = estimate(style, path, &body, &opts);
        PacedRequest {
            style,
            path: path.to_owned(),
            body,
            opts,
            estimate,
            report: None,
        }
    }

    /// The body as it will be sent.
    pub fn body(&self) -> &Value {
        &self.body
    }

    /// The estimate of the body as it will be sent.
    pub fn estimate(&self) -> TokenEstimate {
        self.estimate
    }

    /// What shrinking dropped, if it happened.
    pub fn shrink_report(&self) -> Option<ShrinkReport> {
        self.report
    }

    /// Takes the body out.
    pub fn into_body(self) -> Value {
        self.body
    }
}

impl Demand for PacedRequest {
    fn tokens(&self) -> u32 {
        self.estimate.total()
    }

    fn shrink_to(&mut self, target: u32) -> bool {
        let r = shrink(
            self.style,
            &mut self.body,
            &self.opts,
            self.estimate,
            target,
        );
        if r.messages_dropped == 0 {
            return false;
        }
        self.estimate = estimate(self.style, &self.path, &self.body, &self.opts);
        self.report.get_or_insert_with(ShrinkReport::default).add(r);
        true
    }

    fn split(&self) -> TokenEstimate {
        self.estimate
    }

    fn model(&self) -> Option<&str> {
        self.body.get("model").and_then(Value::as_str)
    }
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

fn is_protected(style: ApiStyle, m: &Value) -> bool {
    style == ApiStyle::OpenAi && matches!(role(m), "system" | "developer")
}

/// A user message that starts a turn (not one carrying only tool results).
fn starts_turn(style: ApiStyle, m: &Value) -> bool {
    if role(m) != "user" {
        return false;
    }
    match (style, m.get("content")) {
        (ApiStyle::Anthropic, Some(Value::Array(blocks))) => !blocks
            .iter()
            .all(|b| b.get("type").and_then(Value::as_str) == Some("tool_result")),
        _ => true,
    }
}

/// Drops the oldest turns of `body` until its estimate (now `current`) is at
/// most `target`; returns what was dropped (nothing if nothing may go).
pub fn shrink(
    style: ApiStyle,
    body: &mut Value,
    opts: &EstimateOptions,
    current: TokenEstimate,
    target: u32,
) -> ShrinkReport {
    let mut report = ShrinkReport::default();
    if current.total() <= target {
        return report;
    }
    let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else {
        return report;
    };
    // The last user turn and everything after it stay.
    let Some(last_turn) = messages.iter().rposition(|m| starts_turn(style, m)) else {
        return report;
    };
    // Each message's share of the estimate (the estimate is a sum over
    // messages, so dropping one removes exactly its share).
    let share = |m: &Value| -> u32 {
        let one = Value::Array(vec![m.clone()]);
        let none = Value::Array(Vec::new());
        let with = estimate(
            style,
            "",
            &serde_json::json!({ "messages": one, "max_tokens": 0 }),
            opts,
        );
        let without = estimate(
            style,
            "",
            &serde_json::json!({ "messages": none, "max_tokens": 0 }),
            opts,
        );
        with.prompt.saturating_sub(without.prompt)
    };
    let mut excess = current.total() - target;
    let mut drop = vec![false; messages.len()];
    let mut i = 0;
    while i < last_turn && excess > 0 {
        // One unit: from i up to the next message that starts a turn.
        let mut end = i + 1;
        while end < last_turn && !starts_turn(style, &messages[end]) {
            end += 1;
        }
        for (j, m) in messages.iter().enumerate().take(end).skip(i) {
            if is_protected(style, m) {
                continue;
            }
            drop[j] = true;
            let t = share(m);
            report.tokens_dropped += t;
            report.messages_dropped += 1;
            excess = excess.saturating_sub(t);
        }
        i = end;
    }
    let mut j = 0;
    messages.retain(|_| {
        let keep = !drop[j];
        j += 1;
        keep
    });
    report
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chat(n: usize) -> Value {
        let mut messages = vec![json!({"role":"system","content":"You are a careful assistant."})];
        for i in 0..n {
            messages.push(json!({"role":"user","content":format!("question {i}: {}", "lorem ipsum ".repeat(50))}));
            messages.push(json!({"role":"assistant","content":format!("answer {i}: {}", "dolor sit ".repeat(50))}));
        }
        messages.push(json!({"role":"user","content":"the last question"}));
        json!({"model":"gpt-4o","messages":messages,"max_tokens":100})
    }

    #[test]
    fn c4_drops_oldest_turns_keeps_system_and_last_user_turn() {
        let opts = EstimateOptions::default();
        let mut req = PacedRequest::new(ApiStyle::OpenAi, "/chat/completions", chat(5), opts);
        let before = req.tokens();
        assert!(req.shrink_to(before - 300));
        let after = req.tokens();
        assert!(after <= before - 300, "{after} {before}");
        let r = req.shrink_report().unwrap();
        assert_eq!(r.messages_dropped % 2, 0);
        assert_eq!(r.tokens_dropped, before - after);
        let msgs = req.body()["messages"].as_array().unwrap();
        assert_eq!(msgs[0]["role"], "system");
        assert_eq!(msgs.last().unwrap()["content"], "the last question");
        assert!(msgs[1]["content"].as_str().unwrap().starts_with("question"));
        // Dropped the oldest: the first remaining question is not question 0.
        assert!(
            !msgs[1]["content"]
                .as_str()
                .unwrap()
                .starts_with("question 0")
        );
        // Asking for the impossible drops every old turn and stops there.
        assert!(req.shrink_to(1));
        let msgs = req.body()["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 2);
        assert!(!req.shrink_to(1));
    }

    #[test]
    fn c4_anthropic_turns_keep_tool_pairs_together() {
        let body = json!({"max_tokens":10,"system":"sys","messages":[
            {"role":"user","content":"first ".repeat(100)},
            {"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"r"}]},
            {"role":"assistant","content":"ok"},
            {"role":"user","content":"last"}
        ]});
        let mut req = PacedRequest::new(
            ApiStyle::Anthropic,
            "/messages",
            body,
            EstimateOptions::default(),
        );
        assert!(req.shrink_to(req.tokens() - 5));
        let msgs = req.body()["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0]["content"], "last");
        assert_eq!(req.body()["system"], "sys");
        assert_eq!(req.shrink_report().unwrap().messages_dropped, 4);
    }
}
