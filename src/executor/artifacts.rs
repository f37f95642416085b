//! `artifact.upload`: send a file of a session's workspace to the harness.
//!
//! The bytes do not travel over the control connection: the request names
//! an upload URL and a ticket, and the file goes there in bounded chunks
//! over plain HTTP (docs/protocol.md, "Artifacts, backups and skills", says
//! why). The upload is keyed by the file's digest, so it resumes wherever
//! the harness stands after any cut (a dropped HTTP connection here, or a
//! dropped control connection that makes the harness send the request
//! again), and the same bytes are never stored twice.
//!
//! The file is opened once through [`Beneath`] (the tools' boundary rules:
//! no `..`, no absolute path elsewhere, no symlink out, no swap after the
//! check) and every read is a `pread` on that one descriptor, so what is
//! hashed is what is sent, even if the name is replaced meanwhile. Its size
//! is checked against the limit before a byte is read.

use crate::tools::beneath::{self, Beneath, Kind};
use crate::tools::boundary;
use crate::wire::types::{
    ArtifactRef, ArtifactUploadParams, ArtifactUploadResult, UploadBegin, UploadStatus,
    UploadTarget,
};
use crate::wire::{Method, RpcError};
use sha2::Digest as _;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Whether this executor advertises (and accepts) `artifacts`,
/// `workspace.backup` and `skill.install`: on, since their black-box tests
/// (`tests/harness/{artifacts,backups,skills}.rs`, which check the
/// advertisement too) run green. One switch for all three, so an embedder
/// can turn the three off together.
pub const ENABLED: bool = true;

/// The largest artifact this executor uploads (advertised as
/// `artifacts.maxBytes`).
pub const MAX_BYTES: u64 = 1 << 30;
/// Bytes per `PATCH`: small enough for the harness's body limit and to
/// lose little on a cut, large enough that the per-request cost is small.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Consecutive failed attempts (no progress) before the upload gives up.
const MAX_ATTEMPTS: u32 = 8;
/// The whole upload must finish within this.
const DEADLINE: Duration = Duration::from_secs(600);
/// One HTTP request (a chunk or the offset query) must finish within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) fn mime_of(name: &str) -> &'static str {
    let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("txt" | "log" | "md") => "text/plain",
        Some("json") => "application/json",
        Some("html" | "htm") => "text/html",
        Some("csv") => "text/csv",
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("svg") => "image/svg+xml",
        Some("pdf") => "application/pdf",
        Some("zip") => "application/zip",
        Some("tar") => "application/x-tar",
        Some("gz" | "tgz") => "application/gzip",
        Some("zst") => "application/zstd",
        _ => "application/octet-stream",
    }
}

fn boundary_error(e: boundary::BoundaryError) -> RpcError {
    RpcError::invalid_params(e.to_string()).with_reason(e.reason())
}

/// Open `path` in `workspace` for reading: a regular file, inside, with its
/// size. Blocking.
pub(crate) fn open(workspace: &Path, path: &str) -> Result<(File, u64), RpcError> {
    let resolved = boundary::resolve(workspace, path).map_err(boundary_error)?;
    let io = |e: std::io::Error| {
        if beneath::is_swapped(&e) || e.raw_os_error() == Some(libc::EXDEV) {
            RpcError::invalid_params(format!("path `{path}` is outside the workspace"))
                .with_reason(crate::tools::reason::WORKSPACE_BOUNDARY)
        } else if e.kind() == std::io::ErrorKind::NotFound {
            RpcError::not_found(format!("no file `{path}`"))
        } else {
            RpcError::internal(format!("`{path}`: {e}"))
        }
    };
    let b = Beneath::new(workspace).map_err(io)?;
    let f = b.open_read(&resolved).map_err(io)?;
    if beneath::kind_of(&f).map_err(io)? != Kind::File {
        return Err(RpcError::invalid_params(format!(
            "`{path}` is not a regular file"
        )));
    }
    let size = f.metadata().map_err(io)?.len();
    Ok((f, size))
}

