//! File-transfer processes (`process.start.fileTransfer`, issue 15): one
//! file copied between the harness and the session's workspace, run as a
//! process of the session, so it is listed, timed out, terminated and
//! killed with the session like any other, and its end is a process
//! state. Its result is `process.read.fileTransfer`.
//!
//! The bytes take the data paths that exist already, not the control
//! connection: a **download** is a `GET` of the harness's one-time
//! download route (the one `skill.install` uses) with the token the
//! harness put in the spec; an **upload** is the artifact upload (ticket,
//! chunks, resumable, idempotent by digest: [`super::artifacts::send`]).
//!
//! Rules, in the order they are checked:
//! - the path: a relative path without `..` (refused at `process.start`,
//!   -32602 `workspace_boundary`), then the tools' boundary rules at run
//!   time (a symlink out is error `workspace_boundary`), every open
//!   through [`Beneath`];
//! - the conflict check: with `expectedDigest`, the local file must have
//!   that digest (`""`: must not exist), checked before any byte moves and
//!   again just before a download replaces the file; otherwise error
//!   `conflict` with `currentDigest`;
//! - sizes: at most `maxBytes` (capped by [`MAX_BYTES`]), counted as the
//!   bytes arrive (a download does not trust a declared length);
//! - a download is written to a temp file beside the destination, fsynced
//!   and renamed over it only once its digest matched: on any failure
//!   (too large, digest mismatch, disk full, a cancel) the temp file is
//!   removed and the destination is untouched.

use super::artifacts;
use crate::tools::beneath::{self, Beneath, Kind, Staged};
use crate::tools::boundary;
use crate::wire::types::{
    FileTransferError, FileTransferResult, ProcessFileTransfer, ProcessStartParams, UploadBegin,
};
use crate::wire::{ErrorCode, RpcError};
use sha2::Digest as _;
use std::io::Write as _;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Whether this executor runs file-transfer processes (advertised as
/// `process.fileTransfer`): on since `tests/harness/file_transfer.rs`
/// runs green; off with the artifact switch, whose upload it uses.
pub const ENABLED: bool = artifacts::ENABLED;
/// The largest file transferred either way (the artifacts' limit).
pub const MAX_BYTES: u64 = artifacts::MAX_BYTES;
/// Chunks in flight between the download and the file writer.
const WRITE_QUEUE: usize = 8;
/// A download's whole deadline (a `timeoutMs` on the process may cut it
/// shorter).
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// The error codes of `fileTransfer.error.code`.
pub mod code {
    pub const CONFLICT: &str = "conflict";
    pub const DIGEST_MISMATCH: &str = "digest_mismatch";
    pub const TOO_LARGE: &str = "too_large";
    pub const WORKSPACE_BOUNDARY: &str = "workspace_boundary";
    pub const NOT_FOUND: &str = "not_found";
    pub const NOT_A_FILE: &str = "not_a_file";
    pub const TOKEN_EXPIRED: &str = "token_expired";
    pub const TOKEN_INVALID: &str = "token_invalid";
    pub const DOWNLOAD_FAILED: &str = "download_failed";
    pub const UPLOAD_FAILED: &str = "upload_failed";
    pub const DISK_FULL: &str = "disk_full";
    pub const IO_ERROR: &str = "io_error";
    pub const CANCELED: &str = "canceled";
}

/// A failed transfer, before it becomes a [`FileTransferResult`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Failure {
    pub code: &'static str,
    pub message: String,
    pub current_digest: Option<String>,
}

fn fail(code: &'static str, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
        current_digest: None,
    }
}

impl Failure {
    /// The result that reports this failure for `path`.
    pub fn into_result(self, path: &str) -> FileTransferResult {
        FileTransferResult {
            path: path.to_owned(),
            digest: String::new(),
            size_bytes: None,
            artifact_id: None,
            error: Some(FileTransferError {
                code: self.code.to_owned(),
                current_digest: self.current_digest,
                message: self.message,
            }),
        }
    }
}

