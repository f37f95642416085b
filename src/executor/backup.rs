//! `workspace.backup`: a deterministic, zstd-compressed tar of paths of a
//! session's workspace, uploaded to the harness's blob store.
//!
//! **Fingerprint first.** The tree is walked with `lstat` only (no file is
//! opened): every entry's path, kind, size, mtime (ns), inode and mode go
//! into a SHA-256, the `fingerprint`. When it equals `skipIfFingerprint`
//! nothing is read or sent (`skipped: true`): an unchanged tree costs one
//! `lstat` per entry. Otherwise the archive is built and its digest is the
//! content hash.
//!
//! **Deterministic.** Entries sorted by path (bytes); headers GNU format
//! with the recorded mtime (seconds) and permission bits, uid/gid 0 and no
//! user/group names; symlinks kept as symlinks (their target text);
//! devices, FIFOs and sockets left out. The same tree gives the same bytes,
//! so the same digest: the blob store keeps one copy.
//!
//! **Boundary.** `paths` and the walk stay inside the workspace (the tools'
//! rules); files are read through [`Beneath`] (`openat2` beneath the
//! workspace, no symlink followed), and only the `size` bytes `lstat`
//! reported are archived: a file that shrank meanwhile fails the backup.

use crate::tools::beneath::Beneath;
use crate::tools::boundary;
use crate::wire::types::{WorkspaceBackupParams, WorkspaceBackupResult};
use crate::wire::RpcError;
use sha2::Digest as _;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Entries a backup may hold.
pub const MAX_ENTRIES: usize = 1_000_000;
/// Results remembered per executor for idempotency by `backupId`.
const REMEMBERED: usize = 1024;

