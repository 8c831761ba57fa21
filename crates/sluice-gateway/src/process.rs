//! What a process that runs a gateway needs from its surroundings: the default
//! data directory, an open-file limit that holds its connections, the termination
//! signals, and where its log lines go.

use std::num::NonZeroUsize;
use std::path::PathBuf;

/// Descriptors a client connection may hold: its own, its upstream's, and on the
/// HTTP/1.1 path hyper serves the second one that watches for its hang-up.
const FDS_PER_CONNECTION: u64 = 3;

/// File descriptors the process needs besides those of client connections:
/// listeners, the admin side, the durable store, Redis, logs.
const FDS_BESIDES_CONNECTIONS: u64 = 128;

/// The `--max-connections` the open-file limit allows: the soft limit is raised
/// toward the hard one when three descriptors per connection do not fit, and when even
/// the hard one is too low the cap is lowered, with a warning, rather than `accept`
/// failing in a loop once descriptors run out.
///
/// Returns the cap, and a warning to show when it was lowered.
///
/// # Errors
/// A limit too low for a single connection (the message says so).
pub fn connections_within_fd_limit(
    wanted: NonZeroUsize,
) -> Result<(NonZeroUsize, Option<String>), String> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let needed = (wanted.get() as u64)
        .saturating_mul(FDS_PER_CONNECTION)
        .saturating_add(FDS_BESIDES_CONNECTIONS);
    let limit = getrlimit(Resource::Nofile);
    let Some(soft) = limit.current else {
        return Ok((wanted, None));
    };
    if soft >= needed {
        return Ok((wanted, None));
    }
    let hard = limit.maximum.unwrap_or(u64::MAX);
    let raised = needed.min(hard);
    let soft = if raised > soft
        && setrlimit(
            Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(raised),
                maximum: limit.maximum,
            },
        )
        .is_ok()
    {
        raised
    } else {
        soft
    };
    if soft >= needed {
        return Ok((wanted, None));
    }
    let fits = soft.saturating_sub(FDS_BESIDES_CONNECTIONS) / FDS_PER_CONNECTION;
    let fits = usize::try_from(fits)
        .ok()
        .and_then(NonZeroUsize::new)
        .ok_or_else(|| {
            format!(
                "the open-file limit is {soft} (hard {hard}): too low to serve a connection; raise it (ulimit -n)"
            )
        })?;
    let warning = format!(
        "--max-connections {wanted} needs {needed} open files and the limit is {soft} (hard {hard}): serving at most {fits} connections"
    );
    Ok((fits, Some(warning)))
}

/// Checks that a memory store of `max_keys` cells, whose tables are allocated at
/// start (see [`sluice_store::MemoryConfig::preallocated`]), fits in half of the
/// memory this process may use (the machine's from `/proc/meminfo`, or its control
/// group's limit where lower; where neither can be read, any size passes).
///
/// # Errors
/// The message names the memory the store would take and the machine's.
pub fn keys_within_memory(max_keys: usize) -> Result<(), String> {
    keys_within(max_keys, physical_memory())
}

fn keys_within(max_keys: usize, memory: Option<u64>) -> Result<(), String> {
    let needed = sluice_store::MemoryConfig::with_max_keys(max_keys).bytes_at_cap();
    let Some(total) = memory else {
        return Ok(());
    };
    if needed <= total / 2 {
        return Ok(());
    }
    const MIB: u64 = 1 << 20;
    Err(format!(
        "--max-keys {max_keys} takes about {} MiB for the budget store's tables, more than half of this machine's {} MiB; lower --max-keys (each cell is about 20 bytes)",
        needed.div_ceil(MIB),
        total / MIB
    ))
}

/// The memory this process may use, in bytes: the machine's (`MemTotal` of
/// `/proc/meminfo`), or its control group's limit where that is lower (cgroup v2
/// `memory.max`, v1 `memory.limit_in_bytes`), where they can be read.
fn physical_memory() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|meminfo| {
            let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        });
    let group = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .filter_map(|f| std::fs::read_to_string(f).ok())
    // `max` (v2) or a huge number (v1) mean no limit.
    .filter_map(|limit| limit.trim().parse::<u64>().ok())
    .min();
    match (total, group) {
        (Some(total), Some(group)) => Some(total.min(group)),
        (total, group) => total.or(group),
    }
}

/// The data directory when `--data-dir` is not given: `$XDG_STATE_HOME/sluice`, else
/// `$HOME/.local/state/sluice`, else `./sluice-data`.
pub fn default_data_dir() -> PathBuf {
    let non_empty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(state) = non_empty("XDG_STATE_HOME") {
        return PathBuf::from(state).join("sluice");
    }
    if let Some(home) = non_empty("HOME") {
        return PathBuf::from(home).join(".local/state/sluice");
    }
    PathBuf::from("sluice-data")
}

/// A future that resolves with the signal's name on SIGTERM or SIGINT (Ctrl-C).
pub fn termination_signal() -> std::io::Result<impl Future<Output = &'static str>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            match tokio::signal::ctrl_c().await {
                Ok(()) => "Ctrl-C",
                Err(_) => std::future::pending().await,
            }
        })
    }
}

/// Installs the process's log subscriber: lines on stderr, one JSON object each when
/// `json` (`timestamp`, `level`, `target`, `message` and the event's fields, e.g.
/// `request_id`, `reason`, `budget`, `caller`), else one readable line each; from
/// `level` up. A second call changes nothing: the first subscriber stays.
pub fn init_logs(json: bool, level: tracing::Level) {
    use std::io::IsTerminal as _;
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(true);
    let _ = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init()
    } else {
        builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_pointer_width = "64")]
    #[test]
    fn a_store_larger_than_half_the_memory_is_refused_with_both_figures() {
        const GIB: u64 = 1 << 30;
        // The default million cells: about 20 MB, anywhere.
        assert!(keys_within(1_000_000, Some(GIB)).is_ok());
        assert!(
            keys_within(1 << 32, None).is_ok(),
            "memory unknown: no check"
        );
        // 2^32 cells: about 90 GiB, on a 24 GiB machine.
        let err = keys_within(1 << 32, Some(24 * GIB)).expect_err("too large");
        assert!(
            err.contains("92160 MiB") && err.contains("24576 MiB"),
            "{err}"
        );
        assert!(keys_within(1 << 32, Some(200 * GIB)).is_ok());
    }
}
