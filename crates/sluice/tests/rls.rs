//! R1, sluice as Envoy's rate-limit service (`sluice serve --rls ADDR`), asked by a
//! client generated from Envoy's own protos in another language (Python `grpcio` and
//! `xds-protos`, `tests/rls/client.py`): envoyproxy/ratelimit's README examples
//! loaded unchanged, all-or-nothing decisions, `hits_addend`, shadow mode, health
//! checking, bounds, and three replicas on one Redis admitting exactly a rule's limit.
//!
//! Counting tests use rules of a year (windows aligned to the epoch): no run can
//! straddle one.

use crate::edit;
use edit::Edit as _;

use crate::support;

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

/// R1: `sluice check` refuses a rule with `unlimited: true` and a `unit` or
/// `requests_per_unit` (it was loaded as unlimited), naming its file and path,
/// as the service refuses to start with it.
#[test]
fn r1_sluice_check_refuses_unlimited_with_a_unit_by_its_path() {
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    let file = dir.0.join("a.yaml");
    std::fs::write(
        &file,
        "domain: d2\ndescriptors:\n  - key: user\n    rate_limit: { unit: second, requests_per_unit: 10, unlimited: true }\n",
    )
    .expect("write");
    let out = Command::new(support::binary())
        .arg("check")
        .arg(&dir.0)
        .output()
        .expect("sluice check");
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    let shown = file.display();
    for key in ["unit", "requests_per_unit"] {
        let expected =
            format!("{shown}: descriptors[0].rate_limit.{key}: not with `unlimited: true`");
        assert!(text.contains(&expected), "missing {expected:?} in:\n{text}");
    }
    let data = DataDir::new();
    let started = support::run_to_exit(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--rls",
            "127.0.0.1:0",
            "--rls-config",
            dir.0.to_str().expect("utf-8"),
            "--data-dir",
            data.arg(),
        ],
        std::time::Duration::from_secs(20),
    );
    assert!(!started.status.success(), "{}", started.stderr);
    assert!(
        started.stderr.contains("not with `unlimited: true`"),
        "{}",
        started.stderr
    );
}

#[tokio::test]
async fn r1_sluice_rls_runs_the_service_alone() {
    let dir = DataDir::new();
    // `sluice rls: listening on grpc://A (admin http://B)`: no HTTP gateway.
    let alone = RlsAlone::spawn(&["--rls-config", EXAMPLES, "--data-dir", dir.arg()]);
    let answer = ask_at(
        alone.rls,
        json!([request("mongo_cps", &[&[("database", "users")]])]),
    )
    .await;
    assert_eq!(answer[0]["statuses"][0]["limit"], 500);
    let status = support::get(&format!("http://{}/status", alone.admin))
        .await
        .json();
    assert_eq!(status["listen"], "", "no gateway listens: {status}");
    assert_eq!(status["upstream_kind"], "none");
}

