//! The tenant table of a single process: a journal file under `--data-dir`, one
//! change a line, appended and synced before a change is applied, read back at
//! start. A torn last line (a crash mid-write) is dropped; the journal is written
//! afresh from the table when it holds many more lines than the table entries.

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use sluice_policy::{Policy, TenantChange, TenantTable};

/// The journal's file name under the data directory.
pub const FILE: &str = "tenants.jsonl";

/// The tenant journal.
#[derive(Debug)]
pub(super) struct Journal {
    path: PathBuf,
    /// Lines in the file now.
    lines: Mutex<usize>,
}

impl Journal {
    /// Opens (or creates) the journal under `dir` and reads the table it holds, its
    /// changes made over `base` (the policy file's).
    ///
    /// # Errors
    /// The I/O error, or a line before the last that does not read.
    pub(super) fn open(dir: &Path, base: &Policy) -> std::io::Result<(Journal, TenantTable)> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(FILE);
        let mut table = TenantTable::default();
        let mut lines = 0;
        let mut torn = false;
        match std::fs::File::open(&path) {
            Ok(file) => {
                let all: Vec<String> = std::io::BufReader::new(file)
                    .lines()
                    .collect::<Result<_, _>>()?;
                let count = all.len();
                for (i, line) in all.iter().enumerate() {
                    match serde_json::from_str::<TenantChange>(line) {
                        Ok(change) => {
                            table = table.with(&change, base);
                            lines += 1;
                        }
                        // The last line may be torn by a crash: what it held was
                        // never applied (a change is applied after its line is synced).
                        Err(_) if i + 1 == count => torn = true,
                        Err(e) => {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                format!("{}: line {}: {e}", path.display(), i + 1),
                            ));
                        }
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let journal = Journal {
            path,
            lines: Mutex::new(lines),
        };
        // A torn line (appending after it would join two changes on one line), or
        // far more lines than entries: written afresh.
        journal.compact(&table, torn)?;
        Ok((journal, table))
    }

    /// Appends `change` and syncs it to disk.
    ///
    /// # Errors
    /// The I/O error: nothing may be applied then.
    pub(super) fn append(&self, change: &TenantChange, table: &TenantTable) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(change).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut lines = self.lines.lock();
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        file.write_all(&line)?;
        file.sync_data()?;
        *lines += 1;
        let entries = table.workspaces.len() + table.keys.len();
        if *lines > 4 * (entries + 1_000) {
            drop(lines);
            self.compact(table, true)?;
        }
        Ok(())
    }

    /// Writes the journal afresh as one line per entry of `table` (when `force`, or
    /// when it holds more than twice as many lines): to a new file, synced, then
    /// renamed over the old one.
    fn compact(&self, table: &TenantTable, force: bool) -> std::io::Result<()> {
        let mut lines = self.lines.lock();
        let entries = table.workspaces.len() + table.keys.len();
        if !force && *lines <= 2 * entries + 100 {
            return Ok(());
        }
        let tmp = self.path.with_extension("jsonl.tmp");
        {
            let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            for change in snapshot(table) {
                serde_json::to_writer(&mut out, &change).map_err(std::io::Error::other)?;
                out.write_all(b"\n")?;
            }
            out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        *lines = entries;
        Ok(())
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
        None => TenantChange::RemoveWorkspace { name: name.clone() },
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
