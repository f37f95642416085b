//! Workspace path resolution: the one gate every tool path goes through.
//!
//! Paths come from the model, so they are hostile until proven otherwise:
//! `../x`, `/etc/passwd`, or a symlink planted in the workspace pointing at
//! `/etc` must all be refused *before* anything outside is opened. We resolve
//! a path component by component, following symlinks ourselves (like
//! `realpath`) so that the result is a symlink-free absolute path, and accept
//! it only if it lies under the canonical workspace. Callers then operate on
//! the resolved path, never on the original string, so the OS cannot follow
//! a symlink we did not check. Components that do not exist yet (a file
//! about to be written, its missing parent directories) are taken literally,
//! which is exactly where the OS would create them.
//!
//! The directory walk of `glob`/`grep` is [`super::walk`]: through
//! descriptors, never by name.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use super::{reason, ToolOutput};

/// Symlink hops allowed while resolving one path, as Linux's `MAXSYMLINKS`.
const MAX_SYMLINK_HOPS: usize = 40;

/// Why a path could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum BoundaryError {
    /// The path, after following symlinks, is outside the workspace.
    #[error("path `{path}` is outside the workspace")]
    Outside { path: String },
    /// Following the path's symlinks did not terminate.
    #[error("path `{path}` has too many levels of symbolic links")]
    SymlinkLoop { path: String },
    /// Inspecting a component failed for another reason (e.g. permissions).
    #[error("cannot resolve path `{path}`: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
}

impl BoundaryError {
    /// The protocol reason for this failure.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Outside { .. } => reason::WORKSPACE_BOUNDARY,
            Self::SymlinkLoop { .. } | Self::Io { .. } => reason::IO_ERROR,
        }
    }
}

impl From<BoundaryError> for ToolOutput {
    fn from(err: BoundaryError) -> Self {
        ToolOutput::failure(err.reason(), err.to_string())
    }
}

/// The workspace as a canonical path. The contract says the context already
/// holds one; canonicalizing again is cheap insurance against a caller that
/// passed a path through a symlink (e.g. macOS-style `/tmp`), which would
/// otherwise make every path look like it escapes.
pub fn canonical_workspace(workspace: &Path) -> PathBuf {
    fs::canonicalize(workspace).unwrap_or_else(|_| workspace.to_path_buf())
}

enum Part {
    Root,
    Parent,
    Name(OsString),
}

fn parts_of(path: &Path) -> impl DoubleEndedIterator<Item = Part> + '_ {
    path.components().filter_map(|c| match c {
        Component::RootDir => Some(Part::Root),
        Component::ParentDir => Some(Part::Parent),
        Component::Normal(name) => Some(Part::Name(name.to_os_string())),
        Component::CurDir | Component::Prefix(_) => None,
    })
}

/// Resolves `path` (relative to the workspace, or absolute) to a
/// symlink-free absolute path inside the workspace.
///
/// Only metadata of the components is inspected (`lstat`, `readlink`); no
/// file content is read, so refusing a path never reads what it points at.
pub fn resolve(workspace: &Path, path: &str) -> Result<PathBuf, BoundaryError> {
    let ws = canonical_workspace(workspace);
    let requested = Path::new(path);
    let mut resolved = if requested.is_absolute() {
        PathBuf::from("/")
    } else {
        ws.clone()
    };
    let mut queue: VecDeque<Part> = parts_of(requested).collect();
    let mut hops = 0;
    while let Some(part) = queue.pop_front() {
        match part {
            Part::Root => resolved = PathBuf::from("/"),
            Part::Parent => {
                resolved.pop();
            }
            Part::Name(name) => {
                let candidate = resolved.join(&name);
                match fs::symlink_metadata(&candidate) {
                    Ok(meta) if meta.file_type().is_symlink() => {
                        hops += 1;
                        if hops > MAX_SYMLINK_HOPS {
                            return Err(BoundaryError::SymlinkLoop {
                                path: path.to_string(),
                            });
                        }
                        let target =
                            fs::read_link(&candidate).map_err(|source| BoundaryError::Io {
                                path: path.to_string(),
                                source,
                            })?;
                        // The target replaces the link: an absolute target
                        // restarts at `/`, a relative one continues from the
                        // link's directory, which is `resolved` unchanged.
                        for part in parts_of(&target).rev() {
                            queue.push_front(part);
                        }
                    }
                    Ok(_) => resolved = candidate,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                        ) =>
                    {
                        // Does not exist (yet): taken literally. Later
                        // components are still checked, because `..` may
                        // bring us back to existing (symlinked) ground.
                        resolved = candidate;
                    }
                    Err(source) => {
                        return Err(BoundaryError::Io {
                            path: path.to_string(),
                            source,
                        })
                    }
                }
            }
        }
    }
    if resolved.starts_with(&ws) {
        Ok(resolved)
    } else {
        Err(BoundaryError::Outside {
            path: path.to_string(),
        })
    }
}

