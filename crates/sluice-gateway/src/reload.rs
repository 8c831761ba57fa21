//! Reloading the policy without a restart: on SIGHUP, and when the policy file's
//! content changes (looked at every [`POLL_EVERY`]; a change is applied once two reads
//! in a row agree, so a file caught half-written is not taken). At rest a look is one
//! `stat`: the file is read again only once its metadata changed, or while its last
//! change is too recent for the metadata to tell.
//!
//! A new policy is checked first, exactly as `sluice check` checks it (the same
//! messages); one that does not pass, or that changes what only a restart can change,
//! is logged and rejected, and the running policy stays. An accepted one replaces the
//! limiter both request paths take each request from (see
//! [`sluice_tower::SharedLimiter`]): requests already admitted finish under the old
//! policy, the next ones are decided by the new one, and budgets keep their counts
//! (the store is shared; see [`sluice_tower::Limiter::reloaded`]).
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
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use sha2::{Digest as _, Sha256};
use sluice_policy::Policy;
use sluice_tower::SharedLimiter;

use crate::Stop;
use crate::store::AnyStore;

/// How often the policy file is looked at to see whether it changed.
pub const POLL_EVERY: Duration = Duration::from_millis(250);

/// How old a file's last change must be before its metadata is trusted to show
/// the next one: file times tick coarsely (a few milliseconds), so a second write
/// of the same length soon after a read could leave them as they were.
#[cfg(unix)]
const TRUST_METADATA_AFTER: Duration = Duration::from_secs(1);

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
    /// [`policy_version`] of the text the running policy was parsed from.
    pub version: String,
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
    pub fn new(
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
        }
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
            "loaded_at": sluice_tower::rfc3339(state.loaded_at),
            "source": self.file.as_ref().map_or_else(
                || "built-in".to_owned(),
                |f| f.path.display().to_string(),
            ),
            "reloads": state.reloads,
            "rejected": state.rejected,
            "last_rejected": state.last_rejected.as_ref().map(|(at, version, error)| {
                serde_json::json!({
                    "at": sluice_tower::rfc3339(*at),
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
        self.apply(trigger, &text)
    }

    /// Applies the policy `text` (the file's content).
    fn apply(&self, trigger: Trigger, text: &[u8]) -> Result<String, String> {
        let Some(file) = &self.file else {
            return Err("no policy file".to_owned());
        };
        let version = policy_version(text);
        let running = self.version();
        if version == running {
            if trigger == Trigger::Signal {
                tracing::info!(
                    target: "sluice::reload",
                    trigger = trigger.as_str(),
                    version,
                    "policy unchanged"
                );
            }
            return Ok(version);
        }
        let policy = match parse(file, text) {
            Ok(policy) => policy,
            Err(error) => return Err(self.rejected(trigger, &version, error)),
        };
        let current = self.limiter.load_full();
        if let Some(error) = self.restart_only(current.policy(), &policy) {
            return Err(self.rejected(trigger, &version, error));
        }
        let next = match current.reloaded(policy) {
            Ok(next) => next,
            Err(refused) => return Err(self.rejected(trigger, &version, refused.to_string())),
        };
        self.limiter.store(Arc::new(next));
        {
            let mut state = self.state.lock();
            state.version.clone_from(&version);
            state.loaded_at = unix_now();
            state.reloads += 1;
        }
        metrics::counter!("sluice_policy_reloads_total", "outcome" => "applied").increment(1);
        tracing::info!(
            target: "sluice::reload",
            trigger = trigger.as_str(),
            version,
            previous = running,
            file = %file.path.display(),
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
            version: String::new(),
        };
        let policy = parse(&file, &text)?;
        file.version = policy_version(&text);
        Ok((policy, file))
    }
}

/// The policy in `text`, checked as `sluice check` checks it (same messages), with
/// the `--profile` the gateway was started with.
fn parse(file: &PolicyFile, text: &[u8]) -> Result<Policy, String> {
    let text = std::str::from_utf8(text)
        .map_err(|e| format!("{}: not UTF-8: {e}", file.path.display()))?;
    let policy = sluice_policy::parse_str(text, &file.path).map_err(|e| e.to_string())?;
    match &file.profile {
        Some(profile) => policy
            .with_profile(profile)
            .map_err(|e| format!("--profile: {e}")),
        None => Ok(policy),
    }
}

/// What `stat` says of the policy file: which file it is, its length, and when
/// its content and its inode last changed. Equal looks, the later one taken more
/// than [`TRUST_METADATA_AFTER`] after the change, mean equal content (as git
/// trusts its index only for files not changed within its own timestamp's tick).
#[cfg(unix)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileLook {
    device: u64,
    inode: u64,
    len: u64,
    modified: (i64, i64),
    changed: (i64, i64),
}

#[cfg(unix)]
impl FileLook {
    /// The look of `path` (following symbolic links, as a read does); `None` when
    /// it cannot be had, or when the file changed too recently for it to tell.
    async fn trusted(path: &std::path::Path) -> Option<FileLook> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = tokio::fs::metadata(path).await.ok()?;
        let changed = UNIX_EPOCH
            + Duration::new(
                u64::try_from(meta.ctime()).ok()?,
                u32::try_from(meta.ctime_nsec()).ok()?,
            );
        let settled = SystemTime::now()
            .duration_since(changed)
            .is_ok_and(|age| age > TRUST_METADATA_AFTER);
        settled.then_some(FileLook {
            device: meta.dev(),
            inode: meta.ino(),
            len: meta.len(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// The file's bytes, at most [`MAX_POLICY_BYTES`].
async fn read_bounded(file: &PolicyFile) -> Result<Vec<u8>, String> {
    use tokio::io::AsyncReadExt as _;
    let shown = file.path.display();
    let opened = tokio::fs::File::open(&file.path)
        .await
        .map_err(|e| format!("{shown}: {e}"))?;
    let mut text = Vec::new();
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

/// Reloads on SIGHUP and when the file changes, until `stop`.
#[cfg(unix)]
pub(crate) async fn watch(
    reloader: Arc<Reloader>,
    mut hangups: tokio::signal::unix::Signal,
    stop: Stop,
) {
    let stopped = stop.wait();
    tokio::pin!(stopped);
    let mut tick = tokio::time::interval(POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The last content read, and the last one rejected or unreadable (not tried
    // again until it changes, so a bad file is reported once).
    let mut seen: Option<String> = None;
    let mut given_up: Option<String> = None;
    // The look of the file when its content was last read and handled: while the
    // file looks the same, a tick is one `stat` and nothing more.
    let mut handled: Option<FileLook> = None;
    loop {
        tokio::select! {
            _ = hangups.recv() => {
                // What the signal read is not tried again by the poll when it failed.
                given_up = match reloader.reload(Trigger::Signal).await {
                    Ok(_) => None,
                    Err(_) => seen.clone(),
                };
            }
            _ = tick.tick(), if reloader.file.is_some() => {
                let Some(file) = &reloader.file else { continue };
                let look = FileLook::trusted(&file.path).await;
                if look.is_some() && look == handled {
                    continue;
                }
                let read = read_bounded(file).await;
                let key = match &read {
                    Ok(text) => policy_version(text),
                    Err(error) => format!("unreadable: {error}"),
                };
                let settled = seen.as_deref() == Some(key.as_str());
                seen = Some(key.clone());
                if !settled {
                    handled = None;
                    continue;
                }
                // Two reads agree: this content is handled below (applied, found
                // running already, or given up on) for as long as the file looks so.
                handled = look;
                if given_up.as_deref() == Some(key.as_str()) {
                    continue;
                }
                let outcome = match read {
                    Ok(text) => reloader.apply(Trigger::FileChanged, &text),
                    Err(error) => Err(reloader.rejected(Trigger::FileChanged, "-", error)),
                };
                given_up = outcome.is_err().then_some(key);
            }
            () = &mut stopped => return,
        }
    }
}
