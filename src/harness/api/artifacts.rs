//! Artifacts: files a session's executor uploads to the harness's
//! [blob store](crate::harness::blob), listed per session and downloaded
//! by id.
//!
//! The platform asks (`POST /v1/sessions/{id}/artifacts {path}`); the
//! harness mints an **upload ticket** and sends `artifact.upload` with its
//! URL; the executor sends the file's bytes there in chunks
//! ([`crate::harness::http::artifacts`]) and answers with the artifact once
//! the harness has stored and verified it. Why a side HTTP upload and not
//! chunks over the control connection: docs/protocol.md, "Artifacts,
//! backups and skills".
//!
//! The index (artifact id → ref, per session) lives in memory, bounded; the
//! bytes live in the blob store. Idempotent by digest: the same bytes
//! uploaded again in one session are the same artifact.

use super::sessions::Session;
use crate::harness::blob::{BlobError, BlobStore, Digest};
use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::wire::types::{ArtifactRef, ArtifactUploadParams, ArtifactUploadResult, UploadTarget};
use crate::wire::{ErrorCode, Method, RpcError};
use serde::Deserialize;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The path of the upload route; the ticket's id follows.
pub const UPLOAD_PATH: &str = "/v1/artifact-uploads";
/// Upload tickets outstanding at once (429 past it).
pub const MAX_UPLOADS: usize = 256;
/// Artifacts the index keeps (the oldest is forgotten first; its blob
/// stays in the store).
pub const MAX_ARTIFACTS: usize = 100_000;
/// Longest artifact name and media type accepted.
const MAX_NAME: usize = 255;
const MAX_MIME: usize = 127;

/// `POST /v1/sessions/{id}/artifacts`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PublishArtifact {
    /// A path in the session's workspace.
    pub path: String,
    pub name: Option<String>,
    pub mime_type: Option<String>,
}

/// What an upload ticket allows: one upload, into one session.
#[derive(Debug, Clone)]
pub(crate) struct Upload {
    secret: String,
    pub session_id: String,
    expires: Instant,
    /// Set by the first `POST`: the ticket is bound to these bytes.
    pub declared: Option<Declared>,
}

#[derive(Debug, Clone)]
pub(crate) struct Declared {
    pub digest: Digest,
    pub size: u64,
    pub name: String,
    pub mime_type: String,
}

#[derive(Default)]
struct Index {
    by_id: HashMap<String, (String, ArtifactRef)>,
    /// (session, digest) → artifact id: idempotency by digest.
    by_digest: HashMap<(String, String), String>,
    /// Session → its artifact ids, oldest first.
    by_session: HashMap<String, Vec<String>>,
    order: VecDeque<String>,
}

