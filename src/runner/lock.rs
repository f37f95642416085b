//! The workspace lock: `DIR/.bmx/lock`.
//!
//! The kernel's advisory lock (`flock`) is the truth: it is held exactly as
//! long as the holder's open file lives and is released by the kernel when
//! the holder dies, however it dies. So a lock left by a dead process, a
//! file of garbage, or a file naming a pid that now belongs to another
//! program are all the same case: nobody holds the `flock`, and the next
//! executor takes the lock over. The file's contents (pid, instance id,
//! start time) only *name* the holder, for the message a refused executor
//! prints and for `bmx env diagnose`; the instance id is what tells a live
//! holder from an unrelated process that got the same pid.
//!
//! # Errors
//!
//! [`WorkspaceLock::acquire`] fails with [`LockError::Held`] when a live
//! process holds the lock, and with [`LockError::Io`] when the lock cannot
//! be created (a read-only workspace, a missing directory).

use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Largest lock file read: a real one is ~150 bytes; anything bigger is
/// garbage and is not parsed.
const MAX_LOCK_FILE_BYTES: u64 = 4096;

/// Who holds (or last held) a lock, as written in the lock file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockHolder {
    pub pid: u32,
    /// Random per process start: a pid can be reused, this cannot.
    pub instance_id: String,
    /// RFC 3339.
    pub started_at: String,
    /// What holds it (`bmx executor`, `bmx up`, ...).
    #[serde(default)]
    pub program: String,
}

impl LockHolder {
    /// This process, under a fresh instance id.
    pub fn this_process(program: &str) -> LockHolder {
        LockHolder {
            pid: std::process::id(),
            instance_id: uuid::Uuid::new_v4().simple().to_string(),
            started_at: now_rfc3339(),
            program: program.to_owned(),
        }
    }
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// A live process holds it. `holder` is `None` when its file could not
    /// be read (it is being written, or is garbage while still locked).
    #[error("{} is locked by {}", path.display(), describe(holder.as_ref()))]
    Held {
        path: PathBuf,
        holder: Option<LockHolder>,
    },
    /// The lock could not be created or written.
    #[error("cannot take the lock {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn describe(holder: Option<&LockHolder>) -> String {
    match holder {
        Some(h) => format!(
            "pid {} (instance {}, {} since {})",
            h.pid,
            h.instance_id,
            if h.program.is_empty() {
                "a process"
            } else {
                &h.program
            },
            h.started_at
        ),
        None => "another process (its lock file is unreadable)".into(),
    }
}

/// A held lock; dropping it releases the lock (the file stays, naming the
/// last holder).
#[derive(Debug)]
pub struct WorkspaceLock {
    file: File,
    path: PathBuf,
    holder: LockHolder,
    /// The holder whose lock was taken over (it was dead), if any.
    took_over: Option<LockHolder>,
}

/// The lock file of workspace `dir` (not canonicalized).
pub fn lock_path(dir: &Path) -> PathBuf {
    dir.join(".bmx").join("lock")
}

impl WorkspaceLock {
    /// Take `DIR/.bmx/lock` for `holder`, creating `DIR/.bmx` (0700) if
    /// needed. Never blocks: a held lock is an error naming its holder.
    ///
    /// # Errors
    ///
    /// See the module doc.
    pub fn acquire(dir: &Path, holder: LockHolder) -> Result<WorkspaceLock, LockError> {
        Self::acquire_at(&lock_path(dir), holder)
    }

    /// Take the lock file at `path` itself (a state dir's lock).
    ///
    /// # Errors
    ///
    /// See the module doc.
    pub fn acquire_at(path: &Path, holder: LockHolder) -> Result<WorkspaceLock, LockError> {
        let io = |source| LockError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(io)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(path)
            .map_err(io)?;
        // SAFETY: flock on a valid, owned descriptor.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(LockError::Held {
                    path: path.to_owned(),
                    holder: read_holder(&mut file),
                });
            }
            return Err(io(err));
        }
        let took_over = read_holder(&mut file);
        let text = serde_json::to_string(&holder).map_err(|e| io(std::io::Error::other(e)))?;
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(text.as_bytes()).map_err(io)?;
        file.write_all(b"\n").map_err(io)?;
        file.sync_data().map_err(io)?;
        if let Some(old) = &took_over {
            tracing::info!(path = %path.display(), old_pid = old.pid, old_instance = %old.instance_id, "took over a stale lock");
        }
        Ok(WorkspaceLock {
            file,
            path: path.to_owned(),
            holder,
            took_over,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn holder(&self) -> &LockHolder {
        &self.holder
    }

    /// The earlier holder whose (dead) lock this one replaced.
    pub fn took_over(&self) -> Option<&LockHolder> {
        self.took_over.as_ref()
    }

    /// Empty the file while still holding the lock: a clean exit leaves
    /// no holder named, so a later probe does not mistake it for a crash
    /// (a stale lock is one whose file still names a holder).
    ///
    /// # Errors
    ///
    /// Truncating the file failed.
    pub fn clear(&mut self) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.file.sync_data()
    }
}

