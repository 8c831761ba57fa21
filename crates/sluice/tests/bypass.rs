//! Requests written as an attacker writes them to spend more than a budget allows,
//! over raw loopback sockets, on both HTTP/1.1 paths of one `sluice serve` (the fast
//! path takes a `Content-Length` body; a chunked body is left to hyper and the service
//! stack) and over HTTP/2, in front of an upstream that records every request it gets.
//! What sluice forwards, it counted as the upstream will read it; what it cannot
//! count, it refuses, saying why, and forwards nothing.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt as _, Full};
use serde_json::{Value, json};
use support::Sluice;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Bound on every test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out")
}

/// An upstream that answers every request `200 {"ok":true}` once it has its whole
/// body, and records its request line (`POST /chats`).
struct Recorder {
    url: String,
    seen: Arc<Mutex<Vec<String>>>,
    credentials: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let credentials = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let record_credentials = Arc::clone(&credentials);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_recorded(
                    stream,
                    Arc::clone(&record),
                    Arc::clone(&record_credentials),
                ));
            }
        });
        Recorder {
            url,
            seen,
            credentials,
        }
    }

    /// The credential fields of each request received so far, as
    /// `name=value` joined by `, ` (`x-api-key`, `authorization`, `cookie`).
    fn credentials(&self) -> Vec<String> {
        self.credentials.lock().expect("lock").clone()
    }

    /// The request lines received so far.
    fn seen(&self) -> Vec<String> {
        self.seen.lock().expect("lock").clone()
    }
}

async fn serve_recorded(
    mut stream: TcpStream,
    seen: Arc<Mutex<Vec<String>>>,
    credentials: Arc<Mutex<Vec<String>>>,
) {
    let mut got = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut request = httparse::Request::new(&mut fields);
        if let Ok(httparse::Status::Complete(end)) = request.parse(&got) {
            let field = |name: &str| {
                request
                    .headers
                    .iter()
                    .find(|f| f.name.eq_ignore_ascii_case(name))
                    .map(|f| String::from_utf8_lossy(f.value).to_ascii_lowercase())
            };
            let whole = if field("transfer-encoding").is_some_and(|te| te.contains("chunked")) {
                got[end..]
                    .windows(5)
                    .position(|w| w == b"0\r\n\r\n")
                    .map(|at| end + at + 5)
            } else {
                let length: usize = field("content-length")
                    .and_then(|l| l.trim().parse().ok())
                    .unwrap_or(0);
                (got.len() >= end + length).then_some(end + length)
            };
            if let Some(whole) = whole {
                let line = format!(
                    "{} {}",
                    request.method.unwrap_or("?"),
                    request.path.unwrap_or("?")
                );
                seen.lock().expect("lock").push(line);
                let sent: Vec<String> = request
                    .headers
                    .iter()
                    .filter(|f| {
                        ["x-api-key", "authorization", "cookie"]
                            .iter()
                            .any(|n| f.name.eq_ignore_ascii_case(n))
                    })
                    .map(|f| {
                        format!(
                            "{}={}",
                            f.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(f.value)
                        )
                    })
                    .collect();
                credentials.lock().expect("lock").push(sent.join(", "));
                got.drain(..whole);
                let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}";
                if stream.write_all(ok.as_bytes()).await.is_err() {
                    return;
                }
                continue;
            }
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The default policy with a window that never rolls during a test (it started at the
/// Unix epoch and ends in 2106), edited by `edit`, written to a file.
fn policy_file(name: &str, edit: impl FnOnce(String) -> String) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-bypass-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit(
        "window_seconds: 60\nprofiles",
        "window_seconds: 4294967295\nprofiles",
    );
    std::fs::write(&path, edit(yaml)).expect("write policy");
    path
}

/// `sluice serve` with the policy `name` (edited by `edit`) in front of a [`Recorder`].
async fn gateway(name: &str, edit: impl FnOnce(String) -> String) -> (Sluice, Recorder) {
    gateway_to(name, "", edit).await
}

/// [`gateway`], the upstream URL ending with `prefix` (`/api`: a request for `/a`
/// goes to `/api/a`).
async fn gateway_to(
    name: &str,
    prefix: &str,
    edit: impl FnOnce(String) -> String,
) -> (Sluice, Recorder) {
    let recorder = Recorder::start().await;
    let policy = policy_file(name, edit);
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("utf-8 path"),
        "--upstream",
        &format!("{}{prefix}", recorder.url),
    ]);
    (sluice, recorder)
}

/// Which of the gateway's HTTP/1.1 paths serves a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The fast path: HTTP/1.1, the body (if any) framed by `Content-Length`.
    Fast,
    /// hyper and the service stack: the body is chunked, which the fast path leaves
    /// to hyper.
    Hyper,
}

const BOTH: [Path; 2] = [Path::Fast, Path::Hyper];

/// An answer read off a raw connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Field names lower case.
    fields: BTreeMap<String, String>,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// `error.code` and `error.data` of a JSON-RPC error answering no request
    /// (`id: null`), as a route answering as JSON-RPC refuses a body it cannot read
    /// (SPEC E5).
    fn jsonrpc_error(&self) -> (i64, Value) {
        let json = self.json();
        assert_eq!(json["jsonrpc"], "2.0", "{json}");
        assert_eq!(json["id"], Value::Null, "{json}");
        assert!(json.get("result").is_none(), "{json}");
        let code = json["error"]["code"].as_i64().unwrap_or(0);
        (code, json["error"]["data"].clone())
    }

    /// `error.code` and `error.details` of the JSON envelope.
    fn envelope(&self) -> (String, Value) {
        let json = self.json();
        let code = json["error"]["code"].as_str().unwrap_or("").to_owned();
        (code, json["error"]["details"].clone())
    }
}

