//! File transfers and session files (issue 15).
//!
//! **File transfers** are processes of a session
//! (`process.start.fileTransfer`, run by the executor,
//! [`crate::executor::file_transfer`]). The platform names the file and
//! the direction; the harness fills in the data path it owns: for a
//! download, the blob (by `digest` or `artifactId`) and a one-time
//! download token for it (the route `skill.install` uses); for an upload,
//! an artifact upload ticket. So the bytes never cross the control
//! connection, and no new route or credential exists for them.
//!
//! **Session files** are two directories of the workspace the platform
//! reaches over HTTP: `PUT /v1/sessions/{id}/files/uploads/{path}` stores
//! the body as a blob and has the executor download it into
//! `uploads/{path}`; `GET /v1/sessions/{id}/files/outputs/{path}` has the
//! executor upload `outputs/{path}` and streams the blob back. Both are
//! file-transfer processes underneath (listed by `process.list` while they
//! run), so every rule of the transfer (boundary, sizes, no partial file)
//! is the one rule.

use super::artifacts::{self, http_base, lock, UPLOAD_PATH};
use super::sessions::{process_params, ReadRequest, Session};
use crate::harness::blob::Digest;
use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::lease::ConnId;
use crate::wire::types::{
    FileTransferResult, ProcessFileTransfer, RestoreSource, Stream, UploadTarget,
};
use crate::wire::{ErrorCode, RpcError};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `POST /v1/sessions {restoreFrom}`: the backup a new session starts
/// from, by `backupId` (of `sessionId`, or of any session, the newest
/// first) or by the archive's `artifactId`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestoreFrom {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_id: Option<String>,
}

/// The archive `r` names, stored in the blob store.
///
/// # Errors
///
/// 400 unless exactly one of `backupId` and `artifactId` is given; 404
/// for an unknown (or not completed) backup, artifact or a blob no longer
/// stored; 501 without a blob store.
pub(crate) async fn restore_digest(shared: &Shared, r: &RestoreFrom) -> Result<Digest, ApiError> {
    let blobs = artifacts::store(shared)?;
    let digest = match (&r.backup_id, &r.artifact_id) {
        (Some(b), None) => {
            // The lock is dropped before any await (it is not `Send`).
            let found = lock(&shared.artifacts.backups)
                .iter()
                .filter(|(sid, _)| r.session_id.as_ref().is_none_or(|want| want == *sid))
                .flat_map(|(_, v)| v.iter())
                .filter(|v| v.backup_id == *b && v.result.state == "completed")
                .max_by(|x, y| x.created_at.cmp(&y.created_at))
                .and_then(|v| v.result.digest.clone());
            found.ok_or_else(|| ApiError::not_found(format!("no completed backup {b:?}")))?
        }
        (None, Some(a)) => {
            shared
                .artifacts
                .get(a)
                .ok_or_else(|| ApiError::not_found(format!("no artifact {a:?}")))?
                .digest
        }
        _ => {
            return Err(ApiError::bad_request(
                "restoreFrom: exactly one of backupId and artifactId",
            ))
        }
    };
    let digest = Digest::parse(&digest).map_err(artifacts::blob_error)?;
    if blobs
        .stat(&digest)
        .await
        .map_err(artifacts::blob_error)?
        .is_none()
    {
        return Err(ApiError::not_found(format!(
            "the archive {digest} is not stored"
        )));
    }
    Ok(digest)
}

/// The `session.assign.restore` of `digest` for the executor on `conn`:
/// a one-time download token for it.
///
/// # Errors
///
/// 501 when that executor does not advertise `workspace.restore`; 429
/// with too many downloads pending.
pub(crate) fn restore_source(
    shared: &Shared,
    conn: ConnId,
    digest: Digest,
) -> Result<RestoreSource, ApiError> {
    let restores = shared
        .conns
        .get(&conn)
        .and_then(|c| c.capabilities.workspace.clone())
        .is_some_and(|w| w.restore);
    if !restores {
        return Err(ApiError::rpc(
            RpcError::capability_unavailable("workspace")
                .with_detail("the executor does not restore backups (workspace.restore)"),
        ));
    }
    let (id, bearer) = shared.artifacts.skills.mint(digest.clone())?;
    let expires = time::OffsetDateTime::now_utc()
        + time::Duration::seconds(super::skills::TOKEN_TTL.as_secs() as i64);
    Ok(RestoreSource {
        digest: digest.to_string(),
        download_url: format!("{}{}/{id}", http_base(shared), super::skills::DOWNLOAD_PATH),
        download_token: bearer,
        download_expires_at: crate::wire::types::rfc3339(expires),
    })
}

/// The largest body `PUT …/files/uploads/{path}` takes (checked before
/// the body is read: 413).
pub const MAX_UPLOAD_BYTES: usize = 64 << 20;
/// The workspace directories of session files.
pub const UPLOADS_DIR: &str = "uploads";
pub const OUTPUTS_DIR: &str = "outputs";
/// How long a session-file request waits for its transfer to end.
const TRANSFER_WAIT: Duration = Duration::from_secs(300);

