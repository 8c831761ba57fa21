//! R2, the forward-auth endpoint (`sluice serve --check ADDR`): the requests that
//! nginx's `auth_request`, Traefik's ForwardAuth and Caddy's `forward_auth` hold are
//! decided by the gateway's policy and budgets; asked directly over loopback, then
//! through a real nginx (Debian's package) with the configuration sluice documents
//! (`examples/nginx/sluice.conf`, included unchanged).

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::{DataDir, Reply, Sluice, send};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

/// The built-in policy with the longest window (no run can straddle one), a per-IP
/// ceiling of 40, and loopback trusted as a proxy (nginx and the tests ask from it).
fn policy(dir: &Path) -> String {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit(
            "window_seconds: 60\nprofiles",
            "window_seconds: 4294967295\nprofiles",
        )
        .edit(
            "ip_ceilings: { ip: 300, ip_protocol: 1200 }",
            "ip_ceilings: { ip: 40, ip_protocol: 1200 }",
        )
        .edit("trusted_proxies: []", "trusted_proxies: [127.0.0.1/32]");
    std::fs::create_dir_all(dir).expect("test directory");
    let path = dir.join("check.yaml");
    std::fs::write(&path, yaml).expect("write policy");
    path.to_str().expect("utf-8 path").to_owned()
}

fn spawn(dir: &DataDir) -> Sluice {
    let policy = policy(&dir.0);
    Sluice::spawn(&["--config", &policy, "--check", "127.0.0.1:0"])
}

