//! The skill routes: publish (`POST /v1/skills?skillId=&revisionId=`, the
//! archive as the body), install into a session (`POST
//! /v1/sessions/{id}/skills`), and the executor's one-time download
//! (`GET /v1/skill-downloads/{token id}`, the token as bearer).

use super::App;
use crate::harness::api::skills::InstallSkill;
use crate::harness::error::ApiError;
use crate::wire::transport;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{HeaderMap, StatusCode};
use serde::Deserialize;

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
    super::artifacts::whole_blob(&app, &digest, "skill-archive", "the skill archive is gone").await
}
