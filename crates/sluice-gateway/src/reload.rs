//! Reloading the policy without a restart: on SIGHUP, and when the policy file
//! changes — once its writer has closed it or it was moved into place (inotify, see
//! the `file_watch` module), or where the kernel cannot say so, once its size and
//! modification time have held still for [`SETTLE`]. A file caught half-written is
//! not taken; the habit that is safe everywhere is to write a new file beside it and
//! rename it into place. Its metadata is read first: a file larger than
//! [`MAX_POLICY_BYTES`] is rejected unread, and at most that many bytes are read.
//!
//! A new policy is checked first, exactly as `sluice check` checks it (the same
//! messages); one that does not pass, or that changes what only a restart can change,
//! is logged and rejected, and the running policy stays. An accepted one replaces the
//! limiter both request paths take each request from (see
//! [`sluice_edge::SharedLimiter`]): requests already admitted finish under the old
//! policy, the next ones are decided by the new one, and budgets keep their counts
//! (the store is shared; see [`sluice_edge::Limiter::reloaded`]).
//!
//! The domain files of `--rls-config` are read again with every reload (SIGHUP, or
//! the policy file's change), also when the policy file is unchanged: a changed,
//! added or removed domain file is applied, checked as the policy is.
//!
//! What a reload cannot change (it is refused, the old policy keeps running):
//! - `lanes:` — a lane's engine counts the calls running through it and its batch
//!   queue was opened with its settings; lanes whose settings are unchanged are kept,
//!   engines and all, and any change to them needs a restart;
//! - `store.timeout` with a Redis store — the connection was made with it;
//! - with lanes shared through Redis, what a lane does while its ledger is down.
//!
//! Flags (`--listen`, `--admin`, `--store`, `--upstream`, …) are not in the policy
//! file: they change only with a restart.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use sha2::{Digest as _, Sha256};
use sluice_admin::tenants::Tenants;
use sluice_edge::SharedLimiter;
use sluice_policy::Policy;

use crate::Stop;
use crate::store::AnyStore;

use crate::file_watch::{Cue, FileWatch, Stamp};
pub use crate::file_watch::{POLL_EVERY, SETTLE};

/// The largest policy file read (a larger one is rejected).
pub const MAX_POLICY_BYTES: u64 = 4 * 1024 * 1024;

/// A policy's version: the first 16 hex digits of the SHA-256 of its file's bytes.
pub fn policy_version(text: &[u8]) -> String {
    let digest = Sha256::digest(text);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The policy file a gateway was started with, to read again on a reload.
#[derive(Clone, Debug)]
pub struct PolicyFile {
    /// The file.
    pub path: PathBuf,
    /// The profile `--profile` chose (applied to every version of the file), if any.
    pub profile: Option<String>,
    /// `--dry-run`: every version of the file runs with every budget in shadow mode.
    pub dry_run: bool,
    /// [`policy_version`] of the text the running policy was parsed from.
    pub version: String,
    /// A directory of envoyproxy/ratelimit domain files (`--rls-config`), read
    /// again with every reload, whether the policy file changed or not (a
    /// changed, added or removed domain file is applied; the policy's version
    /// names the policy file alone).
    pub domain_dir: Option<PathBuf>,
}

/// What made a reload happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// SIGHUP.
    Signal,
    /// The file's content changed.
    FileChanged,
}

impl Trigger {
    fn as_str(self) -> &'static str {
        match self {
            Trigger::Signal => "SIGHUP",
            Trigger::FileChanged => "file changed",
        }
    }
}

/// Where the running policy stands, for `/status`.
#[derive(Debug)]
struct State {
    version: String,
    loaded_at: u64,
    reloads: u64,
    rejected: u64,
    /// The last rejection: when, the version rejected, why.
    last_rejected: Option<(u64, String, String)>,
}