/// Sends `method target` with `fields` and `body` on a new connection, on `path`,
/// and reads the answer to the connection's close.
async fn exchange(
    sluice: &Sluice,
    path: Path,
    method: &str,
    target: &str,
    fields: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    let mut head = format!("{method} {target} HTTP/1.1\r\nhost: x\r\n");
    for (name, value) in fields {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    exchange_raw(sluice, path, &head, body).await
}

/// Sends `head` (the request line and fields, each line ending with CRLF, without the
/// framing of the body or the blank line) with `connection: close` and `body`, on
/// `path`, on a new connection, and reads the answer to the connection's close.
async fn exchange_raw(sluice: &Sluice, path: Path, head: &str, body: &[u8]) -> Answer {
    let mut request = format!("{head}connection: close\r\n").into_bytes();
    match path {
        Path::Fast => {
            request.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
            request.extend_from_slice(body);
        }
        Path::Hyper => {
            request.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
            if !body.is_empty() {
                request.extend_from_slice(format!("{:x}\r\n", body.len()).as_bytes());
                request.extend_from_slice(body);
                request.extend_from_slice(b"\r\n");
            }
            request.extend_from_slice(b"0\r\n\r\n");
        }
    }
    let mut stream = TcpStream::connect(sluice.start.gateway)
        .await
        .expect("connect");
    stream.write_all(&request).await.expect("write");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("read");
    parse_answer(&answer)
}

/// The first answer in `answer` (all the bytes read from a connection).
fn parse_answer(answer: &[u8]) -> Answer {
    let end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head: {}", String::from_utf8_lossy(answer)));
    let head = String::from_utf8_lossy(&answer[..end]).into_owned();
    let mut lines = head.lines();
    let status = lines.next().expect("status line")[9..12]
        .parse()
        .expect("status");
    let fields: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    let mut body = answer[end + 4..].to_vec();
    if fields
        .get("transfer-encoding")
        .is_some_and(|te| te == "chunked")
    {
        body = dechunk(&body);
    }
    Answer {
        status,
        fields,
        body,
    }
}

/// A whole chunked body, decoded (no trailers).
fn dechunk(mut chunked: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let at = chunked
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size");
        let size =
            usize::from_str_radix(&String::from_utf8_lossy(&chunked[..at]), 16).expect("hex size");
        if size == 0 {
            return body;
        }
        body.extend_from_slice(&chunked[at + 2..at + 2 + size]);
        chunked = &chunked[at + 2 + size + 2..];
    }
}

/// A JSON-RPC `tools/call` of `tool`.
fn tool_call(id: usize, tool: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{{}}}}}}"#
    )
}

/// A batch of `n` calls of the expensive `start_chat`.
fn expensive_batch(n: usize) -> String {
    let items: Vec<String> = (0..n).map(|i| tool_call(i, "start_chat")).collect();
    format!("[{}]", items.join(","))
}

/// `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"start_chat"}}`,
/// gzip-compressed.
const GZIPPED_CALL: &[u8] = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\x03\x0d\xc9\x4b\x0a\xc0\x20\x0c\x05\xc0\xbb\xbc\xb5\xf4\xb7\xf4\x32\x25\x58\xc1\x16\x35\x92\x64\x27\xde\xbd\xd9\x0d\xcc\xc4\xa7\xdc\x65\x24\x44\x5c\xdb\x81\x80\xf7\x41\x3c\x03\x5a\xb6\xc2\x4e\x18\x73\xd5\x3d\x51\xad\x9e\x83\x84\x9a\x22\x4e\x74\x6a\xd9\x57\x8d\xc4\xee\x54\xc8\xb0\xd6\x0f\xc1\x90\xd3\xf3\x4d\x00\x00\x00";

/// The fields of a JSON-RPC POST by `key`.
fn rpc_fields(key: &str) -> Vec<(&str, &str)> {
    vec![("x-api-key", key), ("content-type", "application/json")]
}

/// Asserts that both paths gave the same answer (status, body, the fields that do not
/// depend on the clock or the framing).
fn assert_same_answer(fast: &Answer, hyper: &Answer) {
    assert_eq!(fast.status, hyper.status);
    assert_eq!(fast.body, hyper.body);
    for name in [
        "content-type",
        "accept-encoding",
        "retry-after",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
    ] {
        assert_eq!(fast.fields.get(name), hyper.fields.get(name), "{name}");
    }
}

/// 31 expensive tool calls in one batch, above `max_batch_items: 30`: once they
/// counted as one standard item while the upstream could run them all. Now: 413
/// naming the bound, nothing forwarded, nothing spent (a batch of 30 then spends the
/// whole expensive budget).
#[tokio::test]
async fn e5_oversized_batch_is_refused_not_counted_as_standard() {
    let (sluice, upstream) = gateway("batch.yaml", |y| {
        y.edit("max_batch_items: 1000", "max_batch_items: 30")
    })
    .await;
    bounded(async {
        let mut answers = Vec::new();
        for path in BOTH {
            let key = format!("sk-batch-{path:?}");
            let fields = rpc_fields(&key);
            let refused = exchange(
                &sluice,
                path,
                "POST",
                "/mcp",
                &fields,
                expensive_batch(31).as_bytes(),
            )
            .await;
            assert_eq!(refused.status, 413, "{path:?}: {refused:?}");
            assert_eq!(
                refused.jsonrpc_error(),
                (
                    -32700,
                    json!({"reason": "too_many_items", "max_batch_items": 30})
                ),
                "{path:?}"
            );
            let message = refused.json()["error"]["message"].to_string();
            assert!(message.contains("max_batch_items"), "{message}");
            assert!(!refused.fields.contains_key("x-ratelimit-remaining"));
            assert_eq!(upstream.seen().len(), answers.len(), "nothing forwarded");

            let whole = exchange(
                &sluice,
                path,
                "POST",
                "/mcp",
                &fields,
                expensive_batch(30).as_bytes(),
            )
            .await;
            assert_eq!(whole.status, 200, "{path:?}: {whole:?}");
            assert_eq!(
                whole
                    .fields
                    .get("x-ratelimit-remaining")
                    .map(String::as_str),
                Some("0"),
                "{path:?}: the refused batch spent nothing"
            );
            answers.push(refused);
        }
        assert_same_answer(&answers[0], &answers[1]);
        assert_eq!(upstream.seen(), ["POST /mcp", "POST /mcp"]);
    })
    .await;
}

/// A body, what it is, the fields sent with it and the refusal it gets: status and
/// the JSON-RPC error's `data` (its code is -32700, its id null).
type RefusedBody<'a> = (&'a str, &'a [u8], &'a [(&'a str, &'a str)], u16, Value);

