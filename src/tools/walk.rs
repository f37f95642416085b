//! The directory walk of `glob` and `grep`, through descriptors.
//!
//! A walk by name (`readdir` of `a`, then of `a/b`, …) can be steered
//! outside: a process in the session swaps `a/b` for a symlink to `/etc`
//! between the listing of `a` and the listing of `a/b`, and the walk
//! reports `/etc`'s names as the workspace's. This walk never names a path
//! to the kernel: the base is opened beneath the workspace handle
//! ([`Beneath::open_dir`]), every subdirectory with `openat(parent_fd,
//! name, O_DIRECTORY | O_NOFOLLOW)` and listed through its own descriptor.
//! A directory swapped for a symlink is refused by the kernel (`ELOOP` /
//! `ENOTDIR`) and skipped; a directory moved elsewhere keeps being listed
//! through its descriptor, so what is reported was inside the workspace
//! when it was read.
//!
//! It honours `.gitignore` files (read beneath the workspace handle, never
//! from outside it: the `ignore` crate's own loader would also read parent,
//! global and symlinked ignore files), skips `.git` and the workspace's own
//! `.bmx` (tool output spills: searching it would echo earlier results),
//! yields entries in pre-order, siblings sorted by name, and holds at most
//! [`MAX_DEPTH`] directory descriptors at once.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use ignore::gitignore::{Gitignore, GitignoreBuilder};
use ignore::Match;
use nix::dir::{Dir, Type};

pub use super::beneath::Kind;
use super::beneath::{self, kind_of_mode, Beneath};

/// Directories open at once, deepest first: a deeper tree is not entered
/// (its directory is still reported). Linux's `PATH_MAX` allows ~2 000
/// levels of one-letter names; 256 descriptors bound the walk's use of the
/// process's descriptor table.
pub const MAX_DEPTH: usize = 256;

/// Largest `.gitignore` we parse; bigger ones are not hand-written rules.
const MAX_GITIGNORE_BYTES: u64 = 1 << 20;

/// One entry of the walk.
#[derive(Debug)]
pub struct Entry {
    /// Where it is, as a path under the (canonical) workspace.
    pub path: PathBuf,
    pub kind: Kind,
    /// The directory it was listed in, and its name there.
    dir: Rc<OwnedFd>,
    name: CString,
}

impl Entry {
    /// Its own modification time (`lstat` relative to its directory: a
    /// symlink's own, its target untouched).
    pub fn modified(&self) -> Option<SystemTime> {
        let st = Beneath::stat_in(&self.dir, &self.name)?;
        let secs = u64::try_from(st.st_mtime).ok()?;
        let nanos = u32::try_from(st.st_mtime_nsec).unwrap_or(0);
        Some(SystemTime::UNIX_EPOCH + Duration::new(secs, nanos.min(999_999_999)))
    }
}

struct Frame {
    dir: Rc<OwnedFd>,
    path: PathBuf,
    names: std::vec::IntoIter<(CString, Kind)>,
}

/// A walk over `base` (a resolved path inside `workspace`); see the module
/// docs. An explicitly given `base` is walked even if it is itself ignored,
/// like `rg some/ignored/dir`; a file as `base` is the walk's one entry.
pub struct Walk {
    beneath: Beneath,
    workspace: PathBuf,
    bmx_dir: PathBuf,
    frames: Vec<Frame>,
    single: Option<Entry>,
    ignores: RefCell<HashMap<PathBuf, Option<Rc<Gitignore>>>>,
}

impl Walk {
    /// Start a walk; `Err` when the workspace or `base` cannot be opened.
    pub fn new(workspace: &Path, base: &Path) -> io::Result<Walk> {
        let beneath = Beneath::new(workspace)?;
        let ws = super::boundary::canonical_workspace(workspace);
        let mut walk = Walk {
            beneath,
            bmx_dir: ws.join(".bmx"),
            workspace: ws,
            frames: Vec::new(),
            single: None,
            ignores: RefCell::new(HashMap::new()),
        };
        match walk.beneath.open_dir(base) {
            Ok(fd) => {
                let fd = Rc::new(fd);
                let names = list(&fd)?;
                walk.frames.push(Frame {
                    dir: fd,
                    path: base.to_path_buf(),
                    names: names.into_iter(),
                });
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) || beneath::is_swapped(&e) => {
                // A file (or a symlink) as the base: itself, listed in its
                // parent, which must be a directory beneath the workspace.
                let (Some(parent), Some(name)) = (base.parent(), base.file_name()) else {
                    return Err(e);
                };
                let dir = Rc::new(walk.beneath.open_dir(parent)?);
                let name = beneath::cstr(name)?;
                let Some(st) = Beneath::stat_in(&dir, &name) else {
                    return Err(io::Error::from_raw_os_error(libc::ENOENT));
                };
                walk.single = Some(Entry {
                    path: base.to_path_buf(),
                    kind: kind_of_mode(st.st_mode),
                    dir,
                    name,
                });
            }
            Err(e) => return Err(e),
        }
        Ok(walk)
    }

