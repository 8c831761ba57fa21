//! SPEC T5 with C1–C3: `sluice pace` in front of `sluice serve` in front of an
//! OpenAI-compatible provider (the project's simulator). The gateway's token
//! budget is far below what the pacer was told the provider allows; the pacer
//! learns it from the gateway's `x-ratelimit-*-tokens` fields and sends no call
//! the gateway refuses. Real HTTP over loopback, ports 0.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::{Value, json};
use sluice_client::proxy::{ProxyOptions, ProxyServer};
use sluice_client::simulator::{Simulator, SimulatorConfig};
use sluice_gateway::{Gateway, GatewayConfig, Upstream};

/// The gateway's budget: 1,500 weighed tokens a caller per 5 s.
const POLICY: &str = r#"
profile: default
window_seconds: 60
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
tokens:
  team: { per: caller, limit: 1500, window_seconds: 5, default_max_output: 100 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }
  - { class: llm }
"#;

fn chat() -> Value {
    json!({"model":"gpt-4o","messages":[
        {"role":"system","content":"You are terse."},
        {"role":"user","content":"Say hello."}],"max_tokens":100})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t5_c1_the_pacer_learns_the_gateways_token_budget_and_trips_nothing() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Simulator::start(SimulatorConfig {
            tpm: 0,
            rpm: 0,
            completion_tokens: 100,
            ..SimulatorConfig::default()
        })
        .await
        .unwrap();
        let policy = sluice_policy::parse_str(POLICY, std::path::Path::new("t.yaml")).unwrap();
        let dir = std::env::temp_dir().join(format!("sluice-tokens-pace-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let mut config = GatewayConfig::new(policy, dir.clone());
        config.workers = std::num::NonZeroUsize::new(1).unwrap();
        let sim_addr: std::net::SocketAddr = sim
            .base_url()
            .trim_start_matches("http://")
            .trim_end_matches("/v1")
            .parse()
            .unwrap();
        config.upstream = Some(Upstream::from_addr(sim_addr));
        let gateway = Gateway::start(config).await.unwrap();
        let edge = gateway.addr().unwrap();

        // The pacer is told the provider allows 100,000 tokens a minute: the
        // gateway's budget is what it must find out.
        let file = dir.join("pace.yaml");
        std::fs::write(
            &file,
            format!(
                "providers:\n  edge:\n    baseUrl: http://{edge}/v1\n    apiKey: sk-team\n    rateLimits: {{ tpm: 100000, rpm: 0, rpd: 0 }}\n"
            ),
        )
        .unwrap();
        let server = ProxyServer::bind(ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap()))
            .await
            .unwrap();
        let pace = server.bound().listen;
        let serving = tokio::spawn(server.serve());

        // 24 calls of about 120 reserved tokens each, 8 at a time: about two
        // budgets' worth, so the pacer must wait for the gateway's window.
        let client = reqwest::Client::new();
        let url = format!("http://{pace}/edge/chat/completions");
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let calls: Vec<_> = (0..8)
                .map(|_| {
                    let (client, url) = (client.clone(), url.clone());
                    tokio::spawn(async move {
                        client.post(url).json(&chat()).send().await.unwrap().status().as_u16()
                    })
                })
                .collect();
            for c in calls {
                statuses.push(c.await.unwrap());
            }
        }
        let refused = statuses.iter().filter(|&&s| s == 429).count();
        assert_eq!(refused, 0, "the gateway refused calls the pacer sent: {statuses:?}");
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
        serving.abort();
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await
    .expect("the test finished in time");
}
