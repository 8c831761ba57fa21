//! SPEC O5: TLS on the gateway listener (`--tls-cert`, `--tls-key`) and the admin
//! listener (`--admin-tls-cert`, `--admin-tls-key`), as a real process over loopback
//! on free ports: curl with `--cacert` over HTTP/1.1 and HTTP/2 (ALPN), a certificate
//! swapped while a client holds a connection, changed files that are half-written,
//! mismatched or expired (the old certificate stays), a bad pair at start, and a
//! client hello that never finishes.
//!
//! Certificates are made by `openssl` (the test script installs it) in a temporary
//! directory: one CA, and leaf certificates for 127.0.0.1 it signs.

use crate::support;

use crate::python_venv;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use support::{DataDir, Sluice, get, run_to_exit};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Bound on every test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(90);

/// Longest wait for the file watch to take (or refuse) changed files.
const RELOAD_WITHIN: Duration = Duration::from_secs(20);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out")
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl runs (the test script installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and, signed by it for 127.0.0.1: `a` and `b` (valid), `expired` (valid in
/// January 2020 only); each `NAME.pem` with its key `NAME.key`.
struct Certs {
    dir: DataDir,
}

impl Certs {
    fn new() -> Certs {
        let dir = DataDir::new();
        std::fs::create_dir_all(&dir.0).expect("certificate dir");
        let d = dir.0.as_path();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
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
            "/CN=sluice-o5-ca",
        ]);
        openssl(d, &ca);
        std::fs::write(d.join("ext"), "subjectAltName=IP:127.0.0.1\n").expect("ext");
        for name in ["a", "b", "expired"] {
            let (key, csr) = (format!("{name}.key"), format!("{name}.csr"));
            let mut req = vec!["req"];
            req.extend(ec);
            req.extend(["-keyout", &key, "-out", &csr, "-subj", "/CN=127.0.0.1"]);
            openssl(d, &req);
        }
        for name in ["a", "b"] {
            openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-extfile",
                    "ext",
                    "-out",
                    &format!("{name}.pem"),
                ],
            );
        }
        // OpenSSL 3.0's `x509` has no start date: `ca` has.
        std::fs::write(
            d.join("ca.cnf"),
            "[ca]\ndefault_ca=d\n[d]\ndatabase=index.txt\nnew_certs_dir=.\nserial=serial\n\
             default_md=sha256\npolicy=p\n[p]\ncommonName=supplied\n\
             [x]\nsubjectAltName=IP:127.0.0.1\n",
        )
        .expect("ca.cnf");
        std::fs::write(d.join("index.txt"), "").expect("index");
        std::fs::write(d.join("serial"), "1000\n").expect("serial");
        openssl(
            d,
            &[
                "ca",
                "-batch",
                "-config",
                "ca.cnf",
                "-cert",
                "ca.pem",
                "-keyfile",
                "ca.key",
                "-in",
                "expired.csr",
                "-out",
                "expired.pem",
                "-startdate",
                "20200101000000Z",
                "-enddate",
                "20200102000000Z",
                "-extensions",
                "x",
                "-notext",
            ],
        );
        Certs { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.0.join(name)
    }

    fn arg(&self, name: &str) -> String {
        self.path(name).to_str().expect("UTF-8 path").to_owned()
    }

    /// The DER of `NAME.pem`'s certificate.
    fn der(&self, name: &str) -> Vec<u8> {
        CertificateDer::from_pem_file(self.path(&format!("{name}.pem")))
            .expect("a PEM certificate")
            .to_vec()
    }

    /// Puts `NAME.pem` and `NAME.key` in place as `live/tls.crt` and `live/tls.key`,
    /// each written aside and renamed in (the certificate first: for a moment the
    /// pair does not match, which the watch must ride out).
    fn install(&self, name: &str) {
        let live = self.path("live");
        std::fs::create_dir_all(&live).expect("live dir");
        for (from, to) in [
            (format!("{name}.pem"), "tls.crt"),
            (format!("{name}.key"), "tls.key"),
        ] {
            let aside = live.join(format!(".{to}.new"));
            std::fs::copy(self.path(&from), &aside).expect("copy");
            std::fs::rename(&aside, live.join(to)).expect("rename");
        }
    }

    /// Writes `bytes` as the live certificate, in place (a writer that stopped
    /// half-way and closed the file).
    fn write_live_cert(&self, bytes: &[u8]) {
        std::fs::write(self.path("live").join("tls.crt"), bytes).expect("write");
    }

    fn live_args(&self) -> [String; 4] {
        [
            "--tls-cert".into(),
            self.arg("live/tls.crt"),
            "--tls-key".into(),
            self.arg("live/tls.key"),
        ]
    }

    /// A TLS client trusting this CA only, offering ALPN `alpn`.
    fn connector(&self, alpn: &[u8]) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(self.path("ca.pem")).expect("ca"))
            .expect("root");
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

