//! The connection against real `redis-server`s: one server on a Unix socket,
//! and a 3-master cluster. A script is called by hash, and called again after
//! the server forgot it (`SCRIPT FLUSH`, as after a restart).

use std::time::Duration;

use sluice_redis::redis::Script;
use sluice_redis::{Connection, RedisUrl, UrlKind};

#[path = "../../../tests/support/redis_server.rs"]
mod redis_server;

use redis_server::{RedisCluster, RedisServer};

const INCR: &str = "return redis.call('INCRBY', KEYS[1], ARGV[1])";

async fn incr(conn: &Connection, script: &Script, key: &str, by: i64) -> i64 {
    let mut call = script.prepare_invoke();
    call.key(key).arg(by);
    conn.invoke(&call).await.expect("script call")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_calls_a_script_by_hash_and_reloads_it_after_noscript() {
    let server = RedisServer::start("conn");
    let url: RedisUrl = server.url().parse().expect("url");
    assert_eq!(url.kind(), UrlKind::UnixSocket);
    let conn = Connection::connect(&url, Duration::from_millis(500))
        .await
        .expect("connect");
    assert!(!conn.is_cluster());
    let script = Script::new(INCR);
    conn.load_script(&script).await.expect("load");
    assert_eq!(incr(&conn, &script, "k", 2).await, 2);
    server.cli(&["SCRIPT", "FLUSH"]);
    assert_eq!(incr(&conn.clone(), &script, "k", 3).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_loads_a_script_on_each_node_at_its_first_noscript() {
    let cluster = RedisCluster::start();
    let conn = Connection::open(&cluster.url(), Duration::from_secs(2))
        .await
        .expect("connect to the cluster");
    assert!(conn.is_cluster());
    let script = Script::new(INCR);
    conn.load_script(&script).await.expect("nothing to do");
    // Keys spread over the three masters' slots.
    for key in ["a", "b", "c", "d", "e", "f"] {
        assert_eq!(incr(&conn, &script, key, 1).await, 1);
        assert_eq!(incr(&conn, &script, key, 1).await, 2);
    }
}
