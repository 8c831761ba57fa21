//! A storage for rehearsing a full disk.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use redb::StorageBackend;
use redb::backends::InMemoryBackend;

/// In-memory storage whose writes fail, as on a full disk (`ENOSPC`), while
/// the switch [`FillableDisk::new`] returns is on (its quota journal,
/// [`FillableDisk::log`], refuses every append then). A disk made with
/// [`FillableDisk::growth_only`] refuses only what needs new room, as a real
/// full disk does. Open a [`super::DurableStore`] on it with
/// [`super::DurableStore::with_backend`] to see what sluice does when the disk
/// fills and when it has room again.
/// Clones reach the same storage.
#[derive(Clone, Debug, Default)]
pub struct FillableDisk {
    inner: Arc<InMemoryBackend>,
    full: Arc<AtomicBool>,
    journal: Arc<parking_lot::Mutex<Vec<u8>>>,
    /// Refuse only writes that need new room (growing the file).
    growth_only: bool,
}

impl FillableDisk {
    /// An empty disk with room, and the switch that fills it.
    pub fn new() -> (Self, Arc<AtomicBool>) {
        let disk = FillableDisk::default();
        let full = Arc::clone(&disk.full);
        (disk, full)
    }

    /// [`FillableDisk::new`], but while full it refuses only what needs new
    /// room: growing the file or writing past its end. Writing over bytes the
    /// file already has (a header, a page freed and reused) and syncing work,
    /// as on a real full disk.
    pub fn growth_only() -> (Self, Arc<AtomicBool>) {
        let disk = FillableDisk {
            growth_only: true,
            ..FillableDisk::default()
        };
        let full = Arc::clone(&disk.full);
        (disk, full)
    }

    fn room(&self) -> std::io::Result<()> {
        room(&self.full)
    }

    /// The quota journal on this disk: in memory, failing while the disk is full.
    /// Every call returns the same journal, so a store opened again after a
    /// simulated crash finds what the last one appended.
    pub fn log(&self) -> FillableLog {
        FillableLog {
            bytes: Arc::clone(&self.journal),
            full: Arc::clone(&self.full),
            inline: false,
        }
    }

    /// [`FillableDisk::log`], appended by deciding threads themselves, as a
    /// journal written to the operating system only (`--quota-sync write`) is.
    pub fn log_written_through(&self) -> FillableLog {
        FillableLog {
            inline: true,
            ..self.log()
        }
    }
}

fn room(full: &AtomicBool) -> std::io::Result<()> {
    if full.load(Ordering::SeqCst) {
        Err(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            "no space left on device",
        ))
    } else {
        Ok(())
    }
}

/// The quota journal of a [`FillableDisk`].
#[derive(Debug)]
pub struct FillableLog {
    bytes: Arc<parking_lot::Mutex<Vec<u8>>>,
    full: Arc<AtomicBool>,
    inline: bool,
}

impl super::QuotaLog for FillableLog {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        room(&self.full)?;
        self.bytes.lock().extend_from_slice(bytes);
        Ok(())
    }

    fn read_all(&mut self) -> std::io::Result<Vec<u8>> {
        Ok(self.bytes.lock().clone())
    }

    fn reset(&mut self) -> std::io::Result<()> {
        room(&self.full)?;
        self.bytes.lock().clear();
        Ok(())
    }

    fn len(&self) -> u64 {
        self.bytes.lock().len() as u64
    }

    fn inline(&self) -> bool {
        self.inline
    }
}

impl StorageBackend for FillableDisk {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        if !self.growth_only || len > self.inner.len()? {
            self.room()?;
        }
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        if !self.growth_only {
            self.room()?;
        }
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let end = offset.saturating_add(data.len() as u64);
        if !self.growth_only || end > self.inner.len()? {
            self.room()?;
        }
        self.inner.write(offset, data)
    }
}