/// The harness's artifact state, in [`Shared`].
#[derive(Default)]
pub struct Artifacts {
    uploads: Mutex<HashMap<String, Upload>>,
    index: Mutex<Index>,
    /// Workspace backups by session, oldest first ([`super::backups`]):
    /// their archives are artifacts, so they live beside them.
    pub(crate) backups: Mutex<HashMap<String, Vec<super::backups::BackupView>>>,
    /// Published skill revisions and their download tokens.
    pub skills: super::skills::Skills,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A blob store error as the API answers it.
pub fn blob_error(e: BlobError) -> ApiError {
    match e {
        BlobError::BadDigest(_) => ApiError::bad_request(e.to_string()),
        BlobError::NotFound(_) => ApiError::not_found(e.to_string()),
        BlobError::TooLarge { .. } => ApiError::rpc(RpcError::payload_too_large(e.to_string())),
        BlobError::OffsetMismatch { .. } => {
            ApiError::rpc(RpcError::conflict("upload_offset", e.to_string()))
        }
        BlobError::Incomplete { .. } => {
            ApiError::rpc(RpcError::conflict("upload_incomplete", e.to_string()))
        }
        BlobError::DigestMismatch { .. } => ApiError::with_status(
            422,
            RpcError::invalid_params(e.to_string()).with_reason("digest_mismatch"),
        ),
        BlobError::DiskFull => ApiError::with_status(
            507,
            RpcError::new(ErrorCode::ResourceUnavailable, e.to_string()).with_reason("disk_full"),
        ),
        BlobError::Io(_) => ApiError::internal(e.to_string()),
    }
}

fn no_store() -> ApiError {
    ApiError::rpc(
        RpcError::capability_unavailable("artifacts")
            .with_detail("this harness has no blob store (no data dir)"),
    )
}

/// The blob store, or 501 when the harness has none.
pub(crate) fn store(shared: &Shared) -> Result<Arc<dyn BlobStore>, ApiError> {
    shared.blobs.get().cloned().ok_or_else(no_store)
}

/// A name or media type: bounded, printable.
fn check_label(what: &str, s: &str, max: usize) -> Result<(), ApiError> {
    if s.len() > max || s.chars().any(char::is_control) {
        return Err(ApiError::bad_request(format!(
            "{what} must be at most {max} bytes, without control characters"
        )));
    }
    Ok(())
}

impl Artifacts {
    /// A new upload ticket for `session_id`: `(id, bearer)`.
    pub(crate) fn mint(
        &self,
        session_id: &str,
        ttl: Duration,
    ) -> Result<(String, String), ApiError> {
        let now = Instant::now();
        let mut uploads = lock(&self.uploads);
        uploads.retain(|_, u| u.expires > now);
        if uploads.len() >= MAX_UPLOADS {
            return Err(ApiError::rpc(
                RpcError::resource_unavailable(format!("{MAX_UPLOADS} uploads are in progress"))
                    .with_reason("uploads_full"),
            ));
        }
        let id = hex(&rand::random::<[u8; 8]>());
        let secret = hex(&rand::random::<[u8; 32]>());
        uploads.insert(
            id.clone(),
            Upload {
                secret: secret.clone(),
                session_id: session_id.to_owned(),
                expires: now + ttl,
                declared: None,
            },
        );
        Ok((id.clone(), format!("{id}.{secret}")))
    }

    pub(crate) fn forget_upload(&self, id: &str) {
        lock(&self.uploads).remove(id);
    }

    /// The upload `id` if `bearer` is its whole, unexpired ticket. A
    /// ticket is good for every request of its one upload (the offset
    /// query and the chunks, again after a cut) until the upload ends.
    pub(crate) fn upload(&self, id: &str, bearer: Option<&str>) -> Option<Upload> {
        let (bid, secret) = bearer?.split_once('.')?;
        if !crate::harness::http::same_secret(bid, id) {
            return None;
        }
        let uploads = lock(&self.uploads);
        let u = uploads.get(id)?;
        (crate::harness::http::same_secret(&u.secret, secret) && u.expires > Instant::now())
            .then(|| u.clone())
    }

    /// Bind upload `id` to `declared`; a ticket already bound to other
    /// bytes is a conflict.
    pub(crate) fn declare(&self, id: &str, declared: Declared) -> Result<(), ApiError> {
        let mut uploads = lock(&self.uploads);
        let u = uploads.get_mut(id).ok_or_else(ApiError::unauthorized)?;
        match &u.declared {
            Some(d) if d.digest != declared.digest || d.size != declared.size => {
                Err(ApiError::rpc(RpcError::conflict(
                    "upload_declared",
                    "this upload ticket is for other bytes",
                )))
            }
            Some(_) => Ok(()),
            None => {
                u.declared = Some(declared);
                Ok(())
            }
        }
    }

    /// The artifact for `declared` in `session_id`: the existing one for
    /// these bytes, else a new one.
    pub(crate) fn record(&self, session_id: &str, d: &Declared) -> ArtifactRef {
        let mut ix = lock(&self.index);
        let key = (session_id.to_owned(), d.digest.to_string());
        if let Some(r) = ix.by_digest.get(&key).and_then(|id| ix.by_id.get(id)) {
            return r.1.clone();
        }
        while ix.order.len() >= MAX_ARTIFACTS {
            let Some(old) = ix.order.pop_front() else {
                break;
            };
            if let Some((sid, r)) = ix.by_id.remove(&old) {
                ix.by_digest.remove(&(sid.clone(), r.digest.clone()));
                if let Some(v) = ix.by_session.get_mut(&sid) {
                    v.retain(|x| *x != old);
                }
            }
        }
        let r = ArtifactRef {
            artifact_id: format!("art-{}", hex(&rand::random::<[u8; 12]>())),
            name: d.name.clone(),
            mime_type: d.mime_type.clone(),
            size_bytes: d.size,
            digest: d.digest.to_string(),
            created_at: crate::wire::types::now_rfc3339(),
        };
        ix.by_id
            .insert(r.artifact_id.clone(), (session_id.to_owned(), r.clone()));
        ix.by_digest.insert(key, r.artifact_id.clone());
        ix.by_session
            .entry(session_id.to_owned())
            .or_default()
            .push(r.artifact_id.clone());
        ix.order.push_back(r.artifact_id.clone());
        r
    }