/// A JSON-RPC body sluice cannot read as sent (compressed) or that is not UTF-8 JSON
/// (a byte-order mark, UTF-16) or nests past the bound: refused with the reason, on
/// both paths alike, as the route answers: a JSON-RPC parse error (-32700, `id:
/// null`) with the status it has elsewhere (issue 23, item 6); nothing reaches the
/// upstream and nothing is spent.
#[tokio::test]
async fn e5_encoded_bom_utf16_and_deep_bodies_are_refused_on_both_paths() {
    let (sluice, upstream) = gateway("bodies.yaml", |y| y).await;
    let call = tool_call(1, "start_chat");
    let with_bom = [&b"\xEF\xBB\xBF"[..], call.as_bytes()].concat();
    let utf16: Vec<u8> = [0xFF, 0xFE]
        .into_iter()
        .chain(call.encode_utf16().flat_map(u16::to_le_bytes))
        .collect();
    let utf16_bare: Vec<u8> = call.encode_utf16().flat_map(u16::to_le_bytes).collect();
    let deep = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"start_chat","arguments":{}1{}}}}}"#,
        "[".repeat(70),
        "]".repeat(70)
    );
    let cases: Vec<RefusedBody<'_>> = vec![
        (
            "gzip",
            GZIPPED_CALL,
            &[("content-encoding", "gzip")],
            415,
            json!({"reason": "content_encoding", "content_encodings": ["identity"]}),
        ),
        (
            "identity then br",
            call.as_bytes(),
            &[("content-encoding", "identity"), ("content-encoding", "br")],
            415,
            json!({"reason": "content_encoding", "content_encodings": ["identity"]}),
        ),
        (
            "UTF-8 BOM",
            &with_bom,
            &[],
            400,
            json!({"reason": "byte_order_mark"}),
        ),
        (
            "UTF-16 with BOM",
            &utf16,
            &[],
            400,
            json!({"reason": "byte_order_mark"}),
        ),
        (
            "UTF-16",
            &utf16_bare,
            &[],
            400,
            json!({"reason": "not_utf8"}),
        ),
        (
            "deep",
            deep.as_bytes(),
            &[],
            400,
            json!({"reason": "too_deep", "max_json_depth": 64}),
        ),
        (
            "empty batch",
            b"[]",
            &[],
            400,
            json!({"reason": "empty_batch"}),
        ),
        (
            "a number",
            b"30",
            &[],
            400,
            json!({"reason": "not_jsonrpc"}),
        ),
        (
            "not JSON",
            b"certainly not json",
            &[],
            400,
            json!({"reason": "not_json"}),
        ),
    ];
    bounded(async {
        for (what, body, extra, status, data) in cases {
            let mut answers = Vec::new();
            for path in BOTH {
                let mut fields = rpc_fields("sk-bodies");
                fields.extend_from_slice(extra);
                let answer = exchange(&sluice, path, "POST", "/mcp", &fields, body).await;
                assert_eq!(answer.status, status, "{what} on {path:?}: {answer:?}");
                assert_eq!(
                    answer.jsonrpc_error(),
                    (-32700, data.clone()),
                    "{what} on {path:?}"
                );
                assert_eq!(
                    answer.fields.get("content-type").map(String::as_str),
                    Some("application/json")
                );
                assert!(
                    !answer.fields.contains_key("x-ratelimit-limit"),
                    "nothing decided"
                );
                answers.push(answer);
            }
            assert_same_answer(&answers[0], &answers[1]);
            if status == 415 {
                assert_eq!(
                    answers[0].fields.get("accept-encoding").map(String::as_str),
                    Some("identity")
                );
            }
        }
        assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());

        // Nothing was spent: the caller's whole expensive budget is left.
        let fields = rpc_fields("sk-bodies");
        let r = exchange(
            &sluice,
            Path::Fast,
            "POST",
            "/mcp",
            &fields,
            call.as_bytes(),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(
            (
                r.fields.get("x-ratelimit-limit").map(String::as_str),
                r.fields.get("x-ratelimit-remaining").map(String::as_str)
            ),
            (Some("30"), Some("29"))
        );
    })
    .await;
}

/// A JSON-RPC body past `limits.max_body_bytes` is answered 413 as JSON-RPC on both
/// paths (a parse error, `id: null`, naming the bound), and is not forwarded; a REST
/// route's refusals keep the JSON envelope (issue 23, item 6).
#[tokio::test]
async fn e5_a_jsonrpc_body_past_the_size_bound_is_a_jsonrpc_parse_error_on_both_paths() {
    let (sluice, upstream) = gateway("size.yaml", |y| {
        y.edit("max_body_bytes: 1048576", "max_body_bytes: 1024")
    })
    .await;
    bounded(async {
        let big = format!(
            r#"{{"jsonrpc":"2.0","id":7,"method":"ping","params":{{"pad":"{}"}}}}"#,
            "x".repeat(2000)
        );
        let mut answers = Vec::new();
        for path in BOTH {
            let fields = rpc_fields("sk-size");
            let r = exchange(&sluice, path, "POST", "/mcp", &fields, big.as_bytes()).await;
            assert_eq!(r.status, 413, "{path:?}: {r:?}");
            assert_eq!(
                r.jsonrpc_error(),
                (
                    -32700,
                    json!({"reason": "payload_too_large", "max_bytes": 1024})
                ),
                "{path:?}"
            );
            answers.push(r);
        }
        assert_eq!(answers[0].status, answers[1].status);
        assert_eq!(answers[0].body, answers[1].body);
        assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
        // A REST route answers with the envelope, as before.
        let r = exchange(&sluice, Path::Fast, "GET", "/../etc", &[], b"").await;
        assert_eq!(r.envelope().0, "invalid_request");
    })
    .await;
}

/// The same refusals over HTTP/2 (the service stack).
#[tokio::test]
async fn e5_h2_an_oversized_batch_and_a_gzip_body_are_refused() {
    let (sluice, upstream) = gateway("h2.yaml", |y| {
        y.edit("max_batch_items: 1000", "max_batch_items: 30")
    })
    .await;
    bounded(async {
        let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http::<Full<Bytes>>();
        let send = |body: Bytes, encoding: Option<&'static str>| {
            let mut request = Request::post(sluice.url("/mcp"))
                .header("x-api-key", "sk-h2")
                .header("content-type", "application/json");
            if let Some(encoding) = encoding {
                request = request.header("content-encoding", encoding);
            }
            let request = request.body(Full::new(body)).expect("request");
            let h2 = h2.clone();
            async move {
                let response = h2.request(request).await.expect("h2 request");
                assert_eq!(response.version(), http::Version::HTTP_2);
                let status = response.status().as_u16();
                let body = response.into_body().collect().await.expect("body");
                (
                    status,
                    serde_json::from_slice::<Value>(&body.to_bytes()).expect("json"),
                )
            }
        };
        let (status, body) = send(Bytes::from(expensive_batch(31)), None).await;
        assert_eq!(
            (
                status,
                &body["error"]["code"],
                &body["error"]["data"]["reason"]
            ),
            (413, &json!(-32700), &json!("too_many_items"))
        );
        let (status, body) = send(Bytes::from_static(GZIPPED_CALL), Some("gzip")).await;
        assert_eq!(
            (
                status,
                &body["error"]["code"],
                &body["error"]["data"]["reason"]
            ),
            (415, &json!(-32700), &json!("content_encoding"))
        );
        assert_eq!(
            (&body["jsonrpc"], &body["id"]),
            (&json!("2.0"), &Value::Null)
        );
        assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    })
    .await;
}

