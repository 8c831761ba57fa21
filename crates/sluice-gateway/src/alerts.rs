//! Alerts (SPEC O3): the outbox the edge hands its alert events to, and the
//! sender that delivers them to the policy's webhooks.
//!
//! **Outbox.** An event is kept before the call that made it is answered: in
//! the embedded durable store (on disk; with Redis, the replica's own data
//! directory) and in memory. At most [`MAX_OUTBOX_EVENTS`] are kept; an event
//! delivered (or given up) stays until its budget's period is over, so that the
//! same event is never kept twice, and then goes when room is needed. A new
//! event that finds no room is dropped, counted in
//! `sluice_alerts_dropped_total{reason="outbox_full"}` and logged. With Redis,
//! an event is kept as `claiming`, then claimed in Redis (in one decision: the
//! event's budget of one, and this replica's own mark of it, both kept until its
//! period is over): of several replicas that see the same event, one sends it.
//! A replica killed between keeping and claiming claims again when it starts,
//! and finds by its own mark whether the claim was its: no event is lost.
//!
//! **Sender.** One task, sending one event at a time: a POST of the event's
//! JSON to the alert's URL, with `X-Sluice-Signature: sha256=<hex>` (HMAC-SHA256
//! of the body under the secret read from the alert's `secret_file` at start)
//! and `X-Sluice-Event: <id>`, within the alert's `timeout_ms`. A 2xx delivers
//! it; anything else (an error status, a redirect, no answer in time, no
//! connection) is tried again after `retry_ms`, doubled each time up to
//! `max_retry_ms`, for at most [`MAX_ATTEMPTS`] tries. At rest it waits on the
//! outbox's signal or the next retry's time: it never polls. A delivery never
//! delays a request: requests only wait for an event to be kept.
//!
//! Delivery is at least once: a process killed after a webhook answered 2xx
//! and before the outbox noted it sends that event again when it starts; the
//! `X-Sluice-Event` id (the same for the same event) lets the receiver drop it.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;
use parking_lot::Mutex;
use sluice_edge::{AlertEvent, AlertSink};
use sluice_store::DurableStore;
use tokio::sync::Notify;

use crate::Stop;

/// The most events the outbox keeps.
pub const MAX_OUTBOX_EVENTS: usize = 10_000;

/// The most tries of one event's delivery.
pub const MAX_ATTEMPTS: u32 = 64;

/// The most events `/status` lists.
const RECENT: usize = 50;

/// Where an event stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum State {
    /// To be sent (again) at `next_at_ms`.
    Pending,
    /// A 2xx answered it.
    Delivered,
    /// [`MAX_ATTEMPTS`] tries failed.
    GaveUp,
    /// Another replica claimed it.
    Elsewhere,
    /// Kept, and to be claimed in the shared store before it is sent (replicas
    /// on Redis).
    Claiming,
}

/// An event in the outbox.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Entry {
    event: AlertEvent,
    state: State,
    attempts: u32,
    /// Unix milliseconds of the next try (pending).
    next_at_ms: u64,
    /// What the last try met (`200`, `500`, `timed out`, …).
    last: Option<String>,
}

/// Claims an event for replica `u64` in the shared store: true when this replica
/// is to send it (claimed now, or by it before).
pub(crate) type Claim =
    Arc<dyn Fn(AlertEvent, u64) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;

/// Claims `event` for `replica` in `store` (see [`Claim`]): in one decision, the
/// event's budget of one and the replica's own mark of it, both kept a day past
/// the event's period. True when both were spent now, or when the event was
/// claimed before and the replica's mark is spent (it claimed it before a
/// restart), or when the store cannot answer (better sent twice than never).
pub(crate) async fn claim_in<S: sluice_store::BudgetStore>(
    store: &S,
    event: &AlertEvent,
    replica: u64,
) -> bool {
    let id = u64::from_str_radix(&event.id, 16).unwrap_or(0);
    let budget = |scope: &[u8]| sluice_core::Budget {
        key: sluice_core::BudgetKey::from_digests(sluice_core::digest(scope), id),
        rate: sluice_core::Rate::until(event.period_ends_at.saturating_add(86_400)),
        limit: 1,
        cost: 1,
    };
    let claim = budget(b"alert-claim");
    let mark = budget(format!("alert-claim:{replica:016x}").as_bytes());
    match store.decide(&[claim, mark]).await {
        Ok(d) if d.is_admitted() => true,
        Ok(_) => store.peek(&[mark]).await.map_or(true, |d| {
            d.statuses().first().is_some_and(|s| s.remaining == 0)
        }),
        Err(_) => true,
    }
}