/// One entry of the walk, from `lstat`.
#[derive(Debug, Clone)]
pub struct Node {
    /// Relative to the workspace, `/`-separated.
    pub rel: String,
    pub kind: NodeKind,
    pub size: u64,
    pub mtime_s: i64,
    pub mtime_ns: i64,
    pub ino: u64,
    pub mode: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    File,
    Dir,
    Symlink,
}

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{0}")]
    Boundary(#[from] boundary::BoundaryError),
    #[error("bad exclude pattern: {0}")]
    Exclude(String),
    #[error("more than {MAX_ENTRIES} entries")]
    TooMany,
    #[error("`{0}` changed while it was archived")]
    Changed(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl BackupError {
    pub fn rpc(&self) -> RpcError {
        match self {
            BackupError::Boundary(e) => {
                RpcError::invalid_params(e.to_string()).with_reason(e.reason())
            }
            BackupError::Exclude(_) => RpcError::invalid_params(self.to_string()),
            BackupError::TooMany => RpcError::payload_too_large(self.to_string()),
            _ => RpcError::internal(self.to_string()),
        }
    }
}

/// Walk `paths` (default: the whole workspace) minus `exclude` (globs on
/// the relative path; a matching directory is not entered). Sorted by
/// path. Blocking.
pub fn walk(
    workspace: &Path,
    paths: &[String],
    exclude: &[String],
) -> Result<Vec<Node>, BackupError> {
    let ws = boundary::canonical_workspace(workspace);
    let mut gs = globset::GlobSetBuilder::new();
    for e in exclude {
        gs.add(globset::Glob::new(e).map_err(|err| BackupError::Exclude(err.to_string()))?);
    }
    let excluded = gs
        .build()
        .map_err(|e| BackupError::Exclude(e.to_string()))?;
    let roots: Vec<String> = if paths.is_empty() {
        vec![".".into()]
    } else {
        paths.to_vec()
    };
    let mut seen: HashMap<String, Node> = HashMap::new();
    let mut queue: VecDeque<PathBuf> = VecDeque::new();
    for p in &roots {
        queue.push_back(boundary::resolve(&ws, p)?);
    }
    while let Some(abs) = queue.pop_front() {
        let Ok(rel) = abs.strip_prefix(&ws) else {
            continue;
        };
        let rel = rel.to_string_lossy().into_owned();
        // `.bmx` is the executor's own (tool output spills), never the
        // session's work.
        if !rel.is_empty() && (excluded.is_match(&rel) || seen.contains_key(&rel) || rel == ".bmx")
        {
            continue;
        }
        let meta = match std::fs::symlink_metadata(&abs) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        let ft = meta.file_type();
        let kind = if ft.is_symlink() {
            NodeKind::Symlink
        } else if ft.is_dir() {
            NodeKind::Dir
        } else if ft.is_file() {
            NodeKind::File
        } else {
            continue;
        };
        if kind == NodeKind::Dir {
            for e in std::fs::read_dir(&abs)? {
                queue.push_back(abs.join(e?.file_name()));
            }
        }
        if rel.is_empty() {
            continue;
        }
        if seen.len() >= MAX_ENTRIES {
            return Err(BackupError::TooMany);
        }
        seen.insert(
            rel.clone(),
            Node {
                rel,
                kind,
                size: if kind == NodeKind::File {
                    meta.len()
                } else {
                    0
                },
                mtime_s: meta.mtime(),
                mtime_ns: meta.mtime_nsec(),
                ino: meta.ino(),
                mode: meta.mode() & 0o7777,
            },
        );
    }
    let mut v: Vec<Node> = seen.into_values().collect();
    v.sort_by(|a, b| a.rel.as_bytes().cmp(b.rel.as_bytes()));
    Ok(v)
}

/// The fingerprint of a walk: metadata only, no content.
pub fn fingerprint(nodes: &[Node]) -> String {
    let mut h = sha2::Sha256::new();
    for n in nodes {
        let kind = match n.kind {
            NodeKind::File => 'f',
            NodeKind::Dir => 'd',
            NodeKind::Symlink => 'l',
        };
        h.update(n.rel.as_bytes());
        h.update(
            format!(
                "\0{kind}\0{}\0{}.{}\0{}\0{:o}\n",
                n.size, n.mtime_s, n.mtime_ns, n.ino, n.mode
            )
            .as_bytes(),
        );
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("fp1:{hex}")
}

/// Write the archive of `nodes` to `out` (zstd level 3). Blocking.
pub fn archive(workspace: &Path, nodes: &[Node], out: impl Write) -> Result<(), BackupError> {
    let ws = boundary::canonical_workspace(workspace);
    let beneath = Beneath::new(&ws)?;
    let enc = zstd::Encoder::new(out, 3)?;
    let mut tar = tar::Builder::new(enc);
    tar.mode(tar::HeaderMode::Deterministic);
    for n in nodes {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(n.mtime_s.max(0) as u64);
        h.set_mode(n.mode);
        h.set_uid(0);
        h.set_gid(0);
        match n.kind {
            NodeKind::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                tar.append_data(&mut h, format!("{}/", n.rel), std::io::empty())?;
            }
            NodeKind::Symlink => {
                let target = std::fs::read_link(ws.join(&n.rel))?;
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                tar.append_link(&mut h, &n.rel, &target)?;
            }
            NodeKind::File => {
                let f = beneath.open_read(&ws.join(&n.rel))?;
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(n.size);
                let mut exact = Exact {
                    inner: f.take(n.size),
                    left: n.size,
                };
                tar.append_data(&mut h, &n.rel, &mut exact).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        BackupError::Changed(n.rel.clone())
                    } else {
                        e.into()
                    }
                })?;
            }
        }
    }
    tar.into_inner()?.finish()?.flush()?;
    Ok(())
}

/// Exactly `left` bytes: `tar` writes whatever the reader gives after a
/// header that already states the size, so a file that shrank between the
/// `lstat` and the read must fail here, not pad the archive out of shape.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let k = self.inner.read(buf)?;
        if k == 0 && self.left > 0 && !buf.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the file shrank while it was archived",
            ));
        }
        self.left -= k as u64;
        Ok(k)
    }
}

