//! The tenant table of a single process: a journal file under `--data-dir`, one
//! change a line, written and synced before a change is acknowledged and applied,
//! read back at start.
//!
//! A record is whole only with its newline, and the journal knows the length of
//! its whole records: a write that fails (a full disk) is cut back to that length
//! at once, and, should that fail too, before the next write, so a torn record can
//! never swallow a later, acknowledged one. At start a last line without its
//! newline (a crash mid-write, never acknowledged) is cut off with a log line. The
//! journal is written afresh from the table when it holds many more lines than the
//! table entries.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use sluice_policy::{Policy, TenantChange, TenantTable};

/// The journal's file name under the data directory.
pub const FILE: &str = "tenants.jsonl";

/// The tenant journal.
#[derive(Debug)]
pub(super) struct Journal {
    path: PathBuf,
    state: Mutex<State>,
}

/// The open journal file and what is known of it.
#[derive(Debug)]
struct State {
    file: File,
    /// Bytes of whole records (each ending in a newline) at the start of the file.
    len: u64,
    /// Records in it.
    lines: usize,
    /// Bytes past `len` may be in the file (a failed write not yet cut back).
    dirty: bool,
}

impl Journal {
    /// Opens (or creates) the journal under `dir` and reads the table it holds, its
    /// changes made over `base` (the policy file's).
    ///
    /// # Errors
    /// The I/O error, or a whole line that does not read as a change.
    pub(super) fn open(dir: &Path, base: &Policy) -> std::io::Result<(Journal, TenantTable)> {
        private_dir(dir)?;
        let path = dir.join(FILE);
        // A compaction that did not finish.
        match std::fs::remove_file(tmp_path(&path)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let existed = path.exists();
        let mut file = private_file().create(true).truncate(false).open(&path)?;
        tighten(&file, &path);
        if !existed {
            sync_dir(&path)?;
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let (table, lines) = read(&bytes[..whole], base, &path)?;
        let mut dirty = false;
        if whole < bytes.len() {
            // Written without its newline, so never synced whole nor acknowledged:
            // appending after it would join it to the next change.
            tracing::warn!(
                target: "sluice::tenants",
                "{}: cut off a torn last line ({} bytes without a newline: a write that did not finish)",
                path.display(),
                bytes.len() - whole
            );
            if let Err(e) = cut(&file, whole as u64) {
                tracing::warn!(target: "sluice::tenants", "{}: cutting off the torn line: {e}; it is cut before the next change", path.display());
                dirty = true;
            }
        }
        let journal = Journal {
            path,
            state: Mutex::new(State {
                file,
                len: whole as u64,
                lines,
                dirty,
            }),
        };
        // Far more lines than entries: written afresh, when there is room.
        {
            let mut state = journal.state.lock();
            let entries = table.workspaces.len() + table.keys.len();
            if state.lines > 2 * entries + 100
                && let Err(e) = journal.compact(&mut state, &table)
            {
                tracing::warn!(target: "sluice::tenants", "{}: not written afresh: {e}", journal.path.display());
            }
        }
        Ok((journal, table))
    }

    /// Writes `change` whole and syncs it; `table` is the table after it.
    ///
    /// # Errors
    /// The I/O error: nothing may be applied then, and nothing of `change` stays
    /// in the journal (it is cut back at once, or before the next change).
    pub(super) fn append(&self, change: &TenantChange, table: &TenantTable) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(change).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut state = self.state.lock();
        if state.dirty {
            cut(&state.file, state.len)?;
            state.dirty = false;
        }
        let at = state.len;
        let written = (|| {
            let mut file = &state.file;
            file.seek(SeekFrom::Start(at))?;
            file.write_all(&line)?;
            file.sync_data()
        })();
        if let Err(e) = written {
            // Part of the line may be in the file (a full disk takes what fits):
            // cut back to the last whole record now, or before the next change.
            state.dirty = true;
            match cut(&state.file, at) {
                Ok(()) => state.dirty = false,
                Err(cut_error) => tracing::warn!(
                    target: "sluice::tenants",
                    "{}: cutting back a failed write: {cut_error}; it is cut before the next change",
                    self.path.display()
                ),
            }
            return Err(e);
        }
        state.len = at + line.len() as u64;
        state.lines += 1;
        let entries = table.workspaces.len() + table.keys.len();
        // The change is durable: a compaction that fails only leaves more lines.
        if state.lines > 4 * (entries + 1_000)
            && let Err(e) = self.compact(&mut state, table)
        {
            tracing::warn!(target: "sluice::tenants", "{}: not written afresh: {e}", self.path.display());
        }
        Ok(())
    }

    /// Writes the journal afresh as one line per entry of `table`: to a new file,
    /// synced, then renamed over the old one.
    fn compact(&self, state: &mut State, table: &TenantTable) -> std::io::Result<()> {
        let tmp = tmp_path(&self.path);
        let written = (|| {
            let mut out =
                std::io::BufWriter::new(private_file().create(true).truncate(true).open(&tmp)?);
            let mut lines = 0;
            for change in snapshot(table) {
                serde_json::to_writer(&mut out, &change).map_err(std::io::Error::other)?;
                out.write_all(b"\n")?;
                lines += 1;
            }
            let file = out.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            Ok::<_, std::io::Error>(lines)
        })();
        let lines = match written {
            Ok(lines) => lines,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)?;
        state.len = file.metadata()?.len();
        state.file = file;
        state.lines = lines;
        state.dirty = false;
        sync_dir(&self.path)
    }
}

/// The table the whole lines of `bytes` make over `base`, and their count.
fn read(bytes: &[u8], base: &Policy, path: &Path) -> std::io::Result<(TenantTable, usize)> {
    let mut table = TenantTable::default();
    let mut lines = 0;
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        let change = match serde_json::from_slice::<TenantChange>(line) {
            Ok(change) => change,
            Err(e) => match joined(line) {
                // An earlier sluice appended a change onto a torn line: the whole
                // change is the line's last, acknowledged one.
                Some(change) => {
                    tracing::warn!(
                        target: "sluice::tenants",
                        "{}: line {}: a torn change joined to a whole one; the whole one kept",
                        path.display(),
                        i + 1
                    );
                    change
                }
                None => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("{}: line {}: {e}", path.display(), i + 1),
                    ));
                }
            },
        };
        table = table.with(&change, base);
        lines += 1;
    }
    Ok((table, lines))
}

