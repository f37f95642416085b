//! The executor's work root and the session directories in it (issue 56,
//! finding 2): owned by this executor's user, never adopted from someone
//! else, never followed through a link.
//!
//! Why: the old default, `$TMPDIR/bmx-work`, is a name anyone on the host
//! can create first. An executor that adopted such a directory followed
//! the links planted in it: a `confirm` link made it `chmod 0700` the
//! victim's directory, and a `sessions/<id>` link made a session run in
//! the victim's directory and its `DELETE` remove that directory
//! recursively. So:
//!
//! * the default work root is `~/.bmx/work` (not a shared temp dir);
//! * an existing work root (or a directory bmx makes in it) must be a real
//!   directory (not a link), owned by this user, and not writable by its
//!   group or others; anything else is refused with an error that says
//!   which;
//! * a new one is made 0700;
//! * a session's directories are made with one `mkdir` (0700) of a name
//!   that cannot leave its parent, and removed with
//!   `std::fs::remove_dir_all`, which removes a link in place of a
//!   directory rather than following it.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum WorkRootError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("refusing {path}: it is a symbolic link (make a directory of your own, or pass --work-root)")]
    Link { path: PathBuf },
    #[error("refusing {path}: it is not a directory")]
    NotDir { path: PathBuf },
    #[error("refusing {path}: it belongs to uid {owner}, not to this user (uid {me}); another user may have made it first")]
    Owner { path: PathBuf, owner: u32, me: u32 },
    #[error("refusing {path}: its group or others may write to it (mode {mode:o}); chmod go-w it or pass another --work-root")]
    Writable { path: PathBuf, mode: u32 },
}

/// The default work root: `~/.bmx/work`, or `$TMPDIR/bmx-work-<uid>`
/// without a home (checked like any other).
pub fn default_work_root() -> PathBuf {
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => PathBuf::from(home).join(".bmx").join("work"),
        // SAFETY: getuid has no preconditions.
        None => std::env::temp_dir().join(format!("bmx-work-{}", unsafe { libc::getuid() })),
    }
}

fn me() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Check an existing directory (without following a link at `path`).
///
/// # Errors
/// Which rule it breaks.
pub fn check_owned(path: &Path) -> Result<(), WorkRootError> {
    let meta = std::fs::symlink_metadata(path).map_err(|source| WorkRootError::Io {
        path: path.to_owned(),
        source,
    })?;
    if meta.file_type().is_symlink() {
        return Err(WorkRootError::Link {
            path: path.to_owned(),
        });
    }
    if !meta.is_dir() {
        return Err(WorkRootError::NotDir {
            path: path.to_owned(),
        });
    }
    if meta.uid() != me() {
        return Err(WorkRootError::Owner {
            path: path.to_owned(),
            owner: meta.uid(),
            me: me(),
        });
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(WorkRootError::Writable {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

/// Make `path` a private directory of this user: create it 0700 (with any
/// missing parents 0700) or check the one there.
///
/// # Errors
/// [`WorkRootError`]: the rule an existing directory breaks, or why it
/// could not be made.
pub fn ensure_private(path: &Path) -> Result<(), WorkRootError> {
    let io = |source| WorkRootError::Io {
        path: path.to_owned(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(_) => check_owned(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = path.parent() {
                if !parent.as_os_str().is_empty() && !parent.exists() {
                    std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(parent)
                        .map_err(io)?;
                }
            }
            match std::fs::DirBuilder::new().mode(0o700).create(path) {
                Ok(()) => {}
                // Made by someone else in between: check theirs.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
            check_owned(path)
        }
        Err(e) => Err(io(e)),
    }
}

/// Prepare the work root (`ensure_private`) and the directories the
/// executor keeps in it.
///
/// # Errors
/// As [`ensure_private`].
pub fn prepare(work_root: &Path) -> Result<(), WorkRootError> {
    ensure_private(work_root)?;
    for sub in ["sessions", "private"] {
        ensure_private(&work_root.join(sub))?;
    }
    Ok(())
}

/// Make the directory of session `id` under `<root>/<kind>` (`sessions`:
/// its workspace; `private`: its sandbox's temp and home): one `mkdir`,
/// 0700, given to the `--run-as` user. A directory left by an earlier
/// session of the same id is taken again only if it is a real directory
/// of this user (a link in its place is refused).
///
/// # Errors
/// The refusal, or the system call's error.
pub fn make_session_dir(root: &Path, kind: &str, id: &str) -> std::io::Result<PathBuf> {
    let parent = root.join(kind);
    if !parent.exists() {
        ensure_private(&parent).map_err(std::io::Error::other)?;
    }
    check_owned(&parent).map_err(std::io::Error::other)?;
    let dir = parent.join(crate::executor::actors::session::safe_name(id));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(&dir)?;
            if meta.file_type().is_symlink() || !meta.is_dir() {
                return Err(std::io::Error::other(format!(
                    "refusing {}: not a directory of this executor",
                    dir.display()
                )));
            }
        }
        Err(e) => return Err(e),
    }
    crate::process::run_as::chown_tree(&dir)?;
    Ok(dir)
}

/// Remove the directory of session `id` under `<root>/<kind>` and all it
/// holds; a link in its place is removed, never followed.
///
/// # Errors
/// The removal's error (`NotFound` when it is already gone).
pub fn remove_session_dir(root: &Path, kind: &str, id: &str) -> std::io::Result<()> {
    let dir = root
        .join(kind)
        .join(crate::executor::actors::session::safe_name(id));
    std::fs::remove_dir_all(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_work_root_is_private_and_a_planted_one_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("a/b/work");
        prepare(&root).unwrap();
        for d in [&root, &root.join("sessions"), &root.join("private")] {
            let mode = std::fs::metadata(d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
        // Group-writable: refused, never chmodded behind the operator's back.
        let loose = t.path().join("loose");
        std::fs::create_dir(&loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            prepare(&loose),
            Err(WorkRootError::Writable { .. })
        ));
        // A link to a victim directory: refused, the victim untouched.
        let victim = t.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o755)).unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(matches!(prepare(&link), Err(WorkRootError::Link { .. })));
        let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755);
    }

    #[test]
    fn a_planted_session_link_is_refused_and_its_removal_spares_the_victim() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("work");
        prepare(&root).unwrap();
        let victim = t.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("precious"), "x").unwrap();
        std::os::unix::fs::symlink(&victim, root.join("sessions/s1")).unwrap();
        assert!(make_session_dir(&root, "sessions", "s1").is_err());
        remove_session_dir(&root, "sessions", "s1").unwrap();
        assert!(victim.join("precious").exists(), "the victim survives");
        // A real one is made, taken again, and removed.
        let d = make_session_dir(&root, "sessions", "s2").unwrap();
        std::fs::write(d.join("f"), "y").unwrap();
        assert_eq!(make_session_dir(&root, "sessions", "s2").unwrap(), d);
        remove_session_dir(&root, "sessions", "s2").unwrap();
        assert!(!d.exists());
    }
}