fn spawn_tls(certs: &Certs, extra: &[&str]) -> Sluice {
    let live = certs.live_args();
    let mut args: Vec<&str> = live.iter().map(String::as_str).collect();
    args.extend(extra);
    Sluice::spawn(&args)
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// A TLS connection to `addr`, and the certificate the server presented.
async fn connect(certs: &Certs, addr: SocketAddr) -> (Tls, Vec<u8>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::from(addr.ip());
    let tls = certs
        .connector(b"http/1.1")
        .connect(name, tcp)
        .await
        .expect("TLS handshake");
    let presented = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .expect("a server certificate")
        .to_vec();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    (tls, presented)
}

/// One keep-alive `GET path` on `tls`: the status and the `x-ratelimit-limit` header.
async fn exchange(tls: &mut Tls, path: &str) -> (u16, Option<String>) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    tls.write_all(request.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let n = tls.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the connection closed before a whole response");
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(head) = response.parse(&buf).expect("HTTP") {
            let header = |name: &str| {
                response
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).into_owned())
            };
            let length: usize = header("content-length")
                .and_then(|l| l.parse().ok())
                .expect("content-length");
            if buf.len() >= head + length {
                assert_eq!(buf.len(), head + length, "nothing past the response");
                return (response.code.expect("status"), header("x-ratelimit-limit"));
            }
        }
    }
}

/// Polls `/status` until `done` holds of its `limiter.tls.gateway` field, within
/// [`RELOAD_WITHIN`].
async fn wait_status(sluice: &Sluice, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + RELOAD_WITHIN;
    loop {
        let status = get(&sluice.admin_url("/status")).await.json();
        let tls = status["limiter"]["tls"]["gateway"].clone();
        if done(&tls) {
            return tls;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {RELOAD_WITHIN:?}: {tls}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// curl, exiting with its output: `-w` writes the HTTP version last.
fn curl(certs: &Certs, version: &str, url: &str, method: &str) -> String {
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            &certs.arg("ca.pem"),
            version,
        ])
        .args([
            "-X",
            method,
            "-D",
            "-",
            "-o",
            "/dev/null",
            "-w",
            "version=%{http_version}\n",
            url,
        ])
        .output()
        .expect("curl runs");
    assert!(
        out.status.success(),
        "curl {version} {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_ascii_lowercase()
}

#[tokio::test]
async fn o5_curl_with_cacert_over_http1_and_http2_gets_rate_limit_headers_and_a_429() {
    let certs = Certs::new();
    certs.install("a");
    let sluice = spawn_tls(&certs, &[]);
    let base = format!("https://{}", sluice.start.gateway);
    bounded(async {
        let h1 = curl(&certs, "--http1.1", &format!("{base}/search/fields"), "GET");
        assert!(h1.starts_with("http/1.1 200"), "{h1}");
        assert!(h1.contains("x-ratelimit-limit: 300"), "{h1}");
        assert!(h1.contains("x-ratelimit-remaining: "), "{h1}");
        assert!(h1.trim_end().ends_with("version=1.1"), "{h1}");

        // ALPN picks h2 (curl offers it first over TLS).
        let h2 = curl(&certs, "--http2", &format!("{base}/search/fields"), "GET");
        assert!(h2.starts_with("http/2 200"), "{h2}");
        assert!(h2.contains("x-ratelimit-limit: 300"), "{h2}");
        assert!(h2.trim_end().ends_with("version=2"), "{h2}");

        // `POST /oauth/register`: 5 a minute per IP, whatever the protocol.
        let register = format!("{base}/oauth/register");
        let mut statuses = Vec::new();
        for i in 0..6 {
            let version = if i % 2 == 0 { "--http1.1" } else { "--http2" };
            let out = curl(&certs, version, &register, "POST");
            let status: u16 = out
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("a status line: {out}"));
            statuses.push(status);
            if status == 429 {
                assert!(out.contains("retry-after: "), "{out}");
                assert!(out.contains("x-ratelimit-remaining: 0"), "{out}");
            }
        }
        assert_eq!(statuses[..5], [200; 5], "{statuses:?}");
        assert_eq!(statuses[5], 429, "{statuses:?}");

        // Plain HTTP on the TLS port is no request.
        let plain = std::process::Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "5",
                &format!("http://{}/search/fields", sluice.start.gateway),
            ])
            .output()
            .expect("curl");
        assert!(
            !plain.status.success(),
            "plain HTTP answered on the TLS listener"
        );
    })
    .await;
}

