//! Answering one request: the URL and body checked, the request counted
//! against the books, then a 429, the model list, a completion or its event
//! stream, as the provider whose style the path names would answer.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use sluice_core::Timestamp;

use super::book::{Count, Refusal, Shared, admit, settle};
use super::config::SimulatorConfig;
use super::headers::{fmt_duration, rate_headers};
use crate::api::ApiStyle;
use crate::tokens::{EstimateOptions, estimate};

/// The simulator's answer body.
pub type SimBody = BoxBody<Bytes, Infallible>;

pub(super) fn full(status: StatusCode, v: &Value) -> Response<SimBody> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub(super) fn words(n: u32) -> String {
    // " tok" is one token in both encodings.
    " tok".repeat(n as usize)
}

/// Answers one request as the provider would: 404 for a URL it does not
/// serve, 400 for a body that is not a JSON object, 429 when the request
/// does not fit its books, else (after the latency) the model list, a
/// completion or its stream, each with the rate-limit headers.
pub(super) async fn answer(
    shared: Arc<Shared>,
    method: Method,
    path: String,
    latency: Option<Duration>,
    body: Bytes,
) -> Response<SimBody> {
    let mut cfg = *shared.config.lock();
    if let Some(l) = latency {
        cfg.latency = l;
    }
    let style = style_of(&path);
    if !is_known(&method, &path) {
        return full(
            StatusCode::NOT_FOUND,
            &json!({"error":{"message":format!("Unknown request URL: {method} {path}"),"type":"invalid_request_error","code":"unknown_url"}}),
        );
    }
    let Some(json) = request_json(&method, &body) else {
        return full(
            StatusCode::BAD_REQUEST,
            &json!({"error":{"message":"We could not parse the JSON body of your request.","type":"invalid_request_error","code":null}}),
        );
    };
    let est = estimate(
        style,
        &path,
        &json,
        &EstimateOptions::new(cfg.encoding, cfg.default_max_tokens),
    );
    let est = if method == Method::GET {
        Default::default()
    } else {
        crate::tokens::TokenEstimate {
            prompt: provider_prompt(&cfg, est.prompt, &json),
            ..est
        }
    };
    let delay = arrival_delay(&shared, &cfg);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let now = shared.clock.now();
    let model = json
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("gpt-4o")
        .to_owned();
    let count = Count {
        tokens: u64::from(est.total()),
        input: u64::from(est.prompt),
        output: u64::from(est.completion),
    };
    let v = admit(&shared, &cfg, &model, count, now);
    if let Some(refusal) = &v.refused {
        let mut r = refused(style, &model, refusal);
        if cfg.headers {
            rate_headers(r.headers_mut(), style, &v, now);
        } else {
            r.headers_mut().remove(http::header::RETRY_AFTER);
        }
        return r;
    }
    let completion = cfg.completion_tokens.min(est.completion);
    let reply = Reply {
        id: v.id,
        now,
        model,
        prompt: est.prompt,
        completion,
        budget: est.completion,
        used: u64::from(est.prompt) + u64::from(completion),
    };
    let mut r = if method == Method::GET {
        tokio::time::sleep(cfg.latency).await;
        settle(&shared, cfg.reconcile, reply.id, &reply.model, 0, 0);
        full(
            StatusCode::OK,
            &json!({"object":"list","data":[{"id":"gpt-4o","object":"model","owned_by":"simulator"}]}),
        )
    } else if json.get("stream").and_then(Value::as_bool).unwrap_or(false) {
        shared.book.lock().stats.streamed += 1;
        let include_usage = json
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        streamed(shared.clone(), cfg, style, reply, include_usage)
    } else {
        tokio::time::sleep(cfg.latency).await;
        let (input, output) = reply.usage();
        settle(
            &shared,
            cfg.reconcile,
            reply.id,
            &reply.model,
            input,
            output,
        );
        full(StatusCode::OK, &reply.whole(style))
    };
    if cfg.headers {
        rate_headers(r.headers_mut(), style, &v, now);
    }
    r
}