/// R1: the `--rls-config` directory is read again with every reload, as the
/// docs and `--help` say, also when the policy file is unchanged (its domain
/// files were read again only with a changed policy file: SIGHUP logged
/// `policy unchanged` and kept the old rules). A changed, an added and a
/// removed domain file are applied; a broken one is rejected and the running
/// rules stay; nothing changed is `policy unchanged`.
#[tokio::test]
async fn r1_a_reload_reads_the_rls_config_directory_again_with_the_policy_unchanged() {
    let dir = DataDir::new();
    let policy = policy(&dir.0, "");
    let conf = dir.0.join("conf");
    std::fs::create_dir_all(&conf).expect("conf");
    let rule = |domain: &str, limit: u32| {
        format!(
            "domain: {domain}\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: year, requests_per_unit: {limit} }}\n"
        )
    };
    let write = |name: &str, text: &str| std::fs::write(conf.join(name), text).expect("write");
    write("d.yaml", &rule("d", 5));
    write("gone.yaml", &rule("gone", 7));
    let sluice = Sluice::spawn(&[
        "--config",
        &policy,
        "--rls",
        "127.0.0.1:0",
        "--rls-config",
        conf.to_str().expect("utf-8"),
        "--log-format",
        "json",
        "--data-dir",
        dir.arg(),
    ]);
    // Each domain's limit, spending nothing (hits 0).
    let limits = || async {
        let look = |domain: &str| json!({ "domain": domain, "descriptors": [[["user", "u"]]], "descriptor_hits": [0] });
        let answers = ask(&sluice, json!([look("d"), look("gone"), look("new")])).await;
        answers
            .iter()
            .map(|a| a["statuses"][0]["limit"].clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(limits().await, [json!(5), json!(7), Value::Null]);
    let logged = |message: &'static str| {
        move |l: &str| serde_json::from_str::<Value>(l).is_ok_and(|l| l["message"] == message)
    };

    write("d.yaml", &rule("d", 500));
    std::fs::remove_file(conf.join("gone.yaml")).expect("remove");
    write("new.yaml", &rule("new", 9));
    sluice.signal("HUP");
    let log = sluice.stderr_with(1, logged("policy reloaded")).await;
    assert_eq!(
        log.lines().filter(|l| logged("policy reloaded")(l)).count(),
        1,
        "{log}"
    );
    assert_eq!(limits().await, [json!(500), Value::Null, json!(9)]);

    write(
        "bad.yaml",
        "domain: bad\ndescriptors:\n  - key: user\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n",
    );
    sluice.signal("HUP");
    let rejected = |l: &str| {
        serde_json::from_str::<Value>(l).is_ok_and(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("policy reload rejected") && m.contains("fortnight"))
        })
    };
    let log = sluice.stderr_with(1, rejected).await;
    assert!(log.lines().any(rejected), "{log}");
    assert_eq!(
        limits().await,
        [json!(500), Value::Null, json!(9)],
        "the running rules stay"
    );

    std::fs::remove_file(conf.join("bad.yaml")).expect("remove");
    sluice.signal("HUP");
    let log = sluice.stderr_with(1, logged("policy unchanged")).await;
    assert!(log.lines().any(logged("policy unchanged")), "{log}");
    assert_eq!(
        log.lines().filter(|l| logged("policy reloaded")(l)).count(),
        1,
        "nothing to apply: {log}"
    );
}

/// `sluice rls <args> --rls 127.0.0.1:0 --admin 127.0.0.1:0`, alone: its
/// addresses, killed when dropped.
struct RlsAlone {
    child: std::process::Child,
    rls: std::net::SocketAddr,
    admin: String,
}

impl RlsAlone {
    fn spawn(args: &[&str]) -> RlsAlone {
        use std::io::BufRead as _;
        let mut child = Command::new(support::binary())
            .args(["rls", "--rls", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("sluice rls");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the start line");
        let rest = line
            .trim()
            .strip_prefix("sluice rls: listening on grpc://")
            .unwrap_or_else(|| panic!("start line: {line:?}"));
        let (rls, rest) = rest.split_once(" (admin http://").expect("admin");
        RlsAlone {
            child,
            rls: rls.parse().expect("an address"),
            admin: rest.trim_end_matches(')').to_owned(),
        }
    }
}

impl Drop for RlsAlone {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Asks the service at `addr` each request in turn; their answers.
async fn ask_at(addr: std::net::SocketAddr, requests: Value) -> Vec<Value> {
    let addr = addr.to_string();
    let answer = tokio::task::spawn_blocking(move || client(&["ask", &addr], &requests))
        .await
        .expect("client task");
    answer.as_array().expect("a list").clone()
}

/// R1, as envoyproxy/ratelimit (`GetLimit` takes a descriptor's `limit`
/// override before it looks for a rule): an override on a descriptor whose rule
/// is `unlimited` or in `shadow_mode` is enforced as its limit, neither
/// unlimited nor in shadow mode (it was ignored: such a descriptor was always
/// `OK`). Without an override those rules answer as before.
#[tokio::test]
async fn r1_a_limit_override_on_an_unlimited_or_shadow_rule_is_enforced() {
    use sluice_rls::proto::rate_limit_descriptor::{Entry, RateLimitOverride};
    use sluice_rls::proto::rate_limit_response::rate_limit::Unit;
    use sluice_rls::proto::rate_limit_service_client::RateLimitServiceClient;
    use sluice_rls::proto::{RateLimitDescriptor, RateLimitRequest};

    let dir = DataDir::new();
    let policy = policy(
        &dir.0,
        "domains:
  - domain: api
    descriptors:
      - key: unl
        rate_limit: { unlimited: true }
      - key: sh
        rate_limit: { unit: year, requests_per_unit: 1 }
        shadow_mode: true
",
    );
    let sluice = rls_server(&policy, ["--data-dir", dir.arg()]);
    let rls = sluice.start.rls.expect("rls");
    let mut client = RateLimitServiceClient::connect(format!("http://{rls}"))
        .await
        .expect("connect");
    let request = |key: &str, limit: Option<u32>| RateLimitRequest {
        domain: "api".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: key.into(),
                value: "probe".into(),
            }],
            limit: limit.map(|requests_per_unit| RateLimitOverride {
                requests_per_unit,
                unit: Unit::Year.into(),
            }),
            hits_addend: None,
        }],
        hits_addend: 0,
    };
    // overall_code: 1 OK, 2 OVER_LIMIT.
    for key in ["unl", "sh", "no_rule"] {
        let mut codes = Vec::new();
        for _ in 0..3 {
            let answer = client
                .should_rate_limit(request(key, Some(2)))
                .await
                .expect("answered")
                .into_inner();
            let limit = answer.statuses[0].current_limit.as_ref();
            assert_eq!(limit.map(|l| l.requests_per_unit), Some(2), "{key}");
            codes.push(answer.overall_code);
        }
        assert_eq!(codes, [1, 1, 2], "{key}: the override's 2 a year");
    }
    for key in ["unl", "sh"] {
        for _ in 0..3 {
            let answer = client
                .should_rate_limit(request(key, None))
                .await
                .expect("answered")
                .into_inner();
            assert_eq!(answer.overall_code, 1, "{key} without an override");
        }
    }
}

