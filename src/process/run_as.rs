//! `bmx executor --run-as USER` (issue 18, finding 2): a session's code
//! runs as an unprivileged user, so it can neither read the executor's
//! credential nor signal the executor, whatever it does.
//!
//! The executor runs as root and stays the only holder of its token; every
//! child it starts for a session (processes, terminals, the `bash` tool,
//! MCP servers and ACP agents: everything started by [`super::spawn`])
//! becomes the user between its `clone` and `exec` ([`become_user`]). The built-in
//! file tools run inside the executor, on blocking threads: for the length
//! of a call such a thread takes the user's filesystem identity
//! ([`FsIdentity`]: `setfsuid`/`setfsgid` and its supplementary groups,
//! all per thread), so the kernel judges every open, create and rename
//! of a tool as the user's (a root-only file in the workspace stays
//! unreadable) and what a tool creates is the user's. Files the executor
//! itself writes into a workspace (session files, restores, skills, the
//! git credential helper) are handed over with [`chown_tree`].
//!
//! The setting is process-wide and set once at start ([`set`]), because
//! the code that forks cannot allocate or look anything up: the user's ids
//! and groups are resolved beforehand and read from a `OnceLock` in the
//! child.

use std::path::Path;
use std::sync::OnceLock;

/// A resolved user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the user's, from the group database).
    pub groups: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunAsError {
    #[error("--run-as {0:?}: no such user")]
    NoUser(String),
    #[error("--run-as {0:?}: that is root; name an unprivileged user")]
    Root(String),
    #[error("--run-as needs the executor to run as root (it runs as uid {0})")]
    NotRoot(u32),
    #[error("--run-as {name:?}: {source}")]
    Lookup { name: String, source: nix::Error },
    #[error("--run-as is already set")]
    AlreadySet,
}

static RUN_AS: OnceLock<RunAs> = OnceLock::new();

/// Look `name` up (a user name, or a numeric uid).
///
/// # Errors
/// [`RunAsError`] for an unknown user, root, or a lookup failure.
pub fn resolve(name: &str) -> Result<RunAs, RunAsError> {
    use nix::unistd::{Uid, User};
    let lookup = |e| RunAsError::Lookup {
        name: name.to_owned(),
        source: e,
    };
    let user = match name.parse::<u32>() {
        Ok(uid) => User::from_uid(Uid::from_raw(uid)).map_err(lookup)?,
        Err(_) => User::from_name(name).map_err(lookup)?,
    }
    .ok_or_else(|| RunAsError::NoUser(name.to_owned()))?;
    if user.uid.is_root() {
        return Err(RunAsError::Root(name.to_owned()));
    }
    let cname = std::ffi::CString::new(user.name.clone())
        .map_err(|_| RunAsError::NoUser(name.to_owned()))?;
    let groups = nix::unistd::getgrouplist(&cname, user.gid)
        .map_err(lookup)?
        .into_iter()
        .map(|g| g.as_raw())
        .collect();
    Ok(RunAs {
        name: user.name,
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        groups,
    })
}

/// Make `user` the identity of every session child from now on.
///
/// # Errors
/// [`RunAsError::NotRoot`] unless this process is root (only root can
/// change to another user), [`RunAsError::AlreadySet`] on a second call.
pub fn set(user: RunAs) -> Result<(), RunAsError> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(RunAsError::NotRoot(euid));
    }
    RUN_AS.set(user).map_err(|_| RunAsError::AlreadySet)
}

/// The user session code runs as, if any.
pub fn get() -> Option<&'static RunAs> {
    RUN_AS.get()
}

