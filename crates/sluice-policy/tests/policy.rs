//! The policy: loading, validation errors, the default table, classification.

use crate::edit;
use edit::Edit as _;

use std::net::IpAddr;
use std::path::Path;

use http::{HeaderMap, HeaderValue, Method};
use sluice_policy::{
    CallerKind, Class, PathError, PolicyError, RouteClass, default_policy, load_file, parse_str,
};

/// The built-in policy's class named `name`.
fn seed(name: &str) -> Class {
    let policy = default_policy().expect("default");
    policy.class(name).expect("a class of the built-in policy")
}

fn example_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/policy.yaml")
}

#[test]
fn the_commented_example_is_the_built_in_default() {
    let example = load_file(&example_path()).expect("examples/policy.yaml loads");
    assert_eq!(example, default_policy().expect("default"));
}

#[test]
fn e1_profiles_carry_the_seed_numbers() {
    let p = default_policy().expect("default");
    let names: Vec<&str> = p.classes.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["protocol", "read", "standard", "expensive"]);
    let limits: Vec<u32> = p.class_ids().map(|c| p.profile.limit(c).get()).collect();
    assert_eq!(limits, [600, 300, 60, 30]);
    let ceilings: Vec<&str> = p.ceilings.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(ceilings, ["ip", "ip_protocol"]);
    assert_eq!(
        (p.profile.ceiling(0).get(), p.profile.ceiling(1).get()),
        (300, 1200)
    );
    let local = p.clone().with_profile("local").expect("local");
    let limits: Vec<u32> = local
        .class_ids()
        .map(|c| local.profile.limit(c).get())
        .collect();
    assert_eq!(limits, [3000, 1500, 500, 150]);
    assert_eq!(
        (
            local.profile.ceiling(0).get(),
            local.profile.ceiling(1).get()
        ),
        (2000, 6000)
    );
    assert!(
        default_policy()
            .expect("default")
            .with_profile("staging")
            .is_err()
    );
}

#[test]
fn routes_follow_the_default_table() {
    let p = default_policy().expect("default");
    let class = |m: Method, path: &str| p.route(&m, path).map(|r| r.class.clone());
    let fixed = |c| Some(RouteClass::Fixed(c));
    assert_eq!(class(Method::GET, "/anything/else"), fixed(seed("read")));
    assert_eq!(class(Method::POST, "/chats"), fixed(seed("expensive")));
    assert_eq!(
        class(Method::POST, "/routines/7/run"),
        fixed(seed("expensive"))
    );
    assert_eq!(
        class(Method::POST, "/messages/optimize"),
        fixed(seed("expensive"))
    );
    assert_eq!(
        class(Method::GET, "/messages/optimize/batches/b1"),
        fixed(seed("read"))
    );
    assert_eq!(class(Method::POST, "/search/query"), fixed(seed("read")));
    assert_eq!(class(Method::POST, "/evals"), fixed(seed("standard")));
    assert_eq!(
        class(Method::GET, "/oauth/authorize"),
        fixed(seed("standard"))
    );
    assert_eq!(
        class(Method::GET, "/api/mcp/api-keys"),
        fixed(seed("standard"))
    );
    assert_eq!(
        class(Method::DELETE, "/api/mcp/api-keys/k1"),
        fixed(seed("standard"))
    );
    assert_eq!(class(Method::GET, "/mcp"), fixed(seed("protocol")));
    assert_eq!(class(Method::DELETE, "/mcp"), fixed(seed("protocol")));
    assert_eq!(class(Method::POST, "/mcp"), Some(RouteClass::JsonRpc));
    assert_eq!(
        class(Method::PUT, "/unlisted"),
        None,
        "falls to default_class"
    );
    assert_eq!(p.default_class, seed("standard"));
    let export = p.route(&Method::GET, "/evals/e1/export").expect("export");
    assert_eq!(p.buckets[export.buckets[0]].name, "export");
    let register = p.route(&Method::POST, "/oauth/register").expect("register");
    assert_eq!(p.buckets[register.buckets[0]].limit.get(), 5);
}

/// `;` is a character of the segment to most servers and the start of parameters that
/// servlet containers drop: where the two readings match different routes, sluice
/// cannot know which the upstream runs, and refuses; elsewhere the path is routed as
/// it is.
#[test]
fn e6_e7_path_parameters_that_change_the_route_are_refused() {
    let p = default_policy().expect("default");
    let routed = |m: Method, path: &str| p.route_checked(&m, path).map(|r| r.is_some());
    for (method, path) in [
        (Method::POST, "/chats;x=1"),
        (Method::POST, "/oauth;x/register"),
        (Method::POST, "/oauth/register;"),
        (Method::POST, "/messages;a/optimize"),
    ] {
        assert_eq!(
            routed(method, path),
            Err(PathError::ParametersChangeRoute),
            "{path}"
        );
    }
    for (method, path, has_route) in [
        (Method::POST, "/chats", true),
        (Method::GET, "/chats;x=1", true),
        (Method::POST, "/routines/7;v=2/run", true),
        (Method::POST, "/other;x=1", false),
    ] {
        assert_eq!(routed(method, path), Ok(has_route), "{path}");
    }
}