/// A rule of 5 (a year, so that no run straddles a window; the report of the
/// defect used 5 a minute).
const FIVE: &str = "domains:
  - domain: api
    descriptors:
      - key: user
        rate_limit: { unit: year, requests_per_unit: 5 }
";

/// P5 and R1: `--dry-run` (on `sluice rls` and on `serve --rls`) and
/// `dry_run: true` hold on the rate-limit service as on the gateway: 8 calls
/// against 5 a minute are all OK, each would-be refusal counted under the
/// gateway's metric, and the dashboard says it is a dry run.
#[tokio::test]
async fn p5_r1_a_dry_run_refuses_nothing_on_the_rate_limit_service() {
    let dir = DataDir::new();
    let policy = policy(&dir.0, FIVE);
    let dry_policy = {
        let path = dir.0.join("dry.yaml");
        let text = std::fs::read_to_string(&policy).expect("policy");
        std::fs::write(&path, format!("dry_run: true\n{text}")).expect("policy");
        path.to_str().expect("utf-8").to_owned()
    };
    let eight = json!(vec![request("api", &[&[("user", "ada")]]); 8]);
    let alone = RlsAlone::spawn(&["--config", &policy, "--dry-run", "--data-dir", dir.arg()]);
    let dir2 = DataDir::new();
    let served = Sluice::spawn(&[
        "--config",
        &policy,
        "--rls",
        "127.0.0.1:0",
        "--dry-run",
        "--data-dir",
        dir2.arg(),
    ]);
    let dir3 = DataDir::new();
    let in_file = rls_server(&dry_policy, ["--data-dir", dir3.arg()]);
    let admins = [
        format!("http://{}", alone.admin),
        served.admin_url(""),
        in_file.admin_url(""),
    ];
    let rls = [
        alone.rls,
        served.start.rls.expect("rls"),
        in_file.start.rls.expect("rls"),
    ];
    for (rls, admin) in rls.into_iter().zip(admins) {
        let answers = ask_at(rls, eight.clone()).await;
        for (n, answer) in answers.iter().enumerate() {
            assert_eq!(answer["overall"], "OK", "call {} of 8 at {admin}", n + 1);
        }
        assert_eq!(
            answers[7]["headers"]["x-ratelimit-remaining"], "0",
            "the headers still describe the rule"
        );
        let metrics = support::get(&format!("{admin}/metrics")).await.text();
        assert!(
            metrics.contains(
                "sluice_shadow_refusals_total{budget=\"api.user\",reason=\"rate_limited\"} 3"
            ),
            "{admin}: {metrics}"
        );
        let dashboard = support::get(&format!("{admin}/dashboard.json"))
            .await
            .json();
        assert_eq!(dashboard["status"]["limiter"]["dry_run"], true, "{admin}");
        assert_eq!(
            dashboard["tally"]["shadow_refusals"],
            json!([{ "budget": "api.user", "reason": "rate_limited", "count": 3 }]),
            "{admin}"
        );
    }
}

