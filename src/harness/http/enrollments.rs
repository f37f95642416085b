//! `/v1/enrollments` and `/v1/credentials` (docs/runner.md): a thin layer
//! over [`Enrollments`](crate::harness::api::enrollments::Enrollments).
//! Store calls run on the blocking pool. Create and poll need no API
//! token (the device has none yet); the rest is the operator's.

use super::throttle::{EnrollRoute, Source};
use super::App;
use crate::harness::api::enrollments::{EnrollError, Enrollments};
use crate::harness::enroll::Status;
use crate::wire::CloseCode;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

/// The routes a device calls before it holds any credential (create, and
/// poll with its device code), which have per-source limits of their own.
pub(crate) fn public_route(method: &http::Method, path: &str) -> Option<EnrollRoute> {
    if method != http::Method::POST {
        return None;
    }
    match path {
        "/v1/enrollments" => Some(EnrollRoute::Create),
        "/v1/enrollments/poll" => Some(EnrollRoute::Poll),
        _ => None,
    }
}

/// Largest body of the unauthenticated enrollment routes: a create holds
/// at most 4 KiB of workspace and two 256-byte labels, even as JSON
/// escapes. A larger body is refused by its declared length, or cut at
/// this size, and never read whole.
pub(crate) const MAX_BODY: usize = 32 * 1024;

/// 429 for a source past its enrollment rate ([`SourceLimits`]
/// (crate::harness::config::SourceLimits)), in the enrollment routes'
/// error shape, with `Retry-After`.
pub(crate) fn rate_limited(wait: std::time::Duration) -> Response {
    let mut r = error(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        "too many enrollment requests from this address: try again later",
    );
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, super::retry_after(wait));
    r
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": code, "message": message.into()})),
    )
        .into_response()
}

impl IntoResponse for EnrollError {
    fn into_response(self) -> Response {
        match &self {
            EnrollError::BadRequest(m) => error(StatusCode::BAD_REQUEST, "invalid_request", m),
            EnrollError::NotFound(_) => error(StatusCode::NOT_FOUND, "not_found", self.to_string()),
            EnrollError::SlowDown => error(
                StatusCode::TOO_MANY_REQUESTS,
                "slow_down",
                "polling faster than pollIntervalMs",
            ),
            EnrollError::TooManyPending(_) | EnrollError::TooManyPendingHere(_) => error(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_pending",
                self.to_string(),
            ),
            EnrollError::Decision(_) => error(StatusCode::CONFLICT, "conflict", self.to_string()),
            EnrollError::Store(e) => {
                tracing::error!(error = %e, "enrollment store");
                error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the store failed",
                )
            }
        }
    }
}

fn service(app: &App) -> Result<Arc<Enrollments>, Response> {
    app.shared.enrollments.get().cloned().ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            "not_found",
            "enrollment is not enabled on this harness",
        )
    })
}

fn parse<T: serde::de::DeserializeOwned>(bytes: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(bytes).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("body: {e}"),
        )
    })
}

/// Run a store call off the runtime's worker threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, EnrollError> + Send + 'static,
) -> Result<T, Response> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(IntoResponse::into_response),
        Err(_) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the enrollment task failed",
        )),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateBody {
    workspace: String,
    #[serde(default)]
    display_name: String,
    #[serde(default)]
    fingerprint: String,
}

pub(crate) async fn create(
    State(app): State<App>,
    source: Option<axum::Extension<Source>>,
    bytes: Bytes,
) -> Response {
    let run = async {
        let svc = service(&app)?;
        let b: CreateBody = parse(&bytes)?;
        let source = source.map(|s| s.0.key());
        let per_source = app.shared.config.sources.pending_enrollments;
        let base = app
            .shared
            .relay_base
            .get()
            .map(|r| api_base(r))
            .unwrap_or_default();
        let created = blocking(move || {
            let from = source.as_deref().map(|s| (s, per_source));
            svc.create_from(from, &b.workspace, &b.display_name, &b.fingerprint, &base)
        })
        .await?;
        Ok::<_, Response>((StatusCode::CREATED, Json(created)).into_response())
    };
    run.await.unwrap_or_else(|r| r)
}