/// The outbox record holding this replica's id (see [`Claim`]).
const REPLICA_KEY: &str = "~replica";

/// The outbox (see the module).
pub(crate) struct Outbox {
    entries: Mutex<BTreeMap<String, Entry>>,
    disk: Option<DurableStore>,
    claim: Mutex<Option<Claim>>,
    /// This replica's id in claims: random, kept in the outbox across restarts.
    replica: u64,
    wake: Notify,
    max: usize,
}

/// A random id (from the standard library's randomly keyed hasher), never 0.
fn random_id() -> u64 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(u128::from(now_ms()) << 32 | u128::from(std::process::id()));
    h.finish().max(1)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Outbox {
    /// An outbox on `disk` (none: in memory only), with the events kept there
    /// read back: those still pending are sent again at once.
    ///
    /// # Errors
    /// The store's, when its outbox cannot be read.
    pub(crate) fn open(disk: Option<DurableStore>) -> Result<Arc<Outbox>, String> {
        let mut entries = BTreeMap::new();
        let mut replica = None;
        if let Some(disk) = &disk {
            let records = disk
                .outbox_read(MAX_OUTBOX_EVENTS + 1)
                .map_err(|e| e.to_string())?;
            for (id, bytes) in records {
                if id == REPLICA_KEY {
                    replica = <[u8; 8]>::try_from(bytes.as_slice())
                        .ok()
                        .map(u64::from_le_bytes);
                    continue;
                }
                match serde_json::from_slice::<Entry>(&bytes) {
                    Ok(mut entry) => {
                        if entry.state == State::Pending {
                            entry.next_at_ms = 0;
                        }
                        entries.insert(id, entry);
                    }
                    Err(e) => {
                        tracing::warn!(id, error = %e, "alert outbox: an unreadable event is skipped")
                    }
                }
            }
        }
        let replica = match (replica, &disk) {
            (Some(id), _) => id,
            (None, Some(disk)) => {
                let id = random_id();
                disk.outbox_write(&[(REPLICA_KEY, &id.to_le_bytes())], &[])
                    .map_err(|e| e.to_string())?;
                id
            }
            (None, None) => random_id(),
        };
        Ok(Arc::new(Outbox {
            entries: Mutex::new(entries),
            disk,
            claim: Mutex::new(None),
            replica,
            wake: Notify::new(),
            max: MAX_OUTBOX_EVENTS,
        }))
    }

    /// Claims each new event in the shared store with `claim` first (replicas on
    /// Redis).
    pub(crate) fn set_claim(&self, claim: Claim) {
        *self.claim.lock() = Some(claim);
    }

    /// Writes `entry` to disk (off the async workers), then keeps it in memory.
    async fn keep(&self, entry: Entry) {
        if let Some(disk) = &self.disk {
            let disk = disk.clone();
            let id = entry.event.id.clone();
            let bytes = serde_json::to_vec(&entry).unwrap_or_default();
            let written =
                tokio::task::spawn_blocking(move || disk.outbox_write(&[(&id, &bytes)], &[])).await;
            if !matches!(written, Ok(Ok(()))) {
                metrics::counter!("sluice_alert_outbox_write_failures_total").increment(1);
                tracing::warn!(id = %entry.event.id, "alert outbox: the event could not be written to disk; kept in memory");
            }
        }
        self.entries.lock().insert(entry.event.id.clone(), entry);
    }

    /// Room for one more event: entries done whose period is over go (from disk
    /// too). False when there is none.
    async fn make_room(&self) -> bool {
        let now = now_ms() / 1000;
        let gone: Vec<String> = {
            let mut entries = self.entries.lock();
            if entries.len() < self.max {
                return true;
            }
            let gone: Vec<String> = entries
                .iter()
                .filter(|(_, e)| {
                    !matches!(e.state, State::Pending | State::Claiming)
                        && e.event.period_ends_at < now
                })
                .map(|(id, _)| id.clone())
                .collect();
            for id in &gone {
                entries.remove(id);
            }
            gone
        };
        if let (Some(disk), false) = (&self.disk, gone.is_empty()) {
            let disk = disk.clone();
            let gone2 = gone.clone();
            let _ = tokio::task::spawn_blocking(move || {
                let keys: Vec<&str> = gone2.iter().map(String::as_str).collect();
                disk.outbox_write(&[], &keys)
            })
            .await;
        }
        self.entries.lock().len() < self.max
    }

    /// The earliest pending event due at or before `now` (Unix ms), or when the
    /// next one is due.
    fn due(&self, now: u64) -> Result<Entry, Option<u64>> {
        let entries = self.entries.lock();
        let next = entries
            .values()
            .filter(|e| matches!(e.state, State::Pending | State::Claiming))
            .min_by_key(|e| (e.next_at_ms, e.event.at));
        match next {
            Some(e) if e.next_at_ms <= now => Ok(e.clone()),
            Some(e) => Err(Some(e.next_at_ms)),
            None => Err(None),
        }
    }

    /// The events most recently made, newest first, at most [`RECENT`], as
    /// `/status` lists them.
    pub(crate) fn recent(&self) -> serde_json::Value {
        let entries = self.entries.lock();
        let mut recent: Vec<&Entry> = entries.values().collect();
        recent.sort_by_key(|e| std::cmp::Reverse((e.event.at, e.event.id.clone())));
        recent
            .into_iter()
            .take(RECENT)
            .map(|e| {
                serde_json::json!({
                    "id": e.event.id,
                    "workspace": e.event.workspace,
                    "budget": e.event.budget,
                    "threshold": f64::from(e.event.threshold_permille) / 1000.0,
                    "used": e.event.used,
                    "limit": e.event.limit,
                    "at": e.event.at,
                    "state": e.state,
                    "attempts": e.attempts,
                    "last": e.last,
                })
            })
            .collect()
    }
}