/// A check request as Traefik or Caddy sends it (`X-Forwarded-*`).
async fn forwarded(sluice: &Sluice, method: &str, uri: &str, key: &str, client: &str) -> Reply {
    send(
        Request::get(sluice.check_url("/check"))
            .header("x-forwarded-method", method)
            .header("x-forwarded-uri", uri)
            .header("x-forwarded-for", client)
            .header("x-api-key", key)
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
}

/// A check request as the documented nginx configuration sends it.
async fn nginx_style(sluice: &Sluice, method: &str, uri: &str, key: &str, client: &str) -> Reply {
    send(
        Request::get(sluice.check_url("/check"))
            .header("x-original-method", method)
            .header("x-original-uri", uri)
            .header("x-forwarded-for", client)
            .header("x-api-key", key)
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
}

fn remaining(reply: &Reply) -> Option<u32> {
    reply.header("x-ratelimit-remaining")?.parse().ok()
}

#[tokio::test]
async fn r2_the_check_endpoint_decides_with_the_gateways_policy_and_budgets() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    // The expensive class, 30 per caller: admitted with X-RateLimit-*, then 429.
    for left in (0..30).rev() {
        let r = forwarded(&sluice, "POST", "/chats", "sk-a", "198.51.100.1").await;
        assert_eq!(r.status, 204, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-limit"), Some("30"));
        assert_eq!(remaining(&r), Some(left));
    }
    let refused = forwarded(&sluice, "POST", "/chats", "sk-a", "198.51.100.1").await;
    assert_eq!(refused.status, 429, "Traefik and Caddy pass the 429 on");
    assert!(refused.header("retry-after").is_some());
    assert_eq!(
        refused.text(),
        "Too many requests, please try again later.",
        "the body sluice's proxy gives (the seed's, for this class)"
    );
    // One set of budgets with the gateway: calls through sluice's own proxy and
    // through the check endpoint spend the same count.
    for _ in 0..10 {
        let r = send(
            Request::post(sluice.url("/chats"))
                .header("x-api-key", "sk-b")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{}")))
                .expect("request"),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = forwarded(&sluice, "POST", "/chats", "sk-b", "198.51.100.2").await;
    assert_eq!(
        remaining(&r),
        Some(19),
        "10 spent through the gateway, 1 here"
    );
    // A read is a read: the class comes from the original's method and path, so
    // sk-a, out of expensive calls, may still read (its address's ceiling of 40
    // has 9 left after its 31 asks).
    let r = forwarded(&sluice, "GET", "/chats/7?x=1", "sk-a", "198.51.100.1").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit"), Some("40"));
    assert_eq!(remaining(&r), Some(9));
}

/// A check request's head of `len` bytes in all, padded with an `X-Pad` field, sent
/// on a connection of its own; the status of the answer.
async fn check_with_head_of(check: std::net::SocketAddr, len: usize) -> String {
    let start = "GET /check HTTP/1.1\r\nHost: a\r\nX-Forwarded-Method: POST\r\n\
                 X-Forwarded-Uri: /chats\r\nX-Forwarded-For: 198.51.100.9\r\n\
                 X-Api-Key: sk-head\r\nConnection: close\r\nX-Pad: ";
    let end = "\r\n\r\n";
    let pad = len - start.len() - end.len();
    let head = format!("{start}{}{end}", "A".repeat(pad));
    assert_eq!(head.len(), len);
    let mut stream = tokio::net::TcpStream::connect(check)
        .await
        .expect("connect to the check listener");
    // Answered and closed before all of it is read, the write may fail.
    let _ = stream.write_all(head.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    answer.get(9..12).unwrap_or("none").to_owned()
}

/// R2 with the gateway's bound on a request head: a check request's head of
/// 64 KiB (65,536 bytes) is decided, one byte more is 431, and so is one that
/// arrives in a few reads well past the bound (hyper's buffer cap alone let
/// those through).
#[tokio::test]
async fn r2_a_check_request_head_past_64_kib_is_refused_431() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    let check = sluice.start.check.expect("check listener");
    assert_eq!(check_with_head_of(check, 65_536).await, "204");
    assert_eq!(check_with_head_of(check, 65_537).await, "431");
    assert_eq!(check_with_head_of(check, 100_000).await, "431");
}

#[tokio::test]
async fn r2_the_client_address_is_read_through_the_trusted_proxy() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    // Two callers behind one client address share its ceiling of 40.
    for key in ["sk-c1", "sk-c2"] {
        for _ in 0..20 {
            let r = forwarded(&sluice, "POST", "/chats", key, "203.0.113.9").await;
            assert_eq!(r.status, 204, "{}", r.text());
        }
    }
    let refused = forwarded(&sluice, "POST", "/chats", "sk-c3", "203.0.113.9").await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(
        refused.header("x-ratelimit-limit"),
        Some("40"),
        "the per-IP ceiling"
    );
    // Another client address is not held by it.
    let other = forwarded(&sluice, "POST", "/chats", "sk-c3", "203.0.113.10").await;
    assert_eq!(other.status, 204, "{}", other.text());
}

#[tokio::test]
async fn r2_routes_that_need_the_body_or_a_lane_are_refused_never_decided_cheaper() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    for (method, uri, reason) in [
        ("POST", "/mcp", "needs_body"),
        ("POST", "/messages/optimize/batch", "needs_body"),
        ("POST", "/search/query", "needs_body"),
        ("POST", "/messages/optimize", "needs_proxy"),
        ("GET", "/messages/optimize/batches/b1", "needs_proxy"),
    ] {
        let r = forwarded(&sluice, method, uri, "sk-d", "198.51.100.4").await;
        assert_eq!(r.status, 429, "{method} {uri}: {}", r.text());
        assert_eq!(
            r.json()["error"]["details"]["reason"],
            reason,
            "{method} {uri}"
        );
        let r = nginx_style(&sluice, method, uri, "sk-d", "198.51.100.4").await;
        assert_eq!(r.status, 403, "{method} {uri}: nginx hears 403");
        assert_eq!(r.header("x-sluice-status"), Some("429"));
    }
    // `sluice check` names them.
    let out = Command::new(support::binary())
        .args(["check", &policy(&dir.0)])
        .output()
        .expect("sluice check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("not served by --check: POST /mcp (needs_body)"),
        "{text}"
    );
    assert!(
        text.contains("POST /messages/optimize (needs_proxy)"),
        "{text}"
    );
}

#[tokio::test]
async fn r2_a_check_request_that_names_no_original_or_a_bad_one_is_refused() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    let none = send(
        Request::get(sluice.check_url("/check"))
            .header("x-api-key", "sk-e")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(none.status, 403);
    assert_eq!(none.header("x-sluice-status"), Some("400"));
    assert_eq!(
        none.json()["error"]["details"]["reason"],
        "no_original_request"
    );
    for (method, uri) in [
        ("POST", "http://elsewhere/chats"),
        ("POST", "chats"),
        ("P OST", "/chats"),
        ("POST", "/chats/%2e%2e/%2e%2e/admin"),
    ] {
        let r = forwarded(&sluice, method, uri, "sk-e", "198.51.100.5").await;
        assert!(
            r.status == 400 || r.status == 403,
            "{method} {uri}: {} {}",
            r.status,
            r.text()
        );
    }
    // A client cannot name a cheaper original beside the proxy's: both kinds, or
    // one twice, are refused rather than read.
    let both = send(
        Request::get(sluice.check_url("/check"))
            .header("x-forwarded-method", "POST")
            .header("x-forwarded-uri", "/chats")
            .header("x-original-method", "GET")
            .header("x-original-uri", "/search/fields")
            .header("x-api-key", "sk-e")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(both.status, 403);
    assert_eq!(both.header("x-sluice-status"), Some("400"));
    // Nor a stray field of the other kind beside a whole pair (before, the pair
    // was read and the stray one ignored).
    for (name, value) in [("x-forwarded-method", "GET"), ("x-forwarded-uri", "/x")] {
        let stray = send(
            Request::get(sluice.check_url("/check"))
                .header("x-original-method", "POST")
                .header("x-original-uri", "/chats")
                .header(name, value)
                .header("x-api-key", "sk-e")
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        assert_eq!(stray.status, 403, "{name}: {}", stray.text());
        assert_eq!(stray.header("x-sluice-status"), Some("400"), "{name}");
    }
    let twice = send(
        Request::get(sluice.check_url("/check"))
            .header("x-forwarded-method", "POST")
            .header("x-forwarded-uri", "/search/fields")
            .header("x-forwarded-uri", "/chats")
            .header("x-api-key", "sk-e")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(twice.status, 403, "{}", twice.text());
    let elsewhere = send(
        Request::get(sluice.check_url("/checkout"))
            .header("x-forwarded-method", "GET")
            .header("x-forwarded-uri", "/chats")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(elsewhere.status, 404);
}

/// A real proxy (nginx or Caddy) in front of the demo upstream, asking sluice's
/// check listener; it listens on a Unix socket in a test's directory.
struct Proxy {
    child: Child,
    socket: PathBuf,
}

/// Waits (bounded) for `socket` to appear, saying what `log` holds if it does not.
fn wait_for_socket(socket: &Path, what: &str, log: &Path) {
    let started = Instant::now();
    while !socket.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what} did not start: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Proxy {
    /// Caddy 2 (Debian's package) with `forward_auth` to sluice, as docs/forward-auth.md
    /// shows it.
    fn caddy(dir: &Path, check: std::net::SocketAddr, upstream: &str) -> Proxy {
        let caddy = ["/usr/bin/caddy", "/usr/local/bin/caddy"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("caddy must be installed (scripts/test installs it)");
        let socket = dir.join("caddy.sock");
        let upstream = upstream.trim_start_matches("http://").trim_end_matches('/');
        let conf = format!(
            "{{
    admin off
    auto_https off
}}
http:// {{
    bind unix/{socket}
    route {{
        request_header -X-Sluice-*
        forward_auth {check} {{
            uri /check
            copy_headers X-Sluice-Workspace X-Sluice-User
        }}
        reverse_proxy {upstream}
    }}
}}
",
            socket = socket.display()
        );
        let path = dir.join("Caddyfile");
        std::fs::write(&path, conf).expect("write Caddyfile");
        let log = dir.join("caddy.log");
        let child = Command::new(caddy)
            .args(["run", "--adapter", "caddyfile", "--config"])
            .arg(&path)
            .env("XDG_DATA_HOME", dir)
            .env("XDG_CONFIG_HOME", dir)
            .env("HOME", dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("caddy log"))
            .spawn()
            .expect("start caddy");
        wait_for_socket(&socket, "caddy", &log);
        Proxy { child, socket }
    }

    /// nginx asking sluice through `examples/nginx/sluice.conf`; it takes the client's
    /// address from `X-Real-IP` (the realip module, as behind a load balancer).
    fn nginx(dir: &Path, check: std::net::SocketAddr, upstream: &str) -> Proxy {
        let nginx = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("nginx must be installed (scripts/test installs it)");
        let socket = dir.join("nginx.sock");
        let snippet = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/nginx/sluice.conf"
        );
        let upstream = upstream.trim_start_matches("http://").trim_end_matches('/');
        let d = dir.display();
        let conf = format!(
            "daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    upstream app {{ server {upstream}; }}
    upstream sluice_check {{ server {check}; keepalive 8; keepalive_timeout 9s; }}
    server {{
        listen unix:{socket};
        set_real_ip_from unix:;
        real_ip_header X-Real-IP;
        include {snippet};
    }}
}}
",
            socket = socket.display()
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).expect("write nginx.conf");
        let child = Command::new(nginx)
            .arg("-p")
            .arg(dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-c")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nginx");
        wait_for_socket(&socket, "nginx", &dir.join("error.log"));
        Proxy { child, socket }
    }

    /// One request over a fresh connection: its status line's code and headers.
    async fn request(
        &self,
        method: &str,
        path: &str,
        key: &str,
        client: &str,
    ) -> (u16, Vec<(String, String)>, String) {
        self.request_with(method, path, &[("X-Api-Key", key), ("X-Real-IP", client)])
            .await
    }

    /// One request with these fields over a fresh connection: its status line's code,
    /// headers and body.
    async fn request_with(
        &self,
        method: &str,
        path: &str,
        fields: &[(&str, &str)],
    ) -> (u16, Vec<(String, String)>, String) {
        let mut stream = UnixStream::connect(&self.socket)
            .await
            .expect("connect to the proxy");
        let body = if method.eq_ignore_ascii_case("POST") {
            "{}"
        } else {
            ""
        };
        let fields: String = fields
            .iter()
            .map(|(n, v)| format!("{n}: {v}\r\n"))
            .collect();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: api.example\r\n{fields}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
            .await
            .expect("the proxy answers within 10 s")
            .expect("read");
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {text}"));
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        (status, headers, body.to_owned())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[tokio::test]
async fn r2_through_real_nginx_auth_request_the_classes_and_ceilings_hold() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    let check = sluice.start.check.expect("check listener");
    let nginx = Proxy::nginx(&dir.0, check, &sluice.start.upstream);
    // A caller's expensive class: 30, with X-RateLimit-* on each answer the
    // upstream gave, then the client's 429 with Retry-After.
    for left in (0..30).rev() {
        let (status, headers, body) = nginx.request("POST", "/chats", "sk-n1", "192.0.2.1").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(header(&headers, "x-ratelimit-limit"), Some("30"));
        assert_eq!(
            header(&headers, "x-ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
    }
    let (status, headers, body) = nginx.request("POST", "/chats", "sk-n1", "192.0.2.1").await;
    assert_eq!(status, 429, "the client's answer is 429: {body}");
    let retry: u64 = header(&headers, "retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After reaches the client");
    assert!(retry > 0);
    assert_eq!(header(&headers, "x-ratelimit-remaining"), Some("0"));
    assert!(body.contains("rate_limited"), "the documented body: {body}");
    // The per-IP ceiling of the client's address (nginx's X-Forwarded-For): 10 more
    // from another caller at the same address reach 40, then it refuses.
    for _ in 0..10 {
        let (status, _, body) = nginx.request("POST", "/chats", "sk-n2", "192.0.2.1").await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, headers, _) = nginx.request("POST", "/chats", "sk-n3", "192.0.2.1").await;
    assert_eq!(status, 429);
    assert_eq!(header(&headers, "x-ratelimit-limit"), Some("40"));
    let (status, _, body) = nginx.request("POST", "/chats", "sk-n3", "192.0.2.2").await;
    assert_eq!(status, 200, "another client address: {body}");
    // A route that needs its body is refused, never decided as something cheaper.
    let (status, _, _) = nginx.request("POST", "/mcp", "sk-n4", "192.0.2.3").await;
    assert_eq!(status, 429);
}

#[tokio::test]
async fn r2_through_real_caddy_forward_auth_the_429_reaches_the_client() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    let check = sluice.start.check.expect("check listener");
    let caddy = Proxy::caddy(&dir.0, check, &sluice.start.upstream);
    for _ in 0..30 {
        let (status, _, body) = caddy.request("POST", "/chats", "sk-c1", "192.0.2.9").await;
        assert_eq!(status, 200, "{body}");
    }
    // Caddy answers the client with the check's own refusal: its 429, Retry-After
    // and X-RateLimit-*.
    let (status, headers, body) = caddy.request("POST", "/chats", "sk-c1", "192.0.2.9").await;
    assert_eq!(status, 429, "{body}");
    assert!(header(&headers, "retry-after").is_some_and(|v| v.parse::<u64>().is_ok()));
    assert_eq!(header(&headers, "x-ratelimit-limit"), Some("30"));
    assert_eq!(header(&headers, "x-ratelimit-remaining"), Some("0"));
    // Another caller is not held by it.
    let (status, _, body) = caddy.request("POST", "/chats", "sk-c2", "192.0.2.9").await;
    assert_eq!(status, 200, "{body}");
    // A route that needs its body: refused, never decided as something cheaper.
    let (status, _, body) = caddy.request("POST", "/mcp", "sk-c3", "192.0.2.9").await;
    assert_eq!(status, 429);
    assert!(body.contains("needs_body"), "{body}");
}

/// Through the documented nginx configuration, the spellings a client could use to be
/// counted as something cheaper are refused or counted as what they are: a path in
/// another case is the route, a method-override field to another route is refused,
/// a session cookie in every spelling is one caller; and the principal headers a
/// client sends itself (`X-Workspace`, `X-User`, `X-Plan`) never reach sluice, which
/// believes them from nginx (a trusted proxy).
#[tokio::test]
async fn r2_through_real_nginx_no_spelling_or_principal_header_is_cheaper() {
    let dir = DataDir::new();
    let path = policy(&dir.0);
    let yaml = std::fs::read_to_string(&path).expect("policy").edit(
        "  trusted_proxies: [127.0.0.1/32]\n",
        "  trusted_proxies: [127.0.0.1/32]\n  principal_headers: { workspace: x-workspace, user: x-user, plan: x-plan }\n",
    ) + "plans:\n  default: {}\n  trial:\n    mode: shadow\n    classes: { expensive: 10 }\n";
    std::fs::write(&path, yaml).expect("write policy");
    let sluice = Sluice::spawn(&["--config", &path, "--check", "127.0.0.1:0"]);
    let check = sluice.start.check.expect("check listener");
    let nginx = Proxy::nginx(&dir.0, check, &sluice.start.upstream);
    let limit_left = |headers: &[(String, String)]| {
        (
            header(headers, "x-ratelimit-limit").map(str::to_owned),
            header(headers, "x-ratelimit-remaining").map(str::to_owned),
        )
    };
    let expensive = |left: u32| (Some("30".to_owned()), Some(left.to_string()));
    // The path in another case: the expensive route.
    let mut left = 30;
    for target in ["/CHATS", "/Chats"] {
        let fields = [("X-Api-Key", "sk-case"), ("X-Real-IP", "192.0.2.10")];
        let (status, headers, body) = nginx.request_with("POST", target, &fields).await;
        left -= 1;
        assert_eq!(status, 200, "{target}: {body}");
        assert_eq!(limit_left(&headers), expensive(left), "{target}");
    }
    // A method override to another route: refused, nothing spent.
    let fields = [
        ("X-Api-Key", "sk-override"),
        ("X-Real-IP", "192.0.2.11"),
        ("X-HTTP-Method-Override", "POST"),
    ];
    let (status, _, body) = nginx.request_with("GET", "/chats", &fields).await;
    assert_eq!(status, 400, "{body}");
    let (_, headers, _) = nginx
        .request("POST", "/chats", "sk-override", "192.0.2.11")
        .await;
    assert_eq!(
        limit_left(&headers),
        expensive(29),
        "the refusal spent nothing"
    );
    // A session cookie in three spellings: one caller.
    let mut left = 30;
    for cookie in [
        "session=secret-n",
        "session=\"secret-n\"",
        "a=1; session = secret-n",
    ] {
        let fields = [("Cookie", cookie), ("X-Real-IP", "192.0.2.12")];
        let (status, headers, body) = nginx.request_with("POST", "/chats", &fields).await;
        left -= 1;
        assert_eq!(status, 200, "{cookie}: {body}");
        assert_eq!(
            limit_left(&headers),
            expensive(left),
            "{cookie}: one budget"
        );
    }
    // A client naming a shadow plan and another workspace: nginx clears both, so the
    // client is counted as itself on the default plan, and refused at 30.
    let fields = [
        ("X-Api-Key", "sk-principal"),
        ("X-Real-IP", "192.0.2.13"),
        ("X-Workspace", "victim"),
        ("X-User", "victim"),
        ("X-Plan", "trial"),
    ];
    for left in (0..30).rev() {
        let (status, headers, body) = nginx.request_with("POST", "/chats", &fields).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(limit_left(&headers), expensive(left));
    }
    let (status, _, body) = nginx.request_with("POST", "/chats", &fields).await;
    assert_eq!(
        status, 429,
        "the trial plan's shadow mode was not the client's to name: {body}"
    );
    let (_, headers, _) = nginx
        .request("POST", "/chats", "sk-victim", "192.0.2.14")
        .await;
    assert_eq!(limit_left(&headers), expensive(29));
}

/// E2 and R2 with `identity.counted_credential`: sluice's own proxy removes the
/// kinds of credential it did not count before the upstream reads them; a proxy
/// asking the check endpoint forwards the request as sent, so one sending two
/// kinds (a fresh counted key each call, the real one in `Authorization`) is
/// refused rather than charged to a caller the upstream never sees.
#[tokio::test]
async fn r2_two_kinds_of_credential_are_refused_when_one_is_counted() {
    let dir = DataDir::new();
    let path = policy(&dir.0);
    let yaml = std::fs::read_to_string(&path).expect("policy").edit(
        "  session_cookie: session\n",
        "  session_cookie: session\n  counted_credential: x_api_key\n",
    );
    std::fs::write(&path, yaml).expect("write policy");
    let sluice = Sluice::spawn(&["--config", &path, "--check", "127.0.0.1:0"]);
    let one = forwarded(&sluice, "GET", "/search/fields", "sk-one", "198.51.100.7").await;
    assert_eq!(one.status, 204, "{}", one.text());
    let both = send(
        Request::get(sluice.check_url("/check"))
            .header("x-forwarded-method", "GET")
            .header("x-forwarded-uri", "/search/fields")
            .header("x-forwarded-for", "198.51.100.7")
            .header("x-api-key", "sk-fresh-1")
            .header("authorization", "Bearer sk-real")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(both.status, 400, "{}", both.text());
    assert_eq!(
        both.json()["error"]["details"]["reason"],
        "ambiguous_credentials"
    );
}

/// R2 and E2: sluice's own proxy drops an underscore spelling of a field it reads
/// or sets (`X_API_KEY`, `X_HTTP_Method_Override`, `X_Sluice_Workspace`), which an
/// upstream mapping names CGI-style would read as the field sluice never saw. A
/// proxy asking the check endpoint forwards it, so such a request is refused 400
/// `underscore_field`, nothing spent. Before, it was admitted as a caller by IP
/// (the key uncounted), a GET with a POST override on the GET's cheaper budget,
/// and the proxy passed the fields on.
#[tokio::test]
async fn r2_an_underscore_spelling_of_a_field_sluice_reads_is_refused() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    for (name, value, method) in [
        ("x_api_key", "sk-victim", "POST"),
        ("X_HTTP_Method_Override", "POST", "GET"),
        ("x_sluice_workspace", "victim", "GET"),
        ("Authorization_", "Bearer x", "GET"),
    ] {
        let reply = send(
            Request::get(sluice.check_url("/check"))
                .header("x-forwarded-method", method)
                .header("x-forwarded-uri", "/chats")
                .header("x-forwarded-for", "198.51.100.9")
                .header(name, value)
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        if name == "Authorization_" {
            // Not a spelling of a field sluice reads: decided as usual.
            assert_ne!(reply.status, 400, "{name}: {}", reply.text());
            continue;
        }
        assert_eq!(reply.status, 400, "{name}: {}", reply.text());
        let details = &reply.json()["error"]["details"];
        assert_eq!(details["reason"], "underscore_field", "{name}");
        assert_eq!(details["field"], name.to_ascii_lowercase(), "{name}");
    }
    // Nothing was spent of the client address's budget, which the refused
    // requests (sending no credential sluice reads) would have been counted to.
    let first = send(
        Request::get(sluice.check_url("/check"))
            .header("x-forwarded-method", "POST")
            .header("x-forwarded-uri", "/chats")
            .header("x-forwarded-for", "198.51.100.9")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(first.status, 204, "{}", first.text());
    let limit: u32 = first
        .header("x-ratelimit-limit")
        .and_then(|v| v.parse().ok())
        .expect("a limit");
    assert_eq!(
        remaining(&first),
        Some(limit - 1),
        "the first of the address"
    );
}

/// An upstream that answers every request with the head it received (so a test sees
/// what the proxy forwarded). Bound to port 0; it lives as long as the test's runtime.
async fn echo_upstream() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the echo upstream");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65_536 {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    head.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.write_all(&head).await;
            });
        }
    });
    format!("http://{addr}")
}