/// The digest of the first `size` bytes of `f`. Blocking.
pub(crate) fn digest(f: &File, size: u64) -> std::io::Result<String> {
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut at = 0u64;
    while at < size {
        let want = buf.len().min((size - at) as usize);
        let n = f.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the file shrank while it was read",
            ));
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("sha256:{hex}"))
}

/// Bytes `at..at+len` of `f`. Blocking.
fn chunk(f: &File, at: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, at)?;
    Ok(buf)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, RpcError> + Send + 'static,
) -> Result<T, RpcError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RpcError::internal(e.to_string()))?
}

/// What one HTTP exchange with the upload URL came to.
enum Step {
    /// Where the harness stands (and the artifact, once stored).
    Status(UploadStatus),
    /// Worth trying again (transport error, 5xx, 429).
    Retry(String),
}

async fn exchange(req: reqwest::RequestBuilder) -> Result<Step, RpcError> {
    let resp = match req.timeout(REQUEST_TIMEOUT).send().await {
        Ok(r) => r,
        Err(e) => return Ok(Step::Retry(format!("upload request: {e}"))),
    };
    let status = resp.status();
    let body = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => return Ok(Step::Retry(format!("upload answer: {e}"))),
    };
    // 409: the offset was not the harness's; its answer says where it is.
    if status.is_success() || status == reqwest::StatusCode::CONFLICT {
        return serde_json::from_slice::<UploadStatus>(&body)
            .map(Step::Status)
            .map_err(|e| RpcError::internal(format!("upload answer: {e}")));
    }
    // 507: the harness's disk is full. Final, like a refusal: retrying at
    // once would only fill and empty its partial file again.
    if (status.is_server_error() && status != reqwest::StatusCode::INSUFFICIENT_STORAGE)
        || status == reqwest::StatusCode::TOO_MANY_REQUESTS
    {
        return Ok(Step::Retry(format!("upload answered HTTP {status}")));
    }
    // A refusal (bad ticket, too large, digest mismatch): final. The
    // harness's error object is passed on as it is.
    let err = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| serde_json::from_value::<RpcError>(v.get("error")?.clone()).ok())
        .unwrap_or_else(|| RpcError::internal(format!("upload refused: HTTP {status}")));
    Err(err)
}

/// Upload `p.path` of `workspace`; the answer is the stored artifact.
///
/// # Errors
///
/// -32602 `workspace_boundary` for a path outside the workspace; -32602
/// for a directory or device; -32004 for a missing file; -32013 when the
/// file is over the limit; the harness's refusal as it sent it; -32603
/// when the harness stays unreachable for [`MAX_ATTEMPTS`] tries in a row.
pub async fn upload(
    workspace: &Path,
    p: ArtifactUploadParams,
) -> Result<ArtifactUploadResult, RpcError> {
    let limit = p.max_bytes.unwrap_or(MAX_BYTES).min(MAX_BYTES);
    let (ws, path) = (workspace.to_owned(), p.path.clone());
    let (file, size) = blocking(move || open(&ws, &path)).await?;
    if size > limit {
        return Err(RpcError::payload_too_large(format!(
            "`{}` is {size} bytes; artifacts are at most {limit} bytes",
            p.path
        )));
    }
    let file = Arc::new(file);
    let f = file.clone();
    let digest =
        blocking(move || digest(&f, size).map_err(|e| RpcError::internal(e.to_string()))).await?;
    let name = p.name.clone().unwrap_or_else(|| {
        Path::new(&p.path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "artifact".into())
    });
    let mime_type = p
        .mime_type
        .clone()
        .unwrap_or_else(|| mime_of(&name).to_owned());
    let artifact = send(
        &p.session_id,
        file,
        size,
        UploadBegin {
            digest,
            size_bytes: size,
            name,
            mime_type,
        },
        &p.upload,
    )
    .await?;
    Ok(ArtifactUploadResult { artifact })
}