impl AlertSink for Outbox {
    fn knows(&self, id: &str) -> bool {
        self.entries.lock().contains_key(id)
    }

    fn offer<'a>(&'a self, event: AlertEvent) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            if self.knows(&event.id) {
                return;
            }
            if !self.make_room().await {
                metrics::counter!("sluice_alerts_dropped_total", "reason" => "outbox_full")
                    .increment(1);
                tracing::warn!(id = %event.id, budget = %event.budget, workspace = %event.workspace, "alert outbox full ({MAX_OUTBOX_EVENTS} events): event dropped");
                return;
            }
            let shared = self.claim.lock().is_some();
            let entry = Entry {
                event,
                state: if shared {
                    State::Claiming
                } else {
                    State::Pending
                },
                attempts: 0,
                next_at_ms: 0,
                last: None,
            };
            // Kept first: a crash from here on leaves it to be claimed again.
            self.keep(entry.clone()).await;
            if shared {
                self.resolve_claim(entry).await;
            }
            self.wake.notify_one();
        })
    }
}

/// Where one alert's events go, as the sender needs it.
#[derive(Clone)]
pub(crate) struct Target {
    url: http::Uri,
    secret: Arc<[u8]>,
    timeout: Duration,
    retry: Duration,
    max_retry: Duration,
}

/// The targets of `policy`'s alerts, in its order, each with its secret read
/// from its file (relative to `base`, the policy file's directory, when not
/// absolute).
///
/// # Errors
/// A message naming the file that cannot be read or is empty.
pub(crate) fn targets(policy: &sluice_policy::Policy, base: &Path) -> Result<Vec<Target>, String> {
    policy
        .alerts
        .iter()
        .enumerate()
        .map(|(n, a)| {
            let file = if a.secret_file.is_absolute() {
                a.secret_file.clone()
            } else {
                base.join(&a.secret_file)
            };
            let secret = std::fs::read(&file)
                .map_err(|e| format!("alerts[{n}].secret_file {}: {e}", file.display()))?;
            let secret: Vec<u8> = secret.trim_ascii().to_vec();
            if secret.is_empty() {
                return Err(format!(
                    "alerts[{n}].secret_file {} is empty",
                    file.display()
                ));
            }
            let url = a
                .url
                .parse::<http::Uri>()
                .map_err(|e| format!("alerts[{n}].url: {e}"))?;
            Ok(Target {
                url,
                secret: secret.into(),
                timeout: a.timeout,
                retry: a.retry,
                max_retry: a.max_retry,
            })
        })
        .collect()
}

/// HMAC-SHA256 of `message` under `key` (RFC 2104).
pub(crate) fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    use sha2::{Digest as _, Sha256};
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

