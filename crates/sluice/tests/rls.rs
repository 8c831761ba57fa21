//! R1, sluice as Envoy's rate-limit service (`sluice serve --rls ADDR`), asked by a
//! client generated from Envoy's own protos in another language (Python `grpcio` and
//! `xds-protos`, `tests/rls/client.py`): envoyproxy/ratelimit's README examples
//! loaded unchanged, all-or-nothing decisions, `hits_addend`, shadow mode, health
//! checking, bounds, and three replicas on one Redis admitting exactly a rule's limit.
//!
//! Counting tests use rules of a year (windows aligned to the epoch): no run can
//! straddle one.

#[path = "../../../tests/support/edit.rs"]
mod edit;
use edit::Edit as _;

mod support;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use support::redis::RedisServer;
use support::{DataDir, Sluice};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/rls/examples");
const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/rls/client.py");

/// A virtualenv with grpcio, grpcio-health-checking and xds-protos, made once.
fn python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rls-venv");
            let python = venv.join("bin/python");
            let probe =
                "from envoy.service.ratelimit.v3 import rls_pb2; import grpc_health.v1.health_pb2";
            let ready = |python: &Path| {
                python.exists()
                    && Command::new(python)
                        .args(["-c", probe])
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
            };
            if !ready(&python) {
                let made = Command::new("python3")
                    .args(["-m", "venv"])
                    .arg(&venv)
                    .status()
                    .expect("python3 -m venv");
                assert!(made.success(), "python3 -m venv failed");
                let installed = Command::new(venv.join("bin/pip"))
                    .args([
                        "install",
                        "-q",
                        "--disable-pip-version-check",
                        "grpcio==1.85.3",
                        "grpcio-health-checking==1.85.1",
                        "xds-protos==1.85.0",
                    ])
                    .status()
                    .expect("pip");
                assert!(installed.success(), "pip install grpcio xds-protos failed");
            }
            python
        })
        .clone()
}

