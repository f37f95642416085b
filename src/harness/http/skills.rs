//! The skill routes: publish (`POST /v1/skills?skillId=&revisionId=`, the
//! archive as the body), install into a session (`POST
//! /v1/sessions/{id}/skills`), and the executor's one-time download
//! (`GET /v1/skill-downloads/{token id}`, the token as bearer).

use super::App;
use crate::harness::api::artifacts;
use crate::harness::api::skills::InstallSkill;
use crate::harness::error::ApiError;
use crate::wire::transport;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{header, HeaderMap, StatusCode};
use serde::Deserialize;
use tokio::io::AsyncReadExt;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PublishQuery {
    skill_id: String,
    revision_id: String,
}

/// `POST /v1/skills?skillId=&revisionId=` with the archive (tar or
/// tar.zst) as the body → 201 `{skill: {skillId, revisionId, digest,
/// sizeBytes}}`.
pub(super) async fn publish(
    State(app): State<App>,
    Query(q): Query<PublishQuery>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let r = app
        .shared
        .artifacts
        .skills
        .publish(&app.shared, &q.skill_id, &q.revision_id, &bytes)
        .await?;
    Ok((StatusCode::CREATED, Json(serde_json::json!({ "skill": r }))).into_response())
}

/// `POST /v1/sessions/{id}/skills {skillId, revisionId?}` → the
/// executor's `{state, error?, errorCode?}`.
pub(super) async fn install(
    State(app): State<App>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let req: InstallSkill = super::body(&bytes)?;
    let r = app.sessions().session(&id).install_skill(req).await?;
    Ok(Json(r).into_response())
}

/// `GET /v1/skill-downloads/{token id}`: the archive, once per token.
pub(super) async fn download(
    State(app): State<App>,
    Path(token): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if token.len() != 16 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::unauthorized());
    }
    let digest = app
        .shared
        .artifacts
        .skills
        .redeem(&token, transport::bearer(&headers))
        .ok_or_else(ApiError::unauthorized)?;
    let blobs = artifacts::store(&app.shared)?;
    let size = blobs
        .stat(&digest)
        .await
        .map_err(artifacts::blob_error)?
        .ok_or_else(|| ApiError::not_found("the skill archive is gone"))?;
    let reader = blobs
        .read_range(&digest, 0, size)
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
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_LENGTH, size)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::ETAG, format!("\"{digest}\""))
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}