/// R1 bounds: a request past a documented bound is refused with
/// `RESOURCE_EXHAUSTED` (as gRPC's own servers do past their message bound),
/// never decoded in part; one at the bound is answered.
#[tokio::test]
async fn r1_bounds_a_request_past_a_bound_is_resource_exhausted() {
    let dir = DataDir::new();
    let policy = policy(&dir.0, API);
    let sluice = rls_server(&policy, ["--data-dir", dir.arg()]);
    let descriptors = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| json!([["other", format!("v{i}")]]))
            .collect()
    };
    let entries: Vec<Value> = (0..65).map(|i| json!([format!("k{i}"), "v"])).collect();
    let at_bound: Vec<Value> = (0..64).map(|i| json!([format!("k{i}"), "v"])).collect();
    let five_mb = "x".repeat(5_000_000);
    let answers = ask(
        &sluice,
        json!([
            { "domain": "api", "descriptors": descriptors(1024) },
            { "domain": "api", "descriptors": descriptors(1025) },
            { "domain": "api", "descriptors": [at_bound] },
            { "domain": "api", "descriptors": [entries] },
            { "domain": "api", "descriptors": [[["user", five_mb]]] },
            request("api", &[&[("user", "after")]]),
        ]),
    )
    .await;
    assert_eq!(
        answers[0]["statuses"].as_array().map(Vec::len),
        Some(1024),
        "1,024 descriptors are answered"
    );
    assert_eq!(answers[1]["error"], "RESOURCE_EXHAUSTED", "{}", answers[1]);
    assert_eq!(answers[2]["overall"], "OK", "64 entries are read");
    assert_eq!(answers[3]["error"], "RESOURCE_EXHAUSTED", "{}", answers[3]);
    assert_eq!(
        answers[4]["error"], "RESOURCE_EXHAUSTED",
        "a 5 MB message, not OUT_OF_RANGE: {}",
        answers[4]
    );
    assert_eq!(answers[5]["statuses"][0]["remaining"], 4, "still serving");
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    for reason in [
        "too_many_descriptors",
        "too_many_entries",
        "message_too_large",
    ] {
        assert!(
            metrics.contains(&format!(
                "sluice_rls_refused_total{{reason=\"{reason}\"}} 1"
            )),
            "{reason}: {metrics}"
        );
    }
}