/// The whole change at the end of `line`, when a torn one comes before it.
fn joined(line: &[u8]) -> Option<TenantChange> {
    line.iter()
        .enumerate()
        .skip(1)
        .filter(|&(_, &b)| b == b'{')
        .find_map(|(i, _)| serde_json::from_slice(&line[i..]).ok())
}

/// Cuts `file` back to `len` bytes and syncs that.
fn cut(file: &File, len: u64) -> std::io::Result<()> {
    file.set_len(len)?;
    file.sync_data()
}

/// The data dir, created readable by this user only (0700) when missing: the
/// journal names the workspaces, and the embedded store beside it keeps the
/// credentials of queued batch items.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

/// Options that open the journal for reading and writing, a file they create
/// readable by this user only (0600).
fn private_file() -> std::fs::OpenOptions {
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options
}

/// Takes group and other permissions away from the journal `file` (at `path`)
/// if it has any (an earlier version made it 0644); says so when that is refused.
fn tighten(file: &File, path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let Ok(meta) = file.metadata() else {
            return;
        };
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 == 0 {
            return;
        }
        match file.set_permissions(std::fs::Permissions::from_mode(mode & !0o077)) {
            Ok(()) => tracing::info!(
                target: "sluice::tenants",
                "{}: was readable by other users (mode {mode:o}); now {:o}, this user's only",
                path.display(),
                mode & !0o077
            ),
            Err(e) => tracing::warn!(
                target: "sluice::tenants",
                "{} is readable by other users (mode {mode:o}) and could not be changed ({e}); chmod 600 it",
                path.display()
            ),
        }
    }
    #[cfg(not(unix))]
    let _ = (file, path);
}

fn tmp_path(path: &Path) -> PathBuf {
    path.with_extension("jsonl.tmp")
}