impl Drop for WorkspaceLock {
    fn drop(&mut self) {
        // Closing the file releases the flock; unlock explicitly anyway so
        // a descriptor leaked into a child cannot keep it (O_CLOEXEC too).
        // SAFETY: flock on our own valid descriptor.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// What a lock file says, and whether someone holds it, without taking it
/// (for `bmx env diagnose`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockProbe {
    /// The file exists.
    pub exists: bool,
    /// A live process holds the flock.
    pub held: bool,
    /// The parsed contents (`None`: missing or garbage).
    pub holder: Option<LockHolder>,
}

/// Look at the lock at `path` without taking it.
///
/// # Errors
///
/// An I/O error other than "not found" opening the file.
pub fn probe(path: &Path) -> std::io::Result<LockProbe> {
    let mut file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(LockProbe {
                exists: false,
                held: false,
                holder: None,
            })
        }
        Err(e) => return Err(e),
    };
    // A shared lock succeeds only when nobody holds the exclusive one;
    // released at once (the descriptor is closed on return too).
    // SAFETY: flock on a valid, owned descriptor.
    let free = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
    if free {
        // SAFETY: as above.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
    }
    Ok(LockProbe {
        exists: true,
        held: !free,
        holder: read_holder(&mut file),
    })
}

/// The holder named by an open lock file; `None` for garbage or too big.
fn read_holder(file: &mut File) -> Option<LockHolder> {
    file.seek(SeekFrom::Start(0)).ok()?;
    let mut buf = Vec::new();
    file.take(MAX_LOCK_FILE_BYTES + 1)
        .read_to_end(&mut buf)
        .ok()?;
    if buf.len() as u64 > MAX_LOCK_FILE_BYTES {
        return None;
    }
    serde_json::from_slice(&buf).ok()
}

/// Whether process `pid` exists (signal 0; EPERM still means it exists).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(nix::errno::Errno::EPERM) => true,
        Err(_) => false,
    }
}

pub(crate) fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_acquire_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = WorkspaceLock::acquire(dir.path(), LockHolder::this_process("t")).unwrap();
        match WorkspaceLock::acquire(dir.path(), LockHolder::this_process("t")) {
            Err(LockError::Held { holder, .. }) => {
                assert_eq!(holder.as_ref(), Some(first.holder()));
                assert!(format!(
                    "{}",
                    LockError::Held {
                        path: first.path().into(),
                        holder
                    }
                )
                .contains(&first.holder().instance_id));
            }
            other => panic!("expected Held, got {other:?}"),
        }
        let p = probe(first.path()).unwrap();
        assert!(p.exists && p.held);
        drop(first);
        let p = probe(&lock_path(dir.path())).unwrap();
        assert!(p.exists && !p.held);
        let again = WorkspaceLock::acquire(dir.path(), LockHolder::this_process("t")).unwrap();
        assert!(again.took_over().is_some());
    }

    #[test]
    fn garbage_and_oversized_files_are_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".bmx")).unwrap();
        let path = lock_path(dir.path());
        std::fs::write(&path, b"\x00\xffnot json").unwrap();
        assert_eq!(probe(&path).unwrap().holder, None);
        let l = WorkspaceLock::acquire(dir.path(), LockHolder::this_process("t")).unwrap();
        assert!(l.took_over().is_none());
        drop(l);
        std::fs::write(&path, vec![b'{'; 10_000]).unwrap();
        let l = WorkspaceLock::acquire(dir.path(), LockHolder::this_process("t")).unwrap();
        let written: LockHolder =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(&written, l.holder());
    }

    #[test]
    fn a_missing_file_probes_as_absent() {
        let dir = tempfile::tempdir().unwrap();
        let p = probe(&lock_path(dir.path())).unwrap();
        assert!(!p.exists && !p.held && p.holder.is_none());
    }

    #[test]
    fn liveness() {
        assert!(pid_alive(std::process::id()));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u32::MAX));
    }
}