fn io_failure(path: &str, e: &std::io::Error) -> Failure {
    if beneath::is_swapped(e) || e.raw_os_error() == Some(libc::ENOTDIR) {
        return fail(
            code::WORKSPACE_BOUNDARY,
            format!("`{path}` leads outside the workspace"),
        );
    }
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            fail(code::DISK_FULL, format!("`{path}`: the disk is full"))
        }
        Some(libc::EISDIR) => fail(code::NOT_A_FILE, format!("`{path}` is a directory")),
        _ if e.kind() == std::io::ErrorKind::NotFound => {
            fail(code::NOT_FOUND, format!("no file `{path}`"))
        }
        _ => fail(code::IO_ERROR, format!("`{path}`: {e}")),
    }
}

/// `sha256:` + 64 lowercase hex, or not a digest.
pub fn is_digest(s: &str) -> bool {
    s.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn same_digest(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}

/// Refuse what may never run, at `process.start` (no process is made):
/// -32602 with `workspace_boundary` for an absolute path or a `..`, plain
/// -32602 for the rest.
///
/// # Errors
///
/// The refusal, as the answer to `process.start`.
pub fn check(spec: &ProcessStartParams, ft: &ProcessFileTransfer) -> Result<(), RpcError> {
    let bad = |what: &str| RpcError::invalid_params(format!("fileTransfer: {what}"));
    if !spec.argv.is_empty() || spec.package_install.is_some() || spec.git_credentials {
        return Err(bad(
            "argv, packageInstall and gitCredentials must be absent: the executor runs the transfer",
        ));
    }
    let p = &ft.local_path;
    if p.is_empty() || p.len() > 4096 || p.contains('\0') {
        return Err(bad("localPath must be 1..4096 bytes, without NUL"));
    }
    let path = Path::new(p);
    if path.is_absolute()
        || path
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(
            bad(&format!("localPath `{p}` must be relative, without `..`"))
                .with_reason(crate::tools::reason::WORKSPACE_BOUNDARY),
        );
    }
    if !path.components().any(|c| matches!(c, Component::Normal(_))) {
        return Err(bad("localPath names no file"));
    }
    if let Some(e) = &ft.expected_digest {
        if !e.is_empty() && !is_digest(e) {
            return Err(bad("expectedDigest must be \"\" or sha256:<64 hex>"));
        }
    }
    match ft.direction.as_str() {
        "download" => {
            if !ft.digest.as_deref().is_some_and(is_digest) {
                return Err(bad("a download needs digest (sha256:<64 hex>)"));
            }
            if ft.download_url.is_none() || ft.download_token.is_none() {
                return Err(bad(
                    "a download needs downloadUrl and downloadToken (the harness fills them in)",
                ));
            }
        }
        "upload" => {
            if ft.upload.is_none() {
                return Err(bad(
                    "an upload needs upload {url, ticket} (the harness fills it in)",
                ));
            }
        }
        other => {
            return Err(bad(&format!(
                "direction must be download or upload, not {:?}",
                other.chars().take(32).collect::<String>()
            )))
        }
    }
    Ok(())
}

/// The digest of the regular file at `resolved` now (`None`: nothing
/// there). Blocking.
fn current_digest(b: &Beneath, resolved: &Path, path: &str) -> Result<Option<String>, Failure> {
    let f = match b.open_read(resolved) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_failure(path, &e)),
    };
    match beneath::kind_of(&f).map_err(|e| io_failure(path, &e))? {
        Kind::File => {}
        _ => {
            return Err(fail(
                code::NOT_A_FILE,
                format!("`{path}` is not a regular file"),
            ))
        }
    }
    let size = f.metadata().map_err(|e| io_failure(path, &e))?.len();
    artifacts::digest(&f, size)
        .map(Some)
        .map_err(|e| io_failure(path, &e))
}

/// The conflict check: `expected` against what is at the path now.
fn check_expected(
    expected: Option<&str>,
    current: Option<&str>,
    path: &str,
) -> Result<(), Failure> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let ok = match current {
        None => expected.is_empty(),
        Some(c) => !expected.is_empty() && same_digest(c, expected),
    };
    if ok {
        return Ok(());
    }
    Err(Failure {
        code: code::CONFLICT,
        message: match current {
            None => format!("`{path}` does not exist; expected {expected}"),
            Some(c) => format!(
                "`{path}` is {c}, not {}",
                if expected.is_empty() {
                    "absent"
                } else {
                    expected
                }
            ),
        },
        current_digest: current.map(str::to_owned),
    })
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    // As the `--run-as` user, like the file tools: the kernel judges the
    // workspace accesses as theirs and the file they get is theirs.
    tokio::task::spawn_blocking(move || {
        let _identity = crate::process::run_as::FsIdentity::enter()
            .map_err(|e| fail(code::IO_ERROR, e.to_string()))?;
        f()
    })
    .await
    .map_err(|e| fail(code::IO_ERROR, e.to_string()))?
}

