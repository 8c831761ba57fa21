//! `--store`: what it accepts, what it refuses, and what it shows.

use sluice_gateway::StoreSpec;

fn parse(s: &str) -> Result<StoreSpec, String> {
    s.parse()
}

#[test]
fn memory_and_every_redis_scheme_sluice_reads_are_accepted() {
    assert_eq!(parse("memory"), Ok(StoreSpec::Memory));
    for url in [
        "redis://127.0.0.1:6379",
        "redis://127.0.0.1:6379/2",
        "redis+unix:///run/redis.sock",
        "unix:///run/redis.sock",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
        "rediss://cache:6380/0?ssl_ca_certs=/etc/ca.pem",
        "redis+sentinel://10.0.0.1,10.0.0.2:26380/mymaster/1",
    ] {
        assert_eq!(parse(url), Ok(StoreSpec::Redis(url.to_owned())), "{url}");
    }
}

#[test]
fn what_cannot_be_used_is_refused_at_the_flag_with_the_reason() {
    let unknown = parse("postgres://db").expect_err("not redis");
    assert!(unknown.starts_with("expected `memory`"), "{unknown}");
    let tls = parse("rediss+cluster://cache:6380").expect_err("no TLS to a cluster");
    assert!(tls.contains("TLS"), "{tls}");
    let no_master = parse("redis+sentinel://:hush@s1,s2").expect_err("no master name");
    assert!(no_master.contains("names no master"), "{no_master}");
    assert!(!no_master.contains("hush"), "{no_master}");
    let typo = parse("rediss://cache?ssl_ca_cert=/ca.pem").expect_err("unknown parameter");
    assert!(typo.contains("ssl_ca_cert"), "{typo}");
    let empty = parse("redis+cluster://").expect_err("no node");
    assert!(empty.contains("names no node"), "{empty}");
    let db = parse("redis://:hush@cache/notanumber").expect_err("db is a number");
    assert!(!db.contains("hush"), "{db}");
}

#[test]
fn describe_never_shows_a_password() {
    let shown = |s: &str| parse(s).expect("store").describe();
    assert_eq!(shown("memory"), "memory");
    assert_eq!(
        shown("redis://127.0.0.1:6379/0"),
        "redis://127.0.0.1:6379/0"
    );
    assert_eq!(shown("redis://:hush@cache:6379"), "redis://…@cache:6379");
    assert_eq!(
        shown("redis+cluster://:hush@a:7000,b:7000"),
        "redis+cluster://…@a:7000,b:7000"
    );
    assert_eq!(
        shown("redis+unix:///run/r.sock?pass=hush"),
        "redis+unix:///run/r.sock?pass=…"
    );
    assert_eq!(shown("rediss://u:hush@cache:6380"), "rediss://…@cache:6380");
    assert_eq!(
        shown("redis+sentinel://:hush@s1,s2/m?sentinel_password=hush"),
        "redis+sentinel://…@s1,s2/m?sentinel_password=…"
    );
}