static DONE: Mutex<Option<HashMap<(String, String), WorkspaceBackupResult>>> = Mutex::new(None);

/// A result already reached for (`session_id`, `backup_id`).
pub fn remembered(session_id: &str, backup_id: &str) -> Option<WorkspaceBackupResult> {
    let g = DONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    g.as_ref()?
        .get(&(session_id.to_owned(), backup_id.to_owned()))
        .cloned()
}

pub fn remember(session_id: &str, backup_id: &str, r: &WorkspaceBackupResult) {
    let mut g = DONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let m = g.get_or_insert_with(HashMap::new);
    if m.len() >= REMEMBERED {
        m.clear();
    }
    m.insert((session_id.to_owned(), backup_id.to_owned()), r.clone());
}

fn failed(error: String, fingerprint: Option<String>) -> WorkspaceBackupResult {
    WorkspaceBackupResult {
        state: "failed".into(),
        digest: None,
        fingerprint,
        entries: 0,
        size_bytes: 0,
        skipped: false,
        error: Some(error),
        artifact_id: None,
    }
}

/// Run `workspace.backup` for `session_id`. Boundary and pattern errors
/// are JSON-RPC errors (nothing was attempted); a backup that started and
/// could not finish answers `state: failed` with `error`.
///
/// # Errors
///
/// -32602 (`workspace_boundary` for a path outside, a bad exclude
/// pattern, no upload target), -32013 past [`MAX_ENTRIES`].
pub async fn run(
    workspace: &Path,
    session_id: &str,
    p: WorkspaceBackupParams,
) -> Result<WorkspaceBackupResult, RpcError> {
    if let Some(r) = remembered(session_id, &p.backup_id) {
        return Ok(r);
    }
    let Some(target) = p.upload.clone() else {
        return Err(RpcError::invalid_params(
            "workspace.backup needs an upload target (the harness sends one)",
        ));
    };
    let (ws, paths, exclude) = (workspace.to_owned(), p.paths.clone(), p.exclude.clone());
    let nodes = tokio::task::spawn_blocking(move || walk(&ws, &paths, &exclude))
        .await
        .map_err(|e| RpcError::internal(e.to_string()))?
        .map_err(|e| e.rpc())?;
    let fp = fingerprint(&nodes);
    let entries = nodes.len() as u64;
    if p.skip_if_fingerprint.as_deref() == Some(fp.as_str()) {
        return Ok(WorkspaceBackupResult {
            state: "skipped".into(),
            digest: None,
            fingerprint: Some(fp),
            entries,
            size_bytes: 0,
            skipped: true,
            error: None,
            artifact_id: None,
        });
    }
    let ws = workspace.to_owned();
    let built = tokio::task::spawn_blocking(
        move || -> Result<(std::fs::File, u64, String), BackupError> {
            // Unnamed, outside the workspace: never part of its own backup.
            let mut f = tempfile::tempfile()?;
            archive(&ws, &nodes, &mut f)?;
            f.flush()?;
            let size = f.metadata()?.len();
            let digest = crate::executor::artifacts::digest(&f, size)?;
            Ok((f, size, digest))
        },
    )
    .await
    .map_err(|e| RpcError::internal(e.to_string()))?;
    let (file, size, digest) = match built {
        Ok(b) => b,
        Err(e) => return Ok(failed(e.to_string(), Some(fp))),
    };
    let limit = p
        .max_bytes
        .unwrap_or(crate::executor::artifacts::MAX_BYTES)
        .min(crate::executor::artifacts::MAX_BYTES);
    if size > limit {
        return Ok(failed(
            format!("the archive is {size} bytes; the limit is {limit}"),
            Some(fp),
        ));
    }
    let begin = crate::wire::types::UploadBegin {
        digest: digest.clone(),
        size_bytes: size,
        name: format!("backup-{}.tar.zst", p.backup_id),
        mime_type: "application/zstd".into(),
    };
    let r = match crate::executor::artifacts::send(
        session_id,
        std::sync::Arc::new(file),
        size,
        begin,
        &target,
    )
    .await
    {
        Ok(a) => WorkspaceBackupResult {
            state: "completed".into(),
            digest: Some(digest),
            fingerprint: Some(fp),
            entries,
            size_bytes: size,
            skipped: false,
            error: None,
            artifact_id: Some(a.artifact_id),
        },
        Err(e) => failed(format!("upload: {}", e.message), Some(fp)),
    };
    if r.state == "completed" {
        remember(session_id, &p.backup_id, &r);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        std::fs::create_dir_all(d.path().join("node_modules/x")).unwrap();
        std::fs::write(d.path().join("a/b/one.txt"), b"one").unwrap();
        std::fs::write(d.path().join("a/two.txt"), b"two").unwrap();
        std::fs::write(d.path().join("node_modules/x/big"), b"big").unwrap();
        std::os::unix::fs::symlink("two.txt", d.path().join("a/link")).unwrap();
        d
    }

    fn names(nodes: &[Node]) -> Vec<&str> {
        nodes.iter().map(|n| n.rel.as_str()).collect()
    }

    #[test]
    fn walks_are_sorted_and_honour_excludes_and_the_boundary() {
        let d = tree();
        let all = walk(d.path(), &[], &[]).unwrap();
        assert_eq!(
            names(&all),
            [
                "a",
                "a/b",
                "a/b/one.txt",
                "a/link",
                "a/two.txt",
                "node_modules",
                "node_modules/x",
                "node_modules/x/big"
            ]
        );
        let some = walk(d.path(), &["a".into()], &["a/b".into()]).unwrap();
        assert_eq!(names(&some), ["a", "a/link", "a/two.txt"]);
        let e = walk(d.path(), &["../".into()], &[]).unwrap_err();
        assert_eq!(e.rpc().reason(), Some("workspace_boundary"));
        assert!(walk(d.path(), &[], &["[".into()]).is_err());
    }

    #[test]
    fn the_fingerprint_sees_metadata_changes_only() {
        let d = tree();
        let fp = |d: &tempfile::TempDir| fingerprint(&walk(d.path(), &[], &[]).unwrap());
        let a = fp(&d);
        assert_eq!(a, fp(&d));
        // Same size, new mtime: a new fingerprint.
        let f = std::fs::File::options()
            .write(true)
            .open(d.path().join("a/two.txt"))
            .unwrap();
        f.set_modified(std::time::SystemTime::UNIX_EPOCH).unwrap();
        let b = fp(&d);
        assert_ne!(a, b);
        std::fs::write(d.path().join("new"), b"").unwrap();
        assert_ne!(b, fp(&d));
    }

    #[test]
    fn archives_are_deterministic_and_hold_the_tree() {
        let d = tree();
        let nodes = walk(d.path(), &[], &["node_modules".into()]).unwrap();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        archive(d.path(), &nodes, &mut x).unwrap();
        archive(d.path(), &nodes, &mut y).unwrap();
        assert_eq!(x, y, "same tree, same bytes");
        let dec = zstd::Decoder::new(&x[..]).unwrap();
        let mut t = tar::Archive::new(dec);
        let mut seen = Vec::new();
        for e in t.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e
                .path()
                .unwrap()
                .to_string_lossy()
                .trim_end_matches('/')
                .to_owned();
            assert_eq!(e.header().uid().unwrap(), 0);
            let mut body = String::new();
            if e.header().entry_type().is_file() {
                e.read_to_string(&mut body).unwrap();
            }
            if e.header().entry_type().is_symlink() {
                body = e
                    .link_name()
                    .unwrap()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
            }
            seen.push((path, body));
        }
        assert_eq!(
            seen,
            [
                ("a".into(), String::new()),
                ("a/b".into(), String::new()),
                ("a/b/one.txt".into(), "one".into()),
                ("a/link".into(), "two.txt".into()),
                ("a/two.txt".into(), "two".into()),
            ]
        );
    }
}
