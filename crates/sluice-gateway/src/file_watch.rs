//! When the policy file may have changed, without reading it: on Linux the kernel says
//! so (inotify on the file's directory), otherwise a slow poll of its metadata.
//!
//! A writer that pauses in the middle of a file is no cue: inotify reports a file once
//! it is closed after writing (`IN_CLOSE_WRITE`) or moved into place (`IN_MOVED_TO`,
//! the atomic-rename habit, and how Kubernetes swaps a ConfigMap's `..data`), never
//! when it is opened or created. Where inotify is not to be had, the poll takes a file
//! only once its size and modification time have held still for [`SETTLE`].

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How often the metadata is read where inotify is not to be had.
pub const POLL_EVERY: Duration = Duration::from_secs(1);

/// How long a file must hold still (same size and modification time, that time this
/// far in the past) before the poll takes it.
pub const SETTLE: Duration = Duration::from_secs(2);

/// What a file's metadata says of its content: equal stamps, same content (as far as
/// can be told without reading it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    dev: u64,
    ino: u64,
    /// Its size in bytes.
    pub len: u64,
    modified: Option<SystemTime>,
}

impl Stamp {
    /// The stamp of the file at `path` (symbolic links followed).
    ///
    /// # Errors
    /// The file cannot be looked at.
    pub(crate) fn of(path: &Path) -> std::io::Result<Stamp> {
        let meta = std::fs::metadata(path)?;
        #[cfg(unix)]
        let (dev, ino) = {
            use std::os::unix::fs::MetadataExt as _;
            (meta.dev(), meta.ino())
        };
        #[cfg(not(unix))]
        let (dev, ino) = (0, 0);
        Ok(Stamp {
            dev,
            ino,
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }

    /// Whether it was last modified at least [`SETTLE`] ago.
    pub(crate) fn settled(&self, now: SystemTime) -> bool {
        self.modified
            .is_some_and(|m| now.duration_since(m).is_ok_and(|age| age >= SETTLE))
    }
}

/// Why to look at the file now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cue {
    /// A writer finished with a file of its directory, or one was moved in: take the
    /// file as it is.
    Finished,
    /// A poll: take the file only once it has settled.
    Poll,
}

/// Cues for one file.
pub(crate) struct FileWatch {
    #[cfg(target_os = "linux")]
    kernel: Option<linux::Inotify>,
    poll: tokio::time::Interval,
    path: PathBuf,
}

impl std::fmt::Debug for FileWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileWatch")
            .field("path", &self.path)
            .field("kernel", &self.uses_kernel())
            .finish()
    }
}

impl FileWatch {
    /// Watches `path` (its directory through inotify where it can; else by polling).
    pub(crate) fn new(path: &Path) -> FileWatch {
        let mut poll = tokio::time::interval(POLL_EVERY);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        FileWatch {
            #[cfg(target_os = "linux")]
            kernel: linux::Inotify::watch(path),
            poll,
            path: path.to_owned(),
        }
    }

    /// Whether the kernel gives the cues (no polling).
    pub(crate) fn uses_kernel(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            self.kernel.is_some()
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    }

    /// The next cue.
    pub(crate) async fn next(&mut self) -> Cue {
        #[cfg(target_os = "linux")]
        if let Some(kernel) = &mut self.kernel {
            match kernel.finished().await {
                Ok(()) => return Cue::Finished,
                Err(error) => {
                    tracing::warn!(
                        target: "sluice::reload",
                        "watching {} through inotify failed ({error}); reading its metadata every {} s instead",
                        self.path.display(),
                        POLL_EVERY.as_secs()
                    );
                    self.kernel = None;
                }
            }
        }
        self.poll.tick().await;
        Cue::Poll
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::mem::MaybeUninit;
    use std::os::fd::OwnedFd;
    use std::path::{Path, PathBuf};

    use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
    use tokio::io::unix::AsyncFd;

    /// inotify on a directory: its writers' closes and its moves in.
    pub(super) struct Inotify {
        fd: AsyncFd<OwnedFd>,
        dir: PathBuf,
        buf: Vec<MaybeUninit<u8>>,
    }

    const FLAGS: WatchFlags = WatchFlags::CLOSE_WRITE
        .union(WatchFlags::MOVED_TO)
        .union(WatchFlags::DELETE_SELF)
        .union(WatchFlags::MOVE_SELF);

    impl Inotify {
        pub(super) fn watch(path: &Path) -> Option<Inotify> {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
                _ => PathBuf::from("."),
            };
            let fd = inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC).ok()?;
            inotify::add_watch(&fd, &dir, FLAGS).ok()?;
            // `AsyncFd::new` is deprecated for inners that may close their descriptor
            // while registered; an `OwnedFd` closes it only when the `AsyncFd` (which
            // deregisters first) drops it. `register`, the replacement, is `unsafe`,
            // which this crate forbids.
            #[allow(deprecated)]
            let fd = AsyncFd::new(fd).ok()?;
            Some(Inotify {
                fd,
                dir,
                buf: vec![MaybeUninit::uninit(); 4096],
            })
        }

        /// Resolves when a writer closed a file of the directory or one was moved in.
        ///
        /// # Errors
        /// The directory went away (moved or deleted) or inotify failed: poll instead.
        pub(super) async fn finished(&mut self) -> std::io::Result<()> {
            loop {
                let mut guard = self.fd.readable().await?;
                let mut cue = false;
                let mut gone = false;
                let read = guard.try_io(|fd| {
                    let mut reader = inotify::Reader::new(fd.get_ref(), &mut self.buf);
                    loop {
                        match reader.next() {
                            Ok(event) => {
                                let flags = event.events();
                                // A full queue lost events: look, as for a close.
                                if flags.intersects(
                                    ReadFlags::CLOSE_WRITE
                                        | ReadFlags::MOVED_TO
                                        | ReadFlags::QUEUE_OVERFLOW,
                                ) {
                                    cue = true;
                                }
                                if flags.intersects(
                                    ReadFlags::DELETE_SELF
                                        | ReadFlags::MOVE_SELF
                                        | ReadFlags::IGNORED,
                                ) {
                                    gone = true;
                                }
                            }
                            Err(rustix::io::Errno::AGAIN) if cue || gone => return Ok(()),
                            Err(e) => return Err(std::io::Error::from(e)),
                        }
                        if reader.is_buffer_empty() && (cue || gone) {
                            return Ok(());
                        }
                    }
                });
                match read {
                    Ok(Ok(())) if gone => {
                        return Err(std::io::Error::other(format!(
                            "{} was moved or deleted",
                            self.dir.display()
                        )));
                    }
                    Ok(Ok(())) if cue => return Ok(()),
                    Ok(Ok(())) | Err(_) => {}
                    Ok(Err(e)) => return Err(e),
                }
            }
        }
    }
}
