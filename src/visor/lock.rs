//! One visor per home: `<home>/visor.lock`, an advisory `flock` held for
//! the daemon's life, with the holder's pid and instance id written inside
//! so a second visor can name it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another visor holds {path} (pid {pid}, instance {instance}); stop it first")]
    Held {
        path: PathBuf,
        pid: String,
        instance: String,
    },
    #[error("cannot lock {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The held lock; dropping it releases it.
#[derive(Debug)]
pub struct HomeLock {
    _file: File,
    pub path: PathBuf,
}

fn field<'a>(text: &'a str, name: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or("?")
}

/// Take the home's lock and record `pid` and `instance` in it.
///
/// # Errors
/// [`LockError::Held`] naming the holder when another process has it.
pub fn acquire(home: &Path, instance: &str) -> Result<HomeLock, LockError> {
    let path = home.join("visor.lock");
    let io = |source| LockError::Io {
        path: path.clone(),
        source,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut text = String::new();
            let _ = file.take(4096).read_to_string(&mut text);
            return Err(LockError::Held {
                path,
                pid: field(&text, "pid").to_owned(),
                instance: field(&text, "instance").to_owned(),
            });
        }
        return Err(io(err));
    }
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    write!(file, "pid={}\ninstance={instance}\n", std::process::id()).map_err(io)?;
    file.sync_all().map_err(io)?;
    Ok(HomeLock { _file: file, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let held = acquire(dir.path(), "one").unwrap();
        // flock locks are per open file description: a second open in this
        // process conflicts like another process would.
        match acquire(dir.path(), "two") {
            Err(LockError::Held { pid, instance, .. }) => {
                assert_eq!(pid, std::process::id().to_string());
                assert_eq!(instance, "one");
            }
            other => panic!("expected Held, got {other:?}"),
        }
        drop(held);
        acquire(dir.path(), "three").unwrap();
    }
}