fn expired(at: &str) -> bool {
    time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
        .map(|t| t <= time::OffsetDateTime::now_utc())
        .unwrap_or(true)
}

/// Run the transfer `ft` of session `session_id` in `workspace`; every
/// failure is a result with `error`, never a panic or a lost answer.
pub async fn run(
    workspace: PathBuf,
    session_id: String,
    ft: ProcessFileTransfer,
) -> FileTransferResult {
    let span = tracing::info_span!("file_transfer", session = %session_id, direction = %ft.direction, path = %ft.local_path);
    let path = ft.local_path.clone();
    let r = match ft.direction.as_str() {
        "download" => download(&workspace, &ft).await,
        _ => upload(&workspace, &session_id, &ft).await,
    };
    match r {
        Ok(r) => {
            tracing::info!(parent: &span, digest = %r.digest, size = r.size_bytes.unwrap_or(0), "file transferred");
            r
        }
        Err(e) => {
            tracing::info!(parent: &span, code = e.code, message = %e.message, "file transfer failed");
            e.into_result(&path)
        }
    }
}

fn limit(ft: &ProcessFileTransfer) -> u64 {
    ft.max_bytes.unwrap_or(MAX_BYTES).min(MAX_BYTES)
}

/// Resolve the path by the boundary rules: the symlink-free path inside.
fn resolve(workspace: &Path, path: &str) -> Result<PathBuf, Failure> {
    boundary::resolve(workspace, path).map_err(|e| match e.reason() {
        crate::tools::reason::WORKSPACE_BOUNDARY => fail(code::WORKSPACE_BOUNDARY, e.to_string()),
        _ => fail(code::IO_ERROR, e.to_string()),
    })
}

async fn download(
    workspace: &Path,
    ft: &ProcessFileTransfer,
) -> Result<FileTransferResult, Failure> {
    let path = ft.local_path.clone();
    if ft.download_expires_at.as_deref().is_some_and(expired) {
        return Err(fail(code::TOKEN_EXPIRED, "the download token has expired"));
    }
    let want = ft.digest.clone().unwrap_or_default();
    let max = limit(ft);
    let (ws, p) = (workspace.to_owned(), path.clone());
    let expected = ft.expected_digest.clone();
    // Resolve, check for a conflict and make the temp file beside the
    // destination, all before a byte is fetched.
    let (b, resolved, staged) = blocking(move || {
        let resolved = resolve(&ws, &p)?;
        let b = Beneath::new(&ws).map_err(|e| io_failure(&p, &e))?;
        let current = current_digest(&b, &resolved, &p)?;
        check_expected(expected.as_deref(), current.as_deref(), &p)?;
        let staged = b.stage(&resolved).map_err(|e| io_failure(&p, &e))?;
        Ok((b, resolved, staged))
    })
    .await?;

    // The writer owns the temp file; dropping the sender without a
    // commit (an error, a cancel of this task) drops it, which removes it.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(WRITE_QUEUE);
    let wpath = path.clone();
    let writer = tokio::task::spawn_blocking(move || -> Result<Staged, Failure> {
        let mut staged = staged;
        while let Some(chunk) = rx.blocking_recv() {
            staged
                .file()
                .write_all(&chunk)
                .map_err(|e| io_failure(&wpath, &e))?;
        }
        Ok(staged)
    });

    let fetched = fetch(ft, max, &tx).await;
    drop(tx);
    let staged = writer
        .await
        .map_err(|e| fail(code::IO_ERROR, e.to_string()))?;
    // A write failure (disk full) is the cause when both failed: the
    // fetch then only saw the writer go away.
    let staged = staged?;
    let checked = fetched.and_then(|(digest, size)| {
        if same_digest(&digest, &want) {
            Ok((digest, size))
        } else {
            Err(fail(
                code::DIGEST_MISMATCH,
                format!("the bytes hash to {digest}, not {want}"),
            ))
        }
    });
    let (digest, size) = match checked {
        Ok(v) => v,
        Err(e) => {
            // Dropping the temp file removes it: a syscall, off the
            // runtime's threads.
            let _ = tokio::task::spawn_blocking(move || drop(staged)).await;
            return Err(e);
        }
    };
    let (p, expected) = (path.clone(), ft.expected_digest.clone());
    blocking(move || {
        // Again just before the rename: a change made while the bytes
        // travelled is a conflict too, not overwritten.
        let current = current_digest(&b, &resolved, &p)?;
        check_expected(expected.as_deref(), current.as_deref(), &p)?;
        staged.commit().map_err(|e| io_failure(&p, &e))
    })
    .await?;
    Ok(FileTransferResult {
        path,
        digest,
        size_bytes: Some(size),
        artifact_id: None,
        error: None,
    })
}