#[tokio::test]
async fn o5_a_certificate_swapped_while_a_client_holds_a_connection() {
    let certs = Certs::new();
    certs.install("a");
    let sluice = spawn_tls(&certs, &[]);
    bounded(async {
        let (mut held, presented) = connect(&certs, sluice.start.gateway).await;
        assert_eq!(presented, certs.der("a"));
        assert_eq!(
            exchange(&mut held, "/search/fields").await,
            (200, Some("300".into()))
        );

        certs.install("b");
        wait_status(&sluice, "b taken", |tls| {
            tls["reloads"].as_u64() >= Some(1) && tls["refused"].is_null()
        })
        .await;
        let (mut fresh, presented) = connect(&certs, sluice.start.gateway).await;
        assert_eq!(
            presented,
            certs.der("b"),
            "a new connection sees the new certificate"
        );
        assert_eq!(exchange(&mut fresh, "/search/fields").await.0, 200);

        // The held connection keeps its session and its keep-alive.
        assert_eq!(
            exchange(&mut held, "/search/fields").await,
            (200, Some("300".into()))
        );
        assert_eq!(exchange(&mut held, "/search/fields").await.0, 200);
    })
    .await;
}

#[tokio::test]
async fn o5_half_written_mismatched_or_expired_files_keep_the_old_certificate() {
    let certs = Certs::new();
    certs.install("a");
    let sluice = spawn_tls(&certs, &[]);
    let a = certs.der("a");
    bounded(async {
        // Half-written: the first half of a.pem, then the writer closed it.
        let pem = std::fs::read(certs.path("a.pem")).expect("a.pem");
        certs.write_live_cert(&pem[..pem.len() / 2]);
        let tls = wait_status(&sluice, "half-written refused", |t| !t["refused"].is_null()).await;
        assert!(
            tls["refused"].as_str().is_some_and(|r| r.contains("PEM")),
            "{tls}"
        );
        let (mut c, presented) = connect(&certs, sluice.start.gateway).await;
        assert_eq!(presented, a, "the old certificate stays");
        assert_eq!(exchange(&mut c, "/search/fields").await.0, 200);

        // Mismatched: b's certificate with a's key.
        certs.write_live_cert(&std::fs::read(certs.path("b.pem")).expect("b.pem"));
        let tls = wait_status(&sluice, "mismatch refused", |t| {
            t["refused"]
                .as_str()
                .is_some_and(|r| r.contains("does not match"))
        })
        .await;
        assert_eq!(tls["reloads"], 0, "{tls}");
        assert_eq!(connect(&certs, sluice.start.gateway).await.1, a);

        // Expired: a whole pair, past its notAfter.
        certs.install("expired");
        wait_status(&sluice, "expired refused", |t| {
            t["refused"].as_str().is_some_and(|r| r.contains("expired"))
        })
        .await;
        assert_eq!(connect(&certs, sluice.start.gateway).await.1, a);

        let metrics = get(&sluice.admin_url("/metrics")).await.text();
        assert!(
            metrics.contains("sluice_tls_certificate_stale{listener=\"gateway\"} 1"),
            "{metrics}"
        );
        assert!(
            metrics.contains(
                "sluice_tls_certificate_reloads_total{listener=\"gateway\",outcome=\"refused\"}"
            ),
            "{metrics}"
        );
        assert!(
            sluice
                .stderr()
                .contains("REFUSED, the previous certificate stays in use"),
            "a loud log line: {}",
            sluice.stderr()
        );

        // A good pair again is taken, and the stale mark goes.
        certs.install("b");
        wait_status(&sluice, "b taken", |t| t["refused"].is_null()).await;
        assert_eq!(
            connect(&certs, sluice.start.gateway).await.1,
            certs.der("b")
        );
    })
    .await;
}