/// `POST /oauth/register` is 5 per minute per IP (SPEC E7). Other spellings of it,
/// which an upstream that normalises paths serves as the registration, once skipped
/// the bucket. Each now spends it, on either path, and the upstream gets the route's
/// own spelling; the 6th is refused on both.
#[tokio::test]
async fn e7_other_spellings_of_oauth_register_spend_its_5_per_minute_bucket() {
    let (sluice, upstream) = gateway("register.yaml", |y| y).await;
    bounded(async {
        let spellings = [
            (Path::Fast, "//oauth/register"),
            (Path::Hyper, "/oauth/%72egister"),
            (Path::Fast, "/x/../oauth/register"),
            (Path::Hyper, "/./oauth//register"),
            (Path::Fast, "/oauth/%2E/register/"),
        ];
        for (i, (path, target)) in spellings.into_iter().enumerate() {
            // A new credential each time: the bucket is the client IP's.
            let key = format!("sk-register-{i}");
            let fields = [("x-api-key", key.as_str())];
            let r = exchange(&sluice, path, "POST", target, &fields, b"{}").await;
            assert_eq!(r.status, 200, "{target} on {path:?}: {r:?}");
            assert_eq!(
                (
                    r.fields.get("x-ratelimit-limit").map(String::as_str),
                    r.fields.get("x-ratelimit-remaining").map(String::as_str),
                ),
                (Some("5"), Some((4 - i).to_string().as_str())),
                "{target} on {path:?} spent the registration bucket"
            );
        }
        for (path, target) in [
            (Path::Fast, "//oauth/register"),
            (Path::Hyper, "/oauth/register"),
        ] {
            let fields = [("x-api-key", "sk-register-6")];
            let r = exchange(&sluice, path, "POST", target, &fields, b"{}").await;
            assert_eq!(r.status, 429, "{target} on {path:?}: {r:?}");
            assert_eq!(
                r.fields.get("x-ratelimit-limit").map(String::as_str),
                Some("5")
            );
        }
        assert_eq!(
            upstream.seen(),
            vec!["POST /oauth/register".to_owned(); 4]
                .into_iter()
                .chain(["POST /oauth/register/".to_owned()])
                .collect::<Vec<_>>()
        );
    })
    .await;
}

/// A spelling of `/chats` is counted in its class (expensive, 30) on both paths, and
/// forwarded in its normal form under the upstream's prefix, the query as it came
/// (SPEC E6).
#[tokio::test]
async fn e6_other_spellings_of_a_route_are_counted_and_forwarded_as_the_route() {
    let (sluice, upstream) = gateway_to("chats.yaml", "/api", |y| y).await;
    bounded(async {
        let cases = [
            ("//chats", "/api/chats"),
            ("/%63hats?next=/x/../y", "/api/chats?next=/x/../y"),
            ("/x/../chats", "/api/chats"),
            ("/./chats", "/api/chats"),
            ("/a/%2e%2e/chats", "/api/chats"),
            ("/files/a%2fb/%7euser", "/api/files/a%2Fb/~user"),
        ];
        let mut spent = 0;
        for path in BOTH {
            for (target, forwarded) in cases {
                let fields = [("x-api-key", "sk-chats")];
                let r = exchange(&sluice, path, "POST", target, &fields, b"{}").await;
                assert_eq!(r.status, 200, "{target} on {path:?}: {r:?}");
                let limit = r.fields.get("x-ratelimit-limit").map(String::as_str);
                if forwarded.starts_with("/api/chats") {
                    spent += 1;
                    assert_eq!(limit, Some("30"), "{target} on {path:?} is expensive");
                    assert_eq!(
                        r.fields.get("x-ratelimit-remaining").map(String::as_str),
                        Some((30 - spent).to_string().as_str()),
                        "{target} on {path:?}"
                    );
                } else {
                    assert_eq!(limit, Some("60"), "{target} on {path:?} is standard");
                }
                let seen = upstream.seen();
                assert_eq!(
                    seen.last().map(String::as_str),
                    Some(format!("POST {forwarded}").as_str()),
                    "{target} on {path:?}"
                );
            }
        }
    })
    .await;
}