/// R1: a descriptor key or value that is not UTF-8 (a header's Latin-1 bytes,
/// which Envoy sends as they are) was a gRPC `INTERNAL` error, neither counted
/// nor logged, which Envoy's default `failure_mode_deny: false` lets through:
/// any rule could be skipped, a rule of 0 and a `fail_closed` domain too. Such
/// a request is now answered `OVER_LIMIT` whole, whatever its domain and rules,
/// spending nothing; each is counted and logged as a refusal.
#[tokio::test]
async fn r1_a_descriptor_key_or_value_not_utf8_is_refused_never_an_error() {
    let dir = DataDir::new();
    let domains = format!(
        "{API}      - key: zero
        rate_limit: {{ unit: year, requests_per_unit: 0 }}
  - domain: closed
    outage: fail_closed
    descriptors:
      - key: user
        rate_limit: {{ unit: year, requests_per_unit: 5 }}
"
    );
    let policy = policy(&dir.0, &domains);
    let sluice = Sluice::spawn(&[
        "--config",
        &policy,
        "--rls",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--data-dir",
        dir.arg(),
    ]);
    let addr = sluice.start.rls.expect("rls");
    let mut conn = grpc::connect(addr).await;
    let latin1: &[u8] = b"caf\xe9";
    let one = |key: &'static [u8], value: &'static [u8]| vec![(key, value)];
    let cases = [
        ("api", vec![one(b"zero", latin1)]),
        ("closed", vec![one(b"user", latin1)]),
        ("api", vec![one(b"\xffuser", b"ada")]),
        ("api", vec![one(b"user", b"ada"), one(b"user", latin1)]),
        ("nowhere", vec![one(b"user", latin1)]),
    ];
    for (domain, descriptors) in cases {
        let outcome = grpc::call(&mut conn, addr, grpc::request(domain, descriptors)).await;
        assert_eq!(
            outcome,
            Ok(grpc::Outcome {
                status: grpc::OK,
                overall: Some(grpc::OVER_LIMIT)
            }),
            "domain {domain}"
        );
    }
    // A valid request is decided as before; the refused one spent nothing.
    let answers = ask(
        &sluice,
        json!([
            request("api", &[&[("zero", "x")]]),
            request("api", &[&[("user", "ada")]]),
        ]),
    )
    .await;
    assert_eq!(answers[0]["overall"], "OVER_LIMIT", "a rule of 0");
    assert_eq!(answers[1]["overall"], "OK");
    assert_eq!(answers[1]["statuses"][0]["remaining"], 4, "nothing spent");
    assert_eq!(
        metric(&sluice, "sluice_rls_refused_total{reason=\"not_utf8\"}").await,
        Some(5.0)
    );
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    for (domain, n) in [("api", 3), ("closed", 1), ("unknown", 1)] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("sluice_rls_requests_total")
                    && l.contains(&format!("domain=\"{domain}\""))
                    && l.contains("code=\"over_limit\"")
                    && l.contains("outcome=\"not_utf8\"")
                    && l.ends_with(&format!(" {n}"))),
            "{domain}: {metrics}"
        );
    }
    let refusal = |l: &str| {
        serde_json::from_str::<Value>(l)
            .is_ok_and(|l| l["target"] == "sluice::refusal" && l["reason"] == "not_utf8")
    };
    let log = sluice.stderr_with(5, refusal).await;
    assert_eq!(log.lines().filter(|l| refusal(l)).count(), 5, "{log}");
}

/// gRPC over hyper's HTTP/2 client, by hand: what the Python client cannot do
/// — send part of a message and then nothing, time one connection's calls
/// against another's, or hold a connection open.
mod grpc {
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use http_body_util::BodyExt as _;
    use hyper::body::{Body, Frame};
    use hyper::client::conn::http2::SendRequest;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::sync::mpsc;

    const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    /// gRPC's status codes the tests read.
    pub(super) const OK: u32 = 0;
    pub(super) const DEADLINE_EXCEEDED: u32 = 4;
    /// `overall_code` OVER_LIMIT.
    pub(super) const OVER_LIMIT: u64 = 2;
    pub(super) const RESOURCE_EXHAUSTED: u32 = 8;

    /// A request body sent as the test says: what is sent on the channel,
    /// ended when the sender is dropped.
    pub(super) struct Channel(mpsc::UnboundedReceiver<Bytes>);

