//! Opening workspace paths so that what is opened is what was checked.
//!
//! [`super::boundary::resolve`] proves a path stays in the workspace, but a
//! process in the session can swap a directory or file for a symlink to
//! the outside between that check and the tool's `open` (a
//! `renameat2(RENAME_EXCHANGE)` loop wins that race often). So no tool
//! opens a resolved path by name: every access goes through [`Beneath`],
//! which opens relative to a handle of the workspace directory with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`.
//! The resolved path is symlink-free by construction, so a symlink met
//! while opening it can only be one planted since the check: the kernel
//! refuses it (`ELOOP`) and the tool reports a boundary failure instead of
//! reading, writing or listing anything outside.
//!
//! Kernels without `openat2` (before 5.6) get the same guarantee from a
//! walk of `openat(O_NOFOLLOW)` calls, one component at a time, each
//! relative to the directory opened before it.
//!
//! Writes never open the destination: a temp file is created with
//! `O_CREAT | O_EXCL | O_NOFOLLOW` in the parent directory's handle and
//! renamed over the name with `renameat` relative to that same handle, so
//! a symlink planted at the destination is replaced, never followed.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once `openat2` answered `ENOSYS`: use the component walk from then on.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// A handle on the workspace directory; every open is relative to it.
#[derive(Debug)]
pub struct Beneath {
    root: OwnedFd,
    workspace: PathBuf,
}

/// What a path is, without following a symlink: from `fstat` on an opened
/// descriptor (never a symlink: every open here refuses one), or from a
/// directory listing ([`super::walk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

/// The kind of a `st_mode`.
pub fn kind_of_mode(mode: u32) -> Kind {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFREG => Kind::File,
        libc::S_IFLNK => Kind::Symlink,
        _ => Kind::Other,
    }
}

/// The kind of an open descriptor.
pub fn kind_of(file: &File) -> io::Result<Kind> {
    use std::os::unix::fs::MetadataExt;
    Ok(kind_of_mode(file.metadata()?.mode()))
}

/// Whether an error means "a symlink or an escape appeared on the way":
/// the race this module exists for.
pub fn is_swapped(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ELOOP) | Some(libc::EXDEV))
}

/// `resolved`'s parent directory and its name in it.
fn split(resolved: &Path) -> io::Result<(&Path, &OsStr)> {
    let parent = resolved
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent"))?;
    let name = resolved
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    Ok((parent, name))
}

pub(super) fn cstr(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn fd_result(rc: libc::c_long) -> io::Result<OwnedFd> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative return of open(2)-like calls is a new
    // descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

/// `openat2` of one relative path beneath `dir`, following no symlink.
fn openat2(dir: &OwnedFd, rel: &CString, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: open_how is plain integers; all-zero is its "nothing asked".
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    if flags & libc::O_CREAT != 0 {
        how.mode = u64::from(mode);
    }
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads the NUL-terminated path and the open_how of
    // the given size; both outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    fd_result(rc)
}

/// `openat` of one name in `dir`, never following a symlink.
pub(super) fn openat(dir: &OwnedFd, name: &CString, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: openat reads the NUL-terminated name only.
    let rc = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    };
    fd_result(rc as libc::c_long)
}

/// The names of a relative, symlink-free path; `..` or a root is refused
/// (a resolved path never has them).
fn names(rel: &Path) -> io::Result<Vec<&OsStr>> {
    let mut out = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => {
                return Err(io::Error::from_raw_os_error(libc::EXDEV));
            }
        }
    }
    Ok(out)
}

impl Beneath {
    /// Open a handle on `workspace` (canonical, as `resolve` returns paths
    /// under it).
    pub fn new(workspace: &Path) -> io::Result<Beneath> {
        let workspace = super::boundary::canonical_workspace(workspace);
        let path = cstr(workspace.as_os_str())?;
        // SAFETY: open reads the NUL-terminated path only.
        let rc = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        Ok(Beneath {
            root: fd_result(rc as libc::c_long)?,
            workspace,
        })
    }