/// Sends the outbox's events to `targets` until `stop`.
pub(crate) async fn send(outbox: Arc<Outbox>, targets: Vec<Target>, stop: Stop) {
    let tls = std::sync::OnceLock::new();
    let stopped = stop.wait();
    tokio::pin!(stopped);
    loop {
        let now = now_ms();
        let entry = match outbox.due(now) {
            Ok(entry) => entry,
            Err(next) => {
                let wait = next.map(|at| Duration::from_millis(at.saturating_sub(now)));
                tokio::select! {
                    () = &mut stopped => return,
                    () = outbox.wake.notified() => {}
                    () = sleep_or_forever(wait) => {}
                }
                continue;
            }
        };
        if entry.state == State::Claiming {
            // Kept by a replica killed before it claimed it: claim it now.
            outbox.resolve_claim(entry).await;
            continue;
        }
        let Some(target) = targets.get(entry.event.alert) else {
            // An alert the policy no longer has: nowhere to send it.
            outbox
                .finish(entry, State::GaveUp, "no such alert".to_owned())
                .await;
            continue;
        };
        let result = tokio::select! {
            () = &mut stopped => return,
            r = deliver(target, &entry.event, &tls) => r,
        };
        match result {
            Ok(status) if (200..300).contains(&status) => {
                metrics::counter!("sluice_alerts_sent_total").increment(1);
                outbox
                    .finish(entry, State::Delivered, status.to_string())
                    .await;
            }
            other => {
                let what = match other {
                    Ok(status) => status.to_string(),
                    Err(e) => e,
                };
                metrics::counter!("sluice_alert_delivery_failures_total").increment(1);
                outbox.retry(entry, target, what).await;
            }
        }
    }
}