    /// Artifact `id`.
    pub fn get(&self, id: &str) -> Option<ArtifactRef> {
        lock(&self.index).by_id.get(id).map(|(_, r)| r.clone())
    }

    /// The artifacts of `session_id`, oldest first.
    pub fn list(&self, session_id: &str) -> Vec<ArtifactRef> {
        let ix = lock(&self.index);
        ix.by_session
            .get(session_id)
            .map(|ids| {
                ids.iter()
                    .filter_map(|id| ix.by_id.get(id).map(|(_, r)| r.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The HTTP base executors reach this harness at: the relay base with
/// `ws` turned into `http`.
pub(crate) fn http_base(shared: &Shared) -> String {
    let base = shared.relay_base.get().cloned().unwrap_or_default();
    if let Some(rest) = base.strip_prefix("ws://") {
        format!("http://{rest}")
    } else if let Some(rest) = base.strip_prefix("wss://") {
        format!("https://{rest}")
    } else {
        base
    }
}

/// Whether the executor holding `session_id` advertises `artifacts.upload`.
pub(crate) fn executor_caps(
    shared: &Shared,
    session_id: &str,
) -> Result<crate::wire::types::Capabilities, ApiError> {
    let info = shared
        .sessions
        .get(session_id)
        .map(|s| s.clone())
        .ok_or_else(|| ApiError::unknown_session(session_id))?;
    let Some(conn) = shared.executors.get(&info.executor_id).map(|c| *c) else {
        return Err(ApiError::executor_disconnected(session_id));
    };
    Ok(shared
        .conns
        .get(&conn)
        .map(|c| c.capabilities.clone())
        .unwrap_or_default())
}

impl Session {
    /// Have the executor upload `req.path` of this session's workspace as
    /// an artifact; returns once it is stored and verified. Sent again on
    /// the resumed connection if the executor's connection drops, and the
    /// upload continues where the harness's copy stands.
    ///
    /// # Errors
    ///
    /// 501 without a blob store or when the executor does not upload
    /// artifacts; the executor's refusal (a path outside the workspace,
    /// over the size limit); 429 with too many uploads in progress.
    pub async fn publish_artifact(&self, req: PublishArtifact) -> Result<ArtifactRef, ApiError> {
        let blobs = store(&self.shared)?;
        if let Some(n) = &req.name {
            check_label("name", n, MAX_NAME)?;
        }
        if let Some(m) = &req.mime_type {
            check_label("mimeType", m, MAX_MIME)?;
        }
        if req.path.is_empty() || req.path.len() > 4096 || req.path.contains('\0') {
            return Err(ApiError::bad_request("path must be 1..4096 bytes, no NUL"));
        }
        let caps = executor_caps(&self.shared, &self.id)?;
        if !caps.artifacts.is_some_and(|a| a.upload) {
            return Err(ApiError::rpc(RpcError::capability_unavailable("artifacts")));
        }
        let timeout = self.shared.config.tool_timeout;
        let ttl = timeout + Duration::from_millis(self.shared.config.lease_ttl_ms);
        let (id, bearer) = self.shared.artifacts.mint(&self.id, ttl)?;
        let params = ArtifactUploadParams {
            session_id: self.id.clone(),
            path: req.path,
            name: req.name,
            mime_type: req.mime_type,
            max_bytes: Some(blobs.max_bytes()),
            upload: UploadTarget {
                url: format!("{}{UPLOAD_PATH}/{id}", http_base(&self.shared)),
                ticket: bearer,
            },
        };
        let r = self
            .request_resending::<_, ArtifactUploadResult>(Method::ArtifactUpload, &params, timeout)
            .await;
        self.shared.artifacts.forget_upload(&id);
        Ok(r?.artifact)
    }

    /// The artifacts of this session, oldest first.
    ///
    /// # Errors
    ///
    /// 404 for a session the harness does not know.
    pub fn artifacts(&self) -> Result<Vec<ArtifactRef>, ApiError> {
        let list = self.shared.artifacts.list(&self.id);
        if list.is_empty() && !self.shared.sessions.contains_key(&self.id) {
            return Err(ApiError::unknown_session(&self.id));
        }
        Ok(list)
    }
}

/// A `Range` this harness cannot serve (HTTP 416).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("range not satisfiable")]
pub struct BadRange;

/// A `Range` header against a blob of `size` bytes: `Ok(None)` for the
/// whole blob, `Ok(Some((start, end)))` (end exclusive) for one range,
/// [`BadRange`] for a range that cannot be served (416). One range only:
/// a multi-range request is answered 416 too (docs/api.md).
pub fn parse_range(header: Option<&str>, size: u64) -> Result<Option<(u64, u64)>, BadRange> {
    let Some(h) = header else { return Ok(None) };
    let spec = h.trim().strip_prefix("bytes=").ok_or(BadRange)?;
    if spec.contains(',') {
        return Err(BadRange);
    }
    let (a, b) = spec.split_once('-').ok_or(BadRange)?;
    let (a, b) = (a.trim(), b.trim());
    let num = |s: &str| -> Result<u64, BadRange> {
        if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
            return Err(BadRange);
        }
        s.parse().map_err(|_| BadRange)
    };
    let (start, end) = if a.is_empty() {
        // The last `n` bytes.
        let n = num(b)?;
        if n == 0 || size == 0 {
            return Err(BadRange);
        }
        (size.saturating_sub(n), size)
    } else {
        let start = num(a)?;
        let end = if b.is_empty() {
            size
        } else {
            let last = num(b)?;
            if last < start {
                return Err(BadRange);
            }
            last.saturating_add(1).min(size)
        };
        (start, end)
    };
    if start >= size {
        return Err(BadRange);
    }
    Ok(Some((start, end)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range(None, 10), Ok(None));
        assert_eq!(parse_range(Some("bytes=0-4"), 10), Ok(Some((0, 5))));
        assert_eq!(parse_range(Some("bytes=5-"), 10), Ok(Some((5, 10))));
        assert_eq!(parse_range(Some("bytes=-3"), 10), Ok(Some((7, 10))));
        assert_eq!(parse_range(Some("bytes=-30"), 10), Ok(Some((0, 10))));
        assert_eq!(parse_range(Some("bytes=8-100"), 10), Ok(Some((8, 10))));
        for bad in [
            "bytes=10-",
            "bytes=5-4",
            "bytes=-0",
            "bytes=a-b",
            "bytes=0-1,3-4",
            "items=0-1",
            "bytes=-",
            "bytes=99999999999999999999999-",
        ] {
            assert_eq!(parse_range(Some(bad), 10), Err(BadRange), "{bad}");
        }
        assert_eq!(parse_range(Some("bytes=0-"), 0), Err(BadRange));
    }

    #[test]
    fn tickets_bind_one_session_and_one_upload() {
        let a = Artifacts::default();
        let (id, bearer) = a.mint("s1", Duration::from_secs(60)).unwrap();
        assert!(a.upload(&id, Some(&bearer)).is_some());
        assert!(a
            .upload(&id, Some(&format!("{id}.{}", "0".repeat(64))))
            .is_none());
        assert!(a.upload(&id, None).is_none());
        let d = |s: &str| Declared {
            digest: Digest::of(s.as_bytes()),
            size: s.len() as u64,
            name: "n".into(),
            mime_type: "text/plain".into(),
        };
        a.declare(&id, d("x")).unwrap();
        a.declare(&id, d("x")).unwrap();
        assert!(a.declare(&id, d("y")).is_err());
        let r1 = a.record("s1", &d("x"));
        assert_eq!(a.record("s1", &d("x")).artifact_id, r1.artifact_id);
        assert_ne!(a.record("s2", &d("x")).artifact_id, r1.artifact_id);
        assert_eq!(a.list("s1").len(), 1);
        a.forget_upload(&id);
        assert!(a.upload(&id, Some(&bearer)).is_none());
        let (id2, b2) = a.mint("s1", Duration::ZERO).unwrap();
        assert!(a.upload(&id2, Some(&b2)).is_none(), "expired");
    }
}
