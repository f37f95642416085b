//! The harness's data directory (`--data-dir`: `harness.db`, its WAL and
//! shared-memory files, the blob store): private to the harness's user
//! whatever the parent's mode or the umask (issue 56, item 2).
//!
//! Why: the files were created 0644 and were safe only while bmx made the
//! directory itself with 0700. An operator-made `/var/lib/bmx` with 0755
//! exposed the database and every workspace backup to local users; one
//! that other users can write to lets them plant or swap files the
//! harness then trusts.
//!
//! The rules:
//! * [`prepare`]: a directory that does not exist is created with 0700
//!   (missing parents too). One that exists (made by the operator, or by an
//!   earlier run) must be owned by this user and not writable by group or
//!   others, else it is refused with [`DataDirError`]; its mode is not
//!   changed (what is inside is made private instead).
//! * Files are created 0600 ([`private_file`]) and directories 0700
//!   ([`private_subdir`]); the umask can only remove bits from those.
//! * A file or directory of an earlier run that is still more open is
//!   made 0600 / 0700 ([`tighten`]), through a descriptor opened without
//!   following a symlink, and only if this user owns it.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a data directory is refused.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("{path}: not a directory")]
    NotADirectory { path: PathBuf },
    #[error("{path} is owned by uid {owner}, not by this user (uid {me}): the harness keeps its state only in a directory of its own user")]
    NotOwned { path: PathBuf, owner: u32, me: u32 },
    #[error("{path} is writable by group or others (mode {mode:04o}): other users could plant or swap the harness's files (chmod go-w it, or choose another --data-dir)")]
    Writable { path: PathBuf, mode: u32 },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

impl From<DataDirError> for io::Error {
    fn from(e: DataDirError) -> io::Error {
        let kind = match &e {
            DataDirError::Io { source, .. } => source.kind(),
            DataDirError::NotADirectory { .. } => io::ErrorKind::NotADirectory,
            DataDirError::NotOwned { .. } | DataDirError::Writable { .. } => {
                io::ErrorKind::PermissionDenied
            }
        };
        io::Error::new(kind, e.to_string())
    }
}

fn me() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Make `dir` the harness's own: create it 0700 if absent, else check it
/// (owned by this user, not group- or other-writable). A symlink to a
/// directory is followed and the directory it names is checked.
///
/// # Errors
///
/// [`DataDirError`]: not a directory, another user's, writable by others,
/// or it cannot be created or read.
pub fn prepare(dir: &Path) -> Result<(), DataDirError> {
    let io_err = |source| DataDirError::Io {
        path: dir.to_owned(),
        source,
    };
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err)?;
    // Checked after the create: a directory someone else made first, in
    // between, is refused all the same.
    let m = std::fs::metadata(dir).map_err(io_err)?;
    if !m.is_dir() {
        return Err(DataDirError::NotADirectory {
            path: dir.to_owned(),
        });
    }
    if m.uid() != me() {
        return Err(DataDirError::NotOwned {
            path: dir.to_owned(),
            owner: m.uid(),
            me: me(),
        });
    }
    let mode = m.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(DataDirError::Writable {
            path: dir.to_owned(),
            mode,
        });
    }
    Ok(())
}

/// Options that create a file 0600.
pub fn private_file() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(0o600);
    o
}

/// Create the directory `path` (and missing parents) 0700; one that
/// exists is [`tighten`]ed.
///
/// # Errors
///
/// It cannot be created, or exists and is another user's or a symlink.
pub fn private_subdir(path: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(path)?;
    tighten(path, 0o700)
}

/// Give `path`, a file or directory of this user, at most `mode` (0600 or
/// 0700): group and other bits are cleared through a descriptor opened
/// with `O_NOFOLLOW`, after checking its owner on that descriptor. A path
/// that does not exist is fine.
///
/// # Errors
///
/// `path` is a symlink (`ELOOP`) or another user's (permission denied).
pub fn tighten(path: &Path, mode: u32) -> io::Result<()> {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    tighten_open(&f, path, mode)
}

fn tighten_open(f: &File, path: &Path, mode: u32) -> io::Result<()> {
    let m = f.metadata()?;
    if m.uid() != me() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is owned by uid {}, not by this user",
                path.display(),
                m.uid()
            ),
        ));
    }
    if m.mode() & 0o777 & !mode != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(m.mode() & 0o777 & mode))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o777
    }

    /// Under the umask of the test process; `tests/security/web_data_dir.rs`
    /// runs the real harness under umask 0.
    #[test]
    fn a_fresh_dir_is_0700_and_files_0600() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("a/b");
        prepare(&dir).unwrap();
        private_file()
            .write(true)
            .create_new(true)
            .open(dir.join("f"))
            .unwrap();
        private_subdir(&dir.join("s")).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&t.path().join("a")), 0o700);
        assert_eq!(mode(&dir.join("f")), 0o600);
        assert_eq!(mode(&dir.join("s")), 0o700);
    }

    #[test]
    fn an_open_dir_is_refused_and_old_files_are_tightened() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("d");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o775)).unwrap();
        let e = prepare(&dir).unwrap_err();
        assert!(
            matches!(e, DataDirError::Writable { mode: 0o775, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("writable by group or others"), "{e}");
        // 0755 (readable, not writable) is accepted as it is.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare(&dir).unwrap();
        assert_eq!(mode(&dir), 0o755);
        let f = dir.join("harness.db");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        tighten(&f, 0o600).unwrap();
        assert_eq!(mode(&f), 0o600);
        tighten(&dir.join("absent"), 0o600).unwrap();
        // A symlink is not followed.
        let link = dir.join("link");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        assert!(tighten(&link, 0o600).is_err());
        let not_dir = dir.join("harness.db");
        assert!(matches!(
            prepare(&not_dir),
            Err(DataDirError::Io { .. }) | Err(DataDirError::NotADirectory { .. })
        ));
    }
}