async fn sleep_or_forever(wait: Option<Duration>) {
    match wait {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

impl Outbox {
    /// Claims a `claiming` entry in the shared store: pending when it is this
    /// replica's to send, `elsewhere` when another's.
    async fn resolve_claim(&self, mut entry: Entry) {
        let claim = self.claim.lock().clone();
        let mine = match claim {
            Some(claim) => claim(entry.event.clone(), self.replica).await,
            None => true,
        };
        entry.state = if mine {
            State::Pending
        } else {
            State::Elsewhere
        };
        self.keep(entry).await;
    }

    /// Notes `entry` as `state` after a try that met `last`.
    async fn finish(&self, mut entry: Entry, state: State, last: String) {
        entry.state = state;
        entry.attempts += 1;
        entry.last = Some(last);
        self.keep(entry).await;
    }

    /// Notes a failed try of `entry` and when it is tried again (or that it is
    /// given up, after [`MAX_ATTEMPTS`]).
    async fn retry(&self, mut entry: Entry, target: &Target, last: String) {
        entry.attempts += 1;
        if entry.attempts >= MAX_ATTEMPTS {
            metrics::counter!("sluice_alerts_dropped_total", "reason" => "gave_up").increment(1);
            tracing::warn!(id = %entry.event.id, last = %last, "alert given up after {MAX_ATTEMPTS} tries");
            entry.state = State::GaveUp;
        } else {
            let shift = (entry.attempts - 1).min(30);
            let wait = target
                .retry
                .saturating_mul(1 << shift)
                .min(target.max_retry);
            entry.next_at_ms = now_ms() + u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        }
        entry.last = Some(last);
        self.keep(entry).await;
    }
}

/// One POST of `event` to `target`: the status, or what went wrong.
async fn deliver(
    target: &Target,
    event: &AlertEvent,
    tls: &std::sync::OnceLock<Result<crate::tls::UpstreamTls, String>>,
) -> Result<u16, String> {
    let body = event.body();
    let signature: String = hmac_sha256(&target.secret, body.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let url = &target.url;
    let host = url.host().ok_or("no host")?.to_owned();
    let https = url.scheme_str() == Some("https");
    let port = url.port_u16().unwrap_or(if https { 443 } else { 80 });
    let authority = url
        .authority()
        .map_or_else(|| host.clone(), |a| a.as_str().to_owned());
    let request = http::Request::post(url.path_and_query().map_or("/", |p| p.as_str()))
        .header(http::header::HOST, authority)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::USER_AGENT, "sluice-alerts")
        .header("x-sluice-event", &event.id)
        .header("x-sluice-signature", format!("sha256={signature}"))
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let host_name = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let tcp = tokio::net::TcpStream::connect((host_name.as_str(), port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        if https {
            let tls = tls
                .get_or_init(crate::tls::UpstreamTls::system_roots)
                .as_ref()
                .map_err(Clone::clone)?;
            let name = rustls::pki_types::ServerName::try_from(host_name)
                .map_err(|e| format!("server name: {e}"))?;
            let stream = tls
                .connector()
                .connect(name, tcp)
                .await
                .map_err(|e| format!("tls: {e}"))?;
            post(hyper_util::rt::TokioIo::new(stream), request).await
        } else {
            post(hyper_util::rt::TokioIo::new(tcp), request).await
        }
    };
    tokio::time::timeout(target.timeout, exchange)
        .await
        .map_err(|_| "timed out".to_owned())?
}

/// Sends `request` over `io` (HTTP/1.1) and returns the answer's status.
async fn post<I>(io: I, request: http::Request<Full<Bytes>>) -> Result<u16, String>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let driver = tokio::spawn(conn);
    let answer = sender.send_request(request).await;
    driver.abort();
    answer
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("request: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: &str) -> AlertEvent {
        AlertEvent {
            id: id.to_owned(),
            alert: 0,
            workspace: "acme".to_owned(),
            budget: "messages".to_owned(),
            threshold_permille: 800,
            used: 8,
            limit: 10,
            period_ends_at: u64::MAX / 4,
            at: 1,
        }
    }

    #[tokio::test]
    async fn o3_an_event_is_claimed_by_one_replica_which_finds_its_claim_again_after_a_restart() {
        let store = sluice_store::MemoryStore::new(sluice_store::MemoryConfig::default());
        let e = event("00000000000000aa");
        assert!(claim_in(&store, &e, 1).await, "the first claims it");
        assert!(!claim_in(&store, &e, 2).await, "another replica does not");
        assert!(
            claim_in(&store, &e, 1).await,
            "the first again, as after a restart"
        );
        assert!(
            claim_in(&store, &event("00000000000000bb"), 2).await,
            "each event apart"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn o3_an_event_kept_but_not_claimed_before_a_crash_is_claimed_when_the_outbox_opens() {
        let dir = std::env::temp_dir().join(format!(
            "sluice-alerts-claim-{}-{}",
            std::process::id(),
            now_ms()
        ));
        let store = Arc::new(sluice_store::MemoryStore::new(
            sluice_store::MemoryConfig::default(),
        ));
        let claim = |store: Arc<sluice_store::MemoryStore>| -> Claim {
            Arc::new(move |e: AlertEvent, replica: u64| {
                let store = Arc::clone(&store);
                Box::pin(async move { claim_in(&*store, &e, replica).await })
            })
        };
        let replica = {
            let outbox =
                Outbox::open(Some(DurableStore::open(&dir).expect("open"))).expect("outbox");
            outbox.set_claim(claim(Arc::clone(&store)));
            // Kept as claiming; its claim reaches the store, and the process dies
            // before it notes it.
            outbox
                .keep(Entry {
                    event: event("00000000000000cc"),
                    state: State::Claiming,
                    attempts: 0,
                    next_at_ms: 0,
                    last: None,
                })
                .await;
            // And one it kept and claimed.
            outbox.offer(event("00000000000000dd")).await;
            assert!(claim_in(&*store, &event("00000000000000cc"), outbox.replica).await);
            outbox.replica
        };
        // Started again on the same data dir: the same replica id; the event it
        // had kept is claimed (its own mark is spent) and waits to be sent.
        let outbox = Outbox::open(Some(DurableStore::open(&dir).expect("reopen"))).expect("outbox");
        assert_eq!(outbox.replica, replica);
        outbox.set_claim(claim(Arc::clone(&store)));
        let due = outbox
            .due(now_ms())
            .map_err(|_| "nothing due")
            .expect("due");
        assert_eq!(due.state, State::Claiming);
        outbox.resolve_claim(due).await;
        let states: Vec<State> = outbox.entries.lock().values().map(|e| e.state).collect();
        assert_eq!(states, [State::Pending, State::Pending]);
        // Another replica's outbox, offered the same event, finds it claimed.
        let other = Outbox::open(None).expect("outbox");
        other.set_claim(claim(Arc::clone(&store)));
        other.offer(event("00000000000000cc")).await;
        let states: Vec<State> = other.entries.lock().values().map(|e| e.state).collect();
        assert_eq!(states, [State::Elsewhere]);
        drop(outbox);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hmac_sha256_is_rfc_4231s() {
        // RFC 4231, test case 2.
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than a block.
        let mac = hmac_sha256(
            &[0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First",
        );
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }
}