/// Runs the Python client: `args`, with `input` on stdin; its stdout as JSON.
fn client(args: &[&str], input: &Value) -> Value {
    let mut child = Command::new(python())
        .arg(CLIENT)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the Python client");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.to_string().as_bytes())
        .expect("write the requests");
    let out = child.wait_with_output().expect("the Python client");
    assert!(
        out.status.success(),
        "client {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    if args.first() == Some(&"health") {
        return Value::String(text.trim().to_owned());
    }
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Asks `sluice` each request in turn; their answers.
async fn ask(sluice: &Sluice, requests: Value) -> Vec<Value> {
    let addr = sluice.start.rls.expect("started with --rls").to_string();
    let answer = tokio::task::spawn_blocking(move || client(&["ask", &addr], &requests))
        .await
        .expect("client task");
    answer.as_array().expect("a list").clone()
}

fn request(domain: &str, descriptors: &[&[(&str, &str)]]) -> Value {
    json!({ "domain": domain, "descriptors": descriptors })
}

/// The built-in policy with `domains` added.
fn policy(dir: &Path, domains: &str) -> String {
    std::fs::create_dir_all(dir).expect("test directory");
    let yaml =
        sluice_policy::DEFAULT_POLICY_YAML.edit("headers:\n", &format!("{domains}headers:\n"));
    let path = dir.join("rls.yaml");
    std::fs::write(&path, yaml).expect("write policy");
    path.to_str().expect("utf-8 path").to_owned()
}

/// `sluice serve --config POLICY --rls 127.0.0.1:0` with `store` (`--data-dir DIR`
/// or `--store URL`).
fn rls_server(policy: &str, store: [&str; 2]) -> Sluice {
    Sluice::spawn(&[
        "--config",
        policy,
        "--rls",
        "127.0.0.1:0",
        store[0],
        store[1],
    ])
}

const API: &str = "domains:
  - domain: api
    descriptors:
      - key: user
        rate_limit: { unit: year, requests_per_unit: 5 }
      - key: path
        value: /export
        rate_limit: { unit: year, requests_per_unit: 3, name: export }
        descriptors:
          - key: plan
            value: pro
            rate_limit: { unit: year, requests_per_unit: 10, replaces: [{ name: export }] }
      - key: trial
        rate_limit: { unit: year, requests_per_unit: 1 }
        shadow_mode: true
      - key: burst
        rate_limit: { unit: year, requests_per_unit: 25 }
";

#[tokio::test]
async fn r1_the_reference_examples_load_unchanged_and_answer_as_documented() {
    let dir = DataDir::new();
    let sluice = Sluice::spawn(&[
        "--rls",
        "127.0.0.1:0",
        "--rls-config",
        EXAMPLES,
        "--data-dir",
        dir.arg(),
    ]);
    let answers = ask(
        &sluice,
        json!([
            request("mongo_cps", &[&[("database", "users")]]),
            request(
                "messaging",
                &[
                    &[("message_type", "marketing"), ("to_number", "2061111111")],
                    &[("to_number", "2061111111")]
                ]
            ),
            request("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.5")]]),
            request("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.1")]]),
            request("example4", &[&[("key", "value"), ("subkey", "subvalue")]]),
            request("example4", &[&[("key", "value")]]),
            request("internal", &[&[("ldap", "x")], &[("azure", "y")]]),
            request(
                "example6",
                &[&[("service", "auth-service"), ("user", "user-a")]]
            ),
            request(
                "example7",
                &[
                    &[("key_1", "value_1"), ("user", "bkthomps")],
                    &[("key_2", "value_2"), ("user", "bkthomps")]
                ]
            ),
            request("example8", &[&[("key1", "other")], &[("key1", "value1")]]),
            request("example9", &[&[("key1", "value_42")], &[("key1", "nope")]]),
            request("no_such_domain", &[&[("a", "b")]]),
        ]),
    )
    .await;
    let status = |i: usize, d: usize| answers[i]["statuses"][d].clone();
    // 1: exact key and value.
    assert_eq!(status(0, 0)["limit"], 500);
    assert_eq!(status(0, 0)["unit"], "SECOND");
    assert_eq!(status(0, 0)["remaining"], 499);
    // 2: nested lists and a key with no value; both descriptors answered.
    assert_eq!(
        (status(1, 0)["limit"].clone(), status(1, 0)["unit"].clone()),
        (json!(5), json!("DAY"))
    );
    assert_eq!(status(1, 1)["limit"], 100);
    // 3: the most specific match; a limit of 0 refuses.
    assert_eq!(answers[2]["overall"], "OVER_LIMIT");
    assert_eq!(status(2, 0)["limit"], 0);
    assert_eq!(answers[3]["overall"], "OK");
    assert_eq!(status(3, 0)["limit"], 10);
    // 4: a descriptor matches only as deep as it is long.
    assert_eq!(status(4, 0)["limit"], 300);
    assert_eq!(
        status(5, 0)["limit"],
        Value::Null,
        "one entry matches no rule"
    );
    assert_eq!(answers[5]["overall"], "OK");
    // 5: unlimited: OK with remaining u32::MAX.
    assert_eq!(status(6, 0)["remaining"], u64::from(u32::MAX));
    assert_eq!(status(6, 1)["limit"], 100);
    // 6: shadow mode answers OK.
    assert_eq!(answers[7]["overall"], "OK");
    assert_eq!(status(7, 0)["limit"], 10);
    // 7: the replacing rule applies, the replaced one does not.
    assert_eq!(status(8, 0)["limit"], Value::Null, "replaced");
    assert_eq!(status(8, 1)["limit"], 10);
    // 8: any value, and the exact one first.
    assert_eq!(status(9, 0)["limit"], 10);
    assert_eq!(status(9, 1)["limit"], 20);
    // 9: a trailing `*` matches by prefix.
    assert_eq!(status(10, 0)["limit"], 20);
    assert_eq!(status(10, 1)["limit"], Value::Null);
    // An unknown domain: OK, as Envoy expects.
    assert_eq!(answers[11]["overall"], "OK");
    // Health checking serves.
    let addr = sluice.start.rls.expect("rls").to_string();
    let health = tokio::task::spawn_blocking(move || client(&["health", &addr], &json!(null)))
        .await
        .expect("task");
    assert_eq!(health, "SERVING");
    // /status (and the dashboard's panel) lists the domains and their rules.
    let status = support::get(&sluice.admin_url("/status")).await.json();
    let domains = status["limiter"]["domains"].as_array().expect("domains");
    assert_eq!(domains.len(), 9);
    let mongo = domains
        .iter()
        .find(|d| d["domain"] == "mongo_cps")
        .expect("mongo_cps");
    assert_eq!(mongo["rules"][0]["id"], "database_users");
    assert_eq!(mongo["rules"][0]["limit"], 500);
    assert_eq!(mongo["rules"][0]["unit"], "second");
}