    fn matcher(&self, dir: &Path) -> Option<Rc<Gitignore>> {
        if let Some(found) = self.ignores.borrow().get(dir) {
            return found.clone();
        }
        let loaded = self.load_gitignore(dir).map(Rc::new);
        self.ignores
            .borrow_mut()
            .insert(dir.to_path_buf(), loaded.clone());
        loaded
    }

    /// `dir/.gitignore`, opened beneath the workspace handle (a symlink or
    /// a non-file there is no ignore file).
    fn load_gitignore(&self, dir: &Path) -> Option<Gitignore> {
        let path = dir.join(".gitignore");
        let file = self.beneath.open_read(&path).ok()?;
        if beneath::kind_of(&file).ok()? != Kind::File {
            return None;
        }
        let mut bytes = Vec::new();
        file.take(MAX_GITIGNORE_BYTES)
            .read_to_end(&mut bytes)
            .ok()?;
        let text = String::from_utf8_lossy(&bytes);
        let mut builder = GitignoreBuilder::new(dir);
        for line in text.lines() {
            // A malformed line is skipped, as git does, rather than
            // dropping the whole file.
            let _ = builder.add_line(Some(path.clone()), line);
        }
        builder.build().ok()
    }

    /// Whether `path` is ignored by the `.gitignore` files of its ancestor
    /// directories in the workspace; the deepest file with an opinion
    /// wins, as in git.
    fn is_ignored(&self, path: &Path, is_dir: bool) -> bool {
        let mut dir = path.parent();
        while let Some(d) = dir {
            if !d.starts_with(&self.workspace) {
                break;
            }
            if let Some(gi) = self.matcher(d) {
                match gi.matched(path, is_dir) {
                    Match::Ignore(_) => return true,
                    Match::Whitelist(_) => return false,
                    Match::None => {}
                }
            }
            dir = d.parent();
        }
        false
    }
}

impl Iterator for Walk {
    type Item = Entry;

    fn next(&mut self) -> Option<Entry> {
        if let Some(e) = self.single.take() {
            return Some(e);
        }
        loop {
            let frame = self.frames.last_mut()?;
            let Some((name, kind)) = frame.names.next() else {
                self.frames.pop();
                continue;
            };
            let path = frame.path.join(OsStr::from_bytes(name.to_bytes()));
            let dir = frame.dir.clone();
            if name.as_bytes() == b".git" || (kind == Kind::Dir && path == self.bmx_dir) {
                continue;
            }
            if self.is_ignored(&path, kind == Kind::Dir) {
                continue;
            }
            if kind == Kind::Dir && self.frames.len() < MAX_DEPTH {
                let sub = beneath::openat(&dir, &name, libc::O_RDONLY | libc::O_DIRECTORY, 0);
                // Swapped for a symlink, gone, or unreadable since it was
                // listed: reported, not entered.
                if let Ok(sub) = sub {
                    let sub = Rc::new(sub);
                    if let Ok(names) = list(&sub) {
                        self.frames.push(Frame {
                            dir: sub,
                            path: path.clone(),
                            names: names.into_iter(),
                        });
                    }
                }
            }
            return Some(Entry {
                path,
                kind,
                dir,
                name,
            });
        }
    }
}

