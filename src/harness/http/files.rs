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
/// (it must not exist). Each header is checked whenever it is present, so a
/// malformed one is a 400 even beside a good one, and the two together
/// (a file that has a digest and does not exist) are refused.
fn precondition(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let if_match = headers
        .get(header::IF_MATCH)
        .map(|v| {
            let v = v
                .to_str()
                .map_err(|_| ApiError::bad_request("If-Match: not text"))?
                .trim()
                .trim_matches('"');
            Digest::parse(v)
                .map(|d| d.to_string())
                .map_err(|_| ApiError::bad_request("If-Match: expected \"sha256:<64 hex>\""))
        })
        .transpose()?;
    let if_none_match = headers
        .get(header::IF_NONE_MATCH)
        .map(|v| {
            if v.to_str().map(str::trim).ok() == Some("*") {
                Ok(String::new())
            } else {
                Err(ApiError::bad_request("If-None-Match: only * is understood"))
            }
        })
        .transpose()?;
    match (if_match, if_none_match) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "If-Match and If-None-Match together: give one",
        )),
        (a, b) => Ok(a.or(b)),
    }
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
    if super::declared_length(&req).is_some_and(|n| n > MAX_UPLOAD_BYTES as u64) {
        return Err(too_large());
    }
    crate::harness::api::files::check_file_path(&path)?;
    let if_match = precondition(req.headers())?;
    let bytes = super::limited_body(req, MAX_UPLOAD_BYTES, too_large).await?;
    let r = app
        .sessions()
        .session(&id)
        .put_upload(&path, &bytes, if_match)
        .await?;
    Ok(Json(r).into_response())
}

/// `GET /v1/sessions/{id}/files/outputs/{path}`: the file's bytes,
/// `ETag` = its digest, as a download named after the file (a session
/// wrote it).
pub(super) async fn get_output(
    State(app): State<App>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let r = app.sessions().session(&id).get_output(&path).await?;
    let digest = Digest::parse(&r.digest).map_err(artifacts::blob_error)?;
    super::artifacts::whole_blob(&app, &digest, &path, "the file's blob is gone").await
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn each_precondition_is_checked_even_beside_the_other() {
        let digest = format!("\"sha256:{}\"", "a".repeat(64));
        assert_eq!(precondition(&with(&[])).unwrap(), None);
        assert_eq!(
            precondition(&with(&[(header::IF_NONE_MATCH, "*")])).unwrap(),
            Some(String::new())
        );
        assert!(precondition(&with(&[(header::IF_MATCH, &digest)]))
            .unwrap()
            .is_some_and(|d| d.starts_with("sha256:")));
        // A malformed If-None-Match beside a good If-Match (what
        // schemathesis sent) is a 400, not ignored.
        assert!(precondition(&with(&[
            (header::IF_MATCH, &digest),
            (header::IF_NONE_MATCH, ";P*=="),
        ]))
        .is_err());
        assert!(precondition(&with(&[
            (header::IF_MATCH, &digest),
            (header::IF_NONE_MATCH, "*"),
        ]))
        .is_err());
        assert!(precondition(&with(&[(header::IF_MATCH, "sha256:zz")])).is_err());
    }
}
