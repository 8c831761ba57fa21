//! The batch queue (SPEC L4): submit, claim, record, status, idempotency,
//! bounds, restarts and retention — on the embedded durable store, and the
//! same suite on Redis (feature `redis`, against a real `redis-server`).
//!
//! Time is injected: every operation takes `now`, nothing sleeps.

#![cfg(feature = "durable")]

use std::path::PathBuf;
use std::time::Duration;

use sluice_batch::{
    BatchBook, BatchConfig, BatchQueue, BatchState, Finish, ItemResult, ItemState, Maintenance,
    QueueBound, ResultBody, SubmitError,
};
use sluice_core::Timestamp;
use sluice_store::DurableStore;

/// 2026-11-30T12:00:00Z.
const T0: u64 = 1_796_040_000;

fn at(secs: u64) -> Timestamp {
    Timestamp::from_secs(T0 + secs)
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        TempDir(std::env::temp_dir().join(format!(
            "sluice-batch-{name}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        )))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn book(dir: &TempDir, config: BatchConfig) -> BatchBook {
    let store = DurableStore::open(&dir.0).expect("open the store");
    BatchBook::open(&store, config).expect("open the batches")
}

fn items(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!(r#"{{"draft":"message {i}"}}"#).into_bytes())
        .collect()
}

fn ok(body: &str) -> ItemResult {
    ItemResult {
        status: 200,
        body: ResultBody::Json(body.as_bytes().to_vec()),
    }
}

fn upstream_error() -> ItemResult {
    ItemResult {
        status: 503,
        body: ResultBody::Text("optimizer unavailable".to_owned()),
    }
}

fn small(max_backlog: u64) -> BatchConfig {
    BatchConfig::default().with_max_backlog(max_backlog)
}

/// The behaviour both backends share, written once.
mod suite {
    use super::*;

    pub(super) async fn submit_claim_complete_status<Q: BatchQueue>(q: &Q) {
        let s = q
            .submit("acme", items(3), None, b"digest", at(0))
            .await
            .expect("submit");
        assert!(s.created);
        assert_eq!(s.items, 3);
        assert!(s.batch_id.starts_with("bat_") && s.batch_id.len() == 36);
        let st = q.status("acme", &s.batch_id, at(0)).await.expect("status");
        let st = st.expect("visible to its workspace");
        assert_eq!(st.state, BatchState::Queued);
        assert_eq!(
            (st.total, st.queued, st.running, st.done, st.failed),
            (3, 3, 0, 0, 0)
        );
        assert_eq!(st.estimated_finish_at, None, "nothing is known yet");
        assert!(
            st.items
                .iter()
                .all(|i| i.state == ItemState::Queued && i.result.is_none())
        );

        let first = q
            .claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("an item");
        assert_eq!((first.index, first.attempt), (0, 1));
        assert_eq!(first.item, items(3)[0]);
        assert_eq!(first.workspace, "acme");
        assert_eq!(first.idempotency_key(), format!("{}/0", s.batch_id));
        let second = q
            .claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("an item");
        assert_eq!(second.index, 1);
        assert_eq!(q.claim_next("nobody", at(1)).await.expect("claim"), None);

        let st = q
            .status("acme", &s.batch_id, at(1))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!(st.state, BatchState::Running);
        assert_eq!((st.queued, st.running), (1, 2));

        let r = q
            .complete(&s.batch_id, 0, ok(r#"{"text":"better"}"#), at(61))
            .await;
        assert_eq!(r.expect("complete"), Finish::Recorded);
        let r = q.fail(&s.batch_id, 1, upstream_error(), at(61)).await;
        assert_eq!(r.expect("fail"), Finish::Recorded);
        let st = q
            .status("acme", &s.batch_id, at(61))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!((st.done, st.failed, st.queued, st.running), (1, 1, 1, 0));
        // Two items finished 60 s after the first claim: 30 s an item, one left.
        assert_eq!(st.estimated_finish_at, Some(at(91)));
        assert_eq!(st.items[0].state, ItemState::Done);
        assert_eq!(st.items[0].result, Some(ok(r#"{"text":"better"}"#)));
        assert_eq!(st.items[1].state, ItemState::Failed);
        assert_eq!(st.items[1].result, Some(upstream_error()));
        assert_eq!(st.items[2].state, ItemState::Queued);

        let last = q
            .claim_next("acme", at(62))
            .await
            .expect("claim")
            .expect("an item");
        assert_eq!(last.index, 2);
        q.complete(&s.batch_id, 2, ok("{}"), at(100))
            .await
            .expect("complete");
        let st = q
            .status("acme", &s.batch_id, at(200))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!(st.state, BatchState::Done);
        assert_eq!((st.done, st.failed, st.queued, st.running), (2, 1, 0, 0));
        assert_eq!(
            st.estimated_finish_at,
            Some(at(100)),
            "a finished batch shows when it finished"
        );
        assert!(q.backlogs().await.expect("backlogs").is_empty());
    }

    pub(super) async fn idempotency<Q: BatchQueue>(q: &Q) {
        let a = q
            .submit("acme", items(2), Some("key-1"), b"body-a", at(0))
            .await
            .expect("submit");
        assert!(a.created);
        let again = q
            .submit("acme", items(2), Some("key-1"), b"body-a", at(5))
            .await
            .expect("same key and body");
        assert_eq!(again.batch_id, a.batch_id);
        assert!(!again.created);
        let conflict = q
            .submit("acme", items(3), Some("key-1"), b"body-b", at(6))
            .await;
        assert_eq!(
            conflict,
            Err(SubmitError::Conflict {
                batch_id: a.batch_id.clone()
            })
        );
        // Read alone, the key names its batch for the same body only, and
        // only in its own workspace.
        let earlier = q
            .earlier_batch("acme", "key-1", b"body-a")
            .await
            .expect("earlier");
        assert_eq!(earlier, Some(again.clone()));
        for (workspace, key, digest) in [
            ("acme", "key-1", &b"body-b"[..]),
            ("acme", "key-2", b"body-a"),
            ("globex", "key-1", b"body-a"),
        ] {
            let none = q
                .earlier_batch(workspace, key, digest)
                .await
                .expect("earlier");
            assert_eq!(none, None, "{workspace} {key}");
        }
        // Keys belong to a workspace.
        let other = q
            .submit("globex", items(2), Some("key-1"), b"body-b", at(7))
            .await
            .expect("another workspace's key");
        assert!(other.created);
        assert_ne!(other.batch_id, a.batch_id);
        // Without a key every submit is a new batch.
        let x = q
            .submit("acme", items(1), None, b"body-a", at(8))
            .await
            .expect("submit");
        let y = q
            .submit("acme", items(1), None, b"body-a", at(8))
            .await
            .expect("submit");
        assert_ne!(x.batch_id, y.batch_id);
        let backlog = q.backlogs().await.expect("backlogs");
        let acme = backlog
            .iter()
            .find(|b| b.workspace == "acme")
            .expect("acme");
        assert_eq!(acme.queued, 4, "the repeat stored nothing");
    }

    /// `q` bounds the backlog at 10.
    pub(super) async fn backlog_limit<Q: BatchQueue>(q: &Q) {
        let a = q
            .submit("acme", items(6), Some("a"), b"a", at(0))
            .await
            .expect("6 of 10");
        let refused = q.submit("acme", items(5), None, b"b", at(0)).await;
        assert_eq!(
            refused,
            Err(SubmitError::Backlog {
                queued: 6,
                limit: 10
            })
        );
        q.submit("acme", items(4), None, b"c", at(0))
            .await
            .expect("exactly 10");
        let refused = q.submit("acme", items(1), None, b"d", at(0)).await;
        assert_eq!(
            refused,
            Err(SubmitError::Backlog {
                queued: 10,
                limit: 10
            })
        );
        // Another workspace has its own backlog.
        q.submit("globex", items(10), None, b"e", at(0))
            .await
            .expect("globex");
        // A repeat of an accepted batch is not refused.
        let again = q
            .submit("acme", items(6), Some("a"), b"a", at(1))
            .await
            .expect("repeat");
        assert_eq!(again.batch_id, a.batch_id);
        // Running items still count; finished ones do not.
        let c = q
            .claim_next("acme", at(2))
            .await
            .expect("claim")
            .expect("item");
        let refused = q.submit("acme", items(1), None, b"f", at(2)).await;
        assert_eq!(
            refused,
            Err(SubmitError::Backlog {
                queued: 10,
                limit: 10
            })
        );
        q.complete(&c.batch_id, c.index, ok("{}"), at(3))
            .await
            .expect("complete");
        q.submit("acme", items(1), None, b"g", at(3))
            .await
            .expect("room for one");
    }

    pub(super) async fn bad_batches<Q: BatchQueue>(q: &Q, max_items: usize) {
        assert_eq!(
            q.submit("acme", Vec::new(), None, b"", at(0)).await,
            Err(SubmitError::Empty)
        );
        assert_eq!(
            q.submit("acme", items(max_items + 1), None, b"", at(0))
                .await,
            Err(SubmitError::TooMany {
                given: max_items + 1,
                limit: max_items
            })
        );
        q.submit("acme", items(max_items), None, b"", at(0))
            .await
            .expect("the bound itself is accepted");
    }

    pub(super) async fn invisible_to_other_workspaces<Q: BatchQueue>(q: &Q) {
        let s = q
            .submit("acme", items(1), None, b"x", at(0))
            .await
            .expect("submit");
        assert!(
            q.status("acme", &s.batch_id, at(0))
                .await
                .expect("status")
                .is_some()
        );
        assert_eq!(
            q.status("globex", &s.batch_id, at(0))
                .await
                .expect("status"),
            None
        );
        assert_eq!(
            q.status("acme", "bat_0000", at(0)).await.expect("status"),
            None
        );
        assert_eq!(q.claim_next("globex", at(0)).await.expect("claim"), None);
    }

    pub(super) async fn completed_twice_is_recorded_once<Q: BatchQueue>(q: &Q) {
        let s = q
            .submit("acme", items(2), None, b"x", at(0))
            .await
            .expect("submit");
        let c = q
            .claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("item");
        let first = q
            .complete(&s.batch_id, c.index, ok(r#"{"n":1}"#), at(2))
            .await;
        assert_eq!(first.expect("complete"), Finish::Recorded);
        let second = q
            .complete(&s.batch_id, c.index, ok(r#"{"n":2}"#), at(3))
            .await;
        assert_eq!(second.expect("complete"), Finish::AlreadyFinished);
        let third = q.fail(&s.batch_id, c.index, upstream_error(), at(3)).await;
        assert_eq!(third.expect("fail"), Finish::AlreadyFinished);
        let unknown = q.complete(&s.batch_id, 99, ok("{}"), at(3)).await;
        assert_eq!(unknown.expect("complete"), Finish::Unknown);
        let unknown = q.complete("bat_nope", 0, ok("{}"), at(3)).await;
        assert_eq!(unknown.expect("complete"), Finish::Unknown);
        let st = q
            .status("acme", &s.batch_id, at(4))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!((st.done, st.failed, st.queued, st.running), (1, 0, 1, 0));
        assert_eq!(
            st.items[0].result,
            Some(ok(r#"{"n":1}"#)),
            "the first answer stays"
        );
        let renewed = q.renew(&s.batch_id, c.index, at(4)).await.expect("renew");
        assert!(!renewed, "a finished item holds no lease");
        let released = q.release(&s.batch_id, c.index, 0, at(4)).await;
        assert!(
            !released.expect("release"),
            "a finished item stays finished"
        );
    }

    /// `renew_all` renews the claims of every running item given, in one
    /// call, and leaves an item no longer running alone (it is not claimed
    /// again by the renewal).
    pub(super) async fn renews_all_claims_at_once<Q: BatchQueue>(q: &Q) {
        let s = q
            .submit("acme", items(3), None, b"x", at(0))
            .await
            .expect("submit");
        for _ in 0..3 {
            q.claim_next("acme", at(0))
                .await
                .expect("claim")
                .expect("item");
        }
        q.complete(&s.batch_id, 2, ok("{}"), at(1))
            .await
            .expect("complete");
        let claims: Vec<(String, u32)> = (0..3).map(|i| (s.batch_id.clone(), i)).collect();
        let renewed = q.renew_all(&claims, at(300)).await.expect("renew all");
        assert_eq!(renewed, 2, "the two items still running");
        assert_eq!(q.renew_all(&[], at(300)).await.expect("renew none"), 0);
        let m = q.maintain(at(600)).await.expect("maintain");
        assert_eq!(m.requeued, 0, "both renewed until 900");
        let st = q
            .status("acme", &s.batch_id, at(601))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!(
            (st.done, st.running, st.queued),
            (1, 2, 0),
            "the finished one stays done"
        );
        let m = q.maintain(at(900)).await.expect("maintain");
        assert_eq!(m.requeued, 2, "their renewed claims ran out at 900");
    }

    /// `q`'s lease is the default 10 minutes.
    pub(super) async fn leases<Q: BatchQueue>(q: &Q) {
        let s = q
            .submit("acme", items(2), None, b"x", at(0))
            .await
            .expect("submit");
        let c = q
            .claim_next("acme", at(0))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!(c.lease_until, at(600));
        assert!(q.renew(&s.batch_id, 0, at(300)).await.expect("renew"));
        let m = q.maintain(at(600)).await.expect("maintain");
        assert_eq!(m.requeued, 0, "renewed until 900");
        let m = q.maintain(at(900)).await.expect("maintain");
        assert_eq!(
            m,
            Maintenance {
                requeued: 1,
                purged: 0
            }
        );
        let again = q
            .claim_next("acme", at(901))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!(
            (again.index, again.attempt),
            (0, 2),
            "back at the head, second attempt"
        );
        assert_eq!(again.idempotency_key(), c.idempotency_key());
        // The first runner's late answer still counts, once; the second's is ignored.
        assert_eq!(
            q.complete(&s.batch_id, 0, ok(r#"{"run":1}"#), at(902))
                .await,
            Ok(Finish::Recorded)
        );
        assert_eq!(
            q.complete(&s.batch_id, 0, ok(r#"{"run":2}"#), at(903))
                .await,
            Ok(Finish::AlreadyFinished)
        );
        // Released without an answer: back at the head, claimed again.
        let next = q
            .claim_next("acme", at(904))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!(next.index, 1);
        assert!(
            q.release(&s.batch_id, 1, 0, at(905))
                .await
                .expect("release")
        );
        let st = q
            .status("acme", &s.batch_id, at(905))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!((st.done, st.queued, st.running), (1, 1, 0));
        let next = q
            .claim_next("acme", at(906))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!(
            (next.index, next.attempt),
            (1, 1),
            "released with no attempt spent: its first attempt again"
        );
        assert!(
            q.release(&s.batch_id, 1, 2, at(907))
                .await
                .expect("release")
        );
        let next = q
            .claim_next("acme", at(908))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!(
            (next.index, next.attempt),
            (1, 3),
            "released with two attempts spent: its third"
        );
        // An answer for an item whose lease ran out and went back to the queue
        // finishes it where it is.
        q.maintain(at(908 + 600)).await.expect("maintain");
        assert_eq!(
            q.complete(&s.batch_id, 1, ok("{}"), at(1600)).await,
            Ok(Finish::Recorded)
        );
        let st = q
            .status("acme", &s.batch_id, at(1600))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!(
            (st.state, st.done, st.queued, st.running),
            (BatchState::Done, 2, 0, 0)
        );
        assert_eq!(q.claim_next("acme", at(1601)).await.expect("claim"), None);
    }

    pub(super) async fn workspaces_take_turns<Q: BatchQueue>(q: &Q) {
        q.submit("a", items(3), None, b"a", at(0)).await.expect("a");
        q.submit("b", items(3), None, b"b", at(0)).await.expect("b");
        q.submit("c", items(1), None, b"c", at(0)).await.expect("c");
        let mut order = Vec::new();
        for t in 1..=7 {
            let c = q.claim_fairest(at(t)).await.expect("claim").expect("item");
            order.push(c.workspace);
        }
        assert_eq!(order, ["a", "b", "c", "a", "b", "a", "b"]);
        assert_eq!(q.claim_fairest(at(9)).await.expect("claim"), None);
        let mut backlog = q.backlogs().await.expect("backlogs");
        backlog.sort_by(|x, y| x.workspace.cmp(&y.workspace));
        let running: Vec<(String, u64, u64)> = backlog
            .into_iter()
            .map(|b| (b.workspace, b.queued, b.running))
            .collect();
        assert_eq!(
            running,
            [
                ("a".to_owned(), 0, 3),
                ("b".to_owned(), 0, 3),
                ("c".to_owned(), 0, 1)
            ]
        );
    }

    pub(super) async fn fewest_running_goes_next<Q: BatchQueue>(q: &Q) {
        q.submit("busy", items(5), None, b"a", at(0))
            .await
            .expect("busy");
        for t in 0..3 {
            q.claim_next("busy", at(t))
                .await
                .expect("claim")
                .expect("item");
        }
        q.submit("quiet", items(5), None, b"b", at(5))
            .await
            .expect("quiet");
        let order: Vec<String> = {
            let mut v = Vec::new();
            for t in 6..10 {
                v.push(
                    q.claim_fairest(at(t))
                        .await
                        .expect("claim")
                        .expect("item")
                        .workspace,
                );
            }
            v
        };
        // quiet has 0 running against busy's 3: it goes until they are level.
        assert_eq!(order, ["quiet", "quiet", "quiet", "busy"]);
    }

    /// `q` keeps finished batches the default 7 days.
    pub(super) async fn retention<Q: BatchQueue>(q: &Q) {
        let s = q
            .submit("acme", items(1), Some("k"), b"one", at(0))
            .await
            .expect("submit");
        let keep = q
            .submit("acme", items(1), None, b"two", at(0))
            .await
            .expect("submit");
        let c = q
            .claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!(c.batch_id, s.batch_id);
        q.complete(&s.batch_id, 0, ok("{}"), at(10))
            .await
            .expect("complete");
        let week = 7 * 24 * 3600;
        let m = q.maintain(at(10 + week - 1)).await.expect("maintain");
        assert_eq!(m.purged, 0);
        assert!(
            q.status("acme", &s.batch_id, at(10 + week - 1))
                .await
                .expect("status")
                .is_some()
        );
        let m = q.maintain(at(10 + week)).await.expect("maintain");
        assert_eq!(m.purged, 1);
        assert_eq!(
            q.status("acme", &s.batch_id, at(10 + week))
                .await
                .expect("status"),
            None
        );
        assert_eq!(
            q.complete(&s.batch_id, 0, ok("{}"), at(10 + week)).await,
            Ok(Finish::Unknown)
        );
        // An unfinished batch is never purged, however old.
        assert!(
            q.status("acme", &keep.batch_id, at(10 + week))
                .await
                .expect("status")
                .is_some()
        );
        // The key went with its batch.
        let fresh = q
            .submit("acme", items(2), Some("k"), b"other", at(10 + week))
            .await;
        assert!(fresh.expect("the key is free again").created);
    }

    /// The bounds of [`global`]: 10 unfinished items and 1,000 bytes in all, one
    /// origin half of each.
    pub(super) fn global() -> BatchConfig {
        BatchConfig::default()
            .with_max_queued_items(10)
            .with_max_stored_bytes(1_000)
            .with_origin_share(2)
    }

    fn full(bound: QueueBound, used: u64, limit: u64) -> Result<(), SubmitError> {
        Err(SubmitError::QueueFull { bound, used, limit })
    }

    /// `q` keeps [`global`]'s bounds, whatever the workspaces.
    pub(super) async fn global_bounds<Q: BatchQueue>(q: &Q) {
        let from = |ws: &'static str, origin: &'static str, items: Vec<Vec<u8>>, key| async move {
            q.submit_from(ws, origin, items, key, b"d", at(0)).await
        };
        // Each item of items() is 21 bytes.
        let first = from("w1", "192.0.2.1", items(5), Some("k"))
            .await
            .expect("first");
        // Another workspace of the same address: past the address's 5 items.
        assert_eq!(
            from("w2", "192.0.2.1", items(1), None).await.map(drop),
            full(QueueBound::OriginQueuedItems, 5, 5)
        );
        // A repeat is the same batch, never refused as full.
        let again = from("w1", "192.0.2.1", items(5), Some("k"))
            .await
            .expect("repeat");
        assert_eq!(
            (again.batch_id, again.created),
            (first.batch_id.clone(), false)
        );
        from("w3", "198.51.100.1", items(5), None)
            .await
            .expect("another address");
        // The whole queue: 10 unfinished items.
        let refused = from("w4", "203.0.113.1", items(1), None).await;
        assert_eq!(
            refused.clone().map(drop),
            full(QueueBound::QueuedItems, 10, 10)
        );
        assert!(
            refused
                .expect_err("full")
                .to_string()
                .contains("queued_items")
        );
        // A finished item frees its place in the item bound.
        let c = q
            .claim_next("w1", at(1))
            .await
            .expect("claim")
            .expect("item");
        q.complete(&c.batch_id, c.index, ok("{}"), at(1))
            .await
            .expect("complete");
        from("w4", "203.0.113.1", items(1), None)
            .await
            .expect("room for one");
        // Bytes: 210 + 21 stored; an address may hold 500, the queue 1,000.
        let big = |n: usize| vec![vec![b'x'; n]];
        let q2 = q;
        let refused = q2
            .submit_from("w5", "203.0.113.1", big(480), None, b"e", at(2))
            .await;
        assert_eq!(
            refused.map(drop),
            full(QueueBound::QueuedItems, 10, 10),
            "items first"
        );
    }

    /// `q` keeps [`global`]'s byte bounds, and gives bytes back when a batch is
    /// purged.
    pub(super) async fn byte_bounds<Q: BatchQueue>(q: &Q) {
        let big = |n: usize| vec![vec![b'x'; n]];
        let a = q
            .submit_from("w1", "192.0.2.1", big(400), None, b"a", at(0))
            .await
            .expect("a");
        assert_eq!(
            q.submit_from("w2", "192.0.2.1", big(101), None, b"b", at(0))
                .await
                .map(drop),
            full(QueueBound::OriginStoredBytes, 400, 500)
        );
        q.submit_from("w3", "198.51.100.1", big(450), None, b"c", at(0))
            .await
            .expect("c");
        // No origin named: only the global bounds hold it.
        assert_eq!(
            q.submit_from("w4", "", big(151), None, b"d", at(0))
                .await
                .map(drop),
            full(QueueBound::StoredBytes, 850, 1_000)
        );
        // The body goes when its item finishes, the result stays until purged.
        let c = q
            .claim_next("w1", at(1))
            .await
            .expect("claim")
            .expect("item");
        q.complete(&c.batch_id, c.index, ok("{}"), at(1))
            .await
            .expect("complete");
        q.submit_from("w2", "192.0.2.1", big(400), None, b"b", at(2))
            .await
            .expect("room again");
        let week = 7 * 24 * 3600;
        assert_eq!(q.maintain(at(1 + week)).await.expect("maintain").purged, 1);
        assert_eq!(
            q.status("w1", &a.batch_id, at(1 + week))
                .await
                .expect("status"),
            None
        );
        q.submit_from("w5", "192.0.2.1", big(90), None, b"e", at(2 + week))
            .await
            .expect("the purged batch's bytes are free");
    }

    /// `q` stores at most 5 items.
    pub(super) async fn store_bound<Q: BatchQueue>(q: &Q) {
        let s = q.submit("a", items(3), None, b"a", at(0)).await.expect("a");
        q.submit("b", items(2), None, b"b", at(0)).await.expect("b");
        let refused = q.submit("c", items(1), None, b"c", at(0)).await;
        assert_eq!(
            refused,
            Err(SubmitError::Full {
                stored: 5,
                limit: 5
            })
        );
        assert!(
            refused
                .expect_err("full")
                .to_string()
                .contains("maximum is 5")
        );
        // Finished items take room until purged.
        for _ in 0..3 {
            let c = q
                .claim_next("a", at(1))
                .await
                .expect("claim")
                .expect("item");
            q.complete(&c.batch_id, c.index, ok("{}"), at(2))
                .await
                .expect("complete");
        }
        assert!(q.submit("c", items(1), None, b"c", at(3)).await.is_err());
        let week = 7 * 24 * 3600;
        assert_eq!(q.maintain(at(2 + week)).await.expect("maintain").purged, 1);
        assert_eq!(
            q.status("a", &s.batch_id, at(2 + week))
                .await
                .expect("status"),
            None
        );
        q.submit("c", items(3), None, b"c", at(3 + week))
            .await
            .expect("room again");
    }
}

#[tokio::test]
async fn l4_submit_claim_complete_and_status() {
    let dir = TempDir::new("basic");
    suite::submit_claim_complete_status(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_same_key_and_body_is_the_same_batch_another_body_conflicts() {
    let dir = TempDir::new("idem");
    suite::idempotency(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_backlog_limit_per_workspace() {
    let dir = TempDir::new("backlog");
    suite::backlog_limit(&book(&dir, small(10))).await;
}

#[tokio::test]
async fn l4_backlog_limit_is_5000_items_by_default() {
    let dir = TempDir::new("backlog-5000");
    let q = book(&dir, BatchConfig::default());
    assert_eq!(q.config().max_backlog, 5_000);
    assert_eq!(q.config().max_items, 1_000);
    for i in 0..5u8 {
        q.submit("acme", items(1_000), None, &[i], at(0))
            .await
            .expect("up to 5,000");
    }
    let refused = q.submit("acme", items(1), None, b"one more", at(0)).await;
    assert_eq!(
        refused,
        Err(SubmitError::Backlog {
            queued: 5_000,
            limit: 5_000
        })
    );
    let c = q
        .claim_next("acme", at(1))
        .await
        .expect("claim")
        .expect("item");
    q.complete(&c.batch_id, c.index, ok("{}"), at(2))
        .await
        .expect("complete");
    q.submit("acme", items(1), None, b"one more", at(3))
        .await
        .expect("one finished, one fits");
}

#[tokio::test]
async fn l4_empty_and_oversized_batches_are_refused() {
    let dir = TempDir::new("bad");
    let config = BatchConfig::default().with_max_items(20);
    suite::bad_batches(&book(&dir, config), 20).await;
}

#[tokio::test]
async fn l4_another_workspaces_batch_is_invisible() {
    let dir = TempDir::new("invisible");
    suite::invisible_to_other_workspaces(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_an_item_completed_twice_is_recorded_once() {
    let dir = TempDir::new("twice");
    suite::completed_twice_is_recorded_once(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_an_expired_lease_puts_the_item_back_with_the_same_key() {
    let dir = TempDir::new("lease");
    suite::leases(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_a_runner_renews_all_its_claims_in_one_call() {
    let dir = TempDir::new("renew-all");
    suite::renews_all_claims_at_once(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_workspaces_take_turns() {
    let dir = TempDir::new("turns");
    suite::workspaces_take_turns(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_fewest_batch_items_running_goes_next() {
    let dir = TempDir::new("fewest");
    suite::fewest_running_goes_next(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_finished_batches_are_purged_after_seven_days() {
    let dir = TempDir::new("retention");
    suite::retention(&book(&dir, BatchConfig::default())).await;
}

#[tokio::test]
async fn l4_the_whole_queue_and_each_address_are_bounded_in_items() {
    let dir = TempDir::new("global");
    suite::global_bounds(&book(&dir, suite::global())).await;
}

#[tokio::test]
async fn l4_the_whole_queue_and_each_address_are_bounded_in_bytes() {
    let dir = TempDir::new("bytes");
    suite::byte_bounds(&book(&dir, suite::global())).await;
}

#[tokio::test]
async fn l4_a_full_store_refuses_new_batches() {
    let dir = TempDir::new("full");
    let config = BatchConfig::default().with_max_stored_items(5);
    suite::store_bound(&book(&dir, config)).await;
}

#[tokio::test]
async fn l4_queued_items_and_results_survive_a_restart_running_ones_come_back_queued() {
    let dir = TempDir::new("restart");
    let (id, key) = {
        let q = book(&dir, BatchConfig::default());
        let s = q
            .submit("acme", items(4), Some("k"), b"body", at(0))
            .await
            .expect("submit");
        let a = q
            .claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("item");
        let b = q
            .claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("item");
        q.complete(&s.batch_id, a.index, ok(r#"{"kept":true}"#), at(30))
            .await
            .expect("complete");
        (s.batch_id, b.idempotency_key())
        // Dropped with item 1 running, items 2 and 3 queued.
    };
    let q = book(&dir, BatchConfig::default());
    let st = q
        .status("acme", &id, at(40))
        .await
        .expect("status")
        .expect("kept");
    assert_eq!((st.total, st.done, st.queued, st.running), (4, 1, 3, 0));
    assert_eq!(st.items[0].result, Some(ok(r#"{"kept":true}"#)));
    assert_eq!(
        st.items.iter().map(|i| i.state).collect::<Vec<_>>(),
        [
            ItemState::Done,
            ItemState::Queued,
            ItemState::Queued,
            ItemState::Queued
        ]
    );
    let again = q
        .claim_next("acme", at(41))
        .await
        .expect("claim")
        .expect("item");
    assert_eq!(
        (again.index, again.attempt),
        (1, 2),
        "the interrupted item first"
    );
    assert_eq!(again.idempotency_key(), key, "sent again with the same key");
    assert_eq!(again.item, items(4)[1]);
    // The idempotency key survived too.
    let repeat = q.submit("acme", items(4), Some("k"), b"body", at(42)).await;
    assert_eq!(repeat.expect("repeat").batch_id, id);
    let other = q
        .claim_next("acme", at(43))
        .await
        .expect("claim")
        .expect("item");
    assert_eq!((other.index, other.attempt), (2, 1));
}

#[tokio::test]
async fn l4_a_full_disk_refuses_with_unavailable_and_loses_nothing() {
    use std::sync::atomic::Ordering;
    let (disk, full) = sluice_store::durable::FillableDisk::new();
    let store = DurableStore::with_backend("full-disk", disk.clone(), disk.log()).expect("store");
    let q = BatchBook::open(&store, BatchConfig::default()).expect("batches");
    let s = q
        .submit("acme", items(2), Some("k"), b"x", at(0))
        .await
        .expect("submit");
    let c = q
        .claim_next("acme", at(1))
        .await
        .expect("claim")
        .expect("item");
    full.store(true, Ordering::SeqCst);
    let refused = q.submit("acme", items(1), None, b"y", at(2)).await;
    // Its commit failed, and the file cannot be opened anew to read back
    // whether the commit wrote it (a commit may fail after writing): the submit
    // says it cannot tell (the lane answers 503 and keeps its quota counted).
    assert!(
        matches!(refused, Err(SubmitError::OutcomeUnknown(_))),
        "{refused:?}"
    );
    let lost = q.complete(&s.batch_id, c.index, ok("{}"), at(3)).await;
    assert!(
        lost.is_err(),
        "an answer that cannot be written is not acknowledged"
    );
    full.store(false, Ordering::SeqCst);
    // The storage is opened anew: what was committed is there, the rest is not.
    let st = q
        .status("acme", &s.batch_id, at(4))
        .await
        .expect("status")
        .expect("kept");
    assert_eq!((st.done, st.running, st.queued), (0, 1, 1));
    let again = q.complete(&s.batch_id, c.index, ok("{}"), at(5)).await;
    assert_eq!(again, Ok(Finish::Recorded), "the runner's retry records it");
    let backlog = q.backlogs().await.expect("backlogs");
    assert_eq!(backlog[0].queued, 1, "the refused batch was not stored");
}

/// A replica killed while items ran, on a disk that is full when it starts
/// again: the queue opens (the lane answers 503 while full), the items it
/// ran are still claimed once there is room, and they go back to the queue
/// when their claims run out and run again under the same key.
#[tokio::test]
async fn l4_a_replica_that_crashed_on_a_full_disk_starts_again_with_every_item() {
    crashed_on_a_full_disk(false).await;
}

/// As above, when a write before the queue's (the quota book's snapshot) has
/// already failed for want of room.
#[tokio::test]
async fn l4_a_replica_that_crashed_on_a_full_disk_starts_again_after_a_failed_write() {
    crashed_on_a_full_disk(true).await;
}

async fn crashed_on_a_full_disk(failed_before: bool) {
    use std::sync::atomic::Ordering;
    // The disk fills between the store's start and the batch queue's: putting
    // the running items back cannot be written.
    let (disk, full) = sluice_store::durable::FillableDisk::new();
    let open = |fill: bool| {
        let store = DurableStore::with_backend("full-disk", disk.clone(), disk.log())
            .expect("the store starts");
        full.store(fill, Ordering::SeqCst);
        if fill && failed_before {
            let db = store.db().expect("open");
            let tx = db.begin_write().expect("a write transaction");
            tx.open_table(redb::TableDefinition::<&str, u64>::new("other"))
                .expect("a table")
                .insert("k", 1)
                .expect("insert");
            assert!(tx.commit().is_err(), "the disk is full");
        }
        BatchBook::open(&store, BatchConfig::default())
            .expect("a full disk does not stop the batch queue from opening")
    };
    let first = open(false);
    let s = first
        .submit("acme", items(300), Some("k"), b"x", at(0))
        .await
        .expect("submit");
    let mut keys = Vec::new();
    for _ in 0..200 {
        let c = first
            .claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("item");
        keys.push((c.index, c.idempotency_key()));
    }
    // Killed while they ran (no clean stop).
    std::mem::forget(first);
    let second = open(true);
    let refused = second.submit("acme", items(1), None, b"y", at(2)).await;
    assert!(
        matches!(refused, Err(SubmitError::Unavailable(_))),
        "{refused:?}"
    );
    full.store(false, Ordering::SeqCst);
    let st = second
        .status("acme", &s.batch_id, at(3))
        .await
        .expect("status")
        .expect("batch");
    assert_eq!((st.running, st.queued), (200, 100), "nothing lost");
    let lease = BatchConfig::default().lease.as_secs();
    let m = second.maintain(at(2 + lease)).await.expect("maintain");
    assert_eq!(m.requeued, 200, "their claims ran out");
    let mut again = Vec::new();
    for _ in 0..200 {
        let c = second
            .claim_next("acme", at(3 + lease))
            .await
            .expect("claim")
            .expect("item");
        again.push((c.index, c.idempotency_key()));
    }
    again.sort();
    keys.sort();
    assert_eq!(again, keys, "the same items, under the same keys");
}

#[test]
fn l4_a_second_book_on_a_locked_data_dir_is_refused() {
    let dir = TempDir::new("locked");
    let _q = book(&dir, BatchConfig::default());
    assert!(
        DurableStore::open(&dir.0).is_err(),
        "one process per data directory"
    );
}

/// The child half of the crash test: does its work, says so, then waits to
/// be killed. Does nothing unless the parent set the variable.
#[tokio::test]
async fn l4_crash_child() {
    let Some(dir) = std::env::var_os("SLUICE_BATCH_CRASH_DIR") else {
        return;
    };
    let store = DurableStore::open(std::path::Path::new(&dir)).expect("open");
    let q = BatchBook::open(&store, BatchConfig::default()).expect("batches");
    let s = q
        .submit("acme", items(5), Some("k"), b"body", at(0))
        .await
        .expect("submit");
    for _ in 0..3 {
        q.claim_next("acme", at(1))
            .await
            .expect("claim")
            .expect("item");
    }
    q.complete(&s.batch_id, 0, ok(r#"{"before":"crash"}"#), at(20))
        .await
        .expect("complete");
    q.fail(&s.batch_id, 1, upstream_error(), at(21))
        .await
        .expect("fail");
    println!("READY {}", s.batch_id);
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}

#[test]
fn l4_kill_9_loses_no_queued_item_and_no_result() {
    use std::io::BufRead as _;
    let dir = TempDir::new("kill");
    // The child's name as the harness knows it: its module's path past the crate's.
    let child_test = module_path!().split_once("::").map_or_else(
        || "l4_crash_child".to_owned(),
        |(_, m)| format!("{m}::l4_crash_child"),
    );
    let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            child_test.as_str(),
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SLUICE_BATCH_CRASH_DIR", &dir.0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("child");
    let stdout = child.stdout.take().expect("stdout");
    // Whatever happens below, the child does not outlive the test.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reap(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            // The harness may print the test's name on the same line first.
            if let Some((_, rest)) = line.split_once("READY ") {
                let _ = tx.send(rest.trim().to_owned());
                return;
            }
        }
    });
    let id = rx.recv_timeout(Duration::from_secs(60));
    // SIGKILL: nothing runs on the way down.
    child.0.kill().expect("kill -9");
    let _ = child.0.wait();
    let id = id.expect("the child got ready");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let q = book(&dir, BatchConfig::default());
    rt.block_on(async {
        let st = q
            .status("acme", &id, at(60))
            .await
            .expect("status")
            .expect("kept");
        assert_eq!(
            (st.total, st.done, st.failed, st.queued, st.running),
            (5, 1, 1, 3, 0)
        );
        assert_eq!(st.items[0].result, Some(ok(r#"{"before":"crash"}"#)));
        assert_eq!(st.items[1].result, Some(upstream_error()));
        let c = q
            .claim_next("acme", at(61))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!(
            (c.index, c.attempt),
            (2, 2),
            "the item running at the crash, again"
        );
        assert_eq!(c.idempotency_key(), format!("{id}/2"));
    });
}

#[cfg(feature = "redis")]
use crate::redis_server;

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use sluice_batch::RedisBatches;
    use sluice_store::RedisConfig;

    use super::redis_server::RedisServer as Server;

    async fn batches(server: &Server, config: BatchConfig) -> RedisBatches {
        let mut c = RedisConfig::new(server.url());
        c.timeout = Duration::from_millis(2_000);
        RedisBatches::connect(&c, config).await.expect("connect")
    }

    /// A proxy between sluice and Redis that can hold back Redis's next answer
    /// until the client sends again: an answer that comes after sluice gave up
    /// waiting (a slow network, a Redis busy for a moment).
    struct LateAnswers {
        url: String,
        hold_next: std::sync::Arc<std::sync::atomic::AtomicBool>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for LateAnswers {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    impl LateAnswers {
        async fn start(server: &Server) -> LateAnswers {
            use std::sync::Arc;
            use std::sync::atomic::AtomicBool;
            let socket = std::path::PathBuf::from(
                server
                    .url()
                    .strip_prefix("redis+unix://")
                    .expect("a unix socket")
                    .to_owned(),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let url = format!("redis://{}", listener.local_addr().expect("addr"));
            let hold_next = Arc::new(AtomicBool::new(false));
            let hold = Arc::clone(&hold_next);
            let task = tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(redis) = tokio::net::UnixStream::connect(&socket).await else {
                        return;
                    };
                    tokio::spawn(Self::pipe(client, redis, Arc::clone(&hold)));
                }
            });
            LateAnswers {
                url,
                hold_next,
                task,
            }
        }

        async fn pipe(
            client: tokio::net::TcpStream,
            redis: tokio::net::UnixStream,
            hold_next: std::sync::Arc<std::sync::atomic::AtomicBool>,
        ) {
            use std::sync::Arc;
            use std::sync::atomic::Ordering;
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let (mut from_client, to_client) = client.into_split();
            let (mut from_redis, mut to_redis) = redis.into_split();
            let to_client = Arc::new(tokio::sync::Mutex::new(to_client));
            // Some(bytes) while an answer is held.
            let held: Arc<std::sync::Mutex<Option<Vec<u8>>>> = Arc::default();
            let up = {
                let (to_client, held) = (Arc::clone(&to_client), Arc::clone(&held));
                async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n @ 1..) = from_client.read(&mut buf).await {
                        // The client sent again: the held answer goes first.
                        let released = held.lock().expect("lock").take();
                        if let Some(bytes) = released {
                            let _ = to_client.lock().await.write_all(&bytes).await;
                        }
                        if to_redis.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
            };
            let down = async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n @ 1..) = from_redis.read(&mut buf).await {
                    {
                        let mut held = held.lock().expect("lock");
                        if held.is_none() && hold_next.swap(false, Ordering::SeqCst) {
                            *held = Some(Vec::new());
                        }
                        if let Some(bytes) = held.as_mut() {
                            bytes.extend_from_slice(&buf[..n]);
                            continue;
                        }
                    }
                    if to_client.lock().await.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            };
            tokio::join!(up, down);
        }
    }

    /// A submit whose script ran but whose answer came after sluice stopped
    /// waiting (2 s): the batch is stored, and runs. sluice asks Redis whether it
    /// is, and answers with the batch — the submit is not reported as failed
    /// (before, it was `Unavailable`: the lane answered 503 and gave the quota of
    /// its items back, and the batch ran anyway; a retry with the same key then
    /// found it and gave its own quota back too).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_q1_redis_a_submit_whose_answer_came_late_is_the_batch_it_stored() {
        let server = Server::start("batch-late");
        let proxy = LateAnswers::start(&server).await;
        let q = RedisBatches::connect(&RedisConfig::new(proxy.url.clone()), BatchConfig::default())
            .await
            .expect("connect");
        // The script is loaded (an answer held now is the submit's own).
        q.submit("globex", items(1), None, b"w", at(0))
            .await
            .expect("a first submit");

        proxy
            .hold_next
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let late = q
            .submit("acme", items(2), Some("k"), b"x", at(1))
            .await
            .expect("the batch it stored");
        assert!(
            !proxy.hold_next.load(std::sync::atomic::Ordering::SeqCst),
            "the answer was held"
        );
        assert!(late.created);
        let st = q
            .status("acme", &late.batch_id, at(2))
            .await
            .expect("status")
            .expect("stored");
        assert_eq!((st.total, st.queued), (2, 2));
        let again = q
            .submit("acme", items(2), Some("k"), b"x", at(3))
            .await
            .expect("repeat");
        assert_eq!(
            (again.batch_id.as_str(), again.created),
            (late.batch_id.as_str(), false)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_submit_claim_complete_and_status() {
        let server = Server::start("batch");
        suite::submit_claim_complete_status(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_same_key_and_body_is_the_same_batch_another_body_conflicts() {
        let server = Server::start("batch");
        suite::idempotency(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_backlog_limit_per_workspace() {
        let server = Server::start("batch");
        suite::backlog_limit(&batches(&server, small(10)).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_empty_and_oversized_batches_are_refused() {
        let server = Server::start("batch");
        let config = BatchConfig::default().with_max_items(20);
        suite::bad_batches(&batches(&server, config).await, 20).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_another_workspaces_batch_is_invisible() {
        let server = Server::start("batch");
        suite::invisible_to_other_workspaces(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_an_item_completed_twice_is_recorded_once() {
        let server = Server::start("batch");
        suite::completed_twice_is_recorded_once(&batches(&server, BatchConfig::default()).await)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_an_expired_lease_puts_the_item_back_with_the_same_key() {
        let server = Server::start("batch");
        suite::leases(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_a_runner_renews_all_its_claims_in_one_call() {
        let server = Server::start("batch");
        suite::renews_all_claims_at_once(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_workspaces_take_turns() {
        let server = Server::start("batch");
        suite::workspaces_take_turns(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_fewest_batch_items_running_goes_next() {
        let server = Server::start("batch");
        suite::fewest_running_goes_next(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_finished_batches_are_purged_after_seven_days() {
        let server = Server::start("batch");
        suite::retention(&batches(&server, BatchConfig::default()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_the_whole_queue_and_each_address_are_bounded_in_items() {
        let server = Server::start("batch");
        suite::global_bounds(&batches(&server, suite::global()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_the_whole_queue_and_each_address_are_bounded_in_bytes() {
        let server = Server::start("batch");
        suite::byte_bounds(&batches(&server, suite::global()).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_a_full_store_refuses_new_batches() {
        let server = Server::start("batch");
        let config = BatchConfig::default().with_max_stored_items(5);
        suite::store_bound(&batches(&server, config).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_any_replica_runs_items_and_reads_status() {
        let server = Server::start("batch");
        let one = batches(&server, BatchConfig::default()).await;
        let two = batches(&server, BatchConfig::default()).await;
        let s = one
            .submit("acme", items(2), Some("k"), b"x", at(0))
            .await
            .expect("submit");
        let again = two
            .submit("acme", items(2), Some("k"), b"x", at(1))
            .await
            .expect("repeat");
        assert_eq!(
            (again.batch_id.as_str(), again.created),
            (s.batch_id.as_str(), false)
        );
        let a = two
            .claim_next("acme", at(2))
            .await
            .expect("claim")
            .expect("item");
        let b = one
            .claim_next("acme", at(2))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!((a.index, b.index), (0, 1), "each item goes to one replica");
        one.complete(&s.batch_id, 0, ok("{}"), at(3))
            .await
            .expect("complete");
        assert_eq!(
            two.complete(&s.batch_id, 0, ok("{}"), at(3)).await,
            Ok(Finish::AlreadyFinished)
        );
        let st = two
            .status("acme", &s.batch_id, at(4))
            .await
            .expect("status")
            .expect("batch");
        assert_eq!((st.done, st.running), (1, 1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_redis_a_crashed_replicas_items_come_back_after_the_lease() {
        let server = Server::start("batch");
        let s = {
            let crashed = batches(&server, BatchConfig::default()).await;
            let s = crashed
                .submit("acme", items(2), None, b"x", at(0))
                .await
                .expect("submit");
            crashed
                .claim_next("acme", at(1))
                .await
                .expect("claim")
                .expect("item");
            s
        };
        let survivor = batches(&server, BatchConfig::default()).await;
        assert_eq!(
            survivor.maintain(at(600)).await.expect("maintain").requeued,
            0
        );
        assert_eq!(
            survivor.maintain(at(601)).await.expect("maintain").requeued,
            1
        );
        let c = survivor
            .claim_next("acme", at(602))
            .await
            .expect("claim")
            .expect("item");
        assert_eq!((c.index, c.attempt), (0, 2));
        assert_eq!(c.idempotency_key(), format!("{}/0", s.batch_id));
    }
}
