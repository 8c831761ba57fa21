//! The data directory and its files, readable by sluice's user only: they hold
//! monthly counts, and the batch queue holds the credentials its items are sent
//! with until each item finishes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// The mode of a directory sluice creates: this user only.
pub(crate) const DIR_MODE: u32 = 0o700;

/// The mode of a file sluice creates: this user only, read and write.
pub(crate) const FILE_MODE: u32 = 0o600;

/// Creates `dir` and any missing parent with [`DIR_MODE`]. A directory that
/// exists is left as it is: the files in it are what is kept private.
///
/// # Errors
/// The file system's.
pub(crate) fn create_dir(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
}

/// Options that open a file for reading and writing, creating it with
/// [`FILE_MODE`] when it is missing.
pub(crate) fn open_options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).mode(FILE_MODE);
    options
}

/// Takes group and other permissions away from `file` (at `path`) if it has
/// any: a file written by an earlier version, or by hand. When that is refused
/// (another user's file), says so on stderr and leaves it.
pub(crate) fn tighten(file: &File, path: &Path) {
    let Ok(meta) = file.metadata() else {
        return;
    };
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 == 0 {
        return;
    }
    match file.set_permissions(std::fs::Permissions::from_mode(mode & !0o077)) {
        Ok(()) => eprintln!(
            "sluice: {}: was readable by other users (mode {mode:o}); now {:o}, this user's only",
            path.display(),
            mode & !0o077
        ),
        Err(e) => eprintln!(
            "sluice: warning: {} is readable by other users (mode {mode:o}) and could not be changed ({e}): it holds quota counts and the batch queue's credentials; chmod 600 it",
            path.display()
        ),
    }
}

/// Makes sure the file at `path` exists with [`FILE_MODE`] before another
/// library opens it by name (redb): creates it so, or tightens it. A file that
/// cannot be opened is left to that library to report.
pub(crate) fn prepare(path: &Path) {
    if let Ok(file) = open_options().open(path) {
        tighten(&file, path);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::super::{DURABLE_FILE, DurableStore, JOURNAL_FILE};

    /// The permission bits of `path`, in octal.
    fn mode(path: &std::path::Path) -> String {
        let mode = std::fs::metadata(path)
            .expect("metadata")
            .permissions()
            .mode();
        format!("{:o}", mode & 0o777)
    }

    /// The data dir holds the batch queue, and with it the credentials its items
    /// are sent with: no other user reads it (SPEC E2, credentials at rest).
    #[test]
    fn e2_the_data_dir_and_its_files_are_this_users_only() {
        let root = std::env::temp_dir().join(format!(
            "sluice-private-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        let dir = root.join("state").join("sluice");
        let store = DurableStore::open(&dir).expect("open");
        assert_eq!(mode(&dir), "700", "the data dir");
        assert_eq!(mode(&root.join("state")), "700", "a parent it created");
        assert_eq!(mode(&dir.join(DURABLE_FILE)), "600", "sluice.redb");
        assert_eq!(mode(&dir.join(JOURNAL_FILE)), "600", "quota.journal");
        drop(store);

        // Files an earlier version left readable by everyone are made private
        // when they are opened again.
        for file in [DURABLE_FILE, JOURNAL_FILE] {
            std::fs::set_permissions(dir.join(file), std::fs::Permissions::from_mode(0o644))
                .expect("chmod");
        }
        let store = DurableStore::open(&dir).expect("open again");
        assert_eq!(
            mode(&dir.join(DURABLE_FILE)),
            "600",
            "sluice.redb, tightened"
        );
        assert_eq!(
            mode(&dir.join(JOURNAL_FILE)),
            "600",
            "quota.journal, tightened"
        );
        drop(store);
        let _ = std::fs::remove_dir_all(&root);
    }
}