    impl Body for Channel {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            self.0
                .poll_recv(cx)
                .map(|data| data.map(|d| Ok(Frame::data(d))))
        }
    }

    /// An HTTP/2 connection to `addr` from `local` (an address of the
    /// machine's, `None` for any).
    pub(super) async fn connect_from(
        addr: SocketAddr,
        local: Option<std::net::IpAddr>,
    ) -> std::io::Result<SendRequest<Channel>> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        if let Some(ip) = local {
            socket.bind(SocketAddr::new(ip, 0))?;
        }
        let stream = socket.connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(connection);
        Ok(sender)
    }

    /// An HTTP/2 connection to `addr`.
    pub(super) async fn connect(addr: SocketAddr) -> SendRequest<Channel> {
        connect_from(addr, None).await.expect("connect")
    }

    /// A call's outcome: its gRPC status and, when OK, the answer's
    /// `overall_code` (1 OK, 2 OVER_LIMIT).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) struct Outcome {
        pub(super) status: u32,
        pub(super) overall: Option<u64>,
    }

    /// Starts a call on `sender` whose body begins with `first`; with `end`,
    /// that is all of it, else the body stays open (the returned sender) until
    /// dropped. Resolves to the call's outcome.
    pub(super) fn start(
        sender: &mut SendRequest<Channel>,
        addr: SocketAddr,
        first: Bytes,
        end: bool,
    ) -> (
        Option<mpsc::UnboundedSender<Bytes>>,
        impl Future<Output = Result<Outcome, String>> + Send + 'static,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(first);
        let request = http::Request::post(format!("http://{addr}{PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Channel(rx))
            .expect("request");
        let sent = sender.send_request(request);
        let outcome = async move {
            let response = sent.await.map_err(|e| e.to_string())?;
            let from_head = grpc_status(response.headers());
            let collected = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            let status = from_head
                .or_else(|| collected.trailers().and_then(grpc_status))
                .ok_or("no grpc-status")?;
            let message = collected.to_bytes();
            Ok(Outcome {
                status,
                overall: message.get(5..).and_then(overall_code),
            })
        };
        ((!end).then_some(tx), outcome)
    }

    /// One whole call; its outcome.
    pub(super) async fn call(
        sender: &mut SendRequest<Channel>,
        addr: SocketAddr,
        message: Bytes,
    ) -> Result<Outcome, String> {
        start(sender, addr, message, true).1.await
    }

    fn grpc_status(headers: &http::HeaderMap) -> Option<u32> {
        headers.get("grpc-status")?.to_str().ok()?.parse().ok()
    }

    /// Field 1 of a `RateLimitResponse`.
    fn overall_code(message: &[u8]) -> Option<u64> {
        let (&key, rest) = message.split_first()?;
        (key == 0x08).then(|| rest.first().map(|&v| u64::from(v)))?
    }

    fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    fn field(out: &mut Vec<u8>, number: u64, bytes: &[u8]) {
        varint(out, (number << 3) | 2);
        varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    /// A `RateLimitRequest` of `domain` and `descriptors` (each a list of
    /// key and value), framed as gRPC sends it.
    pub(super) fn request<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        domain: &str,
        descriptors: impl IntoIterator<Item = Vec<(K, V)>>,
    ) -> Bytes {
        let mut message = Vec::new();
        field(&mut message, 1, domain.as_bytes());
        let (mut descriptor, mut entry) = (Vec::new(), Vec::new());
        for entries in descriptors {
            descriptor.clear();
            for (key, value) in entries {
                entry.clear();
                field(&mut entry, 1, key.as_ref());
                field(&mut entry, 2, value.as_ref());
                field(&mut descriptor, 1, &entry);
            }
            field(&mut message, 2, &descriptor);
        }
        framed(&message, message.len())
    }

    /// `message` behind gRPC's prefix saying it is `len` bytes long.
    pub(super) fn framed(message: &[u8], len: usize) -> Bytes {
        let mut out = Vec::with_capacity(5 + message.len());
        out.push(0);
        out.extend_from_slice(&u32::try_from(len).expect("a u32").to_be_bytes());
        out.extend_from_slice(message);
        Bytes::from(out)
    }
}

/// R1 bounds: a request of 250,000 distinct descriptors of one rule (a 4 MiB
/// message; the quadratic look for shared counters took seconds) is refused
/// within 1 s, counted on the wire before anything is decoded or matched,
/// while another connection on the same thread is answered within 50 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_bounds_250000_descriptors_are_refused_at_once_while_another_connection_is_served() {
    let dir = DataDir::new();
    let policy = policy(&dir.0, API);
    // One thread: both connections on it.
    let sluice = Sluice::spawn(&[
        "--config",
        &policy,
        "--rls",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--data-dir",
        dir.arg(),
    ]);
    let addr = sluice.start.rls.expect("rls");
    let big = grpc::request(
        "api",
        (0..250_000).map(|i| vec![("user".to_owned(), format!("{i:x}"))]),
    );
    assert!(
        big.len() > 3_000_000 && big.len() <= 4 * 1024 * 1024 + 5,
        "{}",
        big.len()
    );
    let small = grpc::request("api", [vec![("burst", "b")]]);
    let mut other = grpc::connect(addr).await;
    let warm = grpc::call(&mut other, addr, small.clone()).await;
    assert_eq!(warm.map(|o| o.status), Ok(grpc::OK));

    let mut heavy = grpc::connect(addr).await;
    let started = std::time::Instant::now();
    let (_, refused) = grpc::start(&mut heavy, addr, big, true);
    let refused = tokio::spawn(async move { (refused.await, started.elapsed()) });
    let mut latencies = Vec::new();
    while !refused.is_finished() || latencies.len() < 5 {
        let asked = std::time::Instant::now();
        let answer = grpc::call(&mut other, addr, small.clone()).await;
        latencies.push(asked.elapsed());
        assert_eq!(answer.map(|o| o.status), Ok(grpc::OK));
        if started.elapsed() > std::time::Duration::from_secs(10) {
            break;
        }
    }
    let (outcome, took) = refused.await.expect("the heavy call");
    assert_eq!(
        outcome.map(|o| o.status),
        Ok(grpc::RESOURCE_EXHAUSTED),
        "past 1,024 descriptors"
    );
    assert!(
        took < std::time::Duration::from_secs(1),
        "refused within 1 s: {took:?}"
    );
    let slowest = latencies.iter().max().copied().unwrap_or_default();
    assert!(
        slowest < std::time::Duration::from_millis(50),
        "the other connection's calls meanwhile: {latencies:?}"
    );
}

