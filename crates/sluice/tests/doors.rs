//! The doors of a running `sluice serve` (SPEC S2, S3): its admin listener takes no
//! orders from a web page (Origin, Sec-Fetch-Site, content type), answers no foreign
//! `Host` (DNS rebinding), and beyond loopback needs a token. Raw requests over
//! loopback against the real binary.

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;
use support::{DataDir, Reply, Sluice, run_to_exit, send};

const KEY: &str = "door-test-key";

/// Header fields of a raw request.
type Fields<'a> = &'a [(&'a str, &'a str)];

fn workspace() -> String {
    use sha2::Digest as _;
    format!("key:{}", hex::encode(sha2::Sha256::digest(KEY.as_bytes())))
}

/// The `evals` usage of the test's workspace, read as curl would.
async fn evals_usage(s: &Sluice, auth: Option<&str>) -> u64 {
    let mut r = Request::get(s.admin_url(&format!("/quotas?workspace={}", workspace())));
    if let Some(a) = auth {
        r = r.header("authorization", a);
    }
    let reply = send(r.body(Full::new(Bytes::new())).expect("request")).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let quotas: Value = reply.json();
    quotas["quotas"]
        .as_array()
        .and_then(|q| q.iter().find(|f| f["family"] == "evals"))
        .and_then(|f| f["usage"].as_u64())
        .expect("an evals usage")
}

async fn spend_evals(s: &Sluice, n: usize) {
    for _ in 0..n {
        let r = send(
            Request::post(s.url("/evals"))
                .header("x-api-key", KEY)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{}")))
                .expect("request"),
        )
        .await;
        assert!(r.status.is_success(), "{} {}", r.status, r.text());
    }
}

/// `POST /quotas/reset` for the test's workspace with `fields` and `body`.
async fn reset(s: &Sluice, fields: &[(&str, &str)], body: &'static [u8]) -> Reply {
    let mut r = Request::post(s.admin_url(&format!("/quotas/reset?workspace={}", workspace())));
    for (k, v) in fields {
        r = r.header(*k, *v);
    }
    send(
        r.body(Full::new(Bytes::from_static(body)))
            .expect("request"),
    )
    .await
}