/// In a child between its `clone` and `exec` (`super::spawn`): become
/// `u`. Async-signal-safe: raw system calls on memory resolved before
/// the child was made, no allocation (an error is a raw OS error).
///
/// # Errors
/// The failing call's errno; `EPERM` if a root id is left afterwards.
pub fn become_user(u: &RunAs) -> std::io::Result<()> {
    // SAFETY: raw system calls on integers and a slice that lives for the
    // whole process; no allocation, no lock.
    unsafe {
        if libc::getuid() == u.uid && libc::geteuid() == u.uid {
            return Ok(());
        }
        // The raw calls, not libc's wrappers: in the single-threaded child
        // there is nothing to broadcast to, and the wrappers' broadcast
        // machinery is not async-signal-safe.
        if libc::syscall(libc::SYS_setgroups, u.groups.len(), u.groups.as_ptr()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::syscall(libc::SYS_setresgid, u.gid, u.gid, u.gid) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::syscall(libc::SYS_setresuid, u.uid, u.uid, u.uid) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Never exec with root left anywhere.
        if libc::getuid() != u.uid || libc::geteuid() != u.uid || libc::getegid() != u.gid {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
    }
    Ok(())
}

/// The user's filesystem identity on the current thread until dropped
/// (nothing when no `--run-as` is set). Per thread: `setfsuid`,
/// `setfsgid` and the raw `setgroups` system call change only the calling
/// thread, so the executor's other threads keep root's.
pub struct FsIdentity {
    active: bool,
    groups: Vec<libc::gid_t>,
    /// Not `Send`: it must be dropped on the thread that entered it.
    _thread: std::marker::PhantomData<*const ()>,
}

impl FsIdentity {
    /// # Errors
    /// The thread's groups could not be read or changed.
    pub fn enter() -> std::io::Result<FsIdentity> {
        let Some(u) = RUN_AS.get() else {
            return Ok(FsIdentity {
                active: false,
                groups: Vec::new(),
                _thread: std::marker::PhantomData,
            });
        };
        // SAFETY: getgroups/setgroups on a buffer of the size asked for;
        // setfsuid/setfsgid take integers.
        unsafe {
            let n = libc::getgroups(0, std::ptr::null_mut());
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut groups = vec![0 as libc::gid_t; n as usize];
            let n = libc::getgroups(n, groups.as_mut_ptr());
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            groups.truncate(n as usize);
            if libc::syscall(libc::SYS_setgroups, u.groups.len(), u.groups.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::setfsgid(u.gid);
            libc::setfsuid(u.uid);
            Ok(FsIdentity {
                active: true,
                groups,
                _thread: std::marker::PhantomData,
            })
        }
    }
}

impl Drop for FsIdentity {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        // SAFETY: restores what `enter` read, on the same thread (the
        // guard is not Send).
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
            libc::syscall(libc::SYS_setgroups, self.groups.len(), self.groups.as_ptr());
        }
    }
}

/// Give `path` and everything beneath it (symlinks themselves, never
/// followed) to the user; nothing when no `--run-as` is set. For what the
/// executor writes into a workspace on a session's behalf.
///
/// # Errors
/// The first file that could not be changed.
pub fn chown_tree(path: &Path) -> std::io::Result<()> {
    let Some(u) = RUN_AS.get() else {
        return Ok(());
    };
    let own = |p: &Path| std::os::unix::fs::lchown(p, Some(u.uid), Some(u.gid));
    own(path)?;
    // Depth-first with an explicit stack; `file_type` of a directory entry
    // is the entry's own (a symlink to a directory is not entered).
    let mut dirs = Vec::new();
    if std::fs::symlink_metadata(path)?.is_dir() {
        dirs.push(path.to_owned());
    }
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            own(&entry.path())?;
            if entry.file_type()?.is_dir() {
                dirs.push(entry.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_unknown_users_are_refused() {
        assert!(matches!(resolve("root"), Err(RunAsError::Root(_))));
        assert!(matches!(resolve("0"), Err(RunAsError::Root(_))));
        assert!(matches!(
            resolve("no-such-user-bmx"),
            Err(RunAsError::NoUser(_))
        ));
    }

    #[test]
    fn nobody_resolves_with_its_groups() {
        let Ok(u) = resolve("nobody") else {
            return; // a system without `nobody`
        };
        assert_ne!(u.uid, 0);
        assert!(u.groups.contains(&u.gid), "{u:?}");
    }
}