/// The value of the metric line `name` (with its labels) on `sluice`'s admin
/// listener.
async fn metric(sluice: &Sluice, name: &str) -> Option<f64> {
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// R1 bounds: two connections of 256 calls each, every call sending most of
/// a 4 MiB message and then nothing (which held 1.74 GB and never let go).
/// Each connection's unfinished messages hold at most 8 MiB: its other calls
/// are refused `RESOURCE_EXHAUSTED` at once, the bytes held (a gauge) and the
/// process's resident memory stay within the documented bound, another
/// connection is served meanwhile, and the held calls are refused
/// `DEADLINE_EXCEEDED` once their 10 s are up, releasing everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_bounds_unfinished_messages_hold_at_most_their_bound_and_are_reset_when_overdue() {
    const STREAMS: usize = 256;
    const PER_CONNECTION: f64 = 8.0 * 1024.0 * 1024.0;
    let dir = DataDir::new();
    let policy = policy(&dir.0, API);
    let sluice = rls_server(&policy, ["--data-dir", dir.arg()]);
    let addr = sluice.start.rls.expect("rls");
    let small = grpc::request("api", [vec![("burst", "b")]]);
    let mut other = grpc::connect(addr).await;
    for _ in 0..20 {
        let warm = grpc::call(&mut other, addr, small.clone()).await;
        assert_eq!(warm.map(|o| o.status), Ok(grpc::OK));
    }
    let before = sluice.rss_kib();

    // Most of a message of 4,000,000 bytes: its prefix and 3,900,000 of them.
    let most = grpc::framed(&vec![0x0a_u8; 3_900_000], 4_000_000);
    let (done, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut connection = grpc::connect(addr).await;
        for _ in 0..STREAMS {
            let (body, outcome) = grpc::start(&mut connection, addr, most.clone(), false);
            open.push(body);
            let done = done.clone();
            tokio::spawn(async move {
                let _ = done.send(outcome.await);
            });
        }
        open.push(None);
        std::mem::forget(connection);
    }
    // The calls past each connection's bound are refused at once.
    let mut statuses = Vec::new();
    let refused_by = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while statuses.len() < 2 * (STREAMS - 2) {
        let left = refused_by.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, outcomes.recv()).await {
            Ok(Some(outcome)) => statuses.push(outcome.map(|o| o.status)),
            _ => panic!("{} of the calls answered in 30 s", statuses.len()),
        }
    }
    assert!(
        statuses.iter().all(|s| *s == Ok(grpc::RESOURCE_EXHAUSTED)),
        "{statuses:?}"
    );
    // What is held: a few whole messages' worth, not 512.
    let held = metric(&sluice, "sluice_rls_unfinished_bytes")
        .await
        .expect("the gauge");
    assert!(
        held > 0.0 && held <= 2.0 * PER_CONNECTION,
        "held {held} bytes"
    );
    let grown = sluice.rss_kib().saturating_sub(before);
    assert!(
        grown < 64 * 1024,
        "resident memory grew {grown} KiB (bound: 2 x 8 MiB held, 2 x 1 MiB windows)"
    );
    let served = grpc::call(&mut other, addr, small.clone()).await;
    assert_eq!(
        served.map(|o| o.status),
        Ok(grpc::OK),
        "another connection served"
    );
    // The held ones are refused once their 10 s are up, and let go.
    let overdue_by = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while statuses.len() < 2 * STREAMS {
        let left = overdue_by.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, outcomes.recv()).await {
            Ok(Some(outcome)) => statuses.push(outcome.map(|o| o.status)),
            _ => panic!("{} of the calls answered", statuses.len()),
        }
    }
    let overdue = statuses
        .iter()
        .filter(|s| **s == Ok(grpc::DEADLINE_EXCEEDED))
        .count();
    assert_eq!(overdue, 4, "two held on each connection: {statuses:?}");
    assert_eq!(
        metric(&sluice, "sluice_rls_unfinished_bytes").await,
        Some(0.0),
        "everything released"
    );
    drop(open);
}