/// Reloads a gateway's policy.
pub struct Reloader {
    limiter: SharedLimiter<AnyStore>,
    file: Option<PolicyFile>,
    /// The store is Redis (its timeout was used to connect).
    shared_store: bool,
    state: Mutex<State>,
    /// The tenants set through the admin API, applied over every version of the file.
    tenants: Option<Arc<Tenants<AnyStore>>>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("file", &self.file)
            .field("state", &*self.state.lock())
            .finish_non_exhaustive()
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Reloader {
    /// A reloader of `limiter`'s policy from `file` (none: the policy was not read
    /// from a file, and a reload has nothing to read). `version` is the running
    /// policy's.
    pub(crate) fn new(
        limiter: SharedLimiter<AnyStore>,
        file: Option<PolicyFile>,
        version: String,
        shared_store: bool,
    ) -> Self {
        Reloader {
            limiter,
            file,
            shared_store,
            state: Mutex::new(State {
                version,
                loaded_at: unix_now(),
                reloads: 0,
                rejected: 0,
                last_rejected: None,
            }),
            tenants: None,
        }
    }

    /// The same reloader, applying `tenants` over every version of the file.
    #[must_use]
    pub(crate) fn with_tenants(mut self, tenants: Arc<Tenants<AnyStore>>) -> Self {
        self.tenants = Some(tenants);
        self
    }

    /// The running policy's version.
    pub fn version(&self) -> String {
        self.state.lock().version.clone()
    }

    /// `/status`'s `policy`: `{"version","loaded_at","source","reloads","rejected",
    /// "last_rejected": null | {"at","version","error"}}`.
    pub fn status(&self) -> serde_json::Value {
        let state = self.state.lock();
        serde_json::json!({
            "version": state.version,
            "loaded_at": sluice_edge::rfc3339(state.loaded_at),
            "source": self.file.as_ref().map_or_else(
                || "built-in".to_owned(),
                |f| f.path.display().to_string(),
            ),
            "reloads": state.reloads,
            "rejected": state.rejected,
            "last_rejected": state.last_rejected.as_ref().map(|(at, version, error)| {
                serde_json::json!({
                    "at": sluice_edge::rfc3339(*at),
                    "version": version,
                    "error": error,
                })
            }),
        })
    }

    /// Reads the file and applies it when it passes. Returns the version running afterwards.
    ///
    /// # Errors
    /// Why the file was rejected (logged already); the old policy keeps running.
    pub async fn reload(&self, trigger: Trigger) -> Result<String, String> {
        let Some(file) = &self.file else {
            tracing::warn!(
                target: "sluice::reload",
                trigger = trigger.as_str(),
                "no policy file to reload: sluice runs the policy it was started with (--config FILE to reload one)"
            );
            return Err("no policy file".to_owned());
        };
        let text = match read_bounded(file).await {
            Ok(text) => text,
            Err(error) => return Err(self.rejected(trigger, "-", error)),
        };
        self.apply(trigger, &text).await
    }

    /// Applies the policy `text` (the file's content).
    async fn apply(&self, trigger: Trigger, text: &[u8]) -> Result<String, String> {
        let Some(file) = &self.file else {
            return Err("no policy file".to_owned());
        };
        let version = policy_version(text);
        let running = self.version();
        let unchanged = |version: String| -> Result<String, String> {
            if trigger == Trigger::Signal {
                tracing::info!(
                    target: "sluice::reload",
                    trigger = trigger.as_str(),
                    version,
                    "policy unchanged"
                );
            }
            Ok(version)
        };
        // The `--rls-config` files are read again with every reload, the same
        // policy file's too: they are not in its version.
        let same_file = version == running;
        if same_file && file.domain_dir.is_none() {
            return unchanged(version);
        }
        let policy = match parse(file, text) {
            Ok(policy) => policy,
            Err(error) => return Err(self.rejected(trigger, &version, error)),
        };
        if same_file && policy.domains == self.limiter.load().policy().domains {
            return unchanged(version);
        }
        // No tenant change while the file is applied: each is made over the file
        // that runs.
        let _held = match &self.tenants {
            Some(tenants) => Some(tenants.hold().await),
            None => None,
        };
        let (policy, file_policy) = match &self.tenants {
            Some(tenants) => match tenants.over(&policy) {
                Ok(with_tenants) => (with_tenants, Some(policy)),
                Err(error) => return Err(self.rejected(trigger, &version, error)),
            },
            None => (policy, None),
        };
        let current = self.limiter.load_full();
        if let Some(error) = self.restart_only(current.policy(), &policy) {
            return Err(self.rejected(trigger, &version, error));
        }
        let changes = current.policy().counting_changes(&policy);
        let next = match current.reloaded(policy) {
            Ok(next) => next,
            Err(refused) => return Err(self.rejected(trigger, &version, refused.to_string())),
        };
        self.limiter.store(Arc::new(next));
        if let (Some(tenants), Some(file_policy)) = (&self.tenants, file_policy) {
            tenants.rebase(file_policy);
        }
        {
            let mut state = self.state.lock();
            state.version.clone_from(&version);
            state.loaded_at = unix_now();
            state.reloads += 1;
        }
        for change in changes {
            tracing::warn!(target: "sluice::reload", version, "{change}");
        }
        metrics::counter!("sluice_policy_reloads_total", "outcome" => "applied").increment(1);
        tracing::info!(
            target: "sluice::reload",
            trigger = trigger.as_str(),
            version,
            previous = running,
            file = %file.path.display(),
            rls_config_only = same_file,
            "policy reloaded"
        );
        Ok(version)
    }

    /// What only a restart can change, if `new` changes it.
    fn restart_only(&self, old: &Policy, new: &Policy) -> Option<String> {
        (self.shared_store && old.store.timeout != new.store.timeout).then(|| {
            "store.timeout: the Redis connection was made with it; restart sluice to apply"
                .to_owned()
        })
    }

    fn rejected(&self, trigger: Trigger, version: &str, error: String) -> String {
        {
            let mut state = self.state.lock();
            state.rejected += 1;
            state.last_rejected = Some((unix_now(), version.to_owned(), error.clone()));
        }
        metrics::counter!("sluice_policy_reloads_total", "outcome" => "rejected").increment(1);
        tracing::error!(
            target: "sluice::reload",
            trigger = trigger.as_str(),
            version,
            running = self.version(),
            "policy reload rejected, the running policy stays: {error}"
        );
        error
    }
}

impl PolicyFile {
    /// Reads the policy file at `path` for a gateway to start with: the policy, with
    /// `profile` applied when given, checked as `sluice check` checks it (the same
    /// messages), and the file to read again on a reload.
    ///
    /// # Errors
    /// What is wrong with the file, as `sluice check` would say it.
    pub fn load(path: PathBuf, profile: Option<String>) -> Result<(Policy, PolicyFile), String> {
        let read = std::fs::File::open(&path).and_then(|f| {
            let mut text = Vec::new();
            std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_POLICY_BYTES + 1), &mut text)
                .map(|_| text)
        });
        let text = match read {
            Ok(text) if text.len() as u64 > MAX_POLICY_BYTES => {
                return Err(format!(
                    "{}: larger than {MAX_POLICY_BYTES} bytes, not read",
                    path.display()
                ));
            }
            Ok(text) => text,
            // The error `sluice check` gives for a file it cannot read.
            Err(_) => {
                return Err(sluice_policy::load_file(&path).err().map_or_else(
                    || format!("{}: cannot be read", path.display()),
                    |e| e.to_string(),
                ));
            }
        };
        let mut file = PolicyFile {
            path,
            profile,
            dry_run: false,
            version: String::new(),
            domain_dir: None,
        };
        let policy = parse(&file, &text)?;
        file.version = policy_version(&text);
        Ok((policy, file))
    }
}