/// A path whose `..` climbs above the root was forwarded as `/prefix/../etc`, out of
/// the upstream's prefix. It is refused with 400 on both paths and over HTTP/2, and
/// nothing is forwarded; so is a `%` that encodes nothing.
#[tokio::test]
async fn e6_a_path_above_the_root_is_refused_not_forwarded_out_of_the_prefix() {
    let (sluice, upstream) = gateway_to("root.yaml", "/api", |y| y).await;
    bounded(async {
        let cases = [
            ("GET", "/../etc", "path_above_root"),
            ("GET", "/a/../../etc/passwd", "path_above_root"),
            ("POST", "/%2e%2e/chats", "path_above_root"),
            ("GET", "//../etc?x=1", "path_above_root"),
            ("POST", "/chats%zz", "bad_percent_encoding"),
        ];
        for (method, target, reason) in cases {
            let mut answers = Vec::new();
            for path in BOTH {
                let r = exchange(&sluice, path, method, target, &[], b"").await;
                assert_eq!(r.status, 400, "{target} on {path:?}: {r:?}");
                assert_eq!(
                    r.envelope(),
                    ("invalid_request".to_owned(), json!({"reason": reason})),
                    "{target} on {path:?}"
                );
                assert!(!r.fields.contains_key("x-ratelimit-limit"), "nothing decided");
                answers.push(r);
            }
            assert_same_answer(&answers[0], &answers[1]);
        }

        // The connection goes on after the refusal (fast path, kept alive).
        let mut stream = TcpStream::connect(sluice.start.gateway)
            .await
            .expect("connect");
        stream
            .write_all(
                b"GET /../etc HTTP/1.1\r\nhost: x\r\n\r\nGET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            )
            .await
            .expect("write");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("read");
        let answer = String::from_utf8_lossy(&answer);
        let refused = answer.find("HTTP/1.1 400 ").expect("a refusal");
        let served = answer.find("HTTP/1.1 200 OK\r\n").expect("the next request");
        assert!(refused == 0 && served > refused, "{answer}");

        let h2 = hyper_util::client::legacy::Client::builder(
            hyper_util::rt::TokioExecutor::new(),
        )
        .http2_only(true)
        .build_http::<Full<Bytes>>();
        let response = h2
            .request(
                Request::get(sluice.url("/x/../../etc"))
                    .body(Full::new(Bytes::new()))
                    .expect("request"),
            )
            .await
            .expect("h2 request");
        assert_eq!(
            (response.version(), response.status().as_u16()),
            (http::Version::HTTP_2, 400)
        );
        let response = h2
            .request(
                Request::post(sluice.url("//oauth/register"))
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .expect("request"),
            )
            .await
            .expect("h2 request");
        assert_eq!(
            response
                .headers()
                .get("x-ratelimit-limit")
                .map(|v| v.as_bytes()),
            Some(&b"5"[..]),
            "HTTP/2 routes the normal form too"
        );

        assert_eq!(
            upstream.seen(),
            ["GET /api/ok", "POST /api/oauth/register"],
            "nothing above the root was forwarded"
        );
    })
    .await;
}

/// An expensive `POST /chats` by `key` on the fast path: what is left of the key's
/// expensive budget afterwards (`X-RateLimit-Remaining`), to show what refusals spent.
async fn expensive_left(sluice: &Sluice, key: &str) -> String {
    let r = exchange(
        sluice,
        Path::Fast,
        "POST",
        "/chats",
        &[("x-api-key", key)],
        b"{}",
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    r.fields
        .get("x-ratelimit-remaining")
        .cloned()
        .unwrap_or_default()
}

/// Asserts that `r` is sluice's 400 `invalid_request` with `details`, decided nothing.
fn assert_invalid(r: &Answer, details: &Value, what: &str) {
    assert_eq!(r.status, 400, "{what}: {r:?}");
    assert_eq!(
        r.envelope(),
        ("invalid_request".to_owned(), details.clone()),
        "{what}"
    );
    assert!(
        !r.fields.contains_key("x-ratelimit-limit"),
        "{what}: nothing decided"
    );
}

/// RFC 9112 §3.2: an HTTP/1.1 request without `Host`, with two, or with one that is not
/// `host[:port]` is answered 400 — it was forwarded (with the upstream's `Host`), so an
/// upstream or a cache keyed by `Host` read something sluice did not. Both paths
/// answer alike, nothing reaches the upstream, nothing is spent; HTTP/1.0 needs no
/// `Host`.
#[tokio::test]
async fn rfc9112_a_request_without_one_host_is_refused_on_both_paths() {
    let (sluice, upstream) = gateway("host.yaml", |y| y).await;
    bounded(async {
        let key = "sk-host";
        let cases = [
            (
                "POST /chats HTTP/1.1\r\n".to_owned(),
                json!({"reason": "missing_host"}),
            ),
            (
                "POST /chats HTTP/1.1\r\nhost: a\r\nhost: b\r\n".to_owned(),
                json!({"reason": "several_hosts", "count": 2}),
            ),
            (
                "POST /chats HTTP/1.1\r\nhost: x\r\nHost: x\r\nhost: x\r\n".to_owned(),
                json!({"reason": "several_hosts", "count": 3}),
            ),
            (
                "POST /chats HTTP/1.1\r\nhost: evil@x\r\n".to_owned(),
                json!({"reason": "bad_host"}),
            ),
            (
                "POST http://x/chats HTTP/1.1\r\n".to_owned(),
                json!({"reason": "missing_host"}),
            ),
        ];
        for (head, details) in &cases {
            let head = format!("{head}x-api-key: {key}\r\n");
            let mut answers = Vec::new();
            for path in BOTH {
                let r = exchange_raw(&sluice, path, &head, b"{}").await;
                assert_invalid(&r, details, &format!("{head:?} on {path:?}"));
                answers.push(r);
            }
            assert_same_answer(&answers[0], &answers[1]);
        }
        assert_eq!(upstream.seen(), Vec::<String>::new(), "nothing forwarded");
        assert_eq!(expensive_left(&sluice, key).await, "29", "nothing spent");

        // HTTP/1.0 has no `Host` to require (hyper serves it).
        let mut stream = TcpStream::connect(sluice.start.gateway)
            .await
            .expect("connect");
        stream
            .write_all(b"GET /fine HTTP/1.0\r\n\r\n")
            .await
            .expect("write");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("read");
        assert_eq!(parse_answer(&answer).status, 200);
        assert_eq!(upstream.seen(), ["POST /chats", "GET /fine"]);
    })
    .await;
}

/// SPEC E2: two credentials of one kind (two `X-API-Key`, an empty one then a real one,
/// two `Authorization`, two session cookies) were forwarded while only the first was
/// charged — or, after an empty first key, the caller's IP. Refused with 400 before
/// anything is decided, alike on both paths and HTTP/2; nothing forwarded or spent.
#[tokio::test]
async fn e2_ambiguous_credentials_are_refused_before_anything_is_spent() {
    let (sluice, upstream) = gateway("credentials.yaml", |y| y).await;
    bounded(async {
        let cases: [(&[(&str, &str)], Value); 5] = [
            (
                &[("x-api-key", "sk-a"), ("x-api-key", "sk-b")],
                json!({"reason": "ambiguous_credentials", "field": "x-api-key", "fields": ["x-api-key"], "count": 2}),
            ),
            (
                &[("x-api-key", ""), ("x-api-key", "sk-a")],
                json!({"reason": "ambiguous_credentials", "field": "x-api-key", "fields": ["x-api-key"], "count": 2}),
            ),
            (
                &[
                    ("authorization", "Bearer sk-a"),
                    ("authorization", "Bearer sk-b"),
                ],
                json!({"reason": "ambiguous_credentials", "field": "authorization", "fields": ["authorization"], "count": 2}),
            ),
            (
                &[("cookie", "session=sk-a; session=sk-b")],
                json!({"reason": "ambiguous_credentials", "field": "cookie", "fields": ["cookie"], "count": 2}),
            ),
            (
                &[
                    ("cookie", "session=sk-a"),
                    ("cookie", "theme=x; session=sk-b"),
                ],
                json!({"reason": "ambiguous_credentials", "field": "cookie", "fields": ["cookie"], "count": 2}),
            ),
        ];
        for (fields, details) in &cases {
            let mut answers = Vec::new();
            for path in BOTH {
                let r = exchange(&sluice, path, "POST", "/chats", fields, b"{}").await;
                assert_invalid(&r, details, &format!("{fields:?} on {path:?}"));
                let message = r.json()["error"]["message"].to_string();
                assert!(message.contains("ambiguous credentials: "), "{message}");
                answers.push(r);
            }
            assert_same_answer(&answers[0], &answers[1]);
        }
        let r = exchange(
            &sluice,
            Path::Fast,
            "POST",
            "/chats",
            &[("x-api-key", "sk-a"), ("x-api-key", "sk-b")],
            b"",
        )
        .await;
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("ambiguous credentials: 2 X-API-Key fields")),
            "{r:?}"
        );

        // HTTP/2 goes through the same limiter.
        let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http::<Full<Bytes>>();
        let response = h2
            .request(
                Request::post(sluice.url("/chats"))
                    .header("x-api-key", "sk-a")
                    .header("x-api-key", "sk-b")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .expect("request"),
            )
            .await
            .expect("h2 request");
        assert_eq!(
            (response.version(), response.status().as_u16()),
            (http::Version::HTTP_2, 400)
        );

        assert_eq!(upstream.seen(), Vec::<String>::new(), "nothing forwarded");
        assert_eq!(expensive_left(&sluice, "sk-a").await, "29", "nothing spent");
        assert_eq!(expensive_left(&sluice, "sk-b").await, "29", "nothing spent");
    })
    .await;
}