/// `ws://h:p/prefix` (the relay base) → `http://h:p/prefix`.
fn api_base(relay_base: &str) -> String {
    let s = relay_base.trim_end_matches('/');
    if let Some(rest) = s.strip_prefix("wss://") {
        format!("https://{rest}")
    } else if let Some(rest) = s.strip_prefix("ws://") {
        format!("http://{rest}")
    } else {
        s.to_owned()
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PollBody {
    device_code: String,
}

pub(crate) async fn poll(State(app): State<App>, bytes: Bytes) -> Response {
    let run = async {
        let svc = service(&app)?;
        let b: PollBody = parse(&bytes)?;
        let answer = blocking(move || svc.poll(&b.device_code)).await?;
        Ok::<_, Response>(Json(answer).into_response())
    };
    run.await.unwrap_or_else(|r| r)
}

#[derive(Deserialize)]
pub(crate) struct ListQuery {
    status: Option<String>,
}

pub(crate) async fn list(
    State(app): State<App>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let run = async {
        let svc = service(&app)?;
        let Query(q) = query.map_err(|e| {
            error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("query: {e}"),
            )
        })?;
        let status = match q.status.as_deref() {
            None | Some("") | Some("all") => None,
            Some(s) => Some(Status::parse(s).ok_or_else(|| {
                error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    format!("unknown status {s:?}"),
                )
            })?),
        };
        let list = blocking(move || svc.list(status)).await?;
        Ok::<_, Response>(Json(json!({ "enrollments": list })).into_response())
    };
    run.await.unwrap_or_else(|r| r)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DecideBody {
    user_code: String,
}

async fn decide(app: App, bytes: Bytes, approve: bool) -> Response {
    let run = async {
        let svc = service(&app)?;
        let b: DecideBody = parse(&bytes)?;
        let v = blocking(move || {
            if approve {
                svc.approve(&b.user_code)
            } else {
                svc.deny(&b.user_code)
            }
        })
        .await?;
        Ok::<_, Response>(Json(v).into_response())
    };
    run.await.unwrap_or_else(|r| r)
}

pub(crate) async fn approve(State(app): State<App>, bytes: Bytes) -> Response {
    decide(app, bytes, true).await
}

pub(crate) async fn deny(State(app): State<App>, bytes: Bytes) -> Response {
    decide(app, bytes, false).await
}

pub(crate) async fn credentials(State(app): State<App>) -> Response {
    let run = async {
        let svc = service(&app)?;
        let list = blocking(move || svc.credentials()).await?;
        let connected: Vec<serde_json::Value> = list
            .iter()
            .map(|c| {
                let mut v = serde_json::to_value(c).unwrap_or_default();
                v["createdAt"] = json!(crate::harness::api::enrollments::rfc3339_ms(
                    c.created_at_ms
                ));
                v["revoked"] = json!(c.revoked_at_ms.is_some());
                v["connected"] = json!(app.shared.executors.contains_key(&c.executor_id));
                v
            })
            .collect();
        Ok::<_, Response>(Json(json!({ "credentials": connected })).into_response())
    };
    run.await.unwrap_or_else(|r| r)
}

/// Revoke, then close the executor's live connection with 4001 (its next
/// connect is refused: the credential is no longer accepted).
pub(crate) async fn revoke(State(app): State<App>, Path(id): Path<String>) -> Response {
    let run = async {
        let svc = service(&app)?;
        let c = blocking(move || svc.revoke(&id)).await?;
        let mut closed = 0;
        for e in app.shared.conns.iter() {
            if e.executor_id == c.executor_id {
                e.link
                    .close(CloseCode::CredentialRejected, "credential revoked");
                closed += 1;
            }
        }
        let mut v = serde_json::to_value(&c).unwrap_or_default();
        v["revoked"] = json!(true);
        v["connectionsClosed"] = json!(closed);
        Ok::<_, Response>(Json(v).into_response())
    };
    run.await.unwrap_or_else(|r| r)
}