/// Syncs the directory of `path`, so that the file's name is durable too.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// The changes that make `table` from an empty one (removals kept: they remove
/// what the policy file has).
fn snapshot(table: &TenantTable) -> impl Iterator<Item = TenantChange> + '_ {
    let workspaces = table.workspaces.iter().map(|(name, w)| match w {
        Some(w) => TenantChange::PutWorkspace {
            name: name.clone(),
            workspace: w.clone(),
        },
        // The keys it revoked are stated below, each as it is now.
        None => TenantChange::RemoveWorkspace {
            name: name.clone(),
            revoked: Some(Vec::new()),
        },
    });
    let keys = table.keys.iter().map(|(sha, k)| match k {
        Some(k) => TenantChange::PutKey {
            sha256: sha.clone(),
            key: k.clone(),
        },
        None => TenantChange::RevokeKey {
            sha256: sha.clone(),
        },
    });
    // Workspaces first: a removal revokes keys, which the key entries then state.
    workspaces.chain(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revoke(n: u8) -> TenantChange {
        TenantChange::RevokeKey {
            sha256: format!("{n:02x}").repeat(32),
        }
    }

    fn dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "sluice-journal-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    fn revoked(table: &TenantTable) -> Vec<String> {
        table
            .keys
            .iter()
            .filter(|(_, k)| k.is_none())
            .map(|(sha, _)| sha[..2].to_owned())
            .collect()
    }

    /// The journal (and the data dir it creates) is this user's only, also once
    /// written afresh; one an earlier version left readable by everyone is made
    /// so at open (SPEC E2 and P4: the data dir holds credentials at rest).
    #[cfg(unix)]
    #[test]
    fn e2_p4_the_journal_and_the_data_dir_are_this_users_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |p: &Path| {
            let mode = std::fs::metadata(p).expect("metadata").permissions().mode();
            format!("{:o}", mode & 0o777)
        };
        let root = dir();
        let data = root.join("data");
        let base = sluice_policy::default_policy().expect("default policy");
        let (journal, table) = Journal::open(&data, &base).expect("open");
        let path = data.join(FILE);
        assert_eq!(mode(&data), "700", "the data dir");
        assert_eq!(mode(&path), "600", "the journal");
        journal
            .compact(&mut journal.state.lock(), &table)
            .expect("written afresh");
        assert_eq!(mode(&path), "600", "the journal written afresh");
        drop(journal);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let (_journal, _) = Journal::open(&data, &base).expect("open again");
        assert_eq!(mode(&path), "600", "tightened at open");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn p4_a_torn_last_line_is_cut_off_and_the_next_change_survives() {
        let dir = dir();
        let base = sluice_policy::default_policy().expect("default policy");
        let (journal, table) = Journal::open(&dir, &base).expect("open");
        let table = table.with(&revoke(1), &base);
        journal.append(&revoke(1), &table).expect("append");
        drop(journal);
        // A crash mid-write: part of a second change, without its newline.
        let path = dir.join(FILE);
        let whole = std::fs::read(&path).expect("read");
        let torn = serde_json::to_vec(&revoke(2)).expect("json");
        let mut bytes = whole.clone();
        bytes.extend_from_slice(&torn[..torn.len() / 2]);
        std::fs::write(&path, &bytes).expect("write");

        let (journal, table) = Journal::open(&dir, &base).expect("a torn tail never stops a start");
        assert_eq!(
            revoked(&table),
            ["01"],
            "the torn change was never acknowledged"
        );
        assert_eq!(
            std::fs::read(&path).expect("read"),
            whole,
            "cut off at once"
        );
        let table = table.with(&revoke(3), &base);
        journal.append(&revoke(3), &table).expect("append");
        drop(journal);

        let (_, table) = Journal::open(&dir, &base).expect("open again");
        assert_eq!(
            revoked(&table),
            ["01", "03"],
            "the acknowledged change kept"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn p4_a_change_joined_to_a_torn_line_by_an_earlier_sluice_is_kept() {
        let dir = dir();
        let base = sluice_policy::default_policy().expect("default policy");
        let path = dir.join(FILE);
        let first = serde_json::to_string(&revoke(1)).expect("json");
        let second = serde_json::to_string(&revoke(2)).expect("json");
        let third = serde_json::to_string(&revoke(3)).expect("json");
        std::fs::write(
            &path,
            format!("{first}\n{}{second}\n{third}\n", &first[..first.len() - 9]),
        )
        .expect("write");
        let (_, table) = Journal::open(&dir, &base).expect("open");
        assert_eq!(revoked(&table), ["01", "02", "03"]);
        // A whole line that does not read is not a torn one: the start stops.
        std::fs::write(&path, format!("{first}\n{{\"op\":\"nothing\"}}\n{third}\n"))
            .expect("write");
        let error = Journal::open(&dir, &base).expect_err("corrupt");
        assert!(error.to_string().contains("line 2"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