/// The policy in `text`, checked as `sluice check` checks it (same messages), with
/// the `--profile` and `--dry-run` the gateway was started with.
fn parse(file: &PolicyFile, text: &[u8]) -> Result<Policy, String> {
    let text = std::str::from_utf8(text)
        .map_err(|e| format!("{}: not UTF-8: {e}", file.path.display()))?;
    let mut policy = sluice_policy::parse_str(text, &file.path).map_err(|e| e.to_string())?;
    policy.dry_run |= file.dry_run;
    if let Some(dir) = &file.domain_dir {
        policy = with_domain_dir(policy, dir)?;
    }
    match &file.profile {
        Some(profile) => policy
            .with_profile(profile)
            .map_err(|e| format!("--profile: {e}")),
        None => Ok(policy),
    }
}

/// `policy` with the domains of the envoyproxy/ratelimit files in `dir` added.
///
/// # Errors
/// Every problem of the files, one per line, as `sluice check` gives them.
pub fn with_domain_dir(mut policy: Policy, dir: &std::path::Path) -> Result<Policy, String> {
    let more =
        sluice_policy::domains::load_domain_dir(dir, &policy.domains).map_err(|e| e.to_string())?;
    policy.domains.extend(more);
    Ok(policy)
}

/// The file's bytes: its metadata first (a file larger than [`MAX_POLICY_BYTES`] is
/// rejected unread), then at most that many bytes, into a buffer of the size the
/// metadata gave, so memory stays flat whatever is put in place.
async fn read_bounded(file: &PolicyFile) -> Result<Vec<u8>, String> {
    use tokio::io::AsyncReadExt as _;
    let shown = file.path.display();
    // Opened first, then its size read from the open file: a file renamed into place
    // between the two is read as the one opened, never as one file's size over the
    // other's bytes (which read a large file's first 4 MiB, and reported it twice).
    let opened = tokio::fs::File::open(&file.path)
        .await
        .map_err(|e| format!("{shown}: {e}"))?;
    let len = opened
        .metadata()
        .await
        .map_err(|e| format!("{shown}: {e}"))?
        .len();
    if len > MAX_POLICY_BYTES {
        return Err(format!(
            "{shown}: larger than {MAX_POLICY_BYTES} bytes ({len} bytes), not read"
        ));
    }
    let expected = usize::try_from(len).unwrap_or(0);
    let mut text = Vec::with_capacity(expected.saturating_add(1));
    opened
        .take(MAX_POLICY_BYTES + 1)
        .read_to_end(&mut text)
        .await
        .map_err(|e| format!("{shown}: {e}"))?;
    if text.len() as u64 > MAX_POLICY_BYTES {
        return Err(format!(
            "{shown}: larger than {MAX_POLICY_BYTES} bytes, not read"
        ));
    }
    Ok(text)
}

