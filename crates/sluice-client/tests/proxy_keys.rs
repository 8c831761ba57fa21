//! SPEC S4 over loopback: a provider's key goes to that provider's origin and
//! nowhere else. `sluice pace` answers a redirect to another origin as it came
//! (status and `Location`) and follows one within the origin, with the key;
//! a path that could leave the provider's base path (`..` in any spelling, an
//! encoded slash) is 400 and sent nowhere; a middleware client built with
//! `same_origin_redirects` does the same. The providers are loopback servers
//! that record every request they get.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use sluice_client::proxy::{ProxyOptions, ProxyServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as an upstream saw it.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What an upstream answers to a request, given its own address.
type Answer = dyn Fn(&Seen, SocketAddr) -> String + Send + Sync;

/// A loopback HTTP/1.1 server on a port of its own (an origin of its own)
/// that records each request and answers it with `answer`, one request per
/// connection.
struct Upstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Upstream {
    async fn start(answer: impl Fn(&Seen, SocketAddr) -> String + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let answer: Arc<Answer> = Arc::new(answer);
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (log, answer) = (log.clone(), answer.clone());
                tokio::spawn(async move {
                    read_request(conn, addr, &*answer, &log).await;
                });
            }
        });
        Upstream { addr, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Reads one request, records it in `log` and only then answers it, so a
/// client that has its answer finds the request already recorded.
async fn read_request(
    mut conn: TcpStream,
    own: SocketAddr,
    answer: &Answer,
    log: &Mutex<Vec<Seen>>,
) -> Option<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let path = lines.next()?.split(' ').nth(1)?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map_or(0, |(_, v)| v.parse().unwrap());
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < length {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let req = Seen {
        path,
        headers,
        body,
    };
    let reply = answer(&req, own);
    log.lock().unwrap().push(req);
    let _ = conn.write_all(reply.as_bytes()).await;
    let _ = conn.shutdown().await;
    Some(())
}

fn ok(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

fn redirect(status: u16, location: &str) -> String {
    format!(
        "HTTP/1.1 {status} Moved\r\nlocation: {location}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
}

/// The key header of each provider in [`config`], and its value.
const KEYS: [(&str, &str, &str); 4] = [
    ("oa", "authorization", "Bearer sk-openai-secret"),
    ("an", "x-api-key", "sk-ant-secret"),
    ("az", "api-key", "az-secret"),
    ("gg", "x-goog-api-key", "goog-secret"),
];

/// Four providers on `upstream`, one per key style: `Authorization: Bearer`
/// (openai), `x-api-key` (anthropic) and two `authHeader`s of the config.
fn config(upstream: SocketAddr) -> String {
    let limits = "rateLimits: { tpm: 1000000, rpm: 0, rpd: 0 }";
    format!(
        "providers:
  oa:
    baseUrl: http://{upstream}/v1
    style: openai
    apiKey: sk-openai-secret
    {limits}
  an:
    baseUrl: http://{upstream}
    style: anthropic
    apiKey: sk-ant-secret
    {limits}
  az:
    baseUrl: http://{upstream}/v1
    authHeader: api-key
    apiKey: az-secret
    {limits}
  gg:
    baseUrl: http://{upstream}/v1
    authHeader: x-goog-api-key
    apiKey: goog-secret
    {limits}
"
    )
}

/// `sluice pace` on a free port with `yaml`.
async fn pace(name: &str, yaml: &str) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let dir = support::temp_dir(name);
    let file = dir.join("pace.yaml");
    std::fs::write(&file, yaml).unwrap();
    let server = ProxyServer::bind(ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    let listen = server.bound().listen;
    let serving = tokio::spawn(async move {
        let _ = server.serve().await;
    });
    (listen, serving)
}

fn chat() -> Value {
    json!({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5})
}

/// A client that follows no redirect itself, to see what the proxy answers.
fn sdk() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// Where a provider sends each path: another port, the same port under
/// another name, the same host and port in another scheme — each another
/// origin.
fn elsewhere(path: &str, own: SocketAddr, other: SocketAddr) -> Option<(u16, String)> {
    let port = own.port();
    match path.rsplit('/').next()? {
        "to-port" => Some((307, format!("http://{other}/v1/echo"))),
        "to-name" => Some((308, format!("http://localhost:{port}/v1/echo"))),
        "to-https" => Some((302, format!("https://127.0.0.1:{port}/v1/echo"))),
        "to-other" => Some((301, format!("http://{other}/v1/echo"))),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_redirect_to_another_origin_is_answered_as_it_came_and_no_key_leaves() {
    let other = Upstream::start(|_, _| ok(r#"{"took":"the key"}"#)).await;
    let other_addr = other.addr;
    let provider = Upstream::start(
        move |req, own| match elsewhere(&req.path, own, other_addr) {
            Some((status, location)) => redirect(status, &location),
            None => ok("{}"),
        },
    )
    .await;
    let (proxy, serving) = pace("redirect-away", &config(provider.addr)).await;
    let client = sdk();
    let mut sent = 0;
    for (name, header, key) in KEYS {
        for hop in ["to-port", "to-name", "to-https", "to-other"] {
            let r = client
                .post(format!("http://{proxy}/{name}/v1/{hop}"))
                .json(&chat())
                .send()
                .await
                .unwrap();
            sent += 1;
            let (status, location) = elsewhere(hop, provider.addr, other.addr).unwrap();
            assert_eq!(
                r.status().as_u16(),
                status,
                "{name} {hop}: not answered as it came"
            );
            assert_eq!(r.headers()["location"], location.as_str(), "{name} {hop}");
            let seen = provider.seen();
            assert_eq!(
                seen.len(),
                sent,
                "{name} {hop}: followed to the provider's port"
            );
            let last = seen.last().unwrap();
            assert_eq!(
                last.header(header),
                Some(key),
                "{name}: the provider had its key"
            );
        }
    }
    let leaked = other.seen();
    for req in &leaked {
        for (_, header, _) in KEYS {
            assert_eq!(req.header(header), None, "{header} went to another origin");
        }
    }
    assert!(leaked.is_empty(), "another origin was sent {leaked:?}");
    serving.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_redirect_within_the_providers_origin_is_followed_with_its_key() {
    let provider = Upstream::start(|req, own| match req.path.rsplit('/').next() {
        Some("old") => redirect(307, "/v1/new"),
        Some("absolute") => redirect(308, &format!("http://{own}/v1/new")),
        Some("loop") => redirect(307, "/v1/loop"),
        _ => ok(&format!(r#"{{"bytes":{}}}"#, req.body.len())),
    })
    .await;
    let (proxy, serving) = pace("redirect-home", &config(provider.addr)).await;
    let client = sdk();
    let body = chat().to_string();
    for (name, header, key) in [KEYS[0], KEYS[1]] {
        for hop in ["old", "absolute"] {
            let before = provider.seen().len();
            let r = client
                .post(format!("http://{proxy}/{name}/v1/{hop}"))
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{name} {hop}");
            let j: Value = r.json().await.unwrap();
            assert_eq!(j["bytes"], body.len(), "the body went along");
            let seen = provider.seen();
            assert_eq!(seen.len(), before + 2, "{name} {hop}");
            for req in &seen[before..] {
                assert_eq!(
                    req.header(header),
                    Some(key),
                    "{name} {} lost its key",
                    req.path
                );
            }
            assert!(seen[before + 1].path.ends_with("/v1/new"));
        }
    }
    // A loop is followed MAX_REDIRECTS times; the next redirect is the answer.
    let before = provider.seen().len();
    let r = client
        .post(format!("http://{proxy}/oa/v1/loop"))
        .json(&chat())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 307);
    assert_eq!(r.headers()["location"], "/v1/loop");
    assert_eq!(
        provider.seen().len() - before,
        sluice_client::MAX_REDIRECTS + 1
    );
    serving.abort();
}

/// `POST path` over a raw connection (an HTTP client would resolve the dots
/// before sending): the status and the body.
async fn raw_post(proxy: SocketAddr, path: &str) -> (u16, String) {
    let body = chat().to_string();
    let mut conn = TcpStream::connect(proxy).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: {proxy}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_path_that_leaves_the_providers_base_is_400_and_sent_nowhere() {
    let provider = Upstream::start(|_, _| ok("{}")).await;
    let (proxy, serving) = pace("paths", &config(provider.addr)).await;
    for path in [
        "/oa/../an/v1/echo",
        "/oa/./v1/echo",
        "/oa/v1/..",
        "/oa/%2e%2e/an/v1/echo",
        "/oa/%2E%2E/an/v1/echo",
        "/oa/%2e%2E/an/v1/echo",
        "/oa/.%2e/an/v1/echo",
        "/oa/%2e./an/v1/echo",
        "/oa/%2e/v1/echo",
        "/oa/%252e%252e/an/v1/echo",
        "/oa/..;/an/v1/echo",
        "/oa/..;x=1/an/v1/echo",
        "/oa//../an/v1/echo",
        "/oa/v1%2f..%2f..%2fan/v1/echo",
        "/oa/v1%2F..%2F..%2Fan/v1/echo",
        "/oa/v1%5c..%5c..%5can/v1/echo",
        "/oa/%ef%bc%8e%ef%bc%8e/an/v1/echo",
        "/oa/%c0%ae%c0%ae/an/v1/echo",
        "/../oa/v1/echo",
        "/an/v1/../../oa/v1/echo",
    ] {
        let (status, text) = raw_post(proxy, path).await;
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains("\"invalid_path\""), "{path}: {text}");
        assert!(provider.seen().is_empty(), "{path} was forwarded");
    }
    let (status, _) = raw_post(proxy, "/oa/..\\an/v1/echo").await;
    assert_eq!(status, 400, "a backslash");
    assert!(provider.seen().is_empty(), "a backslash was forwarded");
    // The same connection shape with a plain path is forwarded, with its key.
    let (status, text) = raw_post(proxy, "/oa/v1/chat/completions").await;
    assert_eq!(status, 200, "{text}");
    let seen = provider.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/v1/chat/completions");
    assert_eq!(
        seen[0].header("authorization"),
        Some("Bearer sk-openai-secret")
    );
    serving.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_m4_the_middleware_under_same_origin_redirects_keeps_its_key_home() {
    use sluice_client::config::{ApiKey, ApiStyle, PaceConfig, ProviderConfig, ProviderLimits};
    use sluice_client::{Pacer, PacerMiddleware};

    let other = Upstream::start(|_, _| ok("{}")).await;
    let other_addr = other.addr;
    let provider = Upstream::start(move |req, own| match req.path.rsplit('/').next() {
        Some("old") => redirect(307, &format!("http://{own}/v1/new")),
        _ => match elsewhere(&req.path, own, other_addr) {
            Some((status, location)) => redirect(status, &location),
            None => ok("{}"),
        },
    })
    .await;
    let limits = ProviderLimits::new(1_000_000, 0, 0);
    let mut p = ProviderConfig::new("an", &format!("http://{}", provider.addr), limits)
        .with_api_keys([ApiKey::new("team-a", "sk-ant-secret", limits)]);
    p.style = ApiStyle::Anthropic;
    p.auth_header = http::HeaderName::from_static("x-api-key");
    let pacer = Pacer::from_config(PaceConfig::from_providers([p]));
    let http = reqwest::Client::builder()
        .redirect(sluice_client::same_origin_redirects())
        .build()
        .unwrap();
    let client = reqwest_middleware::ClientBuilder::new(http)
        .with(PacerMiddleware::new(pacer, "an"))
        .build();
    let base = format!("http://{}", provider.addr);
    for hop in ["to-port", "to-name", "to-https"] {
        let r = client
            .post(format!("{base}/v1/{hop}"))
            .body(chat().to_string())
            .send()
            .await
            .unwrap();
        let (status, location) = elsewhere(hop, provider.addr, other.addr).unwrap();
        assert_eq!(r.status().as_u16(), status, "{hop}");
        assert_eq!(r.headers()["location"], location.as_str(), "{hop}");
    }
    assert!(other.seen().is_empty(), "another origin was sent a request");
    assert_eq!(
        provider.seen().len(),
        3,
        "a redirect was followed to the provider"
    );
    let r = client
        .post(format!("{base}/v1/old"))
        .body(chat().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await;
    let seen = provider.seen();
    assert_eq!(seen.len(), 5);
    for req in &seen {
        assert_eq!(
            req.header("x-api-key"),
            Some("sk-ant-secret"),
            "{}",
            req.path
        );
    }
}
