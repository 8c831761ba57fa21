//! `sluice_policy::parse_str` on arbitrary UTF-8 (run with `-timeout=5`: a policy
//! file must not hang the parser).
//!
//! Beyond "no panic":
//! - an error names the file and its message can be written;
//! - a policy that parses passes `describe()`, routes and normalises paths and
//!   classifies a JSON-RPC body without panicking;
//! - its raw form written back as YAML reads back the same and is valid again.
#![no_main]

use std::path::Path;

use http::Method;
use libfuzzer_sys::fuzz_target;
use sluice_policy::{RawPolicy, parse_str, validate};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let policy = match parse_str(text, Path::new("fuzz.yaml")) {
        Ok(policy) => policy,
        Err(e) => {
            assert!(e.to_string().contains("fuzz.yaml"), "{e}");
            return;
        }
    };
    assert!(!policy.describe().is_empty());
    for path in [
        "/",
        "/chats",
        "//x/../%63hats?q=1",
        "/a/./b/%2e%2e/c",
        "/../x",
    ] {
        for method in [Method::GET, Method::POST] {
            let _ = policy.route_checked(&method, path);
        }
        let _ = policy.paths.normalize(path);
    }
    let body = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"start_chat"}},{"jsonrpc":"2.0","id":2,"method":"ping"}]"#;
    let _ = policy.jsonrpc.classify(body, &policy.bounds);

    let raw: RawPolicy = serde_saphyr::from_str(text).expect("it parsed once");
    let yaml = serde_saphyr::to_string(&raw).expect("a raw policy is written");
    let again: RawPolicy = serde_saphyr::from_str(&yaml)
        .unwrap_or_else(|e| panic!("written back, it does not read: {e}\n{yaml}"));
    assert_eq!(again, raw, "written back, it reads differently:\n{yaml}");
    assert!(validate(&again).is_ok());
});