/// The path of a session file, as the platform gave it after
/// `uploads/` or `outputs/`: plain names only (no `..`, `.`, empty
/// segment, absolute path, NUL or backslash), at most 4 096 bytes and 64
/// segments; else 400 `invalid_path`. Symlinks are the executor's to find
/// (the workspace is there): one leading out is `invalid_path` too.
pub fn check_file_path(path: &str) -> Result<(), ApiError> {
    let bad = |why: &str| {
        ApiError::rpc(RpcError::invalid_params(format!("path: {why}")).with_reason("invalid_path"))
    };
    if path.is_empty() || path.len() > 4096 {
        return Err(bad("1..4096 bytes"));
    }
    if path.contains('\0') || path.contains('\\') {
        return Err(bad("no NUL or backslash"));
    }
    let segments: Vec<&str> = path.split('/').collect();
    if segments.len() > 64 {
        return Err(bad("at most 64 segments"));
    }
    if segments
        .iter()
        .any(|s| s.is_empty() || *s == "." || *s == "..")
    {
        return Err(bad("plain names only: no empty segment, `.` or `..`"));
    }
    Ok(())
}

/// A failed transfer as the API answers it.
fn transfer_error(r: &FileTransferResult) -> Option<ApiError> {
    let e = r.error.as_ref()?;
    let rpc = |code: ErrorCode| RpcError::new(code, e.message.clone()).with_reason(e.code.clone());
    Some(match e.code.as_str() {
        "workspace_boundary" | "not_a_file" => ApiError::with_status(
            400,
            RpcError::invalid_params(e.message.clone()).with_reason("invalid_path"),
        ),
        "not_found" => ApiError::with_status(404, rpc(ErrorCode::NotFound)),
        "conflict" => {
            let mut err = rpc(ErrorCode::Conflict);
            if let Some(c) = &e.current_digest {
                err = err.with_detail(format!("currentDigest {c}"));
            }
            ApiError::with_status(409, err)
        }
        "too_large" => ApiError::with_status(413, rpc(ErrorCode::PayloadTooLarge)),
        "disk_full" => ApiError::with_status(507, rpc(ErrorCode::ResourceUnavailable)),
        "canceled" => ApiError::with_status(409, rpc(ErrorCode::Canceled)),
        _ => ApiError::with_status(502, rpc(ErrorCode::InternalError)),
    })
}

impl Session {
    /// Fill in the data path of a `fileTransfer` spec (see the module
    /// docs); `ft.artifactId` or `ft.digest` names the blob of a download.
    /// Returns the upload ticket's id, to forget once the transfer ends.
    ///
    /// # Errors
    ///
    /// 501 without a blob store or when the executor does not run file
    /// transfers; 404 for an unknown artifact or a blob not stored; 400
    /// for a bad digest or direction.
    pub(crate) async fn prepare_transfer(
        &self,
        ft: &mut ProcessFileTransfer,
    ) -> Result<Option<String>, ApiError> {
        let blobs = artifacts::store(&self.shared)?;
        let caps = artifacts::executor_caps(&self.shared, &self.id)?;
        if !caps.process.is_some_and(|p| p.file_transfer) {
            return Err(ApiError::rpc(RpcError::capability_unavailable(
                "process.fileTransfer",
            )));
        }
        let max = ft
            .max_bytes
            .unwrap_or(blobs.max_bytes())
            .min(blobs.max_bytes());
        ft.max_bytes = Some(max);
        match ft.direction.as_str() {
            "download" => {
                if let Some(id) = &ft.artifact_id {
                    let r = self
                        .shared
                        .artifacts
                        .get(id)
                        .ok_or_else(|| ApiError::not_found(format!("no artifact {id:?}")))?;
                    ft.digest = Some(r.digest);
                }
                let Some(d) = &ft.digest else {
                    return Err(ApiError::bad_request(
                        "fileTransfer: a download names its blob by digest or artifactId",
                    ));
                };
                let digest = Digest::parse(d).map_err(artifacts::blob_error)?;
                if blobs
                    .stat(&digest)
                    .await
                    .map_err(artifacts::blob_error)?
                    .is_none()
                {
                    return Err(ApiError::not_found(format!("no blob {digest}")));
                }
                let (id, bearer) = self.shared.artifacts.skills.mint(digest.clone())?;
                let expires = time::OffsetDateTime::now_utc()
                    + time::Duration::seconds(super::skills::TOKEN_TTL.as_secs() as i64);
                ft.digest = Some(digest.to_string());
                ft.download_url = Some(format!(
                    "{}{}/{id}",
                    http_base(&self.shared),
                    super::skills::DOWNLOAD_PATH
                ));
                ft.download_token = Some(bearer);
                ft.download_expires_at = Some(crate::wire::types::rfc3339(expires));
                Ok(None)
            }
            "upload" => {
                let ttl = self.shared.config.tool_timeout
                    + Duration::from_millis(self.shared.config.lease_ttl_ms);
                let (id, bearer) = self.shared.artifacts.mint(&self.id, ttl)?;
                ft.upload = Some(UploadTarget {
                    url: format!("{}{UPLOAD_PATH}/{id}", http_base(&self.shared)),
                    ticket: bearer,
                });
                Ok(Some(id))
            }
            other => Err(ApiError::bad_request(format!(
                "fileTransfer: direction must be download or upload, not {:?}",
                other.chars().take(32).collect::<String>()
            ))),
        }
    }