#[tokio::test]
async fn r1_descriptors_are_decided_all_or_nothing_with_hits_addend_and_shadow_mode() {
    let dir = DataDir::new();
    let policy = policy(&dir.0, API);
    let text = std::fs::read_to_string(&policy).expect("policy");
    std::fs::write(&policy, text.edit("ietf_draft: false", "ietf_draft: true")).expect("policy");
    let sluice = rls_server(&policy, ["--data-dir", dir.arg()]);
    let both = request("api", &[&[("user", "ada")], &[("path", "/export")]]);
    let answers = ask(&sluice, json!([both, both, both, both])).await;
    assert_eq!(answers[2]["statuses"][1]["remaining"], 0, "the path's 3rd");
    assert_eq!(answers[3]["overall"], "OVER_LIMIT", "a 4th export");
    assert_eq!(answers[3]["statuses"][1]["code"], "OVER_LIMIT");
    assert_eq!(
        answers[3]["statuses"][0]["remaining"], 2,
        "refused whole: the user's counter was not spent (5 - 3)"
    );
    assert_eq!(
        answers[2]["headers"]["x-ratelimit-limit"], "3",
        "the tightest"
    );
    assert_eq!(answers[2]["headers"]["x-ratelimit-remaining"], "0");
    let reset: u64 = answers[2]["headers"]["x-ratelimit-reset"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .expect("a reset");
    assert!(
        reset > 1_700_000_000,
        "Unix seconds, as the gateway's: {reset}"
    );
    assert_eq!(
        answers[2]["headers"]["ratelimit-policy"],
        "\"user\";q=5;w=31536000, \"path_/export\";q=3;w=31536000",
        "the IETF draft's fields, when the policy turns them on"
    );
    assert!(
        answers[2]["headers"]["ratelimit"]
            .as_str()
            .is_some_and(
                |v| v.starts_with("\"user\";r=2;t=") && v.contains("\"path_/export\";r=0;t=")
            ),
        "{}",
        answers[2]["headers"]
    );
    // hits_addend: the request's, and a descriptor's own (0 only looks).
    let answers = ask(
        &sluice,
        json!([
            { "domain": "api", "descriptors": [[["user", "bo"]]], "hits_addend": 3 },
            { "domain": "api", "descriptors": [[["user", "bo"]]], "descriptor_hits": [0] },
            { "domain": "api", "descriptors": [[["user", "bo"]]], "hits_addend": 3 },
        ]),
    )
    .await;
    assert_eq!(answers[0]["statuses"][0]["remaining"], 2);
    assert_eq!(
        answers[1]["statuses"][0]["remaining"], 2,
        "0 hits spend nothing"
    );
    assert_eq!(
        answers[2]["overall"], "OVER_LIMIT",
        "3 more do not fit in 2"
    );
    // A more specific rule replaces the path's for pro callers.
    let pro = request(
        "api",
        &[
            &[("path", "/export")],
            &[("path", "/export"), ("plan", "pro")],
        ],
    );
    let answers = ask(&sluice, json!([pro])).await;
    assert_eq!(
        answers[0]["overall"], "OK",
        "the path's 3 are spent, but replaced"
    );
    assert_eq!(answers[0]["statuses"][1]["limit"], 10);
    // Shadow mode: over its limit, still OK.
    let trial = request("api", &[&[("trial", "t1")]]);
    let answers = ask(&sluice, json!([trial, trial, trial])).await;
    for a in &answers {
        assert_eq!(a["overall"], "OK");
    }
    assert_eq!(answers[2]["statuses"][0]["limit"], 1);
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sluice_rls_descriptors_total")
                && l.contains("rule=\"path_/export\"")
                && l.contains("code=\"over_limit\"")),
        "a metric per domain and rule: {metrics}"
    );
    assert!(
        metrics.contains(
            "sluice_shadow_refusals_total{budget=\"api.trial\",reason=\"rate_limited\"} 2"
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn r1_bounds_every_request_is_answered_never_a_panic() {
    let dir = DataDir::new();
    let policy = policy(&dir.0, API);
    let sluice = rls_server(&policy, ["--data-dir", dir.arg()]);
    let many: Vec<Value> = (0..1000)
        .map(|i| json!([["other", format!("v{i}")]]))
        .collect();
    let counted: Vec<Value> = (0..20)
        .map(|i| json!([["user", format!("u{i}")]]))
        .collect();
    let long = "x".repeat(64 * 1024);
    let answers = ask(
        &sluice,
        json!([
            { "domain": "api", "descriptors": [] },
            { "domain": "", "descriptors": [[["user", "a"]]] },
            { "domain": "api", "descriptors": many },
            { "domain": "api", "descriptors": [[["user", long]]] },
            { "domain": "api", "descriptors": counted },
        ]),
    )
    .await;
    assert_eq!(answers[0]["overall"], "OK");
    assert_eq!(answers[1]["overall"], "OK", "no such domain");
    assert_eq!(answers[2]["statuses"].as_array().map(Vec::len), Some(1000));
    assert_eq!(answers[3]["statuses"][0]["remaining"], 4);
    assert_eq!(
        answers[4]["overall"], "OVER_LIMIT",
        "20 counted descriptors are more than one decision holds: refused whole"
    );
    let again = ask(&sluice, json!([request("api", &[&[("user", "u0")]])])).await;
    assert_eq!(again[0]["statuses"][0]["remaining"], 4, "nothing was spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_d2_three_replicas_on_one_redis_admit_exactly_a_rules_limit() {
    let redis = RedisServer::start("rls");
    let dir = DataDir::new();
    let policy = policy(&dir.0, API).edit_file_for_store();
    let replicas: Vec<Sluice> = (0..3)
        .map(|_| rls_server(&policy, ["--store", &redis.url()]))
        .collect();
    let addrs: Vec<String> = replicas
        .iter()
        .map(|r| r.start.rls.expect("rls").to_string())
        .collect();
    let addrs = addrs.join(",");
    let counts = tokio::task::spawn_blocking(move || {
        client(
            &["burst", &addrs, "60"],
            &request("api", &[&[("burst", "b1")]]),
        )
    })
    .await
    .expect("task");
    assert_eq!(
        counts["ok"], 25,
        "exactly the limit across replicas: {counts}"
    );
    assert_eq!(counts["over_limit"], 35);
}

#[tokio::test]
async fn r1_d3_while_the_store_is_down_each_domain_answers_by_its_outage_rule() {
    let mut redis = RedisServer::start("rls-outage");
    let dir = DataDir::new();
    let domains = format!(
        "{API}  - domain: strict
    outage: fail_closed
    descriptors:
      - key: user
        rate_limit: {{ unit: year, requests_per_unit: 5 }}
"
    );
    let policy = policy(&dir.0, &domains).edit_file_for_store();
    let sluice = rls_server(&policy, ["--store", &redis.url()]);
    let both = json!([
        request("api", &[&[("user", "ada")]]),
        request("strict", &[&[("user", "ada")]]),
    ]);
    let answers = ask(&sluice, both.clone()).await;
    assert_eq!(
        (answers[0]["overall"].clone(), answers[1]["overall"].clone()),
        (json!("OK"), json!("OK"))
    );
    redis.kill();
    let answers = ask(&sluice, both).await;
    assert_eq!(answers[0]["overall"], "OK", "fail_open, the default");
    assert_eq!(answers[1]["overall"], "OVER_LIMIT", "fail_closed");
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sluice_rls_requests_total")
                && l.contains("domain=\"strict\"")
                && l.contains("outcome=\"outage\"")),
        "counted: {metrics}"
    );
}

/// A store timeout that three replicas starting at once on two cores meet.
trait ForStore {
    fn edit_file_for_store(self) -> String;
}

impl ForStore for String {
    fn edit_file_for_store(self) -> String {
        let text = std::fs::read_to_string(&self).expect("policy");
        std::fs::write(&self, text.edit("timeout_ms: 20", "timeout_ms: 2000")).expect("policy");
        self
    }
}

#[test]
fn r1_sluice_check_names_each_bad_key_with_its_path_and_file() {
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    std::fs::write(
        dir.0.join("bad.yaml"),
        "domain: bad
descriptors:
  - key: a
    rate_limit: { unit: fortnight, requests_per_unit: 5 }
  - key: b
    colour: red
    rate_limit: { unit: second, requests_per_unit: 5, replaces: [{ name: nope }] }
",
    )
    .expect("write");
    std::fs::write(
        dir.0.join("dup.yaml"),
        "domain: mongo_cps\ndescriptors: []\n",
    )
    .expect("write");
    std::fs::write(
        dir.0.join("mongo.yaml"),
        "domain: mongo_cps\ndescriptors: []\n",
    )
    .expect("write");
    let out = Command::new(support::binary())
        .arg("check")
        .arg(&dir.0)
        .output()
        .expect("sluice check");
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    let bad = dir.0.join("bad.yaml").display().to_string();
    for expected in [
        format!(
            "{bad}: descriptors[0].rate_limit.unit: expected second, minute, hour, day, week, month or year, got \"fortnight\""
        ),
        format!("{bad}: descriptors[1].colour: unknown key"),
        format!(
            "{bad}: descriptors[1].rate_limit.replaces[0].name: no rule of domain \"bad\" is named \"nope\""
        ),
        "domain \"mongo_cps\" is also defined in".to_owned(),
    ] {
        assert!(text.contains(&expected), "missing {expected:?} in:\n{text}");
    }
    // The reference's examples pass.
    let ok = Command::new(support::binary())
        .args(["check", EXAMPLES])
        .output()
        .expect("sluice check");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

#[tokio::test]
async fn r1_sluice_rls_runs_the_service_alone() {
    use std::io::BufRead as _;
    let dir = DataDir::new();
    let mut child = Command::new(support::binary())
        .args([
            "rls",
            "--rls",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--rls-config",
            EXAMPLES,
        ])
        .args(["--data-dir", dir.arg()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sluice rls");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the start line");
    // `sluice rls: listening on grpc://A (admin http://B)`: no HTTP gateway.
    let rest = line
        .trim()
        .strip_prefix("sluice rls: listening on grpc://")
        .unwrap_or_else(|| panic!("start line: {line:?}"));
    let (rls, rest) = rest.split_once(" (admin http://").expect("admin");
    let admin = rest.trim_end_matches(')').to_owned();
    let rls = rls.to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        client(
            &["ask", &rls],
            &json!([request("mongo_cps", &[&[("database", "users")]])]),
        )
    })
    .await
    .expect("task");
    assert_eq!(answer[0]["statuses"][0]["limit"], 500);
    let status = support::get(&format!("http://{admin}/status")).await.json();
    assert_eq!(status["listen"], "", "no gateway listens: {status}");
    assert_eq!(status["upstream_kind"], "none");
    let _ = child.kill();
    let _ = child.wait();
}