/// Whether the listener at `addr` serves a connection from `local`: for the
/// rate-limit service, an HTTP/2 handshake and a health check; for the check
/// listener, one HTTP/1.1 request answered. The connection is returned open.
async fn served_from(
    addr: std::net::SocketAddr,
    local: std::net::IpAddr,
    http2: bool,
) -> Option<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind(std::net::SocketAddr::new(local, 0)).ok()?;
    let mut stream = socket.connect(addr).await.ok()?;
    let hello: &[u8] = if http2 {
        // The preface and an empty SETTINGS frame: a served connection answers
        // with its own SETTINGS.
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0"
    } else {
        b"GET /check HTTP/1.1\r\nHost: x\r\nX-Original-Method: GET\r\nX-Original-URI: /\r\n\r\n"
    };
    stream.write_all(hello).await.ok()?;
    let mut first = [0_u8; 9];
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_exact(&mut first),
    )
    .await;
    matches!(read, Ok(Ok(_))).then_some(stream)
}

/// R1, R2 and E4 bounds: one address holds at most `--max-connections-per-ip`
/// connections on the rate-limit service and on the check listener (1,030
/// from one address locked every Envoy out): past it a new one is closed at
/// once, another address is still served, one closing frees a place, and a
/// trusted proxy is not bounded.
#[tokio::test]
async fn r1_r2_one_address_holds_at_most_its_connections_on_the_rls_and_check_listeners() {
    let dir = DataDir::new();
    let path = policy(&dir.0, API);
    let text = std::fs::read_to_string(&path).expect("policy");
    std::fs::write(
        &path,
        text.edit("trusted_proxies: []", "trusted_proxies: [127.0.0.3/32]"),
    )
    .expect("policy");
    let sluice = Sluice::spawn(&[
        "--config",
        &path,
        "--rls",
        "127.0.0.1:0",
        "--check",
        "127.0.0.1:0",
        "--max-connections-per-ip",
        "3",
        "--data-dir",
        dir.arg(),
    ]);
    let (one, other, proxy): (std::net::IpAddr, std::net::IpAddr, std::net::IpAddr) = (
        [127, 0, 0, 1].into(),
        [127, 0, 0, 2].into(),
        [127, 0, 0, 3].into(),
    );
    for (addr, http2) in [
        (sluice.start.rls.expect("rls"), true),
        (sluice.start.check.expect("check"), false),
    ] {
        let mut held = Vec::new();
        for n in 1..=3 {
            held.push(
                served_from(addr, one, http2)
                    .await
                    .unwrap_or_else(|| panic!("connection {n} of 3 served ({addr})")),
            );
        }
        assert!(
            served_from(addr, one, http2).await.is_none(),
            "a 4th from one address is closed ({addr})"
        );
        assert!(
            served_from(addr, other, http2).await.is_some(),
            "another address is served ({addr})"
        );
        let proxies = served_together(addr, proxy, http2, 5).await;
        assert_eq!(proxies, 5, "a trusted proxy is not bounded ({addr})");
        drop(held.pop());
        let mut freed = false;
        for _ in 0..100 {
            if served_from(addr, one, http2).await.is_some() {
                freed = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(freed, "a closed connection frees its place ({addr})");
    }
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    for listener in ["sluice-rls", "sluice-check"] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("sluice_connections_refused_total")
                    && l.contains(&format!("listener=\"{listener}\""))
                    && l.contains("reason=\"per_ip\"")),
            "{listener}: {metrics}"
        );
    }
}

/// How many of `n` connections from `local`, held open together, are served.
async fn served_together(
    addr: std::net::SocketAddr,
    local: std::net::IpAddr,
    http2: bool,
    n: usize,
) -> usize {
    let mut open = Vec::new();
    for _ in 0..n {
        if let Some(stream) = served_from(addr, local, http2).await {
            open.push(stream);
        }
    }
    open.len()
}