/// `GET` the bytes into `tx`, hashing and counting them: `(digest, size)`.
async fn fetch(
    ft: &ProcessFileTransfer,
    max: u64,
    tx: &tokio::sync::mpsc::Sender<bytes::Bytes>,
) -> Result<(String, u64), Failure> {
    let url = ft.download_url.as_deref().unwrap_or_default();
    let token = ft.download_token.as_deref().unwrap_or_default();
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(DOWNLOAD_TIMEOUT)
        .build()
        .map_err(|e| fail(code::DOWNLOAD_FAILED, e.to_string()))?;
    let mut resp = client
        .get(url)
        .bearer_auth(token)
        .send()
        .await
        .map_err(|e| fail(code::DOWNLOAD_FAILED, e.to_string()))?;
    match resp.status().as_u16() {
        200 => {}
        401 | 403 | 410 => {
            return Err(fail(
                code::TOKEN_INVALID,
                format!("the harness refused the token (HTTP {})", resp.status()),
            ))
        }
        404 => return Err(fail(code::NOT_FOUND, "the harness has no such blob")),
        s => return Err(fail(code::DOWNLOAD_FAILED, format!("HTTP {s}"))),
    }
    let mut h = sha2::Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| fail(code::DOWNLOAD_FAILED, e.to_string()))?
    {
        size += chunk.len() as u64;
        if size > max {
            return Err(fail(
                code::TOO_LARGE,
                format!("the file is over {max} bytes"),
            ));
        }
        h.update(&chunk);
        if tx.send(chunk).await.is_err() {
            // The writer failed; its error is the one reported.
            return Err(fail(code::IO_ERROR, "the file writer stopped"));
        }
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((format!("sha256:{hex}"), size))
}

