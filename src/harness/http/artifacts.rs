//! The artifact routes: the platform's (`POST`/`GET
//! /v1/sessions/{id}/artifacts`, `GET /v1/artifacts/{id}`) and the
//! executor's upload route (`POST`/`PATCH /v1/artifact-uploads/{ticket}`),
//! whose credential is the upload ticket, not the API token.
//!
//! Upload protocol (docs/protocol.md): `POST` declares `{digest,
//! sizeBytes, name, mimeType}` and answers `{offset}`, the bytes the
//! harness already holds for that digest (the whole size, with the
//! `artifact`, when the blob is stored already: idempotent by digest).
//! `PATCH` with `Upload-Offset: n` and at most [`MAX_CHUNK`] bytes appends
//! at `n` and answers the new `{offset}`; a wrong `n` is 409 with the
//! right `offset`, so a sender that lost an answer to a cut resumes
//! exactly. The last chunk commits the blob (verified against the digest,
//! published atomically) and the answer carries the `artifact`.

use super::App;
use crate::harness::api::artifacts::{self, Declared, PublishArtifact, Upload};
use crate::harness::blob::{BlobError, Digest};
use crate::harness::error::ApiError;
use crate::wire::transport;
use crate::wire::types::{UploadBegin, UploadStatus};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{header, HeaderMap, StatusCode};
use tokio::io::AsyncReadExt;

/// The largest chunk one `PATCH` may carry (below axum's 2 MiB body limit).
pub const MAX_CHUNK: usize = 1 << 20;
/// The largest `POST` declaring an upload (`{digest, sizeBytes, name,
/// mimeType}`).
const MAX_DECLARATION: usize = 16 * 1024;

/// `200` with the whole blob `digest`, `ETag` = the digest, streamed 64
/// KiB at a time so memory stays bounded whatever its size (skill
/// downloads, session output files), as a download named `name`
/// ([`security_headers::session_content`](super::security_headers::session_content)).
/// A blob the store no longer has is a 404 saying `gone`.
pub(super) async fn whole_blob(
    app: &App,
    digest: &Digest,
    name: &str,
    gone: &'static str,
) -> Result<Response, ApiError> {
    let blobs = artifacts::store(&app.shared)?;
    let size = blobs
        .stat(digest)
        .await
        .map_err(artifacts::blob_error)?
        .ok_or_else(|| ApiError::not_found(gone))?;
    let reader = blobs
        .read_range(digest, 0, size)
        .await
        .map_err(artifacts::blob_error)?;
    let stream = futures_util::stream::unfold(reader, |mut reader| async move {
        let mut buf = vec![0u8; 64 * 1024];
        match reader.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(Bytes::from(buf)), reader))
            }
            Err(e) => Some((Err(e), reader)),
        }
    });
    let mut r = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_LENGTH, size)
        .header(header::ETAG, format!("\"{digest}\""))
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    super::security_headers::session_content(r.headers_mut(), name, None);
    Ok(r)
}

fn ticket_of(headers: &HeaderMap, id: &str, app: &App) -> Result<Upload, ApiError> {
    if id.len() != 16 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::unauthorized());
    }
    app.shared
        .artifacts
        .upload(id, transport::bearer(headers))
        .ok_or_else(ApiError::unauthorized)
}

/// `POST /v1/sessions/{id}/artifacts {path, name?, mimeType?}` → 201
/// `{artifact}`.
pub(super) async fn publish(
    State(app): State<App>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let req: PublishArtifact = super::body(&bytes)?;
    let artifact = app.sessions().session(&id).publish_artifact(req).await?;
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({ "artifact": artifact })),
    )
        .into_response())
}

/// `GET /v1/sessions/{id}/artifacts` → `{artifacts: [ArtifactRef]}`.
pub(super) async fn list(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let list = app.sessions().session(&id).artifacts()?;
    Ok(Json(serde_json::json!({ "artifacts": list })).into_response())
}