#[test]
fn o5_a_bad_certificate_at_start_refuses_to_start_naming_the_flag() {
    let certs = Certs::new();
    let data = DataDir::new();
    let run = |cert: &str, key: &str, flags: [&str; 2]| {
        run_to_exit(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--data-dir",
                data.arg(),
                flags[0],
                &certs.arg(cert),
                flags[1],
                &certs.arg(key),
            ],
            Duration::from_secs(30),
        )
    };
    let expired = run("expired.pem", "expired.key", ["--tls-cert", "--tls-key"]);
    assert_eq!(expired.status.code(), Some(2), "{}", expired.stderr);
    assert!(expired.stderr.contains("--tls-cert"), "{}", expired.stderr);
    assert!(expired.stderr.contains("expired"), "{}", expired.stderr);

    let mismatched = run("a.pem", "b.key", ["--tls-cert", "--tls-key"]);
    assert_eq!(mismatched.status.code(), Some(2), "{}", mismatched.stderr);
    assert!(
        mismatched.stderr.contains("does not match"),
        "{}",
        mismatched.stderr
    );

    std::fs::write(certs.path("half.pem"), b"-----BEGIN CERTIFICATE-----\nMIIB").expect("half");
    let half = run("half.pem", "a.key", ["--admin-tls-cert", "--admin-tls-key"]);
    assert_eq!(half.status.code(), Some(2), "{}", half.stderr);
    assert!(half.stderr.contains("--admin-tls-cert"), "{}", half.stderr);
}

/// A client hello that never finishes is closed at the head timeout (30 s), and
/// counted as a slow head is; a client meanwhile is served.
#[tokio::test]
async fn o5_a_client_hello_that_never_finishes_is_closed_at_the_deadline() {
    let certs = Certs::new();
    certs.install("a");
    let sluice = spawn_tls(&certs, &[]);
    bounded(async {
        let mut stalled = tokio::net::TcpStream::connect(sluice.start.gateway)
            .await
            .expect("connect");
        // A TLS record header announcing a 512-byte handshake message, and 4 of them.
        stalled
            .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc])
            .await
            .expect("write");
        let began = Instant::now();

        let (mut other, _) = connect(&certs, sluice.start.gateway).await;
        assert_eq!(exchange(&mut other, "/search/fields").await.0, 200);

        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(60), stalled.read(&mut buf))
            .await
            .expect("closed within 60 s");
        let waited = began.elapsed();
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "the stalled handshake got {read:?} instead of a close"
        );
        assert!(
            waited >= Duration::from_secs(29) && waited < Duration::from_secs(45),
            "closed after {waited:?}, not at the 30 s deadline"
        );
        let metrics = get(&sluice.admin_url("/metrics")).await.text();
        assert!(
            metrics.contains(
                "sluice_tls_handshakes_failed_total{listener=\"gateway\",reason=\"timeout\"} 1"
            ),
            "{metrics}"
        );
        assert!(
            metrics.contains("sluice_slow_heads_total{listener=\"gateway\"} 1"),
            "{metrics}"
        );
    })
    .await;
}