/// The SIGHUP stream, installed at once (SIGHUP would otherwise end the process).
///
/// # Errors
/// The handler could not be installed.
#[cfg(unix)]
pub(crate) fn hangups() -> std::io::Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
}

/// Starts watching the policy file (before the gateway says it listens, so no change
/// after that is missed), takes whatever changed since it was loaded, and returns the
/// task that reloads on SIGHUP and when the file changes, until `stop`.
#[cfg(unix)]
pub(crate) async fn watcher(
    reloader: Arc<Reloader>,
    hangups: tokio::signal::unix::Signal,
    stop: Stop,
) -> impl Future<Output = ()> + Send + 'static {
    let cues = reloader.file.as_ref().map(|f| FileWatch::new(&f.path));
    let mut given_up = None;
    if let Some(file) = &reloader.file {
        given_up = take(&reloader, file).await;
    }
    watch(reloader, hangups, stop, cues, given_up)
}

/// Reads the file whole and applies it; the key of what was rejected, if it was.
async fn take(reloader: &Reloader, file: &PolicyFile) -> Option<String> {
    let read = read_bounded(file).await;
    let key = match &read {
        Ok(text) => policy_version(text),
        Err(error) => format!("unreadable: {error}"),
    };
    let outcome = match read {
        Ok(text) => reloader.apply(Trigger::FileChanged, &text).await,
        Err(error) => Err(reloader.rejected(Trigger::FileChanged, "-", error)),
    };
    outcome.is_err().then_some(key)
}

#[cfg(unix)]
async fn watch(
    reloader: Arc<Reloader>,
    mut hangups: tokio::signal::unix::Signal,
    stop: Stop,
    mut cues: Option<FileWatch>,
    mut given_up: Option<String>,
) {
    let stopped = stop.wait();
    tokio::pin!(stopped);
    // The file as a poll last saw it, and as last read for a poll (a poll reads the
    // file once its stamp settles on a new value).
    let mut polled: Option<Result<Stamp, String>> = None;
    let mut read_at: Option<Result<Stamp, String>> = None;
    // `given_up`: the last content rejected or unreadable, not tried again until it
    // changes, so a bad file is reported once.
    loop {
        let cue = tokio::select! {
            _ = hangups.recv() => {
                given_up = reloader.reload(Trigger::Signal).await.err();
                continue;
            }
            cue = next_cue(&mut cues) => cue,
            () = &mut stopped => return,
        };
        let Some(file) = &reloader.file else { continue };
        if cue == Cue::Poll {
            // Metadata only, until it has settled on something new (a stamp may miss
            // a rewrite of the same size within the file system's clock tick:
            // SIGHUP takes the file whatever its stamp).
            let stamp = Stamp::of(&file.path).map_err(|e| e.to_string());
            let still = polled.as_ref() == Some(&stamp);
            polled = Some(stamp.clone());
            let settled = stamp
                .as_ref()
                .map_or(true, |s| s.settled(SystemTime::now()));
            if !still || !settled || read_at.as_ref() == Some(&stamp) {
                continue;
            }
            read_at = Some(stamp);
        }
        // A writer finished (or a poll saw the file settle): read it whole and take
        // it unless it is what was rejected last.
        let read = read_bounded(file).await;
        let key = match &read {
            Ok(text) => policy_version(text),
            Err(error) => format!("unreadable: {error}"),
        };
        if given_up.as_deref() == Some(key.as_str()) {
            continue;
        }
        let outcome = match read {
            Ok(text) => reloader.apply(Trigger::FileChanged, &text).await,
            Err(error) => Err(reloader.rejected(Trigger::FileChanged, "-", error)),
        };
        given_up = outcome.is_err().then_some(key);
    }
}

async fn next_cue(cues: &mut Option<FileWatch>) -> Cue {
    match cues {
        Some(c) => c.next().await,
        None => std::future::pending().await,
    }
}