/// `GET /v1/artifacts/{id}`: the bytes, `ETag` = the digest (quoted),
/// one `Range` at most (206, or 416 for a range outside the blob or one
/// this route does not serve), `If-None-Match` → 304. Always a download
/// (`Content-Disposition: attachment`, CSP `sandbox`, the declared type
/// only if inert: [`super::security_headers::session_content`]): a session
/// chose these bytes and their name.
pub(super) async fn download(
    State(app): State<App>,
    Path(id): Path<String>,
    req: Request,
) -> Result<Response, ApiError> {
    let blobs = artifacts::store(&app.shared)?;
    let r = app
        .shared
        .artifacts
        .get(&id)
        .ok_or_else(|| ApiError::not_found(format!("no artifact {id:?}")))?;
    let digest = Digest::parse(&r.digest).map_err(artifacts::blob_error)?;
    let etag = format!("\"{}\"", r.digest);
    let headers = req.headers();
    if headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"))
    {
        return Ok(Response::builder()
            .status(StatusCode::NOT_MODIFIED)
            .header(header::ETAG, &etag)
            .body(Body::empty())
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()));
    }
    let size = r.size_bytes;
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let (status, start, end) = match artifacts::parse_range(range, size) {
        Ok(None) => (StatusCode::OK, 0, size),
        Ok(Some((a, b))) => (StatusCode::PARTIAL_CONTENT, a, b),
        Err(artifacts::BadRange) => {
            let mut resp = ApiError::with_status(
                416,
                crate::wire::RpcError::invalid_params(format!(
                    "range {:?} is not satisfiable for {size} bytes",
                    range
                        .unwrap_or_default()
                        .chars()
                        .take(80)
                        .collect::<String>()
                ))
                .with_reason("range_not_satisfiable"),
            )
            .into_response();
            if let Ok(v) = format!("bytes */{size}").parse() {
                resp.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return Ok(resp);
        }
    };
    let reader = blobs
        .read_range(&digest, start, end)
        .await
        .map_err(artifacts::blob_error)?;
    // 64 KiB at a time: memory stays bounded whatever the blob's size.
    let stream = futures_util::stream::unfold(reader, |mut reader| async move {
        let mut buf = vec![0u8; 64 * 1024];
        match reader.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(Bytes::from(buf)), reader))
            }
            Err(e) => Some((Err(e), reader)),
        }
    });
    let mut b = Response::builder()
        .status(status)
        .header(header::ETAG, &etag)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CONTENT_LENGTH, end - start);
    if status == StatusCode::PARTIAL_CONTENT {
        b = b.header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{size}", end - 1),
        );
    }
    let mut resp = b
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    super::security_headers::session_content(
        resp.headers_mut(),
        &r.name,
        Some(r.mime_type.as_str()),
    );
    Ok(resp)
}

fn status(offset: u64, artifact: Option<crate::wire::types::ArtifactRef>) -> Response {
    Json(UploadStatus { offset, artifact }).into_response()
}

/// The body of an upload request whose ticket was checked first (issue
/// 56: no body is read for a request without its credential).
async fn ticketed_body(req: Request, max: usize) -> Result<Bytes, ApiError> {
    super::limited_body(req, max, || {
        ApiError::rpc(crate::wire::RpcError::payload_too_large(format!(
            "at most {max} bytes"
        )))
    })
    .await
}