/// Issue "one tenant cannot hurt the others" (5): `X-API-Key: <random>` beside
/// `Authorization: Bearer realbob` let the caller pick the credential that was counted
/// (35 of 35 expensive calls admitted, both forwarded). Two kinds in one request are
/// now 400 `ambiguous_credentials` on both paths, nothing spent or forwarded; a
/// `Bearer<TAB>token` is read as the credential it is.
#[tokio::test]
async fn e2_two_kinds_of_credential_in_one_request_are_refused() {
    let (sluice, upstream) = gateway("mixed-credentials.yaml", |y| y).await;
    bounded(async {
        let cases: [(&[(&str, &str)], Value); 2] = [
            (
                &[("x-api-key", "sk-random"), ("authorization", "Bearer realbob")],
                json!({"reason": "ambiguous_credentials", "field": "x-api-key", "fields": ["x-api-key", "authorization"], "count": 2}),
            ),
            (
                &[("authorization", "Bearer realbob"), ("cookie", "theme=x; session=s-1")],
                json!({"reason": "ambiguous_credentials", "field": "authorization", "fields": ["authorization", "cookie"], "count": 2}),
            ),
        ];
        for (fields, details) in &cases {
            for path in BOTH {
                let r = exchange(&sluice, path, "POST", "/chats", fields, b"{}").await;
                assert_invalid(&r, details, &format!("{fields:?} on {path:?}"));
                assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.contains("counted_credential")), "{r:?}");
            }
        }
        // A Bearer sluice cannot read as one token is neither counted nor forwarded.
        for value in ["Bearer", "Bearer ", "Bearer realbob extra"] {
            for path in BOTH {
                let fields = [("x-api-key", "sk-random"), ("authorization", value)];
                let r = exchange(&sluice, path, "POST", "/chats", &fields, b"{}").await;
                let details = json!({"reason": "malformed_credential", "field": "authorization", "fields": ["authorization"], "count": 1});
                assert_invalid(&r, &details, &format!("{value:?} on {path:?}"));
            }
        }
        assert_eq!(upstream.seen(), Vec::<String>::new(), "nothing forwarded");
        assert_eq!(expensive_left(&sluice, "realbob").await, "29", "nothing spent");
        // Another scheme is not sluice's credential: forwarded, counted by address.
        let r = exchange(&sluice, Path::Hyper, "POST", "/chats", &[("authorization", "Basic dXNlcjpwdw==")], b"{}").await;
        assert_eq!(r.status, 200, "{r:?}");
        // `Bearer<TAB>token`: the credential `token`, counted as its X-API-Key twin is.
        for path in BOTH {
            let r = exchange(&sluice, path, "POST", "/chats", &[("authorization", "Bearer\ttabbed")], b"{}").await;
            assert_eq!(r.status, 200, "{r:?}");
        }
        assert_eq!(expensive_left(&sluice, "tabbed").await, "27");
    })
    .await;
}

/// With `identity.counted_credential`, a request sending several kinds is counted by
/// that one, and the others are stripped before it is forwarded (the session cookie
/// out of `Cookie`, the rest kept): 35 `POST /chats` with a fresh `X-API-Key` each
/// beside one Bearer are 30 admitted, on both paths together.
#[tokio::test]
async fn e2_the_counted_credential_is_the_only_one_forwarded() {
    let (sluice, upstream) = gateway("counted-credential.yaml", |y| {
        y.edit(
            "  credentials: [x_api_key, bearer, session_cookie]\n",
            "  credentials: [x_api_key, bearer, session_cookie]\n  counted_credential: bearer\n",
        )
    })
    .await;
    bounded(async {
        let mut statuses = Vec::new();
        for i in 0..35 {
            let path = BOTH[i % 2];
            let key = format!("sk-random-{i}");
            let fields = [
                ("x-api-key", key.as_str()),
                ("authorization", "Bearer realbob"),
                ("cookie", "theme=x; session=s-1"),
            ];
            let r = exchange(&sluice, path, "POST", "/chats", &fields, b"{}").await;
            statuses.push(r.status);
        }
        assert_eq!(
            statuses.iter().filter(|&&s| s == 200).count(),
            30,
            "{statuses:?}"
        );
        assert_eq!(
            statuses.iter().filter(|&&s| s == 429).count(),
            5,
            "{statuses:?}"
        );
        let sent = upstream.credentials();
        assert_eq!(sent.len(), 30);
        for credentials in &sent {
            assert_eq!(
                credentials, "authorization=Bearer realbob, cookie=theme=x",
                "{sent:?}"
            );
        }
        // A request of one kind only is counted by it, as always.
        let r = exchange(
            &sluice,
            Path::Hyper,
            "POST",
            "/chats",
            &[("x-api-key", "sk-alone")],
            b"{}",
        )
        .await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            upstream.credentials().last().map(String::as_str),
            Some("x-api-key=sk-alone")
        );
    })
    .await;
}

/// `CONNECT` was forwarded mangled (as `CONNECT /`). Now 405 `method_not_allowed` with
/// `Allow`, on both paths and HTTP/2, and the connection closes: the bytes after the
/// head (a tunnel's, here a request smuggled as one) are never read as a request.
#[tokio::test]
async fn connect_is_refused_with_405_and_what_follows_is_not_served() {
    let (sluice, upstream) = gateway("connect.yaml", |y| y).await;
    bounded(async {
        let smuggled = b"POST /chats HTTP/1.1\r\nhost: x\r\nx-api-key: sk-c\r\ncontent-length: 0\r\n\r\n";
        let mut answers = Vec::new();
        for head in [
            // The fast path's.
            "CONNECT internal:22 HTTP/1.1\r\nhost: internal:22\r\nx-api-key: sk-c\r\n\r\n",
            // Left to hyper (a chunked body).
            "CONNECT internal:22 HTTP/1.1\r\nhost: internal:22\r\nx-api-key: sk-c\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        ] {
            let mut stream = TcpStream::connect(sluice.start.gateway)
                .await
                .expect("connect");
            let mut sent = head.as_bytes().to_vec();
            sent.extend_from_slice(smuggled);
            stream.write_all(&sent).await.expect("write");
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await.expect("read (the connection closes)");
            let text = String::from_utf8_lossy(&answer);
            assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "one answer: {text}");
            let r = parse_answer(&answer);
            assert_eq!(r.status, 405, "{head:?}: {r:?}");
            assert_eq!(
                r.envelope(),
                ("method_not_allowed".to_owned(), json!({"method": "CONNECT"}))
            );
            assert!(r.fields.get("allow").is_some_and(|a| a.contains("GET")), "{r:?}");
            assert!(!r.fields.get("allow").is_some_and(|a| a.contains("CONNECT")));
            answers.push(r);
        }
        assert_same_answer(&answers[0], &answers[1]);

        let h2 = hyper_util::client::legacy::Client::builder(
            hyper_util::rt::TokioExecutor::new(),
        )
        .http2_only(true)
        .build_http::<Full<Bytes>>();
        let response = h2
            .request(
                Request::connect(format!("http://{}", sluice.start.gateway))
                    .body(Full::new(Bytes::new()))
                    .expect("request"),
            )
            .await
            .expect("h2 request");
        assert_eq!(response.status().as_u16(), 405);

        assert_eq!(upstream.seen(), Vec::<String>::new(), "nothing forwarded");
        assert_eq!(expensive_left(&sluice, "sk-c").await, "29", "nothing spent");
    })
    .await;
}