async fn upload(
    workspace: &Path,
    session_id: &str,
    ft: &ProcessFileTransfer,
) -> Result<FileTransferResult, Failure> {
    let path = ft.local_path.clone();
    let Some(target) = ft.upload.clone() else {
        return Err(fail(code::UPLOAD_FAILED, "no upload target"));
    };
    let max = limit(ft);
    let (ws, p) = (workspace.to_owned(), path.clone());
    let (file, size, digest) = blocking(move || {
        let resolved = resolve(&ws, &p)?;
        let b = Beneath::new(&ws).map_err(|e| io_failure(&p, &e))?;
        let f = b.open_read(&resolved).map_err(|e| io_failure(&p, &e))?;
        if beneath::kind_of(&f).map_err(|e| io_failure(&p, &e))? != Kind::File {
            return Err(fail(
                code::NOT_A_FILE,
                format!("`{p}` is not a regular file"),
            ));
        }
        let size = f.metadata().map_err(|e| io_failure(&p, &e))?.len();
        if size > max {
            return Err(fail(
                code::TOO_LARGE,
                format!("`{p}` is {size} bytes; at most {max}"),
            ));
        }
        let digest = artifacts::digest(&f, size).map_err(|e| io_failure(&p, &e))?;
        Ok((f, size, digest))
    })
    .await?;
    check_expected(ft.expected_digest.as_deref(), Some(&digest), &path)?;
    let name = Path::new(&path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let artifact = artifacts::send(
        session_id,
        Arc::new(file),
        size,
        UploadBegin {
            digest: digest.clone(),
            size_bytes: size,
            mime_type: artifacts::mime_of(&name).to_owned(),
            name,
        },
        &target,
    )
    .await
    .map_err(|e: RpcError| {
        let code = match (e.kind(), e.reason()) {
            (Some(ErrorCode::PayloadTooLarge), _) => code::TOO_LARGE,
            (_, Some("disk_full")) => code::DISK_FULL,
            _ => code::UPLOAD_FAILED,
        };
        fail(
            code,
            format!(
                "{}{}",
                e.message,
                e.data
                    .and_then(|d| d.detail)
                    .map(|d| format!(": {d}"))
                    .unwrap_or_default()
            ),
        )
    })?;
    Ok(FileTransferResult {
        path,
        digest,
        size_bytes: Some(size),
        artifact_id: Some(artifact.artifact_id),
        error: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(ft: ProcessFileTransfer) -> ProcessStartParams {
        let mut p: ProcessStartParams =
            serde_json::from_value(serde_json::json!({"sessionId": "s", "processId": "p"}))
                .unwrap();
        p.file_transfer = Some(Box::new(ft));
        p
    }

    fn download(path: &str) -> ProcessFileTransfer {
        ProcessFileTransfer {
            direction: "download".into(),
            local_path: path.into(),
            digest: Some(format!("sha256:{}", "a".repeat(64))),
            download_url: Some("http://127.0.0.1:1/x".into()),
            download_token: Some("t".into()),
            ..Default::default()
        }
    }

    #[test]
    fn paths_and_shapes_are_checked_at_start() {
        for p in ["../x", "/etc/passwd", "a/../../b", "a/..", ".", ""] {
            let ft = download(p);
            assert!(check(&spec(ft.clone()), &ft).is_err(), "{p}");
        }
        let e = check(&spec(download("../x")), &download("../x")).unwrap_err();
        assert_eq!(e.reason(), Some("workspace_boundary"));
        let ok = download("uploads/a.txt");
        check(&spec(ok.clone()), &ok).unwrap();
        let mut s = spec(ok.clone());
        s.argv = vec!["sh".into()];
        assert!(check(&s, &ok).is_err(), "argv with a transfer");
        let bad_dir = ProcessFileTransfer {
            direction: "sideways".into(),
            ..ok.clone()
        };
        assert!(check(&spec(bad_dir.clone()), &bad_dir).is_err());
        let no_token = ProcessFileTransfer {
            download_token: None,
            ..ok.clone()
        };
        assert!(check(&spec(no_token.clone()), &no_token).is_err());
        let bad_expect = ProcessFileTransfer {
            expected_digest: Some("md5:x".into()),
            ..ok
        };
        assert!(check(&spec(bad_expect.clone()), &bad_expect).is_err());
    }

    #[test]
    fn io_errors_map_to_codes() {
        let e = |n| io_failure("p", &std::io::Error::from_raw_os_error(n)).code;
        assert_eq!(e(libc::ENOSPC), code::DISK_FULL);
        assert_eq!(e(libc::EDQUOT), code::DISK_FULL);
        assert_eq!(e(libc::ELOOP), code::WORKSPACE_BOUNDARY);
        assert_eq!(e(libc::ENOENT), code::NOT_FOUND);
        assert_eq!(e(libc::EISDIR), code::NOT_A_FILE);
        assert_eq!(e(libc::EIO), code::IO_ERROR);
    }

    #[test]
    fn the_conflict_check() {
        let d = format!("sha256:{}", "b".repeat(64));
        assert!(check_expected(None, Some(&d), "f").is_ok());
        assert!(check_expected(Some(""), None, "f").is_ok());
        assert!(check_expected(
            Some(&d),
            Some(&d.to_uppercase().replace("SHA256", "sha256")),
            "f"
        )
        .is_ok());
        let e = check_expected(Some(""), Some(&d), "f").unwrap_err();
        assert_eq!(
            (e.code, e.current_digest.as_deref()),
            (code::CONFLICT, Some(d.as_str()))
        );
        let e = check_expected(Some(&d), None, "f").unwrap_err();
        assert_eq!((e.code, e.current_digest), (code::CONFLICT, None));
        let other = format!("sha256:{}", "c".repeat(64));
        let e = check_expected(Some(&other), Some(&d), "f").unwrap_err();
        assert_eq!(e.current_digest.as_deref(), Some(d.as_str()));
    }
}