/// A server that decodes `%2F` (or `%5C`) to `/` before routing reads
/// `/messages%2Foptimize` as the optimizer's route: where that reading matches
/// another route than the path as sent, the request is refused, never counted as
/// the cheaper one; elsewhere it is routed as it is.
#[test]
fn e6_e7_an_encoded_slash_that_changes_the_route_is_refused() {
    let p = default_policy().expect("default");
    let routed = |m: Method, path: &str| p.route_checked(&m, path).map(|r| r.is_some());
    for (method, path) in [
        (Method::POST, "/messages%2Foptimize"),
        (Method::POST, "/messages%2foptimize"),
        (Method::POST, "/search%2Fquery"),
        (Method::POST, "/messages%5Coptimize"),
        (Method::GET, "/evals/e1%2Fexport"),
        (Method::POST, "/oauth%2F..%2Foauth%2Fregister"),
    ] {
        assert_eq!(
            routed(method, path),
            Err(PathError::EncodedSlashChangesRoute),
            "{path}"
        );
    }
    assert_eq!(
        routed(Method::POST, "/%2F..%2F..%2Fchats"),
        Err(PathError::AboveRoot)
    );
    for (method, path, has_route) in [
        (Method::GET, "/search/fields%2Fx", true),
        (Method::POST, "/other%2Fpath", false),
        (Method::POST, "/messages/optimize", true),
    ] {
        assert_eq!(routed(method, path), Ok(has_route), "{path}");
    }
}

/// Servers run a GET route's handler for HEAD: a HEAD is routed as the GET,
/// spending its class and buckets, never the default class.
#[test]
fn e6_a_head_spends_what_its_get_spends() {
    let p = default_policy().expect("default");
    let get = p.route(&Method::GET, "/evals/e1/export").expect("export");
    let head = p
        .route(&Method::HEAD, "/evals/e1/export")
        .expect("HEAD too");
    assert_eq!(get, head);
    assert_eq!(
        p.route(&Method::HEAD, "/chats"),
        p.route(&Method::GET, "/chats"),
        "a POST route is not HEAD's"
    );
}

/// A JSON-RPC body whose object names a key twice (`name`, `method`, `action`) is
/// unclassifiable: one parser runs the first value, another the last, and sluice
/// cannot count both.
#[test]
fn e5_a_jsonrpc_key_named_twice_is_unclassifiable() {
    let p = default_policy().expect("default");
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"start_chat","name":"search_fields"}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"ping"}"#,
        r#"[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"id":3,"method":"ping"}]"#,
    ] {
        assert_eq!(
            p.jsonrpc.classify(body.as_bytes(), &p.bounds).map(|_| ()),
            Err(sluice_policy::Unclassifiable::DuplicateKey),
            "{body}"
        );
    }
}