/// A raw `\` reads as `/` to WHATWG URL parsers (and so to many upstreams):
/// `/oauth\register` was counted as some other path while such an upstream ran the
/// 5-per-minute registration. Refused with 400 on both paths. Path parameters that
/// change the route (`/chats;x=1` is `/chats` to a servlet container, no route to
/// sluice) are refused the same way; those that do not are forwarded as sent.
#[tokio::test]
async fn e7_a_backslash_or_parameters_that_change_the_route_are_refused() {
    let (sluice, upstream) = gateway("backslash.yaml", |y| y).await;
    bounded(async {
        for (target, reason) in [
            ("/oauth\\register", "backslash_in_path"),
            ("/oauth/..\\register", "backslash_in_path"),
            ("/%6fauth\\register", "backslash_in_path"),
            ("/chats;x=1", "path_parameters"),
            ("/oauth;x=1/register", "path_parameters"),
        ] {
            let mut answers = Vec::new();
            for path in BOTH {
                let r = exchange(
                    &sluice,
                    path,
                    "POST",
                    target,
                    &[("x-api-key", "sk-p")],
                    b"{}",
                )
                .await;
                assert_invalid(
                    &r,
                    &json!({"reason": reason}),
                    &format!("{target} on {path:?}"),
                );
                answers.push(r);
            }
            assert_same_answer(&answers[0], &answers[1]);
        }
        assert_eq!(upstream.seen(), Vec::<String>::new(), "nothing forwarded");
        assert_eq!(expensive_left(&sluice, "sk-p").await, "29", "nothing spent");

        for path in BOTH {
            let r = exchange(&sluice, path, "GET", "/chats;x=1?q=\\", &[], b"").await;
            assert_eq!(r.status, 200, "{path:?}: {r:?}");
        }
        assert_eq!(
            upstream.seen(),
            ["POST /chats", "GET /chats;x=1?q=\\", "GET /chats;x=1?q=\\"]
        );
    })
    .await;
}

/// Differential: the same generated requests (valid and invalid: spellings of routes,
/// credentials, JSON-RPC bodies good and bad) sent in the same order to two gateways
/// alike, one on each HTTP/1.1 path. Both must answer every request alike (status,
/// body, the limit fields and `Retry-After`), spend alike (so `X-RateLimit-Remaining`
/// agrees request by request), and forward the same request lines to their upstreams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn differential_both_request_paths_answer_and_forward_alike() {
    bounded(async {
        let (fast_gw, fast_up) = gateway("diff-fast.yaml", |y| y).await;
        let (hyper_gw, hyper_up) = gateway("diff-hyper.yaml", |y| y).await;
        let methods = ["GET", "POST", "PUT", "DELETE", "PATCH"];
        let targets = [
            "/chats",
            "//chats",
            "/%63hats",
            "/x/../chats",
            "/./search/fields",
            "/search/fields?x=1",
            "/oauth/register",
            "/oauth//register",
            "/oauth/%72egister",
            "/../etc/passwd",
            "/a/%2e%2e/%2e%2e/b",
            "/mcp",
            "/messages/optimize",
            "/search/query",
            "/evals/7/export",
            "/routines/7;v=2/run",
            "/chats;x=1",
            "/api/mcp/api-keys/k1",
            "/%zz",
        ];
        let credentials: [&[(&str, &str)]; 5] = [
            &[],
            &[("x-api-key", "sk-diff-a")],
            &[("authorization", "Bearer sk-diff-b")],
            &[("x-api-key", "sk-diff-a"), ("x-api-key", "sk-diff-c")],
            &[("cookie", "session=s1"), ("x-sluice-user", "root")],
        ];
        let bodies: [&[u8]; 6] = [
            b"",
            b"{}",
            br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
            br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"start_chat"}},{"jsonrpc":"2.0","id":2,"method":"tools/list"}]"#,
            b"not json",
            b"\xef\xbb\xbf{}",
        ];
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        for i in 0..160 {
            let method = methods[rng.usize(..methods.len())];
            let target = targets[rng.usize(..targets.len())];
            let mut fields: Vec<(&str, &str)> = credentials[rng.usize(..credentials.len())].to_vec();
            let body = bodies[rng.usize(..bodies.len())];
            if !body.is_empty() {
                fields.push(("content-type", "application/json"));
            }
            let fast = exchange(&fast_gw, Path::Fast, method, target, &fields, body).await;
            let hyper = exchange(&hyper_gw, Path::Hyper, method, target, &fields, body).await;
            let what = format!("request {i}: {method} {target} {fields:?} {:?}", String::from_utf8_lossy(body));
            assert_eq!(fast.status, hyper.status, "{what}");
            assert_eq!(fast.body, hyper.body, "{what}");
            for name in [
                "content-type",
                "retry-after",
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
                "allow",
            ] {
                assert_eq!(fast.fields.get(name), hyper.fields.get(name), "{name} of {what}");
            }
        }
        assert_eq!(fast_up.seen(), hyper_up.seen(), "both forwarded the same request lines");
        assert!(!fast_up.seen().is_empty(), "some requests were forwarded");
    })
    .await;
}