/// How a resolved path is shown to the model: relative to the workspace
/// (`.` for the workspace itself), so results can be fed back as inputs.
pub fn display(workspace: &Path, path: &Path) -> String {
    let ws = canonical_workspace(workspace);
    match path.strip_prefix(&ws) {
        Ok(rel) if rel.as_os_str().is_empty() => ".".to_string(),
        Ok(rel) => rel.to_string_lossy().into_owned(),
        Err(_) => path.to_string_lossy().into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn ws() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = fs::canonicalize(dir.path()).unwrap();
        (dir, path)
    }

    fn outside(ws: &Path, p: &str) -> bool {
        matches!(resolve(ws, p), Err(BoundaryError::Outside { .. }))
    }

    #[test]
    fn relative_and_absolute_inside() {
        let (_d, ws) = ws();
        fs::create_dir(ws.join("a")).unwrap();
        assert_eq!(resolve(&ws, "a/b.txt").unwrap(), ws.join("a/b.txt"));
        assert_eq!(resolve(&ws, "./a/../c").unwrap(), ws.join("c"));
        assert_eq!(resolve(&ws, "").unwrap(), ws);
        assert_eq!(resolve(&ws, ".").unwrap(), ws);
        let abs = ws.join("a/x").to_string_lossy().into_owned();
        assert_eq!(resolve(&ws, &abs).unwrap(), ws.join("a/x"));
        assert_eq!(
            resolve(&ws, "new/dir/file").unwrap(),
            ws.join("new/dir/file")
        );
    }

    #[test]
    fn escapes_are_refused() {
        let (_d, ws) = ws();
        assert!(outside(&ws, "../x"));
        assert!(outside(&ws, ".."));
        assert!(outside(&ws, "a/../../x"));
        assert!(outside(&ws, "missing/../../../etc/passwd"));
        assert!(outside(&ws, "/etc/passwd"));
        assert!(outside(&ws, "/"));
        let err = resolve(&ws, "../x").unwrap_err();
        assert_eq!(err.reason(), reason::WORKSPACE_BOUNDARY);
        assert!(err.to_string().contains("outside the workspace"));
    }

    #[test]
    fn symlinks_out_are_refused() {
        let (_d, ws) = ws();
        symlink("/etc", ws.join("link")).unwrap();
        symlink("/etc/passwd", ws.join("pw")).unwrap();
        symlink("/nonexistent-bmx-target/file", ws.join("dangling")).unwrap();
        symlink("../../..", ws.join("up")).unwrap();
        assert!(outside(&ws, "link"));
        assert!(outside(&ws, "link/passwd"));
        assert!(outside(&ws, "link/new-file"));
        assert!(outside(&ws, "pw"));
        assert!(outside(&ws, "dangling"));
        assert!(outside(&ws, "up/etc"));
        // `..` after a missing component must not skip the symlink check.
        assert!(outside(&ws, "missing/../link/passwd"));
    }

    #[test]
    fn symlinks_inside_are_followed() {
        let (_d, ws) = ws();
        fs::create_dir(ws.join("real")).unwrap();
        fs::write(ws.join("real/f"), "x").unwrap();
        symlink("real", ws.join("alias")).unwrap();
        symlink(ws.join("real/f"), ws.join("abs-alias")).unwrap();
        assert_eq!(resolve(&ws, "alias/f").unwrap(), ws.join("real/f"));
        assert_eq!(resolve(&ws, "abs-alias").unwrap(), ws.join("real/f"));
        assert_eq!(resolve(&ws, "alias/../real").unwrap(), ws.join("real"));
    }

    #[test]
    fn symlink_loops_terminate() {
        let (_d, ws) = ws();
        symlink("b", ws.join("a")).unwrap();
        symlink("a", ws.join("b")).unwrap();
        assert!(matches!(
            resolve(&ws, "a/x"),
            Err(BoundaryError::SymlinkLoop { .. })
        ));
    }

    #[test]
    fn non_canonical_workspace_is_accepted() {
        let (_d, ws) = ws();
        fs::create_dir(ws.join("real-ws")).unwrap();
        symlink(ws.join("real-ws"), ws.join("ws-link")).unwrap();
        let via_link = ws.join("ws-link");
        assert_eq!(resolve(&via_link, "f").unwrap(), ws.join("real-ws/f"));
        assert_eq!(display(&via_link, &ws.join("real-ws/f")), "f");
    }

    #[test]
    fn display_is_workspace_relative() {
        let (_d, ws) = ws();
        assert_eq!(display(&ws, &ws), ".");
        assert_eq!(display(&ws, &ws.join("a/b")), "a/b");
    }
}