/// The values of field `name` in the head an [`echo_upstream`] answered with.
fn forwarded_field(echoed: &str, name: &str) -> Vec<String> {
    echoed
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| k.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim().to_owned())
        .collect()
}

/// Identity to the upstream (SPEC, the contract with the upstream; R2): through the
/// documented nginx and Caddy configurations the API is told `X-Sluice-Workspace` and
/// `X-Sluice-User` as sluice counted the caller, and never a client's own
/// `X-Sluice-*` (one naming another workspace, or a weighted budget passed on).
#[tokio::test]
async fn r2_the_upstream_is_told_who_sluice_counted_never_the_client_s_claim() {
    let dir = DataDir::new();
    let sluice = spawn(&dir);
    let check = sluice.start.check.expect("check listener");
    let upstream = echo_upstream().await;
    let forged = |key: &'static str| {
        [
            ("X-Api-Key", key),
            ("X-Real-IP", "192.0.2.30"),
            ("X-Sluice-Workspace", "victim"),
            ("X-Sluice-User", "victim"),
            ("X-Sluice-Exhausted", "standard; retry-after=1"),
        ]
    };
    let nginx_dir = dir.0.join("nginx");
    let caddy_dir = dir.0.join("caddy");
    std::fs::create_dir_all(&nginx_dir).expect("nginx dir");
    std::fs::create_dir_all(&caddy_dir).expect("caddy dir");
    let nginx = Proxy::nginx(&nginx_dir, check, &upstream);
    let caddy = Proxy::caddy(&caddy_dir, check, &upstream);
    for (proxy, name) in [(&nginx, "nginx"), (&caddy, "caddy")] {
        let mut told = Vec::new();
        for key in ["sk-who-1", "sk-who-1", "sk-who-2"] {
            let (status, _, echoed) = proxy
                .request_with("GET", "/search/fields", &forged(key))
                .await;
            assert_eq!(status, 200, "{name}: {echoed}");
            let workspace = forwarded_field(&echoed, "x-sluice-workspace");
            let user = forwarded_field(&echoed, "x-sluice-user");
            assert_eq!(workspace.len(), 1, "{name}: one workspace: {echoed}");
            assert_eq!(user.len(), 1, "{name}: one user: {echoed}");
            assert_ne!(
                workspace[0], "victim",
                "{name}: the client's claim went upstream"
            );
            assert_ne!(
                user[0], "victim",
                "{name}: the client's claim went upstream"
            );
            assert!(!workspace[0].is_empty(), "{name}: {echoed}");
            assert!(
                forwarded_field(&echoed, "x-sluice-exhausted").is_empty(),
                "{name}: a client's X-Sluice-Exhausted went upstream: {echoed}"
            );
            told.push(workspace[0].clone());
        }
        assert_eq!(told[0], told[1], "{name}: one caller, one workspace");
        assert_ne!(told[0], told[2], "{name}: two callers, two workspaces");
    }
}