/// The entries of the open directory `dir`, sorted by name (`.` and `..`
/// left out), read through a duplicate of its descriptor.
fn list(dir: &OwnedFd) -> io::Result<Vec<(CString, Kind)>> {
    let mut listing = Dir::from_fd(dir.try_clone()?).map_err(io::Error::from)?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry.map_err(io::Error::from)?;
        let name: &CStr = entry.file_name();
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        let kind = match entry.file_type() {
            Some(Type::Directory) => Kind::Dir,
            Some(Type::File) => Kind::File,
            Some(Type::Symlink) => Kind::Symlink,
            Some(_) => Kind::Other,
            // DT_UNKNOWN (some filesystems): ask, without following.
            None => Beneath::stat_in(dir, &name.to_owned())
                .map_or(Kind::Other, |st| kind_of_mode(st.st_mode)),
        };
        names.push((name.to_owned(), kind));
    }
    names.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn rels(ws: &Path, base: &Path) -> Vec<String> {
        Walk::new(ws, base)
            .unwrap()
            .map(|e| {
                e.path
                    .strip_prefix(ws)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }

    #[test]
    fn pre_order_sorted_without_git_bmx_or_ignored() {
        let d = tempfile::tempdir().unwrap();
        let ws = fs::canonicalize(d.path()).unwrap();
        for dir in ["b/c", ".git/objects", ".bmx/spill", "target", "a"] {
            fs::create_dir_all(ws.join(dir)).unwrap();
        }
        for f in [
            "b/c/x",
            "b/y",
            "a/z",
            "target/t",
            ".bmx/spill/s",
            ".git/HEAD",
        ] {
            fs::write(ws.join(f), "").unwrap();
        }
        fs::write(ws.join(".gitignore"), "target/\n").unwrap();
        symlink("/etc", ws.join("b/etc")).unwrap();
        assert_eq!(
            rels(&ws, &ws),
            [
                ".gitignore",
                "a",
                "a/z",
                "b",
                "b/c",
                "b/c/x",
                "b/etc",
                "b/y"
            ]
        );
        // An ignored directory given as the base is walked.
        assert_eq!(rels(&ws, &ws.join("target")), ["target/t"]);
        // A file as the base is its one entry; a symlink is not followed.
        assert_eq!(rels(&ws, &ws.join("b/y")), ["b/y"]);
        let link = Walk::new(&ws, &ws.join("b/etc")).unwrap().next().unwrap();
        assert_eq!(link.kind, Kind::Symlink);
    }

    #[test]
    fn a_tree_deeper_than_max_depth_is_cut_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let ws = fs::canonicalize(d.path()).unwrap();
        let mut p = ws.clone();
        for _ in 0..MAX_DEPTH + 10 {
            p.push("d");
        }
        fs::create_dir_all(&p).unwrap();
        let n = Walk::new(&ws, &ws).unwrap().count();
        assert_eq!(n, MAX_DEPTH);
    }

    #[test]
    fn modified_is_the_entrys_own() {
        let d = tempfile::tempdir().unwrap();
        let ws = fs::canonicalize(d.path()).unwrap();
        fs::write(ws.join("f"), "x").unwrap();
        let f = fs::File::options().write(true).open(ws.join("f")).unwrap();
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        f.set_modified(t).unwrap();
        let e = Walk::new(&ws, &ws).unwrap().next().unwrap();
        assert_eq!(e.modified(), Some(t));
    }

    fn canonical_tmp() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = fs::canonicalize(dir.path()).unwrap();
        (dir, path)
    }

    fn walked(ws: &Path, base: &Path) -> Vec<String> {
        Walk::new(ws, base)
            .unwrap()
            .map(|e| super::super::boundary::display(ws, &e.path))
            .collect()
    }

    #[test]
    fn walk_honours_gitignore_without_git_and_skips_symlinks() {
        let (_d, ws) = canonical_tmp();
        fs::write(ws.join(".gitignore"), "target/\n*.log\n!keep.log\n").unwrap();
        fs::create_dir_all(ws.join("target/debug")).unwrap();
        fs::write(ws.join("target/debug/out"), "x").unwrap();
        fs::create_dir_all(ws.join("src/sub")).unwrap();
        fs::write(ws.join("src/a.rs"), "x").unwrap();
        fs::write(ws.join("src/sub/.gitignore"), "gen.rs\n").unwrap();
        fs::write(ws.join("src/sub/gen.rs"), "x").unwrap();
        fs::write(ws.join("src/sub/b.rs"), "x").unwrap();
        fs::write(ws.join("x.log"), "x").unwrap();
        fs::write(ws.join("keep.log"), "x").unwrap();
        fs::create_dir_all(ws.join(".git")).unwrap();
        fs::write(ws.join(".git/HEAD"), "x").unwrap();
        fs::create_dir_all(ws.join(".bmx/tool-output")).unwrap();
        fs::write(ws.join(".bmx/tool-output/c.stdout"), "x").unwrap();
        symlink("/etc", ws.join("etc-link")).unwrap();
        let got = walked(&ws, &ws);
        assert_eq!(
            got,
            [
                ".gitignore",
                "etc-link",
                "keep.log",
                "src",
                "src/a.rs",
                "src/sub",
                "src/sub/.gitignore",
                "src/sub/b.rs",
            ]
        );
        // An explicit base is walked even when ignored.
        assert_eq!(
            walked(&ws, &ws.join("target")),
            ["target/debug", "target/debug/out"]
        );
        assert_eq!(
            walked(&ws, &ws.join(".bmx")),
            [".bmx/tool-output", ".bmx/tool-output/c.stdout"]
        );
    }

    #[test]
    fn symlinked_gitignore_is_not_read() {
        let (_d, ws) = canonical_tmp();
        let (_o, other) = canonical_tmp();
        fs::write(other.join("rules"), "*.rs\n").unwrap();
        symlink(other.join("rules"), ws.join(".gitignore")).unwrap();
        fs::write(ws.join("a.rs"), "x").unwrap();
        assert_eq!(walked(&ws, &ws), [".gitignore", "a.rs"]);
    }
}