/// The prompt tokens the provider counts for a prompt the client's
/// estimator makes `estimate`: scaled by `prompt_percent`, plus
/// `message_overhead` per message of the body (never below 0).
pub(super) fn provider_prompt(cfg: &SimulatorConfig, estimate: u32, json: &Value) -> u32 {
    let scaled = i128::from(estimate) * i128::from(cfg.prompt_percent) / 100;
    let messages = json
        .get("messages")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let messages = i128::try_from(messages).unwrap_or(i128::MAX);
    let counted = scaled.saturating_add(messages.saturating_mul(i128::from(cfg.message_overhead)));
    u32::try_from(counted.max(0)).unwrap_or(u32::MAX)
}

/// How long a request takes to arrive: `arrival_delay` plus a draw of the
/// jitter from the simulator's seeded stream.
fn arrival_delay(shared: &Shared, cfg: &SimulatorConfig) -> Duration {
    let jitter = u64::try_from(cfg.arrival_jitter.as_nanos()).unwrap_or(u64::MAX);
    let extra = if jitter == 0 {
        0
    } else {
        shared.rng.lock().u64(0..=jitter)
    };
    cfg.arrival_delay
        .saturating_add(Duration::from_nanos(extra))
}

/// Anthropic's shapes on `…/messages`, OpenAI's elsewhere.
pub(super) fn style_of(path: &str) -> ApiStyle {
    if path.ends_with("/messages") {
        ApiStyle::Anthropic
    } else {
        ApiStyle::OpenAi
    }
}

/// Whether the simulator serves `method path`: `POST …/chat/completions`,
/// `POST …/messages`, `GET …/models`.
pub(super) fn is_known(method: &Method, path: &str) -> bool {
    (method == Method::POST && (path.ends_with("/chat/completions") || path.ends_with("/messages")))
        || (method == Method::GET && path.ends_with("/models"))
}

/// The request's JSON object (an empty one for a `GET`); `None` when the
/// body is not a JSON object.
pub(super) fn request_json(method: &Method, body: &Bytes) -> Option<Value> {
    if method == Method::GET {
        return Some(Value::Object(Default::default()));
    }
    match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => Some(v),
        _ => None,
    }
}

/// The 429 for a request over a limit, in the style's body (OpenAI's
/// message names the axis and the wait; Anthropic's adds `Retry-After`).
pub(super) fn refused(style: ApiStyle, model: &str, refusal: &Refusal) -> Response<SimBody> {
    let &Refusal {
        axis,
        wait,
        used,
        limit,
        requested,
    } = refusal;
    let per = match axis {
        "tokens" => "tokens per min (TPM)",
        "input tokens" => "input tokens per min (ITPM)",
        "output tokens" => "output tokens per min (OTPM)",
        "requests" | "requests per slice" => "requests per min (RPM)",
        _ => "requests per day (RPD)",
    };
    let message = format!(
        "Rate limit reached for {model} in organization org-simulator on {per}: Limit {limit}, Used {used}, Requested {requested}. Please try again in {}. Visit https://platform.openai.com/account/rate-limits to learn more.",
        fmt_duration(wait)
    );
    match style {
        ApiStyle::OpenAi => full(
            StatusCode::TOO_MANY_REQUESTS,
            &json!({"error":{"message":message,"type":axis,"param":null,"code":"rate_limit_exceeded"}}),
        ),
        ApiStyle::Anthropic => {
            let mut r = full(
                StatusCode::TOO_MANY_REQUESTS,
                &json!({"type":"error","error":{"type":"rate_limit_error","message":message}}),
            );
            if let Ok(h) = HeaderValue::from_str(&wait.as_secs_f64().ceil().to_string()) {
                r.headers_mut().insert(http::header::RETRY_AFTER, h);
            }
            r
        }
    }
}

/// What the answer to an admitted request says.
pub(super) struct Reply {
    /// The request's number in the book.
    pub(super) id: u64,
    /// When it arrived.
    pub(super) now: Timestamp,
    pub(super) model: String,
    /// Input tokens, as estimated.
    pub(super) prompt: u32,
    /// Tokens generated.
    pub(super) completion: u32,
    /// The completion budget the request set (or the default).
    pub(super) budget: u32,
    /// `prompt + completion`.
    pub(super) used: u64,
}

impl Reply {
    /// Input and output tokens used, to settle the books with.
    pub(super) fn usage(&self) -> (u64, u64) {
        (u64::from(self.prompt), u64::from(self.completion))
    }