/// A client that finishes the handshake with ALPN `h2` and then never sends the
/// HTTP/2 preface is closed at the head timeout (30 s), as one over plain HTTP/2
/// is; a client meanwhile is served.
#[tokio::test]
async fn o5_an_h2_client_that_never_sends_its_preface_is_closed_at_the_deadline() {
    let certs = Certs::new();
    certs.install("a");
    let sluice = spawn_tls(&certs, &[]);
    bounded(async {
        let tcp = tokio::net::TcpStream::connect(sluice.start.gateway)
            .await
            .expect("connect");
        let mut silent = certs
            .connector(b"h2")
            .connect(ServerName::from(sluice.start.gateway.ip()), tcp)
            .await
            .expect("TLS handshake");
        assert_eq!(silent.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        let began = Instant::now();

        let (mut other, _) = connect(&certs, sluice.start.gateway).await;
        assert_eq!(exchange(&mut other, "/search/fields").await.0, 200);

        // The server speaks first (its SETTINGS): read until the connection ends.
        let closed = async {
            let mut buf = [0u8; 256];
            while let Ok(n) = silent.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), closed)
            .await
            .expect("closed within 60 s");
        let waited = began.elapsed();
        assert!(
            waited >= Duration::from_secs(29) && waited < Duration::from_secs(45),
            "closed after {waited:?}, not at the 30 s deadline"
        );
    })
    .await;
}

/// `--admin-tls-cert`/`--admin-tls-key`: the admin listener speaks TLS (HTTP/1.1),
/// its certificate read again when its files change; the gateway may stay plain.
#[tokio::test]
async fn o5_the_admin_listener_speaks_tls_and_takes_a_new_certificate() {
    let certs = Certs::new();
    certs.install("a");
    let live = certs.live_args();
    let sluice = Sluice::spawn(&["--admin-tls-cert", &live[1], "--admin-tls-key", &live[3]]);
    bounded(async {
        let admin = sluice.start.admin;
        let status = curl(
            &certs,
            "--http1.1",
            &format!("https://{admin}/status"),
            "GET",
        );
        assert!(status.starts_with("http/1.1 200"), "{status}");
        // The gateway itself stays plain HTTP.
        assert_eq!(get(&sluice.url("/search/fields")).await.status, 200);

        let (mut tls, presented) = connect(&certs, admin).await;
        assert_eq!(presented, certs.der("a"));
        assert_eq!(exchange(&mut tls, "/metrics").await.0, 200);
        certs.install("b");
        let deadline = Instant::now() + RELOAD_WITHIN;
        while connect(&certs, admin).await.1 != certs.der("b") {
            assert!(Instant::now() < deadline, "admin certificate not swapped");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The held connection goes on.
        assert_eq!(exchange(&mut tls, "/metrics").await.0, 200);
    })
    .await;
}

/// The official openai Python SDK (pinned as in `tokens_sdk.rs`, in the same
/// virtualenv) over https, its HTTP client trusting the test's CA:
/// rate-limit headers on an answer, its own RateLimitError on a 429.
#[tokio::test]
async fn o5_the_openai_sdk_over_https_sees_rate_limit_headers_and_its_rate_limit_error() {
    let python = tokio::task::spawn_blocking(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llm-sdk-venv");
        python_venv::venv(&dir, &[("openai", "3.57.0")])
    })
    .await
    .expect("the virtualenv");
    let certs = Certs::new();
    certs.install("a");
    let sluice = spawn_tls(&certs, &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/tls_sdk.py");
    let base = format!("https://{}", sluice.start.gateway);
    let ca = certs.arg("ca.pem");
    let run = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(script)
            .args([base, ca])
            .output()
    });
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the SDK finished in time")
        .expect("no panic")
        .expect("python ran");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("openai https ok"), "{stdout}");
    assert!(
        stdout.contains("openai RateLimitError over https ok"),
        "{stdout}"
    );
}