    /// Run one transfer as a process of this session and wait for its
    /// result (at most [`TRANSFER_WAIT`]).
    async fn transfer(&self, mut ft: ProcessFileTransfer) -> Result<FileTransferResult, ApiError> {
        let ticket = self.prepare_transfer(&mut ft).await?;
        let process_id = format!("file-{}", uuid::Uuid::new_v4().simple());
        let mut params = process_params(process_id.clone(), Vec::new());
        params.file_transfer = Some(Box::new(ft));
        params.wait_ms = Some(self.shared.config.max_read_wait_ms.min(30_000));
        let r = self.run_transfer(params, &process_id).await;
        if let Some(id) = ticket {
            self.shared.artifacts.forget_upload(&id);
        }
        r
    }

    async fn run_transfer(
        &self,
        params: crate::wire::types::ProcessStartParams,
        process_id: &str,
    ) -> Result<FileTransferResult, ApiError> {
        self.start_process_raw(params).await?;
        let deadline = tokio::time::Instant::now() + TRANSFER_WAIT;
        loop {
            // The streams of a transfer are closed at once: a read with a
            // wait returns when the process ends (or the wait passes).
            let r = self
                .read(ReadRequest {
                    process_id: process_id.to_owned(),
                    stream: Stream::Stdout,
                    cursor: 0,
                    max_bytes: None,
                    wait_ms: Some(10_000),
                })
                .await?;
            if r.state.is_final() {
                return r
                    .file_transfer
                    .ok_or_else(|| ApiError::internal("the transfer ended without a result"));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::rpc(RpcError::timeout(
                    "the file transfer did not end in time",
                )));
            }
        }
    }

    /// `PUT /v1/sessions/{id}/files/uploads/{path}`: store `bytes` and
    /// have the executor write them to `uploads/{path}` (replacing a file
    /// there, whole). `if_match`: the digest the file must have now
    /// (`""`: must not exist), else 409.
    ///
    /// # Errors
    ///
    /// 400 `invalid_path`; 413 over [`MAX_UPLOAD_BYTES`]; 409 conflict;
    /// 501 without a blob store or the capability; the transfer's failure.
    pub async fn put_upload(
        &self,
        path: &str,
        bytes: &[u8],
        if_match: Option<String>,
    ) -> Result<FileTransferResult, ApiError> {
        check_file_path(path)?;
        if bytes.len() > MAX_UPLOAD_BYTES {
            return Err(ApiError::rpc(RpcError::payload_too_large(format!(
                "a session file is at most {MAX_UPLOAD_BYTES} bytes"
            ))));
        }
        let blobs = artifacts::store(&self.shared)?;
        // The session first: no blob is stored for one that is not there.
        artifacts::executor_caps(&self.shared, &self.id)?;
        let digest = blobs.put(bytes).await.map_err(artifacts::blob_error)?;
        let r = self
            .transfer(ProcessFileTransfer {
                direction: "download".into(),
                local_path: format!("{UPLOADS_DIR}/{path}"),
                digest: Some(digest.to_string()),
                max_bytes: Some(bytes.len() as u64),
                expected_digest: if_match,
                ..Default::default()
            })
            .await?;
        match transfer_error(&r) {
            Some(e) => Err(e),
            None => Ok(r),
        }
    }

    /// `GET /v1/sessions/{id}/files/outputs/{path}`: have the executor
    /// upload `outputs/{path}`; the stored file's result (its digest names
    /// the blob to stream back; it is listed among the session's
    /// artifacts too).
    ///
    /// # Errors
    ///
    /// 400 `invalid_path`; 404 when there is no such file; 413 over the
    /// blob store's limit; 501 without a blob store or the capability.
    pub async fn get_output(&self, path: &str) -> Result<FileTransferResult, ApiError> {
        check_file_path(path)?;
        let r = self
            .transfer(ProcessFileTransfer {
                direction: "upload".into(),
                local_path: format!("{OUTPUTS_DIR}/{path}"),
                ..Default::default()
            })
            .await?;
        match transfer_error(&r) {
            Some(e) => Err(e),
            None => Ok(r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_paths() {
        for ok in ["a", "a/b.txt", "x.y/z", "...", "a b"] {
            assert!(check_file_path(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "../x", "a/../b", "/abs", "a//b", "a/", "./a", "a/.", "a\\b", "a\0b",
        ] {
            let e = check_file_path(bad).unwrap_err();
            assert_eq!(
                (e.status, e.reason()),
                (400, Some("invalid_path")),
                "{bad:?}"
            );
        }
        assert!(check_file_path(&"a/".repeat(70)).is_err());
    }
}