    /// The whole (not streamed) answer's body.
    pub(super) fn whole(&self, style: ApiStyle) -> Value {
        let Reply {
            id,
            now,
            ref model,
            prompt,
            completion,
            budget,
            used,
        } = *self;
        match style {
            ApiStyle::OpenAi => json!({
                "id": format!("chatcmpl-sim{id}"), "object": "chat.completion",
                "created": now.as_secs(), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": words(completion), "refusal": null},
                             "logprobs": null, "finish_reason": if completion < budget { "stop" } else { "length" }}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": used},
                "system_fingerprint": "fp_simulator"
            }),
            ApiStyle::Anthropic => json!({
                "id": format!("msg_sim{id}"), "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": words(completion)}],
                "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": prompt, "output_tokens": completion}
            }),
        }
    }

    /// The generated tokens cut into `chunks` content chunks (the last one
    /// takes the rest).
    pub(super) fn chunk_sizes(&self, chunks: u32) -> impl Iterator<Item = u32> {
        let completion = self.completion;
        let per = completion / chunks;
        (0..chunks).map(move |i| {
            if i + 1 == chunks {
                completion - per * (chunks - 1)
            } else {
                per
            }
        })
    }

    /// The streamed answer's frames: OpenAI's `data:` chunks (usage in a
    /// last chunk when `include_usage`, then `[DONE]`) or Anthropic's events.
    pub(super) fn frames(&self, style: ApiStyle, chunks: u32, include_usage: bool) -> Vec<Bytes> {
        let send = |v: Value| Bytes::from(format!("data: {v}\n\n"));
        let event = |name: &str, v: Value| Bytes::from(format!("event: {name}\ndata: {v}\n\n"));
        let Reply {
            id,
            now,
            ref model,
            prompt,
            completion,
            used,
            ..
        } = *self;
        let mut frames = Vec::new();
        match style {
            ApiStyle::OpenAi => {
                let base = |delta: Value, finish: Value| json!({"id": format!("chatcmpl-sim{id}"), "object": "chat.completion.chunk", "created": now.as_secs(), "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]});
                frames.push(send(base(
                    json!({"role":"assistant","content":""}),
                    Value::Null,
                )));
                for n in self.chunk_sizes(chunks) {
                    frames.push(send(base(json!({"content": words(n)}), Value::Null)));
                }
                frames.push(send(base(json!({}), json!("stop"))));
                if include_usage {
                    frames.push(send(json!({"id": format!("chatcmpl-sim{id}"), "object": "chat.completion.chunk", "created": now.as_secs(), "model": model, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": used}})));
                }
                frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            ApiStyle::Anthropic => {
                frames.push(event("message_start", json!({"type":"message_start","message":{"id":format!("msg_sim{id}"),"type":"message","role":"assistant","model":model,"content":[],"usage":{"input_tokens":prompt,"output_tokens":1}}})));
                frames.push(event("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}})));
                for n in self.chunk_sizes(chunks) {
                    frames.push(event("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":words(n)}})));
                }
                frames.push(event(
                    "content_block_stop",
                    json!({"type":"content_block_stop","index":0}),
                ));
                frames.push(event("message_delta", json!({"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":completion}})));
                frames.push(event("message_stop", json!({"type":"message_stop"})));
            }
        }
        frames
    }
}

/// A streamed answer: a task sends its frames after the latency, one
/// `chunk_interval` apart, and settles the books as the last one leaves.
pub(super) fn streamed(
    shared: Arc<Shared>,
    cfg: SimulatorConfig,
    style: ApiStyle,
    reply: Reply,
    include_usage: bool,
) -> Response<SimBody> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        tokio::time::sleep(cfg.latency).await;
        let frames = reply.frames(style, cfg.stream_chunks.max(1), include_usage);
        let (input, output) = reply.usage();
        let last = frames.len() - 1;
        for (i, f) in frames.into_iter().enumerate() {
            if i == last {
                // The answer is complete when its last event leaves.
                settle(
                    &shared,
                    cfg.reconcile,
                    reply.id,
                    &reply.model,
                    input,
                    output,
                );
            }
            if tx.send(f).await.is_err() {
                return;
            }
            if i > 0 && i < last {
                tokio::time::sleep(cfg.chunk_interval).await;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache"),
    );
    r
}