/// `POST /v1/artifact-uploads/{ticket}`: declare (or re-declare after a
/// cut) the bytes; answers where the upload stands.
pub(super) async fn begin(
    State(app): State<App>,
    Path(ticket): Path<String>,
    req: Request,
) -> Result<Response, ApiError> {
    let upload = ticket_of(req.headers(), &ticket, &app)?;
    let bytes = ticketed_body(req, MAX_DECLARATION).await?;
    let blobs = artifacts::store(&app.shared)?;
    let b: UploadBegin =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_request(format!("body: {e}")))?;
    let digest = Digest::parse(&b.digest).map_err(artifacts::blob_error)?;
    if b.size_bytes > blobs.max_bytes() {
        return Err(artifacts::blob_error(BlobError::TooLarge {
            size: b.size_bytes,
            max: blobs.max_bytes(),
        }));
    }
    let name: String = b
        .name
        .chars()
        .filter(|c| !c.is_control())
        .take(255)
        .collect();
    let mime: String = b
        .mime_type
        .chars()
        .filter(|c| !c.is_control())
        .take(127)
        .collect();
    let declared = Declared {
        digest: digest.clone(),
        size: b.size_bytes,
        name: if name.is_empty() {
            "artifact".into()
        } else {
            name
        },
        mime_type: if mime.is_empty() {
            "application/octet-stream".into()
        } else {
            mime
        },
    };
    app.shared.artifacts.declare(&ticket, declared.clone())?;
    if let Some(size) = blobs.stat(&digest).await.map_err(artifacts::blob_error)? {
        if size == declared.size {
            let r = app.shared.artifacts.record(&upload.session_id, &declared);
            return Ok(status(size, Some(r)));
        }
    }
    if declared.size == 0 {
        // Nothing to send: the empty blob is stored here, if that is what
        // the digest says.
        let empty = blobs.put(&[]).await.map_err(artifacts::blob_error)?;
        if empty != digest {
            return Err(artifacts::blob_error(BlobError::DigestMismatch {
                expected: digest.to_string(),
                actual: empty.to_string(),
            }));
        }
        let r = app.shared.artifacts.record(&upload.session_id, &declared);
        return Ok(status(0, Some(r)));
    }
    let offset = blobs
        .partial_len(&digest)
        .await
        .map_err(artifacts::blob_error)?;
    Ok(status(offset.min(declared.size), None))
}

async fn commit(app: &App, session_id: &str, d: &Declared) -> Result<Response, ApiError> {
    let blobs = artifacts::store(&app.shared)?;
    blobs
        .commit(&d.digest, d.size)
        .await
        .map_err(artifacts::blob_error)?;
    let r = app.shared.artifacts.record(session_id, d);
    tracing::info!(session = %session_id, artifact = %r.artifact_id, digest = %r.digest, size = r.size_bytes, "artifact stored");
    Ok(status(d.size, Some(r)))
}

/// `PATCH /v1/artifact-uploads/{ticket}` with `Upload-Offset`: one chunk.
pub(super) async fn chunk(
    State(app): State<App>,
    Path(ticket): Path<String>,
    req: Request,
) -> Result<Response, ApiError> {
    let upload = ticket_of(req.headers(), &ticket, &app)?;
    let headers = req.headers().clone();
    let blobs = artifacts::store(&app.shared)?;
    let Some(d) = upload.declared else {
        return Err(ApiError::rpc(crate::wire::RpcError::conflict(
            "upload_not_declared",
            "POST the upload's digest and size first",
        )));
    };
    let bytes = ticketed_body(req, MAX_CHUNK).await?;
    // Stored meanwhile (another upload of the same bytes finished first):
    // done, nothing to append.
    if blobs.stat(&d.digest).await.map_err(artifacts::blob_error)? == Some(d.size) {
        let r = app.shared.artifacts.record(&upload.session_id, &d);
        return Ok(status(d.size, Some(r)));
    }
    let offset: u64 = headers
        .get("upload-offset")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| ApiError::bad_request("Upload-Offset: expected a byte count"))?;
    match blobs.append(&d.digest, d.size, offset, &bytes).await {
        Ok(n) if n == d.size => commit(&app, &upload.session_id, &d).await,
        Ok(n) => Ok(status(n, None)),
        Err(BlobError::OffsetMismatch { current, .. }) => {
            let e = artifacts::blob_error(BlobError::OffsetMismatch { offset, current });
            Ok((
                StatusCode::CONFLICT,
                Json(serde_json::json!({ "offset": current, "error": e.error })),
            )
                .into_response())
        }
        Err(e) => Err(artifacts::blob_error(e)),
    }
}

/// `POST /v1/sessions/{id}/backups {backupId?, paths?, exclude?,
/// skipIfFingerprint?}` → `{backup}`.
pub(super) async fn backup(
    State(app): State<App>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let req: crate::harness::api::backups::BackupRequest = super::body(&bytes)?;
    let b = app.sessions().session(&id).backup(req).await?;
    Ok(Json(serde_json::json!({ "backup": b })).into_response())
}

/// `GET /v1/sessions/{id}/backups` → `{backups: [...]}`.
pub(super) async fn backups(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let list = app.sessions().session(&id).backups()?;
    Ok(Json(serde_json::json!({ "backups": list })).into_response())
}
