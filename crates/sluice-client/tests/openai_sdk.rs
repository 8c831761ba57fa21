//! The official `openai` Python SDK (from PyPI, in a virtualenv this test
//! creates under the target directory and reuses) pointed at `sluice pace`
//! → the simulator: a chat and a streamed chat complete, an oversize
//! request gets the proxy's 413.
#![allow(clippy::unwrap_used)]

use crate::python_venv;
use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sluice_client::proxy::{ProxyOptions, ProxyServer};
use sluice_client::simulator::{Simulator, SimulatorConfig};

/// The SDK version this test pins (the current release when written).
const OPENAI_SDK_VERSION: &str = "3.57.0";

/// The virtualenv with the pinned SDK, made once for every test of this file (two
/// tests asking at once in a fresh tree would otherwise both create it).
fn venv() -> PathBuf {
    static VENV: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    VENV.get_or_init(make_venv).clone()
}

fn make_venv() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    python_venv::venv(&dir, &[("openai", OPENAI_SDK_VERSION)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_c2_official_openai_python_sdk_through_pace() {
    let python = tokio::task::spawn_blocking(venv).await.unwrap();
    let sim = Simulator::start(SimulatorConfig {
        tpm: 20_000,
        rpm: 600,
        ..SimulatorConfig::default()
    })
    .await
    .unwrap();
    let dir = support::temp_dir("sdk");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        format!(
            "providers:\n  sim:\n    baseUrl: {}\n    apiKey: sk-sim\n    rateLimits: {{ tpm: 20000, rpm: 600, rpd: 0 }}\n",
            sim.base_url()
        ),
    )
    .unwrap();
    let server = ProxyServer::bind(ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    // Exactly as docs/pacer.md says: the SDK's base URL is the proxy and the provider's
    // name, nothing after it (the provider's baseUrl holds its `/v1`).
    let base = format!("http://{}/sim", server.bound().listen);
    let serving = tokio::spawn(server.serve());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_sdk.py");
    let run =
        tokio::task::spawn_blocking(move || Command::new(python).arg(script).arg(base).output());
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for line in ["chat ok", "stream ok", "oversize ok"] {
        assert!(stdout.contains(line), "{stdout}");
    }
    let stats = sim.stats();
    assert_eq!(
        (stats.admitted, stats.streamed, stats.violations),
        (2, 1, 0),
        "{stats:?}"
    );
    serving.abort();
    let _ = std::fs::remove_dir_all(dir);
}

/// Two models with limits of their own (RPM 300 and 600, the provider's TPM
/// far above both): the SDK keeps three requests per model waiting at the
/// proxy for 12 s. Each model gets ≥ 95 % of its own rate, nothing is
/// answered 429, and the answers say which budget paced them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m1_official_openai_sdk_two_models_each_near_its_own_limit_zero_429s() {
    use sluice_client::simulator::SimModel;
    let python = tokio::task::spawn_blocking(venv).await.unwrap();
    let sim = Simulator::start(SimulatorConfig {
        tpm: 1_000_000,
        rpm: 0,
        latency: Duration::from_millis(20),
        completion_tokens: 8,
        ..SimulatorConfig::default()
    })
    .await
    .unwrap();
    sim.set_models([
        SimModel::new("gpt-4o", 0, 300),
        SimModel::new("gpt-4o-mini*", 0, 600),
    ]);
    let dir = support::temp_dir("sdk-models");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        format!(
            "providers:\n  sim:\n    baseUrl: {}\n    apiKey: sk-sim\n    rateLimits: {{ tpm: 1000000, rpm: 0, rpd: 0 }}\n    models:\n      gpt-4o: {{ rateLimits: {{ rpm: 300 }} }}\n      \"gpt-4o-mini*\": {{ rateLimits: {{ rpm: 600 }} }}\n",
            sim.base_url()
        ),
    )
    .unwrap();
    let server = ProxyServer::bind(ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    let base = format!("http://{}/sim", server.bound().listen);
    let serving = tokio::spawn(server.serve());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_sdk_models.py");
    let run = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args([&base, "12", "gpt-4o=300", "gpt-4o-mini=600"])
            .output()
    });
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for (model, rpm) in [("gpt-4o", 300.0), ("gpt-4o-mini", 600.0)] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("model {model} ")))
            .unwrap_or_else(|| panic!("{stdout}"));
        let rate: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(rate >= 0.95 * rpm, "{model}: {rate}/min of {rpm}\n{stdout}");
        assert!(rate <= rpm, "{model}: {rate}/min over {rpm}\n{stdout}");
    }
    assert!(stdout.contains("budget gpt-4o model=gpt-4o\n"), "{stdout}");
    assert!(
        stdout.contains("budget gpt-4o-mini model=gpt-4o-mini*\n"),
        "{stdout}"
    );
    let stats = sim.stats();
    assert_eq!(stats.violations, 0, "{stats:?}");
    for m in ["gpt-4o", "gpt-4o-mini*"] {
        let s = sim.model_stats(m).unwrap();
        assert_eq!(s.violations, 0, "{m}: {s:?}");
    }
    println!("{stdout}");
    serving.abort();
    let _ = std::fs::remove_dir_all(dir);
}
