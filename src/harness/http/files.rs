//! Session files (`crate::harness::api::files`): `PUT
//! /v1/sessions/{id}/files/uploads/{path}` (the body is the file, at most
//! [`MAX_UPLOAD_BYTES`], refused with 413 before it is read whole) and
//! `GET /v1/sessions/{id}/files/outputs/{path}` (the file's bytes).

use super::App;
use crate::harness::api::artifacts;
use crate::harness::api::files::MAX_UPLOAD_BYTES;
use crate::harness::blob::Digest;
use crate::harness::error::ApiError;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{header, HeaderMap};

/// The conflict check from the request's preconditions: `If-Match:
/// "<digest>"` (the file must have that digest now) or `If-None-Match: *`
/// (it must not exist).
fn precondition(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    if let Some(v) = headers.get(header::IF_MATCH) {
        let v = v
            .to_str()
            .map_err(|_| ApiError::bad_request("If-Match: not text"))?
            .trim()
            .trim_matches('"');
        let d = Digest::parse(v)
            .map_err(|_| ApiError::bad_request("If-Match: expected \"sha256:<64 hex>\""))?;
        return Ok(Some(d.to_string()));
    }
    if let Some(v) = headers.get(header::IF_NONE_MATCH) {
        if v.to_str().map(str::trim).ok() != Some("*") {
            return Err(ApiError::bad_request("If-None-Match: only * is understood"));
        }
        return Ok(Some(String::new()));
    }
    Ok(None)
}

/// `PUT /v1/sessions/{id}/files/uploads/{path}` → `{path, digest,
/// sizeBytes}` once the file is in the workspace.
pub(super) async fn put_upload(
    State(app): State<App>,
    Path((id, path)): Path<(String, String)>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let too_large = || {
        ApiError::rpc(crate::wire::RpcError::payload_too_large(format!(
            "a session file is at most {MAX_UPLOAD_BYTES} bytes"
        )))
    };
    // A declared length over the limit is refused before a byte of the
    // body is read; a body without one is read at most to the limit.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_UPLOAD_BYTES as u64) {
        return Err(too_large());
    }
    crate::harness::api::files::check_file_path(&path)?;
    let if_match = precondition(req.headers())?;
    let bytes = axum::body::to_bytes(req.into_body(), MAX_UPLOAD_BYTES)
        .await
        .map_err(|e| {
            // The limit's error, or the client's connection failing.
            if std::error::Error::source(&e)
                .is_some_and(|s| s.to_string().contains("length limit exceeded"))
                || e.to_string().contains("length limit exceeded")
            {
                too_large()
            } else {
                ApiError::bad_request(format!("body: {e}"))
            }
        })?;
    let r = app
        .sessions()
        .session(&id)
        .put_upload(&path, &bytes, if_match)
        .await?;
    Ok(Json(r).into_response())
}

/// `GET /v1/sessions/{id}/files/outputs/{path}`: the file's bytes,
/// `ETag` = its digest.
pub(super) async fn get_output(
    State(app): State<App>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let r = app.sessions().session(&id).get_output(&path).await?;
    let digest = Digest::parse(&r.digest).map_err(artifacts::blob_error)?;
    super::artifacts::whole_blob(&app, &digest, "the file's blob is gone").await
}