async fn get_with(url: &str, fields: &[(&str, &str)]) -> Reply {
    let mut r = Request::get(url);
    for (k, v) in fields {
        r = r.header(*k, *v);
    }
    send(r.body(Full::new(Bytes::new())).expect("request")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_the_admin_listener_takes_no_orders_from_a_web_page() {
    let s = Sluice::spawn(&[]);
    spend_evals(&s, 2).await;
    assert_eq!(evals_usage(&s, None).await, 2);
    let own = format!("http://{}", s.start.admin);
    let pages: [(Fields, &[u8], u16); 6] = [
        // A form or a no-cors fetch from another site.
        (
            &[
                ("origin", "http://evil.example"),
                ("content-type", "text/plain"),
            ],
            b"{}",
            403,
        ),
        (
            &[
                ("origin", "http://evil.example"),
                ("content-type", "application/x-www-form-urlencoded"),
            ],
            b"a=b",
            403,
        ),
        (&[("origin", "null")], b"", 403),
        // Another port of the same host is another origin.
        (
            &[
                ("origin", "http://127.0.0.1:1"),
                ("content-type", "application/json"),
            ],
            b"{}",
            403,
        ),
        (&[("sec-fetch-site", "same-site")], b"", 403),
        // No Origin but a body a page could send without a preflight.
        (&[("content-type", "text/plain")], b"{}", 415),
    ];
    for (fields, body, status) in pages {
        let r = reset(&s, fields, body).await;
        assert_eq!(r.status, status, "{fields:?}: {}", r.text());
        assert_eq!(evals_usage(&s, None).await, 2, "{fields:?} changed nothing");
    }
    // DNS rebinding: a page whose name now points here reads nothing.
    for path in ["/status", "/dashboard.json", "/", "/metrics"] {
        let r = get_with(&s.admin_url(path), &[("host", "evil.example:9090")]).await;
        assert_eq!(r.status, 421, "{path}");
        assert_eq!(r.json()["error"]["code"], "misdirected_host");
    }
    let r = get_with(
        &s.admin_url("/status"),
        &[("host", &format!("localhost:{}", s.start.admin.port()))],
    )
    .await;
    assert_eq!(r.status, 200);
    // The page's own origin, as JSON: the dashboard's habit.
    let r = reset(
        &s,
        &[
            ("origin", &own),
            ("sec-fetch-site", "same-origin"),
            ("content-type", "application/json"),
        ],
        b"{}",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(evals_usage(&s, None).await, 0);
    // curl from the machine: no Origin, no body.
    spend_evals(&s, 1).await;
    let r = reset(&s, &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(evals_usage(&s, None).await, 0);
    let log = stderr_when(&s, |log| log.matches("sluice::audit").count() >= 2).await;
    let audit: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sluice::audit"))
        .collect();
    assert_eq!(audit.len(), 2, "one audit line per change: {log}");
    assert!(
        audit[1].contains("loopback from 127.0.0.1")
            && audit[1].contains("evals=1")
            && audit[1].contains(&workspace()),
        "{}",
        audit[1]
    );
}

/// The child's stderr once `ready` holds of it (log lines arrive through a pipe
/// after the answer), or as it is after a bounded wait.
async fn stderr_when(s: &Sluice, ready: impl Fn(&str) -> bool) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let log = s.stderr();
        if ready(&log) || tokio::time::Instant::now() > deadline {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn token_file(dir: &DataDir, text: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(&dir.0).expect("a dir");
    let path = dir.0.join("admin.token");
    std::fs::write(&path, text).expect("written");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path.to_str().expect("UTF-8").to_owned()
}

#[test]
fn s3_an_admin_beyond_loopback_does_not_start_without_a_good_token() {
    let dir = DataDir::new();
    let data = DataDir::new();
    let base = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "0.0.0.0:0",
        "--data-dir",
        data.arg(),
    ];
    let none = run_to_exit(&base, Duration::from_secs(30));
    assert_eq!(none.status.code(), Some(2), "{}", none.stderr);
    assert!(
        none.stderr.contains("--admin-token-file"),
        "{}",
        none.stderr
    );
    let missing = dir.0.join("missing").to_str().expect("UTF-8").to_owned();
    let empty = token_file(&dir, "\n", 0o600);
    let mut args = base.to_vec();
    args.extend(["--admin-token-file", &missing]);
    let f = run_to_exit(&args, Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(2), "{}", f.stderr);
    assert!(f.stderr.contains(&missing), "{}", f.stderr);
    let mut args = base.to_vec();
    args.extend(["--admin-token-file", &empty]);
    let f = run_to_exit(&args, Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(2), "{}", f.stderr);
    assert!(
        f.stderr.contains(&empty) && f.stderr.contains("no token"),
        "{}",
        f.stderr
    );
    let open = token_file(&dir, "s3cret\n", 0o644);
    let mut args = base.to_vec();
    args.extend(["--admin-token-file", &open]);
    let f = run_to_exit(&args, Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(2), "{}", f.stderr);
    assert!(
        f.stderr.contains(&open) && f.stderr.contains("every user"),
        "{}",
        f.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_with_a_token_every_admin_request_carries_it_or_its_cookie() {
    let dir = DataDir::new();
    let file = token_file(&dir, "s3cret-token\n", 0o600);
    let s = Sluice::spawn(&[
        "--admin",
        "0.0.0.0:0",
        "--admin-token-file",
        &file,
        "--metrics-open",
    ]);
    let status = s.admin_url("/status");
    let r = get_with(&status, &[]).await;
    assert_eq!(r.status, 401);
    assert_eq!(
        r.header("www-authenticate"),
        Some("Bearer realm=\"sluice\"")
    );
    let page = get_with(&s.admin_url("/"), &[("accept", "text/html")]).await;
    assert_eq!(page.status, 401);
    assert!(
        page.text().contains("/login"),
        "the dashboard asks for the token"
    );
    assert_eq!(
        get_with(&status, &[("authorization", "Bearer s3cret-token")])
            .await
            .status,
        200
    );
    assert_eq!(
        get_with(&s.admin_url("/metrics"), &[]).await.status,
        200,
        "--metrics-open"
    );
    spend_evals(&s, 1).await;
    assert_eq!(
        reset(&s, &[], b"").await.status,
        401,
        "a change without the token"
    );
    assert_eq!(evals_usage(&s, Some("Bearer s3cret-token")).await, 1);

    // The login page trades the token once for an HttpOnly, SameSite=Strict cookie.
    let login = |token: &'static str| {
        let url = s.admin_url("/login");
        async move {
            send(
                Request::post(url)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(
                        serde_json::json!({ "token": token }).to_string(),
                    )))
                    .expect("request"),
            )
            .await
        }
    };
    let ok = login("s3cret-token").await;
    assert_eq!(ok.status, 204);
    let cookie = ok.header("set-cookie").expect("a cookie").to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert!(
        !cookie.contains("s3cret-token"),
        "the cookie is not the token"
    );
    let pair = cookie.split(';').next().expect("name=value").to_owned();
    let r = reset(&s, &[("cookie", &pair)], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(evals_usage(&s, Some("Bearer s3cret-token")).await, 0);
    let log = stderr_when(&s, |log| log.contains("who=token")).await;
    assert!(
        log.lines()
            .any(|l| l.contains("sluice::audit") && l.contains("what=\"quota reset\"")),
        "{log}"
    );

    // The cookie lasts half a day, and a logout ends it: a copy of it (taken from
    // the browser) is refused from then on, and counts as a wrong token.
    assert!(
        cookie.contains(&format!("Max-Age={}", sluice_door::SESSION_SECONDS)),
        "{cookie}"
    );
    let again = login("s3cret-token").await;
    let other = again.header("set-cookie").expect("a cookie").to_owned();
    let other = other.split(';').next().expect("name=value").to_owned();
    assert_ne!(pair, other, "each login its own session");
    let logout = send(
        Request::post(s.admin_url("/logout"))
            .header("cookie", &pair)
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(logout.status, 204, "{}", logout.text());
    assert!(
        logout
            .header("set-cookie")
            .is_some_and(|c| c.contains("Max-Age=0"))
    );
    assert_eq!(get_with(&status, &[("cookie", &pair)]).await.status, 401);
    assert_eq!(
        get_with(&status, &[("cookie", &other)]).await.status,
        200,
        "another session goes on"
    );

    // Ten wrong tokens a minute (the ended cookie was one), and the address is
    // refused at once, right token too.
    for i in 1..10 {
        let r = get_with(&status, &[("authorization", "Bearer guess")]).await;
        assert_eq!(r.status, 401, "guess {i}");
    }
    let r = get_with(&status, &[("authorization", "Bearer s3cret-token")]).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    assert_eq!(login("s3cret-token").await.status, 429);
}
