//! SPEC T0: an https upstream. An in-test TLS upstream (a CA and a leaf certificate
//! for 127.0.0.1 made by `openssl` in a temporary directory, served with
//! tokio-rustls and hyper) behind a gateway with the built-in policy: with the CA as
//! the only root, a GET and a POST with a body pass through with the upstream's
//! `Host` and path prefix, over TLS with ALPN `http/1.1`, on one pooled connection;
//! verified against the system's roots instead, the call is sluice's 502, at once.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};
use sluice_gateway::{Gateway, GatewayConfig, Upstream, UpstreamTls};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Bound on every exchange of these tests: nothing may hang.
const TEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "sluice-t0-{what}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs (the test script installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `ca.pem` (a CA) and `leaf.pem` / `leaf.key` (a server certificate for
/// 127.0.0.1 and localhost, signed by it) into `dir`.
fn certificates(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=sluice t0 test CA",
    ]);
    openssl(dir, &ca);
    let mut csr = vec!["req"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "leaf.key",
        "-out",
        "leaf.csr",
        "-subj",
        "/CN=localhost",
    ]);
    openssl(dir, &csr);
    std::fs::write(
        dir.join("leaf.ext"),
        "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n\
         subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .expect("extensions file");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "leaf.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-set_serial",
            "2",
            "-days",
            "2",
            "-extfile",
            "leaf.ext",
            "-out",
            "leaf.pem",
        ],
    );
}

/// What the TLS upstream saw of the requests it answered, and how many TLS
/// connections it accepted.
#[derive(Clone, Default)]
struct Seen {
    connections: Arc<AtomicUsize>,
}

/// A TLS upstream with the certificates in `dir`, offering ALPN `h2` and `http/1.1`
/// and speaking HTTP/1.1: it answers each request with a JSON echo of its method,
/// target, `Host`, body and the negotiated ALPN.
async fn tls_upstream(dir: &Path) -> (SocketAddr, Seen) {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("leaf.pem"))
        .expect("leaf.pem")
        .collect::<Result<_, _>>()
        .expect("certificates");
    let key = PrivateKeyDer::from_pem_file(dir.join("leaf.key")).expect("leaf.key");
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server certificate");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Seen::default();
    let connections = Arc::clone(&seen.connections);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let connections = Arc::clone(&connections);
            tokio::spawn(async move {
                // A client that does not trust the certificate ends the handshake.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                connections.fetch_add(1, Ordering::SeqCst);
                let alpn = tls
                    .get_ref()
                    .1
                    .alpn_protocol()
                    .map(|p| String::from_utf8_lossy(p).into_owned());
                let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    let alpn = alpn.clone();
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await?.to_bytes();
                        let echo = json!({
                            "method": parts.method.as_str(),
                            "target": parts.uri.to_string(),
                            "host": parts.headers.get("host").and_then(|h| h.to_str().ok()),
                            "body": String::from_utf8_lossy(&body),
                            "alpn": alpn,
                        });
                        Ok::<_, hyper::Error>(
                            hyper::Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from(echo.to_string())))
                                .expect("response"),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// A gateway with the built-in policy and one worker (one upstream pool) in front of
/// `upstream`.
async fn gateway(upstream: Upstream, data: &TempDir) -> Gateway {
    let policy = sluice_policy::default_policy().expect("policy");
    let mut config = GatewayConfig::new(policy, data.0.clone());
    config.workers = std::num::NonZeroUsize::MIN;
    config.upstream = Some(upstream);
    Gateway::start(config).await.expect("gateway starts")
}

/// Sends `request` (a whole HTTP/1.1 request asking to close) to `gateway` and
/// returns the answer's status and JSON body.
async fn exchange(gateway: SocketAddr, request: String) -> (u16, Value) {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let mut stream = TcpStream::connect(gateway).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("read");
        let text = String::from_utf8_lossy(&answer).into_owned();
        let status = text
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("a status line: {text}"));
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let body = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, body)
    })
    .await
    .expect("the gateway answered in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t0_an_https_upstream_verified_by_its_ca_gets_gets_and_posts_with_host_and_prefix() {
    let certs = TempDir::new("certs");
    certificates(&certs.0);
    let (addr, seen) = tls_upstream(&certs.0).await;
    let ca = std::fs::read(certs.0.join("ca.pem")).expect("ca.pem");
    let upstream = Upstream::parse(&format!("https://127.0.0.1:{}/api/", addr.port()))
        .expect("an https upstream")
        .with_tls(UpstreamTls::from_pem(&ca).expect("the CA"));
    let data = TempDir::new("data");
    let gateway = gateway(upstream, &data).await;
    let at = gateway.addr().expect("gateway address");
    assert_eq!(
        gateway.upstream().map(ToString::to_string),
        Some(format!("https://127.0.0.1:{}/api", addr.port()))
    );

    let (status, echo) = exchange(
        at,
        "GET /v1/models?limit=2 HTTP/1.1\r\nhost: sluice.test\r\nconnection: close\r\n\r\n".into(),
    )
    .await;
    assert_eq!(status, 200, "{echo}");
    assert_eq!(echo["method"], "GET");
    assert_eq!(echo["target"], "/api/v1/models?limit=2");
    assert_eq!(echo["host"], format!("127.0.0.1:{}", addr.port()));
    assert_eq!(echo["alpn"], "http/1.1");

    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let (status, echo) = exchange(
        at,
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: sluice.test\r\n\
             content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    assert_eq!(status, 200, "{echo}");
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["target"], "/api/v1/chat/completions");
    assert_eq!(echo["host"], format!("127.0.0.1:{}", addr.port()));
    assert_eq!(echo["body"], body);
    assert_eq!(
        seen.connections.load(Ordering::SeqCst),
        1,
        "the second request reused the pooled TLS connection"
    );
    gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t0_an_https_upstream_the_system_roots_do_not_trust_is_a_502_at_once() {
    let certs = TempDir::new("certs");
    certificates(&certs.0);
    let (addr, seen) = tls_upstream(&certs.0).await;
    let upstream =
        Upstream::parse(&format!("https://127.0.0.1:{}", addr.port())).expect("an https upstream");
    let data = TempDir::new("data");
    let gateway = gateway(upstream, &data).await;
    let at = gateway.addr().expect("gateway address");
    let (status, body) = exchange(
        at,
        "GET /v1/models HTTP/1.1\r\nhost: sluice.test\r\nconnection: close\r\n\r\n".into(),
    )
    .await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "bad_gateway", "{body}");
    assert_eq!(
        seen.connections.load(Ordering::SeqCst),
        0,
        "no handshake completed"
    );
    gateway.shutdown().await;
}
