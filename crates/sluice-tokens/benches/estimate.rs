//! The tokenizer's cost per request (SPEC T2): a chat call's estimate from its
//! raw body, as `bench/tokens/run` sends it (a system prompt, an earlier turn and
//! a new question, ~150 prompt tokens), when every message is new to the thread
//! (each is tokenized) and when all but the question were counted before (a
//! conversation's next turn: their counts are kept); beside it the JSON parse
//! alone, the part no tokenizer can save. Then one text's count by the
//! encoding as sluice counts it (ASCII split without the encoding's regular
//! expression) beside the encoding's own count (`bpe-openai`, by the
//! expression), on texts new each time.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use sluice_tokens::{ApiStyle, EstimateOptions, check_body, estimate_body};

const SYSTEM: &str = "You are the support assistant of a small software company. Answer in plain English, in at most three short paragraphs. When a question is about billing, say that an operator will follow up, and do not guess amounts. Quote version numbers exactly as the user gives them.";
const ASKED: &str = "Our deploy failed last night after the upgrade. The logs say the connection pool was exhausted and then the health check timed out. What should we look at first?";
const ANSWERED: &str = "Start with the pool size against the number of workers: the upgrade may run more workers per host. Then check whether the health check shares the pool with requests.";

/// The body of call `n`; `tag` makes every message new.
fn body(n: u64, tag: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"gpt-4o","max_tokens":64,"messages":[{{"role":"system","content":"{SYSTEM}{tag}"}},{{"role":"user","content":"{ASKED}{tag}"}},{{"role":"assistant","content":"{ANSWERED}{tag}"}},{{"role":"user","content":"Thanks. Question {n} of thread 7: does release 4.{} change that?"}}]}}"#,
        n % 97
    )
    .into_bytes()
}

fn estimate(c: &mut Criterion) {
    let opts = EstimateOptions::for_model("gpt-4o");
    let path = "/v1/chat/completions";
    let mut group = c.benchmark_group("estimate a chat call (~150 prompt tokens)");
    // Bodies made before timing; each iteration a different one.
    let new: Vec<Vec<u8>> = (0..4096).map(|n| body(n, &format!(" ({n})"))).collect();
    let next_turn: Vec<Vec<u8>> = (0..4096).map(|n| body(n, "")).collect();
    for (name, bodies) in [
        ("every message new", &new),
        ("a conversation's next turn", &next_turn),
    ] {
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % bodies.len();
                black_box(estimate_body(ApiStyle::OpenAi, path, &bodies[i], &opts))
            });
        });
    }
    let mut i = 0;
    group.bench_function("the JSON parse alone", |b| {
        b.iter(|| {
            i = (i + 1) % new.len();
            black_box(check_body(&new[i]))
        });
    });
    group.finish();

    // A conversation's new question: short enough that no count is kept for
    // it (under 64 bytes), so each is tokenized.
    let texts: Vec<String> = (0..4096)
        .map(|n| {
            format!(
                "Thanks. Question {n} of thread 7: does release 4.{} change?",
                n % 97
            )
        })
        .collect();
    assert!(texts.iter().all(|t| t.len() < 64));
    let mut group = c.benchmark_group("count a new question (~17 tokens)");
    let mut i = 0;
    group.bench_function("sluice (Encoding::count)", |b| {
        b.iter(|| {
            i = (i + 1) % texts.len();
            black_box(sluice_tokens::Encoding::O200kBase.count(&texts[i]))
        });
    });
    let mut i = 0;
    group.bench_function("bpe-openai (Tokenizer::count)", |b| {
        b.iter(|| {
            i = (i + 1) % texts.len();
            black_box(bpe_openai::o200k_base().count(texts[i].as_str()))
        });
    });
    group.finish();
}

criterion_group!(benches, estimate);
criterion_main!(benches);