/// A method that differs from a route's only by case (`post /chats`) was forwarded and
/// counted in the default class, while Werkzeug and Express run it as `POST /chats`; a
/// method-override field (`X-HTTP-Method-Override: POST` on a `GET`) was counted as a
/// read while Express's `method-override`, Rails and ASP.NET run a `POST`. Both are
/// refused with 400 on both paths, nothing is forwarded or spent; an override that
/// names the request's own method, or one of the same route, is read as it is.
#[tokio::test]
async fn e6_a_method_in_another_case_or_overridden_to_another_route_is_refused() {
    let (sluice, upstream) = gateway("methods.yaml", |y| y).await;
    bounded(async {
        let key = [("x-api-key", "sk-methods")];
        for path in BOTH {
            for method in ["post", "Post", "pOST", "get"] {
                let r = exchange(&sluice, path, method, "/chats", &key, b"{}").await;
                let what = format!("{method} /chats on {path:?}");
                assert_invalid(&r, &json!({ "reason": "method_case" }), &what);
            }
            for (method, field, value) in [
                ("GET", "x-http-method-override", "POST"),
                ("GET", "X-Method-Override", "post"),
                ("GET", "x-http-method", "POST"),
                ("POST", "x-http-method-override", "GET"),
                ("POST", "x-http-method-override", "PO ST"),
            ] {
                let fields = [key[0], (field, value)];
                let r = exchange(&sluice, path, method, "/chats", &fields, b"{}").await;
                let what = format!("{method} /chats with {field}: {value} on {path:?}");
                assert_invalid(&r, &json!({ "reason": "method_override" }), &what);
            }
        }
        assert_eq!(upstream.seen(), Vec::<String>::new(), "nothing forwarded");
        assert_eq!(expensive_left(&sluice, "sk-methods").await, "29");
        // An override of the request's own method, or of a method on the same route
        // (`/oauth/*` takes every method), changes nothing.
        for path in BOTH {
            let fields = [key[0], ("x-http-method-override", "POST")];
            let r = exchange(&sluice, path, "POST", "/chats", &fields, b"{}").await;
            assert_eq!(r.status, 200, "{r:?}");
            let fields = [key[0], ("x-http-method-override", "DELETE")];
            let r = exchange(&sluice, path, "POST", "/oauth/token", &fields, b"{}").await;
            assert_eq!(r.status, 200, "{r:?}");
        }
        assert_eq!(expensive_left(&sluice, "sk-methods").await, "26");
    })
    .await;
}

/// `/CHATS` and `/Chats` were counted in the default class, while Express routes them
/// to its `/chats` handler. With `paths.case: insensitive` (the default) they are
/// counted as the route and forwarded as sent; with `sensitive`, as before.
#[tokio::test]
async fn e6_a_path_in_another_case_is_counted_as_the_route() {
    let (sluice, upstream) = gateway("case.yaml", |y| y).await;
    bounded(async {
        let key = [("x-api-key", "sk-case")];
        let mut left = 30;
        for path in BOTH {
            for target in ["/CHATS", "/Chats", "/chats/"] {
                let r = exchange(&sluice, path, "POST", target, &key, b"{}").await;
                left -= 1;
                assert_eq!(r.status, 200, "{target} on {path:?}: {r:?}");
                assert_eq!(
                    (
                        r.fields.get("x-ratelimit-limit").map(String::as_str),
                        r.fields.get("x-ratelimit-remaining").cloned()
                    ),
                    (Some("30"), Some(left.to_string())),
                    "{target} on {path:?} is the expensive route"
                );
                assert_eq!(
                    upstream.seen().last().map(String::as_str),
                    Some(format!("POST {target}").as_str())
                );
            }
        }
    })
    .await;
    let (sensitive, _) = gateway("case-sensitive.yaml", |y| {
        y.edit("  case: insensitive\n", "  case: sensitive\n")
    })
    .await;
    bounded(async {
        let r = exchange(
            &sensitive,
            Path::Fast,
            "POST",
            "/CHATS",
            &[("x-api-key", "sk-case")],
            b"{}",
        )
        .await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            r.fields.get("x-ratelimit-limit").map(String::as_str),
            Some("60"),
            "case-sensitive: /CHATS is not the route"
        );
    })
    .await;
}

/// An expensive `POST /chats` on `path` with this `Cookie` field.
async fn chat_with_cookie(sluice: &Sluice, path: Path, cookie: &str) -> Answer {
    exchange(sluice, path, "POST", "/chats", &[("cookie", cookie)], b"{}").await
}

/// A revoked session cookie was admitted as `session="secret-ada"`, `session =
/// secret-ada` and `other=1; session="secret-ada"` (Python's SimpleCookie and most
/// frameworks read them all as `secret-ada`), and the quoted form was a second budget.
/// Every spelling is now one caller, and stays revoked; a value the frameworks read
/// differently is refused, never counted as another caller.
#[tokio::test]
async fn e2_a_session_cookie_in_every_spelling_is_one_caller_and_stays_revoked() {
    let table = format!(
        "  keys:\n    - {{ sha256: {}, workspace: ada, user: ada }}\n",
        support::sha256_hex("secret-ada")
    );
    let (sluice, upstream) = gateway("cookies.yaml", |y| y.edit("  keys: []\n", &table)).await;
    bounded(async {
        let spellings = [
            "session=secret-ada",
            "session=\"secret-ada\"",
            "session = secret-ada",
            "other=1; session=\"secret-ada\"",
            "session=secret%2Dada",
        ];
        let mut left = 30;
        for path in BOTH {
            for cookie in spellings {
                let r = chat_with_cookie(&sluice, path, cookie).await;
                left -= 1;
                assert_eq!(r.status, 200, "{cookie} on {path:?}: {r:?}");
                assert_eq!(
                    r.fields.get("x-ratelimit-remaining").cloned(),
                    Some(left.to_string()),
                    "{cookie} on {path:?}: one budget"
                );
            }
            for cookie in [
                "session=\"secret\\055ada\"",
                "session=secret ada",
                "session",
            ] {
                let r = chat_with_cookie(&sluice, path, cookie).await;
                assert_eq!(r.status, 400, "{cookie} on {path:?}: {r:?}");
                assert_eq!(r.envelope().1["reason"], "malformed_credential", "{cookie}");
            }
        }
        let forwarded = upstream.seen().len();
        let revoke = support::send(
            Request::delete(sluice.admin_url(&format!(
                "/tenants/keys/{}",
                support::sha256_hex("secret-ada")
            )))
            .body(Full::new(Bytes::new()))
            .expect("request"),
        )
        .await;
        assert_eq!(revoke.status, 204, "{}", revoke.text());
        for path in BOTH {
            for cookie in spellings {
                let r = chat_with_cookie(&sluice, path, cookie).await;
                assert_eq!(r.status, 403, "{cookie} on {path:?}: {r:?}");
                assert_eq!(r.envelope().1["reason"], "credential_revoked", "{cookie}");
            }
        }
        assert_eq!(
            upstream.seen().len(),
            forwarded,
            "nothing forwarded once revoked"
        );
    })
    .await;
}