/// Send `size` bytes of `file` (whose digest `begin` declares) to
/// `target`, resuming after cuts; the stored artifact.
///
/// # Errors
///
/// The harness's refusal as it sent it; -32603 when it stays unreachable
/// for [`MAX_ATTEMPTS`] tries in a row; -32008 past the deadline.
pub async fn send(
    session_id: &str,
    file: Arc<File>,
    size: u64,
    begin: UploadBegin,
    target: &UploadTarget,
) -> Result<ArtifactRef, RpcError> {
    let digest = begin.digest.clone();
    let begin = serde_json::to_vec(&begin).map_err(|e| RpcError::internal(e.to_string()))?;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| RpcError::internal(format!("http client: {e}")))?;
    let url = target.url.as_str();
    let ticket = target.ticket.as_str();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let span = tracing::info_span!("artifact_upload", method = Method::ArtifactUpload.as_str(), session = %session_id, %digest, size);

    let mut failures = 0u32;
    // The furthest offset the harness has confirmed: failures in a row are
    // counted until the upload gets past it, so a failure that keeps
    // coming back at the same place ends after MAX_ATTEMPTS.
    let mut furthest = 0u64;
    // `None`: ask the harness where it stands (first, and after a failure).
    let mut offset: Option<u64> = None;
    loop {
        if tokio::time::Instant::now() >= deadline {
            return Err(RpcError::timeout(
                "the artifact upload did not finish in time",
            ));
        }
        let step = match offset {
            None => {
                exchange(
                    client
                        .post(url)
                        .bearer_auth(ticket)
                        .header(reqwest::header::CONTENT_TYPE, "application/json")
                        .body(begin.clone()),
                )
                .await?
            }
            Some(at) => {
                let len = CHUNK_BYTES.min((size - at) as usize);
                let f = file.clone();
                let data = blocking(move || {
                    chunk(&f, at, len).map_err(|e| RpcError::internal(e.to_string()))
                })
                .await?;
                exchange(
                    client
                        .patch(url)
                        .bearer_auth(ticket)
                        .header("upload-offset", at.to_string())
                        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                        .body(data),
                )
                .await?
            }
        };
        match step {
            Step::Status(s) => {
                if let Some(artifact) = s.artifact {
                    return Ok(artifact);
                }
                if s.offset > size {
                    return Err(RpcError::internal(format!(
                        "the harness holds {} bytes of a {size}-byte upload",
                        s.offset
                    )));
                }
                if s.offset > furthest {
                    furthest = s.offset;
                    failures = 0;
                }
                offset = Some(s.offset);
            }
            Step::Retry(why) => {
                failures += 1;
                tracing::info!(parent: &span, attempt = failures, %why, "artifact upload interrupted: resuming");
                if failures >= MAX_ATTEMPTS {
                    return Err(RpcError::internal(format!(
                        "artifact upload failed {failures} times: {why}"
                    )));
                }
                let backoff = Duration::from_millis(100u64 << failures.min(5));
                tokio::time::sleep(backoff).await;
                offset = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_and_mime_types() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), b"").unwrap();
        let (f, size) = open(dir.path(), "a.txt").unwrap();
        assert_eq!(size, 0);
        assert_eq!(
            digest(&f, 0).unwrap(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(mime_of("x.PNG"), "image/png");
        assert_eq!(mime_of("noext"), "application/octet-stream");
    }

    #[test]
    fn paths_outside_and_non_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        std::fs::write(dir.path().join("secret"), b"s").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), ws.join("link")).unwrap();
        for p in ["../secret", "link", "/etc/passwd"] {
            let e = open(&ws, p).unwrap_err();
            assert_eq!(e.reason(), Some("workspace_boundary"), "{p}: {e:?}");
        }
        std::fs::create_dir(ws.join("d")).unwrap();
        assert!(open(&ws, "d").is_err());
        assert!(open(&ws, "missing").is_err());
    }
}
