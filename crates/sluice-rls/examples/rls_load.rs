//! A load generator for any Envoy rate-limit service (RLS v3): `STREAMS` calls in
//! flight at once over `CONNECTIONS` HTTP/2 connections for `SECONDS`, each asking
//! `DOMAIN` about one descriptor `(user, u<n>)` over 1,000 users; prints decisions/s,
//! p50 and p99 latency, and how many were over the limit or failed, as one line of
//! JSON. Used by `bench/rls/run` against sluice and Kuadrant's limitador alike.
//!
//! `cargo run --release -p sluice-rls --example rls_load -- ADDR [STREAMS=64]
//! [SECONDS=10] [DOMAIN=bench] [CONNECTIONS=4]`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sluice_rls::proto::rate_limit_descriptor::Entry;
use sluice_rls::proto::rate_limit_response::Code;
use sluice_rls::proto::rate_limit_service_client::RateLimitServiceClient;
use sluice_rls::proto::{RateLimitDescriptor, RateLimitRequest};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let addr = args
        .first()
        .ok_or("usage: rls_load ADDR [STREAMS] [SECONDS] [DOMAIN] [CONNECTIONS]")?;
    let streams: usize = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let seconds: u64 = args.get(2).map_or(Ok(10), |s| s.parse())?;
    let domain = args.get(3).cloned().unwrap_or_else(|| "bench".to_owned());
    let connections: usize = args.get(4).map_or(Ok(4), |s| s.parse())?;
    let mut clients = Vec::new();
    for _ in 0..connections.max(1) {
        clients.push(RateLimitServiceClient::connect(format!("http://{addr}")).await?);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..streams {
        let mut client = clients[i % clients.len()].clone();
        let stop = Arc::clone(&stop);
        let domain = domain.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies: Vec<u32> = Vec::with_capacity(1 << 16);
            let (mut over, mut failed) = (0u64, 0u64);
            let mut n = i;
            while !stop.load(Ordering::Relaxed) {
                let request = RateLimitRequest {
                    domain: domain.clone(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: "user".to_owned(),
                            value: format!("u{}", n % 1000),
                        }],
                        limit: None,
                        hits_addend: None,
                    }],
                    hits_addend: 1,
                };
                n += streams;
                let asked = Instant::now();
                match client.should_rate_limit(request).await {
                    Ok(answer) => {
                        if answer.get_ref().overall_code == i32::from(Code::OverLimit) {
                            over += 1;
                        }
                    }
                    Err(_) => failed += 1,
                }
                let took = asked.elapsed().as_micros();
                latencies.push(u32::try_from(took).unwrap_or(u32::MAX));
            }
            (latencies, over, failed)
        }));
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let (mut over, mut failed) = (0u64, 0u64);
    for task in tasks {
        let (latencies, o, f) = task.await?;
        all.extend(latencies);
        over += o;
        failed += f;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let at = |q: f64| {
        let i = ((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1));
        all.get(i).copied().unwrap_or(0)
    };
    println!(
        "{{\"decisions\":{},\"per_second\":{:.0},\"p50_us\":{},\"p99_us\":{},\"over_limit\":{over},\"failed\":{failed}}}",
        all.len(),
        all.len() as f64 / elapsed,
        at(0.50),
        at(0.99)
    );
    Ok(())
}