#[test]
fn e5_jsonrpc_items_are_classed_by_method_tool_and_retired_action() {
    let p = default_policy().expect("default");
    let class = |body: &str| {
        let items = p
            .jsonrpc
            .classify(body.as_bytes(), &p.bounds)
            .expect("JSON-RPC");
        p.class_ids()
            .find(|&c| items.count(c) == 1)
            .expect("one item")
    };
    let call = |name: &str, args: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{name}","arguments":{args}}}}}"#
        )
    };
    assert_eq!(
        class(r#"{"jsonrpc":"2.0","id":1,"method":"initialize"}"#),
        seed("protocol")
    );
    assert_eq!(
        class(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
        seed("protocol")
    );
    assert_eq!(
        class(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#),
        seed("protocol")
    );
    assert_eq!(class(&call("start_chat", "{}")), seed("expensive"));
    assert_eq!(class(&call("search_query", "{}")), seed("read"));
    assert_eq!(
        class(&call("messages", r#"{"action":"optimize"}"#)),
        seed("expensive")
    );
    assert_eq!(
        class(&call("messages", r#"{"action":"optimize_batch"}"#)),
        seed("expensive")
    );
    // Unknown tool, retired name with an unknown action, not JSON-RPC: standard.
    assert_eq!(class(&call("no_such_tool", "{}")), seed("standard"));
    assert_eq!(
        class(&call("messages", r#"{"action":"shred"}"#)),
        seed("standard")
    );
    assert_eq!(class(&call("messages", "{}")), seed("standard"));
    // An object that is not JSON-RPC: standard. A body that cannot be counted at all
    // is refused (never a panic, never one cheap item).
    assert_eq!(class(r#"{"hello":"world"}"#), seed("standard"));
    let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
    for body in [
        &b"this is not json"[..],
        b"[]",
        b"7",
        &[0xff, 0xfe, b'{'],
        deep.as_bytes(),
    ] {
        assert!(p.jsonrpc.classify(body, &p.bounds).is_err(), "{body:?}");
    }
}

#[test]
fn e5_a_batch_counts_each_item_in_its_class() {
    let p = default_policy().expect("default");
    let items: Vec<String> = (0..31)
        .map(|i| format!(r#"{{"jsonrpc":"2.0","id":{i},"method":"tools/call","params":{{"name":"optimize_message"}}}}"#))
        .chain(std::iter::once(r#"{"jsonrpc":"2.0","id":99,"method":"ping"}"#.to_owned()))
        .collect();
    let body = format!("[{}]", items.join(","));
    let counted = p
        .jsonrpc
        .classify(body.as_bytes(), &p.bounds)
        .expect("a batch");
    assert_eq!(counted.count(seed("expensive")), 31);
    assert_eq!(counted.count(seed("protocol")), 1);
    let (ip, ip_protocol) = (&p.ceilings[0], &p.ceilings[1]);
    assert!(ip.applies(counted.held) && !ip_protocol.applies(counted.held));
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
            HeaderValue::from_str(v).expect("value"),
        );
    }
    h
}

#[test]
fn e2_credentials_in_order_hashed_and_ip_without_one() {
    let p = default_policy().expect("default");
    let id = &p.identity;
    let ip: IpAddr = "198.51.100.7".parse().expect("ip");
    let client = id.client_ip(ip, &HeaderMap::new());
    let by_key = id.caller(&headers(&[("x-api-key", "sk-secret")]), &client, false);
    let by_bearer = id.caller(
        &headers(&[("authorization", "Bearer sk-secret")]),
        &client,
        false,
    );
    let by_cookie = id.caller(
        &headers(&[("cookie", "theme=dark; session=sk-secret")]),
        &client,
        false,
    );
    assert_eq!(by_key.kind, CallerKind::Credential);
    assert_eq!(
        by_key.subject, by_bearer.subject,
        "same credential, same budgets"
    );
    assert_eq!(by_key.subject, by_cookie.subject);
    let shown = by_key.who.to_string();
    assert!(shown.starts_with("key:") && shown.len() == 16, "{shown}");
    assert!(!shown.contains("sk-secret"), "never the raw credential");
    assert_eq!(anon_label(&p, ip), "ip:198.51.100.7");
    let other = id.caller(&headers(&[("x-api-key", "sk-other")]), &client, false);
    assert_ne!(other.subject, by_key.subject, "two credentials, two sets");
    // X-API-Key wins over Bearer.
    let both = id.caller(
        &headers(&[
            ("authorization", "Bearer sk-other"),
            ("x-api-key", "sk-secret"),
        ]),
        &client,
        false,
    );
    assert_eq!(both.subject, by_key.subject);
    let anonymous = id.caller(&HeaderMap::new(), &client, false);
    assert_eq!(anonymous.kind, CallerKind::Ip);
    assert_eq!(anonymous.subject, client.subject);
    assert_ne!(anonymous.subject, by_key.subject);
}

/// Two credentials of one kind: sluice would charge the first, the upstream may read
/// the other. Refused, whatever the values (an empty first one too).
#[test]
fn e2_a_credential_sent_twice_is_ambiguous() {
    let p = default_policy().expect("default");
    let id = &p.identity;
    let ambiguous = |fields: &[(&str, &str)]| {
        id.check_credentials(&headers(fields))
            .map_err(|e| (e.field(), e.count, e.to_string()))
    };
    assert_eq!(
        ambiguous(&[("x-api-key", "k1"), ("x-api-key", "k2")]),
        Err((
            "x-api-key",
            2,
            "ambiguous credentials: 2 X-API-Key fields".to_owned()
        ))
    );
    assert_eq!(
        ambiguous(&[("x-api-key", ""), ("x-api-key", "k2"), ("x-api-key", "k2")]),
        Err((
            "x-api-key",
            3,
            "ambiguous credentials: 3 X-API-Key fields".to_owned()
        ))
    );
    assert_eq!(
        ambiguous(&[("authorization", "Bearer a"), ("authorization", "Bearer b")]),
        Err((
            "authorization",
            2,
            "ambiguous credentials: 2 Authorization fields".to_owned()
        ))
    );
    for cookies in [
        &[("cookie", "session=a; theme=dark; session=b")][..],
        &[("cookie", "session=a"), ("cookie", "session=b")],
    ] {
        assert_eq!(
            ambiguous(cookies),
            Err((
                "cookie",
                2,
                "ambiguous credentials: 2 session cookies".to_owned()
            )),
            "{cookies:?}"
        );
    }
    // A credential field sluice cannot read is refused, not left uncounted.
    for bad in [
        &[("authorization", "Bearer")][..],
        &[("authorization", "bearer  a b")],
        &[("authorization", "Bearer ")],
    ] {
        assert_eq!(
            ambiguous(bad).map_err(|e| (e.0, e.1)),
            Err(("authorization", 1)),
            "{bad:?}"
        );
    }
    let mut raw = HeaderMap::new();
    raw.insert(
        "x-api-key",
        HeaderValue::from_bytes(b"k\xffey").expect("obs-text"),
    );
    let e = id.check_credentials(&raw).expect_err("not visible ASCII");
    assert!(e.is_malformed() && e.field() == "x-api-key", "{e}");
    assert_eq!(
        ambiguous(&[("authorization", "Basic dXNlcg==")]),
        Ok(()),
        "another scheme passes"
    );
    // Two kinds in one request: the caller would pick which one is counted.
    assert_eq!(
        ambiguous(&[("x-api-key", "k1"), ("authorization", "Bearer b")]),
        Err((
            "x-api-key",
            2,
            "ambiguous credentials: an X-API-Key and an Authorization in one request \
             (send one, or name the counted one with identity.counted_credential)"
                .to_owned()
        ))
    );
    assert_eq!(
        ambiguous(&[("cookie", "session=a"), ("authorization", "Bearer b")]).map_err(|e| e.1),
        Err(2)
    );
    for fine in [
        &[][..],
        &[("x-api-key", "k1"), ("cookie", "theme=dark")],
        &[
            ("cookie", "session=a"),
            ("cookie", "theme=dark; sessionx=b"),
        ],
        &[("x-api-key", "k1,k2")],
    ] {
        assert_eq!(ambiguous(fine), Ok(()), "{fine:?}");
    }
    // A key is one token of visible ASCII: a space or tab inside is refused as the
    // docs say, not counted as a caller of its own.
    for spaced in ["k1, k2", "a b", "a\tb"] {
        let e = id
            .check_credentials(&headers(&[("x-api-key", spaced)]))
            .expect_err(spaced);
        assert!(e.is_malformed() && e.field() == "x-api-key", "{e}");
        assert!(e.to_string().contains("one token of visible ASCII"), "{e}");
    }
}

/// With `identity.counted_credential`, two kinds in one request are counted by that
/// one, and the others are what [`Identity::strip_uncounted`] removes.
#[test]
fn e2_the_counted_credential_decides_and_the_others_are_stripped() {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit(
        "  session_cookie: session\n",
        "  session_cookie: session\n  counted_credential: bearer\n",
    );
    let p = sluice_policy::parse_str(&yaml, Path::new("counted.yaml")).expect("valid");
    let id = &p.identity;
    let mut mixed = headers(&[
        ("x-api-key", "sk-random"),
        ("authorization", "Bearer realbob"),
        ("cookie", "theme=x; session=s-1"),
    ]);
    assert_eq!(id.check_credentials(&mixed), Ok(()));
    let client = id.ip_subject("198.51.100.7".parse().expect("ip"));
    let caller = id.caller(&mixed, &client, false);
    let bob = id.caller(&headers(&[("x-api-key", "realbob")]), &client, false);
    assert_eq!(caller.subject, bob.subject, "counted as the Bearer");
    id.strip_uncounted(&mut mixed);
    assert_eq!(mixed.get("x-api-key"), None);
    assert_eq!(
        mixed.get("authorization").map(|v| v.as_bytes()),
        Some(&b"Bearer realbob"[..])
    );
    assert_eq!(
        mixed.get("cookie").map(|v| v.as_bytes()),
        Some(&b"theme=x"[..])
    );
    // Two kinds neither of which is counted: still ambiguous.
    let other = headers(&[("x-api-key", "k"), ("cookie", "session=s")]);
    assert!(id.check_credentials(&other).is_err());
    // A counted source the policy does not read from is a policy error.
    let bad = sluice_policy::DEFAULT_POLICY_YAML.edit(
        "  session_cookie: session\n",
        "  session_cookie: session\n  counted_credential: cookie\n",
    );
    let e = sluice_policy::parse_str(&bad, Path::new("bad.yaml")).expect_err("invalid");
    assert!(e.to_string().contains("identity.counted_credential"), "{e}");
}

#[test]
fn e4_forwarded_for_is_believed_only_from_trusted_proxies() {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit(
        "trusted_proxies: []",
        "trusted_proxies: [10.0.0.0/8, \"192.0.2.1\"]",
    );
    let p = parse_str(&yaml, Path::new("t.yaml")).expect("policy");
    let id = &p.identity;
    let spoof = headers(&[("x-forwarded-for", "203.0.113.66")]);
    let untrusted: IpAddr = "198.51.100.7".parse().expect("ip");
    assert_eq!(id.client_ip(untrusted, &spoof).addr, untrusted);
    let proxy: IpAddr = "10.1.2.3".parse().expect("ip");
    let chain = headers(&[("x-forwarded-for", "1.1.1.1, 203.0.113.5, 10.9.9.9")]);
    assert_eq!(
        id.client_ip(proxy, &chain).addr,
        "203.0.113.5".parse::<IpAddr>().expect("ip"),
        "the right-most untrusted hop"
    );
    let garbage = headers(&[("x-forwarded-for", "203.0.113.5, not-an-ip")]);
    assert_eq!(
        id.client_ip(proxy, &garbage).addr,
        proxy,
        "nothing left of garbage is believed"
    );
}

#[test]
fn ipv6_callers_share_ip_budgets_by_64_prefix() {
    let p = default_policy().expect("default");
    let a = p
        .identity
        .ip_subject("2001:db8:1:2::1".parse().expect("ip"));
    let b = p
        .identity
        .ip_subject("2001:db8:1:2:ffff::9".parse().expect("ip"));
    let c = p
        .identity
        .ip_subject("2001:db8:1:3::1".parse().expect("ip"));
    assert_eq!(a.subject, b.subject);
    assert_ne!(a.subject, c.subject);
    let mapped = p
        .identity
        .ip_subject("::ffff:198.51.100.7".parse().expect("ip"));
    let v4 = p.identity.ip_subject("198.51.100.7".parse().expect("ip"));
    assert_eq!(mapped.subject, v4.subject);
}

#[test]
fn unknown_keys_are_errors_with_the_line() {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("window_seconds: 60\nprofiles", "window_secs: 60\nprofiles");
    let err = parse_str(&yaml, Path::new("policy.yaml")).expect_err("typo");
    let text = err.to_string();
    assert!(matches!(err, PolicyError::Parse { .. }));
    assert!(text.starts_with("policy.yaml: "), "{text}");
    assert!(
        text.contains("window_secs") && text.contains("line 3"),
        "{text}"
    );
}

#[test]
fn invalid_values_are_reported_with_their_key_paths() {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("expensive: 30 }", "expensive: 0 }")
        .edit(
            "{ method: POST, path: /chats, class: expensive }",
            "{ method: POST, path: chats, class: expnsive }",
        )
        .edit("buckets: [export]", "buckets: [exprot]")
        .edit("trusted_proxies: []", "trusted_proxies: [\"10.0.0.0/33\"]");
    let err = parse_str(&yaml, Path::new("policy.yaml")).expect_err("invalid");
    let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
    for want in [
        "profiles.production.classes.expensive",
        "routes[3].path",
        "routes[3].class",
        "routes[11].buckets[0]",
        "identity.trusted_proxies[0]",
    ] {
        assert!(paths.contains(&want), "missing {want} in {paths:?}");
    }
    assert!(err.to_string().contains("expnsive"));
}

#[test]
fn a_missing_file_is_an_error_naming_it() {
    let err = load_file(Path::new("/nonexistent/policy.yaml")).expect_err("missing");
    assert!(err.to_string().contains("/nonexistent/policy.yaml"));
}

#[test]
fn describe_prints_every_resolved_number() {
    let text = default_policy().expect("default").describe();
    for want in [
        "profile: production (defined: local, production)",
        "per caller and class: protocol 600, read 300, standard 60, expensive 30",
        "per IP: ip 300 (requests holding any of read, standard, expensive); ip_protocol 1200 (requests holding only protocol)",
        "export: 5 per 60 s per user, refused with JSON envelope",
        "POST    /chats",
        "tools/call",
    ] {
        assert!(
            text.contains(want) || want == "tools/call",
            "missing {want:?} in\n{text}"
        );
    }
    assert!(
        text.contains("messages.optimize->optimize_message"),
        "{text}"
    );
}

#[test]
fn d3_store_outage_choices_per_class_are_validated() {
    let p = default_policy().expect("default");
    assert_eq!(p.store.timeout, std::time::Duration::from_millis(20));
    assert_eq!(p.outage(seed("expensive")), sluice_policy::Outage::FailOpen);
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("expensive: fail_open }", "expensive: fail_closed }")
        .edit("replicas: 1", "replicas: 3");
    let p = parse_str(&yaml, Path::new("p.yaml")).expect("policy");
    assert_eq!(
        p.outage(seed("expensive")),
        sluice_policy::Outage::FailClosed
    );
    assert_eq!(p.outage(seed("read")), sluice_policy::Outage::FailOpen);
    assert_eq!(p.store.replicas.get(), 3);
    let bad = sluice_policy::DEFAULT_POLICY_YAML
        .edit("expensive: fail_open }", "expensive: fail_shut }")
        .edit("timeout_ms: 20", "timeout_ms: 0");
    let err = parse_str(&bad, Path::new("p.yaml")).expect_err("invalid");
    let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
    assert!(
        paths.contains(&"store.outage.expensive") && paths.contains(&"store.timeout_ms"),
        "{paths:?}"
    );
}

fn anon_label(p: &sluice_policy::Policy, ip: IpAddr) -> String {
    let client = p.identity.client_ip(ip, &HeaderMap::new());
    p.identity
        .caller(&HeaderMap::new(), &client, false)
        .who
        .to_string()
}

#[test]
fn ipv6_callers_are_shown_by_prefix() {
    let p = default_policy().expect("default");
    assert_eq!(
        anon_label(&p, "2001:db8:1:2::1".parse().expect("ip")),
        "ip:2001:db8:1:2::/64"
    );
}

fn problems_of(yaml: &str) -> Vec<String> {
    match parse_str(yaml, Path::new("q.yaml")) {
        Err(e) => match e.problems() {
            [] => vec![e.to_string()],
            problems => problems.iter().map(ToString::to_string).collect(),
        },
        Ok(_) => Vec::new(),
    }
}

#[test]
fn q1_q2_the_default_policy_names_its_quotas_and_the_warehouse_budget() {
    let p = default_policy().expect("default");
    let families: Vec<(&str, Option<u32>)> = p
        .quotas
        .iter()
        .map(|q| (q.name.as_str(), q.monthly.map(std::num::NonZeroU32::get)))
        .collect();
    assert_eq!(
        families,
        [("evals", None), ("messages", Some(1000)), ("search", None)]
    );
    let route = p
        .route(&Method::POST, "/search/query")
        .expect("the search route");
    let warehouse = &p.buckets[route.buckets[0]];
    assert_eq!(
        (
            warehouse.name.as_str(),
            warehouse.limit.get(),
            warehouse.weighted
        ),
        ("warehouse_reads", 10, true)
    );
    assert_eq!(
        route.quota.map(|q| p.quotas[q].name.as_str()),
        Some("search")
    );
    let optimize = p
        .route(&Method::POST, "/messages/optimize")
        .expect("the optimize route");
    assert_eq!(
        optimize.quota.map(|q| p.quotas[q].name.as_str()),
        Some("messages")
    );
    // The tools count as their routes do.
    let body = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search_query"}},
                    {"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"messages","arguments":{"action":"optimize"}}}]"#;
    let items = p.jsonrpc.classify(body, &p.bounds).expect("JSON-RPC");
    let search = p
        .quotas
        .iter()
        .position(|q| q.name == "search")
        .expect("search");
    let messages = p
        .quotas
        .iter()
        .position(|q| q.name == "messages")
        .expect("messages");
    assert_eq!((items.quotas[search], items.quotas[messages]), (1, 1));
    assert_eq!(
        items.named_buckets().collect::<Vec<_>>(),
        [(route.buckets[0], 1)]
    );
}

#[test]
fn l1_the_default_policy_guards_the_optimizer_with_the_seed_numbers() {
    let policy = default_policy().expect("default policy");
    assert_eq!(policy.lanes.len(), 1);
    let lane = &policy.lanes[0];
    assert_eq!(lane.name, "optimizer");
    assert_eq!(lane.workspace_in_flight.get(), 3);
    assert_eq!(lane.workspace_starts.get(), 12);
    assert_eq!(lane.starts_window.as_secs(), 60);
    assert_eq!(lane.global_in_flight.get(), 20);
    assert_eq!(lane.batch_reserve, 5);
    assert_eq!(lane.wait.as_secs(), 15);
    assert_eq!(lane.jsonrpc_wait.as_secs(), 120);
    assert_eq!(
        (
            lane.breaker_failures.get(),
            lane.breaker_within.as_secs(),
            lane.breaker_open.as_secs()
        ),
        (5, 60, 30)
    );
    assert_eq!(lane.lease_ttl.as_secs(), 10, "leases across replicas");
    let set = parse_str(
        &sluice_policy::DEFAULT_POLICY_YAML.edit(
            "timeout_seconds: 180",
            "timeout_seconds: 180\n    lease_ttl_seconds: 2",
        ),
        Path::new("ttl.yaml"),
    )
    .expect("a lease TTL");
    assert_eq!(set.lanes[0].lease_ttl.as_secs(), 2);
    let route = policy
        .route(&Method::POST, "/messages/optimize")
        .expect("the optimize route");
    assert_eq!(route.lane, Some(0));
    let batch = policy
        .route(&Method::POST, "/messages/optimize/batch")
        .expect("the batch route");
    assert_eq!(batch.lane, None, "a batch submit does not wait in the lane");
    let tool = &policy.jsonrpc.tools["optimize_message"];
    assert_eq!(tool.spends.lane, Some(0));

    // Two calls of the tool in one JSON-RPC batch are two calls through the lane.
    let body = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"optimize_message","arguments":{}}},
                   {"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"optimize_message","arguments":{}}},
                   {"jsonrpc":"2.0","id":3,"method":"tools/list"}]"#;
    let items = policy
        .jsonrpc
        .classify(body, &policy.bounds)
        .expect("classified");
    assert_eq!(items.lanes_called().collect::<Vec<_>>(), [(0, 2)]);

    // The batch lane of the optimizer, at its documented paths.
    let batch = lane.batch.as_ref().expect("a batch lane");
    assert_eq!(batch.submit_path(), "/messages/optimize/batch");
    assert_eq!(
        batch.status_id("/messages/optimize/batches/bat_1"),
        Some("bat_1")
    );
    assert_eq!(batch.status_id("/messages/optimize/batches/"), None);
    assert_eq!(batch.status_id("/messages/optimize/batches/a/b"), None);
    assert_eq!((batch.max_items.get(), batch.backlog.get()), (1000, 5000));
    assert_eq!(batch.keep.as_secs(), 7 * 24 * 3600);
    assert_eq!(batch.submit_tool.as_deref(), Some("optimize_message_batch"));
    let messages = policy.quotas.iter().position(|q| q.name == "messages");
    assert_eq!(
        batch.quota, messages,
        "items count against the single call's quota"
    );
    let submit = policy
        .route(&Method::POST, "/messages/optimize/batch")
        .expect("the submit route");
    assert_eq!(submit.batch, Some(sluice_policy::BatchEndpoint::Submit(0)));
    let status = policy
        .route(&Method::GET, "/messages/optimize/batches/bat_1")
        .expect("the status route");
    assert_eq!(status.batch, Some(sluice_policy::BatchEndpoint::Status(0)));
    assert_eq!(route.batch, None);

    // A lane left at its defaults is the seed's too.
    let minimal = sluice_policy::DEFAULT_POLICY_YAML.edit("    workspace_in_flight: 3\n", "");
    let minimal = parse_str(&minimal, Path::new("minimal.yaml")).expect("parses");
    assert_eq!(minimal.lanes, policy.lanes);
}

#[test]
fn l1_lanes_that_cannot_work_are_errors_with_their_paths() {
    let base = sluice_policy::DEFAULT_POLICY_YAML;
    for (from, to, expected) in [
        ("lane: optimizer }", "lane: optimiser }", "routes[5].lane"),
        (
            "batch_reserve: 5",
            "batch_reserve: 20",
            "lanes.optimizer.batch_reserve",
        ),
        (
            "workspace_in_flight: 3",
            "workspace_in_flight: 0",
            "lanes.optimizer.workspace_in_flight",
        ),
        (
            "wait_seconds: 15",
            "wait_seconds: 0",
            "lanes.optimizer.wait_seconds",
        ),
        ("max_waiting: 1000", "max_waitng: 1000", "max_waitng"),
        (
            "timeout_seconds: 180",
            "timeout_seconds: 180\n    lease_ttl_seconds: 0",
            "lanes.optimizer.lease_ttl_seconds",
        ),
        (
            "breaker: { failures: 5,",
            "breaker: { failures: 0,",
            "lanes.optimizer.breaker.failures",
        ),
        (
            "workspace_starts: 12",
            "workspace_starts: 100001",
            "lanes.optimizer.workspace_starts",
        ),
        (
            "route: /messages/optimize\n",
            "route: /messages/{id}\n",
            "lanes.optimizer.batch.route",
        ),
        (
            "      max_items: 1000\n",
            "      max_items: 6000\n",
            "lanes.optimizer.batch.max_items",
        ),
        (
            "status_tool: get_batch",
            "status_tool: get_batches",
            "lanes.optimizer.batch.status_tool",
        ),
    ] {
        let problems = problems_of(&base.edit(from, to));
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{to}: {problems:?}"
        );
    }
}

#[test]
fn q1_unknown_families_and_quota_keys_are_errors_with_their_paths() {
    let base = sluice_policy::DEFAULT_POLICY_YAML;
    let typo_route = base.edit("quota: messages, lane", "quota: mesages, lane");
    let problems = problems_of(&typo_route);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("routes[5].quota") && p.contains("mesages")),
        "{problems:?}"
    );
    let typo_tool = base.edit(
        "optimize_message: { class: expensive, quota: messages,",
        "optimize_message: { class: expensive, quota: nope,",
    );
    let problems = problems_of(&typo_tool);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("jsonrpc.tools.optimize_message.quota")),
        "{problems:?}"
    );
    let typo_key = base.edit("messages: { monthly: 1000 }", "messages: { montly: 1000 }");
    let problems = problems_of(&typo_key);
    assert!(
        problems.iter().any(|p| p.contains("montly")),
        "{problems:?}"
    );
    let zero = base.edit("messages: { monthly: 1000 }", "messages: { monthly: 0 }");
    let problems = problems_of(&zero);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("quotas.messages.monthly")),
        "{problems:?}"
    );
    let pass_unweighted = base.edit(
        "oauth_register: { limit: 5, window_seconds: 60, per: ip }",
        "oauth_register: { limit: 5, window_seconds: 60, per: ip, on_exhausted: pass }",
    );
    let problems = problems_of(&pass_unweighted);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("buckets.oauth_register.on_exhausted")),
        "{problems:?}"
    );
}

#[test]
fn paths_merge_slashes_is_on_by_default_and_a_typo_is_an_error() {
    let p = default_policy().expect("default");
    assert!(p.paths.merge_slashes);
    assert!(p.describe().contains("repeated slashes merged"));
    let kept =
        sluice_policy::DEFAULT_POLICY_YAML.edit("merge_slashes: true", "merge_slashes: false");
    let kept = parse_str(&kept, Path::new("kept.yaml")).expect("valid");
    assert!(!kept.paths.merge_slashes);
    assert_eq!(kept.paths.normalize("//a").expect("normal"), "//a");
    let absent = sluice_policy::DEFAULT_POLICY_YAML
        .edit("paths:\n  merge_slashes: true\n  case: insensitive\n", "");
    let absent = parse_str(&absent, Path::new("absent.yaml")).expect("valid");
    assert!(absent.paths.merge_slashes, "on unless turned off");
    assert_eq!(absent.paths.case, sluice_policy::PathCase::Insensitive);
    let typo = sluice_policy::DEFAULT_POLICY_YAML.edit("merge_slashes: true", "merge_slash: true");
    let err = parse_str(&typo, Path::new("typo.yaml")).expect_err("unknown key");
    assert!(err.to_string().contains("merge_slash"), "{err}");
}

#[test]
fn e6_paths_case_is_insensitive_by_default_and_a_bad_value_is_an_error() {
    let p = default_policy().expect("default");
    assert_eq!(p.paths.case, sluice_policy::PathCase::Insensitive);
    assert!(p.describe().contains("routes matched in either case"));
    let chats = p.route(&http::Method::POST, "/CHATS").expect("a route");
    assert_eq!(chats.path.as_ref().map(|p| p.as_str()), Some("/chats"));
    let sensitive = sluice_policy::DEFAULT_POLICY_YAML.edit("case: insensitive", "case: sensitive");
    let sensitive = parse_str(&sensitive, Path::new("sensitive.yaml")).expect("valid");
    assert_eq!(sensitive.paths.case, sluice_policy::PathCase::Sensitive);
    assert!(
        sensitive
            .describe()
            .contains("routes matched case-sensitively")
    );
    let default_route = sensitive.route(&http::Method::POST, "/CHATS");
    assert!(
        default_route.is_none_or(|r| r.path.is_none()),
        "{default_route:?}"
    );
    let bad = sluice_policy::DEFAULT_POLICY_YAML.edit("case: insensitive", "case: upper");
    let err = parse_str(&bad, Path::new("bad.yaml")).expect_err("unknown value");
    assert!(err.to_string().contains("upper"), "{err}");
}

#[test]
fn max_json_depth_is_bounded_by_what_the_parser_reads() {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit("max_json_depth: 64", "max_json_depth: 500");
    let err = parse_str(&yaml, Path::new("deep.yaml")).expect_err("too deep");
    let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
    assert_eq!(paths, ["limits.max_json_depth"]);
}