    /// `resolved` relative to the workspace; a path outside is `EXDEV`.
    fn relative<'a>(&self, resolved: &'a Path) -> io::Result<&'a Path> {
        resolved
            .strip_prefix(&self.workspace)
            .map_err(|_| io::Error::from_raw_os_error(libc::EXDEV))
    }

    /// Open `resolved` (an absolute path from `boundary::resolve`) with
    /// `flags`, refusing any symlink or escape met on the way.
    fn open_raw(&self, resolved: &Path, flags: i32, mode: u32) -> io::Result<OwnedFd> {
        let rel = self.relative(resolved)?;
        let parts = names(rel)?;
        if parts.is_empty() {
            // The workspace itself: reopen the handle as asked.
            let dot = cstr(OsStr::new("."))?;
            return self.open_in(&self.root, &dot, flags, mode);
        }
        if !NO_OPENAT2.load(Ordering::Relaxed) {
            let joined: PathBuf = parts.iter().collect();
            match openat2(&self.root, &cstr(joined.as_os_str())?, flags, mode) {
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    NO_OPENAT2.store(true, Ordering::Relaxed);
                }
                other => return other,
            }
        }
        let (last, dirs) = parts.split_last().expect("not empty");
        let mut dir = self.open_in(&self.root, &cstr(OsStr::new("."))?, libc::O_PATH, 0)?;
        for name in dirs {
            dir = openat(&dir, &cstr(name)?, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        }
        openat(&dir, &cstr(last)?, flags, mode)
    }

    /// One relative name in `dir`, following nothing.
    fn open_in(&self, dir: &OwnedFd, name: &CString, flags: i32, mode: u32) -> io::Result<OwnedFd> {
        if NO_OPENAT2.load(Ordering::Relaxed) {
            openat(dir, name, flags, mode)
        } else {
            match openat2(dir, name, flags, mode) {
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    NO_OPENAT2.store(true, Ordering::Relaxed);
                    openat(dir, name, flags, mode)
                }
                other => other,
            }
        }
    }

    /// Open `resolved` for reading. `O_NONBLOCK` so a FIFO does not hang
    /// the open (callers check [`kind_of`] before reading; it does not
    /// change reads of regular files).
    pub fn open_read(&self, resolved: &Path) -> io::Result<File> {
        let fd = self.open_raw(resolved, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
        Ok(File::from(fd))
    }

    /// Open the directory `resolved` for listing.
    pub fn open_dir(&self, resolved: &Path) -> io::Result<OwnedFd> {
        self.open_raw(resolved, libc::O_RDONLY | libc::O_DIRECTORY, 0)
    }

    /// The directory `resolved`, made (with its missing parents) if need
    /// be, one component at a time relative to its parent's handle.
    fn make_dirs(&self, resolved: &Path) -> io::Result<OwnedFd> {
        let rel = self.relative(resolved)?;
        let mut dir = self.open_in(
            &self.root,
            &cstr(OsStr::new("."))?,
            libc::O_RDONLY | libc::O_DIRECTORY,
            0,
        )?;
        for name in names(rel)? {
            let name = cstr(name)?;
            dir = match self.open_in(&dir, &name, libc::O_RDONLY | libc::O_DIRECTORY, 0) {
                Ok(d) => d,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    // SAFETY: mkdirat reads the NUL-terminated name only.
                    let rc = unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o777) };
                    if rc != 0 {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::AlreadyExists {
                            return Err(e);
                        }
                    }
                    self.open_in(&dir, &name, libc::O_RDONLY | libc::O_DIRECTORY, 0)?
                }
                Err(e) => return Err(e),
            };
        }
        Ok(dir)
    }

    /// What is at `resolved` now, without following a symlink (`None`:
    /// nothing). Only a hint for messages and modes: the write itself
    /// never depends on it.
    pub(super) fn stat_in(dir: &OwnedFd, name: &CString) -> Option<libc::stat> {
        // SAFETY: fstatat writes into the zeroed local stat only.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let rc = unsafe {
            libc::fstatat(
                dir.as_raw_fd(),
                name.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        (rc == 0).then_some(st)
    }

    /// Create (or truncate) the regular file `resolved` for writing,
    /// making missing parent directories beneath the handle; a symlink at
    /// the name is refused (`O_NOFOLLOW`), never followed.
    pub fn create(&self, resolved: &Path) -> io::Result<File> {
        let (parent, name) = split(resolved)?;
        let dir = self.make_dirs(parent)?;
        let fd = openat(
            &dir,
            &cstr(name)?,
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
            0o666,
        )?;
        Ok(File::from(fd))
    }

    /// Replace `resolved` with `content` atomically, making missing parent
    /// directories. Returns whether a file was there before. A directory
    /// at `resolved` is `EISDIR`.
    pub fn write_atomic(&self, resolved: &Path, content: &[u8]) -> io::Result<bool> {
        let (parent, name) = split(resolved)?;
        let dir = self.make_dirs(parent)?;
        let cname = cstr(name)?;
        let existing = Self::stat_in(&dir, &cname);
        if let Some(st) = &existing {
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                return Err(io::Error::from_raw_os_error(libc::EISDIR));
            }
        }
        // Keep a regular file's permission bits; anything else gets 0666
        // less the umask, like a new file.
        let keep = existing
            .as_ref()
            .filter(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG)
            .map(|st| st.st_mode & 0o7777);
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{}.tmp", uuid::Uuid::new_v4().simple()));
        let tmp = cstr(&tmp_name)?;
        let fd = openat(
            &dir,
            &tmp,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            keep.unwrap_or(0o666),
        )?;
        let mut file = File::from(fd);
        let result = (|| {
            if let Some(mode) = keep {
                // The mode at creation is filtered by the umask: set it
                // exactly, on the descriptor.
                use std::os::unix::fs::PermissionsExt;
                file.set_permissions(std::fs::Permissions::from_mode(mode))?;
            }
            file.write_all(content)?;
            file.sync_all()?;
            // SAFETY: renameat reads the two NUL-terminated names only.
            let rc = unsafe {
                libc::renameat(
                    dir.as_raw_fd(),
                    tmp.as_ptr(),
                    dir.as_raw_fd(),
                    cname.as_ptr(),
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })();
        if result.is_err() {
            // SAFETY: unlinkat reads the NUL-terminated name only.
            unsafe { libc::unlinkat(dir.as_raw_fd(), tmp.as_ptr(), 0) };
        }
        result.map(|()| existing.is_some())
    }

    /// The directory `resolved`, made with its missing parents, none of
    /// them followed through a symlink.
    pub fn make_dir(&self, resolved: &Path) -> io::Result<()> {
        self.make_dirs(resolved).map(|_| ())
    }

    /// A symlink at `resolved` pointing at `target` (not checked here:
    /// the caller decides which targets are allowed), made relative to
    /// its parent's handle: nothing on the way is followed.
    pub fn symlink(&self, target: &Path, resolved: &Path) -> io::Result<()> {
        let (parent, name) = split(resolved)?;
        let dir = self.make_dirs(parent)?;
        let (target, name) = (cstr(target.as_os_str())?, cstr(name)?);
        // SAFETY: symlinkat reads the two NUL-terminated strings only.
        let rc = unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A new, empty temp file beside `resolved` (same directory, a hidden
    /// name, `O_EXCL`), making missing parent directories, to be written
    /// by the caller and renamed over `resolved` by [`Staged::commit`].
    /// Why not [`Self::write_atomic`]: a file transfer streams bytes that
    /// need not fit in memory. Dropped uncommitted (an error, a cancel),
    /// the temp file is removed: no partial file is ever left under the
    /// name or beside it. A directory at `resolved` is `EISDIR`.
    pub fn stage(&self, resolved: &Path) -> io::Result<Staged> {
        let (parent, name) = split(resolved)?;
        let dir = self.make_dirs(parent)?;
        let cname = cstr(name)?;
        if let Some(st) = Self::stat_in(&dir, &cname) {
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                return Err(io::Error::from_raw_os_error(libc::EISDIR));
            }
        }
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{}.part", uuid::Uuid::new_v4().simple()));
        let tmp = cstr(&tmp_name)?;
        let fd = openat(
            &dir,
            &tmp,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o666,
        )?;
        Ok(Staged {
            file: File::from(fd),
            dir,
            tmp,
            name: cname,
            done: false,
        })
    }
}

/// A temp file beside its destination ([`Beneath::stage`]): removed when
/// dropped unless committed.
#[derive(Debug)]
pub struct Staged {
    file: File,
    dir: OwnedFd,
    tmp: CString,
    name: CString,
    done: bool,
}

impl Staged {
    /// The temp file, to write into.
    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// fsync the bytes, rename the temp file over the destination
    /// (relative to the parent's handle: a symlink planted at the name is
    /// replaced, never followed), fsync the directory so the rename
    /// survives a crash.
    ///
    /// # Errors
    ///
    /// The failing call's error; the temp file is removed then.
    pub fn commit(mut self) -> io::Result<()> {
        self.file.sync_all()?;
        // SAFETY: renameat reads the two NUL-terminated names only.
        let rc = unsafe {
            libc::renameat(
                self.dir.as_raw_fd(),
                self.tmp.as_ptr(),
                self.dir.as_raw_fd(),
                self.name.as_ptr(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        self.done = true;
        // SAFETY: fsync on a descriptor this value owns.
        if unsafe { libc::fsync(self.dir.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            // SAFETY: unlinkat reads the NUL-terminated name only.
            unsafe { libc::unlinkat(self.dir.as_raw_fd(), self.tmp.as_ptr(), 0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    fn ws() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = fs::canonicalize(dir.path()).unwrap();
        (dir, path)
    }

    #[test]
    fn reads_and_writes_inside() {
        let (_d, ws) = ws();
        let b = Beneath::new(&ws).unwrap();
        assert!(!b.write_atomic(&ws.join("a/b/c.txt"), b"one").unwrap());
        assert!(b.write_atomic(&ws.join("a/b/c.txt"), b"two").unwrap());
        let mut s = String::new();
        b.open_read(&ws.join("a/b/c.txt"))
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "two");
        assert_eq!(
            kind_of(&File::from(b.open_dir(&ws.join("a")).unwrap())).unwrap(),
            Kind::Dir
        );
        assert_eq!(kind_of(&b.open_read(&ws).unwrap()).unwrap(), Kind::Dir);
    }

    #[test]
    fn a_symlink_on_the_way_is_refused_not_followed() {
        let (_d, ws) = ws();
        let (_o, outside) = self::ws();
        fs::write(outside.join("secret"), "outside").unwrap();
        symlink(&outside, ws.join("link")).unwrap();
        symlink(outside.join("secret"), ws.join("file")).unwrap();
        let b = Beneath::new(&ws).unwrap();
        // As if resolve had checked these names when they were plain.
        for p in ["link/secret", "file"] {
            let e = b.open_read(&ws.join(p)).unwrap_err();
            assert!(is_swapped(&e), "{p}: {e}");
        }
        let e = b.write_atomic(&ws.join("link/new"), b"x").unwrap_err();
        assert!(
            is_swapped(&e) || e.raw_os_error() == Some(libc::ENOTDIR),
            "{e}"
        );
        assert!(!outside.join("new").exists());
        // Writing over the symlink `file` replaces the link, not the target.
        b.write_atomic(&ws.join("file"), b"mine").unwrap();
        assert_eq!(
            fs::read_to_string(outside.join("secret")).unwrap(),
            "outside"
        );
        assert_eq!(fs::read_to_string(ws.join("file")).unwrap(), "mine");
        // A path outside the handle's workspace is refused outright.
        assert!(is_swapped(
            &b.open_read(&outside.join("secret")).unwrap_err()
        ));
        assert!(is_swapped(&b.open_read(&ws.join("../x")).unwrap_err()));
    }

    #[test]
    fn staged_files_appear_whole_or_not_at_all() {
        let (_d, ws) = ws();
        let b = Beneath::new(&ws).unwrap();
        let mut st = b.stage(&ws.join("up/a.txt")).unwrap();
        st.file().write_all(b"part").unwrap();
        drop(st);
        assert!(!ws.join("up/a.txt").exists());
        assert_eq!(
            fs::read_dir(ws.join("up")).unwrap().count(),
            0,
            "no leftovers"
        );
        let mut st = b.stage(&ws.join("up/a.txt")).unwrap();
        st.file().write_all(b"whole").unwrap();
        st.commit().unwrap();
        assert_eq!(fs::read_to_string(ws.join("up/a.txt")).unwrap(), "whole");
        assert_eq!(fs::read_dir(ws.join("up")).unwrap().count(), 1);
        fs::create_dir(ws.join("dir")).unwrap();
        assert_eq!(
            b.stage(&ws.join("dir")).unwrap_err().raw_os_error(),
            Some(libc::EISDIR)
        );
    }

    #[test]
    fn a_directory_is_not_overwritten() {
        let (_d, ws) = ws();
        fs::create_dir(ws.join("d")).unwrap();
        let b = Beneath::new(&ws).unwrap();
        let e = b.write_atomic(&ws.join("d"), b"x").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EISDIR));
    }

    #[test]
    fn the_component_walk_gives_the_same_answers() {
        let (_d, ws) = ws();
        let (_o, outside) = self::ws();
        fs::create_dir(ws.join("d")).unwrap();
        fs::write(ws.join("d/f"), "in").unwrap();
        symlink(&outside, ws.join("link")).unwrap();
        let b = Beneath::new(&ws).unwrap();
        let dir = b.open_in(&b.root, &cstr(OsStr::new("d")).unwrap(), libc::O_PATH, 0);
        assert!(dir.is_ok());
        // The fallback itself, directly.
        let root = b
            .open_in(&b.root, &cstr(OsStr::new(".")).unwrap(), libc::O_PATH, 0)
            .unwrap();
        let d = openat(
            &root,
            &cstr(OsStr::new("d")).unwrap(),
            libc::O_PATH | libc::O_DIRECTORY,
            0,
        )
        .unwrap();
        assert!(openat(&d, &cstr(OsStr::new("f")).unwrap(), libc::O_RDONLY, 0).is_ok());
        let e = openat(
            &root,
            &cstr(OsStr::new("link")).unwrap(),
            libc::O_PATH | libc::O_DIRECTORY,
            0,
        )
        .unwrap_err();
        assert!(
            matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENOTDIR)),
            "{e}"
        );
    }
}
