//! The HTTP API and the executors' upgrade route, on one axum router.

pub mod artifacts;
pub mod body_deadline;
pub mod console;
pub mod enrollments;
pub mod files;
pub mod forward;
pub mod forward_ws;
pub mod listener;
pub mod mcp;
pub mod openapi;
pub mod relay;
pub mod rfb;
pub mod security_headers;
pub mod self_wake;
pub mod skills;
pub mod throttle;
pub mod turns;

use self::relay::AttachQuery;
use super::api::sessions::{CreateSession, ReadRequest, Sessions, ToolCall};
use super::api::terminals::{unknown_terminal, OpenTerminal, Terminals};
use super::error::ApiError;
use super::types::ExecutorView;
use crate::harness::{actors::connection, runtime::Shared};
use crate::wire::transport::{self, CONNECT_PATH};
use crate::wire::types::{ProcessStartParams, Stream};
use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, RawPathParams, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{header, HeaderValue, StatusCode};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::sync::Arc;
use tracing::Instrument;

#[derive(Clone)]
pub(crate) struct App {
    pub shared: Arc<Shared>,
    /// The web console's browser sessions (issue 16).
    pub(crate) console: Arc<console::Console>,
    /// Per-source limits (issue 56): failed credentials, enrollments.
    pub(crate) throttles: Arc<throttle::Throttles>,
}

impl App {
    fn sessions(&self) -> Sessions {
        Sessions {
            shared: self.shared.clone(),
        }
    }

    fn terminals(&self) -> Terminals {
        Terminals {
            shared: self.shared.clone(),
        }
    }
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let throttles = Arc::new(throttle::Throttles::new(&shared.config.sources));
    throttle::log_periodically(&throttles, shared.config.sources.log_every);
    let app = App {
        shared,
        console: Arc::new(console::Console::new()),
        throttles,
    };
    // Routes anyone may send a body to get small body limits: a larger
    // body is refused, never read whole (issue 56).
    let login_limit = axum::extract::DefaultBodyLimit::max(console::MAX_LOGIN_BODY);
    let enroll_limit = axum::extract::DefaultBodyLimit::max(enrollments::MAX_BODY);
    Router::new()
        .route(CONNECT_PATH, get(connect))
        .route("/", get(console::index))
        .route(
            &format!("{}/{{hash}}/{{*path}}", console::assets::ASSETS_PATH),
            get(console::asset),
        )
        .route("/console/login", post(console::login).layer(login_limit))
        .route("/console/logout", post(console::logout).layer(login_limit))
        .route("/console/session", get(console::session))
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/executors", get(list_executors))
        .route("/v1/executors/{id}/drain", post(drain_executor))
        .route(
            "/v1/enrollments",
            get(enrollments::list)
                .post(enrollments::create)
                .layer(enroll_limit),
        )
        .route(
            "/v1/enrollments/poll",
            post(enrollments::poll).layer(enroll_limit),
        )
        .route("/v1/enrollments/approve", post(enrollments::approve))
        .route("/v1/enrollments/deny", post(enrollments::deny))
        .route("/v1/credentials", get(enrollments::credentials))
        .route(
            "/v1/credentials/{id}",
            axum::routing::delete(enrollments::revoke),
        )
        .route("/v1/sessions", get(list_sessions).post(create_session))
        .route("/v1/sessions/{id}", get(get_session).delete(delete_session))
        .route(
            "/v1/sessions/{id}/processes",
            get(list_processes).post(start_process),
        )
        .route("/v1/sessions/{id}/processes/{pid}/output", get(read_output))
        .route("/v1/sessions/{id}/processes/{pid}/stdin", post(write_stdin))
        .route(
            "/v1/sessions/{id}/processes/{pid}/interrupt",
            post(interrupt),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/terminate",
            post(terminate),
        )
        .route("/v1/sessions/{id}/tools", post(call_tool))
        .route("/v1/sessions/{id}/turns", post(turns::start))
        .route("/v1/sessions/{id}/turns/{turnId}/input", post(turns::input))
        .route(
            "/v1/sessions/{id}/turns/{turnId}/cancel",
            post(turns::cancel),
        )
        .route("/v1/sessions/{id}/events", get(turns::events))
        .route("/v1/sessions/{id}/events/ws", get(turns::events_ws))
        .route(
            "/v1/sessions/{id}/interactions",
            get(turns::list_interactions),
        )
        .route(
            "/v1/sessions/{id}/interactions/{interactionId}",
            get(turns::get_interaction).post(turns::answer_interaction),
        )
        .route("/v1/sessions/{id}/mcp", get(mcp::list))
        .route(
            "/v1/sessions/{id}/mcp-services",
            post(mcp::register_service),
        )
        .route(
            "/v1/sessions/{id}/mcp/{serverKey}",
            post(mcp::post).get(mcp::get).delete(mcp::delete),
        )
        .route(
            "/v1/executors/{id}/terminals",
            get(list_terminals).post(open_terminal),
        )
        .route(
            "/v1/executors/{id}/terminals/{tid}",
            get(get_terminal).delete(close_terminal),
        )
        .route(
            "/v1/executors/{id}/terminals/{tid}/attach",
            get(attach_terminal),
        )
        .route(
            &format!("{}/{{ticket}}", relay::RELAY_PATH),
            get(relay_dial),
        )
        .route("/v1/sessions/{id}/display/rfb", post(rfb_offer))
        .route(&format!("{}/{{ticket}}", rfb::VIEWER_PATH), get(rfb_viewer))
        .route(
            &format!("{}/{{ticket}}", rfb::EXECUTOR_PATH),
            get(relay_dial),
        )
        .route(
            "/v1/sessions/{id}/artifacts",
            get(artifacts::list).post(artifacts::publish),
        )
        .route("/v1/artifacts/{id}", get(artifacts::download))
        .route(
            "/v1/skills",
            post(skills::publish).layer(axum::extract::DefaultBodyLimit::max(
                crate::harness::api::skills::MAX_ARCHIVE_BYTES,
            )),
        )
        .route("/v1/sessions/{id}/skills", post(skills::install))
        .route(
            &format!("{}/{{token}}", crate::harness::api::skills::DOWNLOAD_PATH),
            get(skills::download),
        )
        .route(
            "/v1/sessions/{id}/files/uploads/{*path}",
            axum::routing::put(files::put_upload).layer(axum::extract::DefaultBodyLimit::max(
                crate::harness::api::files::MAX_UPLOAD_BYTES,
            )),
        )
        .route(
            "/v1/sessions/{id}/files/outputs/{*path}",
            get(files::get_output),
        )
        .route(
            "/v1/sessions/{id}/backups",
            get(artifacts::backups).post(artifacts::backup),
        )
        .route(
            &format!("{}/{{ticket}}", crate::harness::api::artifacts::UPLOAD_PATH),
            post(artifacts::begin).patch(artifacts::chunk),
        )
        // One layer per stage, not one per concern: each axum `from_fn`
        // layer clones and boxes the services under it on every request.
        // Five layers in place of these two cost bmx about 10 µs of CPU a
        // call on the MCP relay's path (docs/benchmarks.md, "One
        // middleware per stage").
        .route_layer(middleware::from_fn_with_state(app.clone(), matched))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(app.clone(), front))
        .with_state(app)
}

/// `GET /metrics`: the harness's metrics in the Prometheus / OpenMetrics
/// text format (docs/reliability.md lists them).
async fn metrics(State(app): State<App>) -> Response {
    let body = app.shared.metrics.render(&app.shared);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::harness::metrics::CONTENT_TYPE,
        )],
        body,
    )
        .into_response()
}

/// Every request, routed or not, in this order: its span
/// ([`request_span`]), authentication ([`api_auth`]), and JSON for the
/// errors axum answers itself ([`json_errors`]); the response echoes the
/// request id and carries the security headers of every answer
/// ([`security_headers::apply`]).
async fn front(State(app): State<App>, req: Request, next: Next) -> Response {
    let (id, span) = request_span(&req);
    let mut resp = async move { json_errors(api_auth(&app, req, next).await) }
        .instrument(span)
        .await;
    security_headers::apply(resp.headers_mut());
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// A request that matched a route, before its handler: the ids in its
/// path ([`check_path_ids`]), then [`forward::forward`], so a call
/// another replica holds goes there, after authentication here.
async fn matched(
    State(app): State<App>,
    params: RawPathParams,
    req: Request,
    next: Next,
) -> Response {
    if let Err(refused) = check_path_ids(&params) {
        return refused;
    }
    forward::forward(&app, req, next).await
}

/// A span per HTTP request, named by `x-request-id` (taken from the
/// request or minted), which the response echoes.
fn request_span(req: &Request) -> (String, tracing::Span) {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map(str::to_owned)
        .unwrap_or_else(|| {
            // The thread's CSPRNG, not `Uuid::new_v4` (a getrandom system
            // call on every request, measured in `bmx bench mcp`).
            format!("{:032x}", rand::random::<u128>())
        });
    // A relay path carries its ticket (a credential, whole in the RFB
    // viewer's URL): logged as `/v1/relay/<kind>/***`.
    let path = req.uri().path();
    let path = match path
        .strip_prefix(RELAYS)
        .and_then(|rest| rest.split_once('/'))
    {
        Some((kind, _)) => format!("{RELAYS}{kind}/***"),
        None => path.to_owned(),
    };
    let span = tracing::info_span!("http", request_id = %id, method = %req.method(), path = %path);
    (id, span)
}

/// Every error answers `{"error": {code, message, data}}`: the ones axum
/// makes itself (413 past the body limit, 405, a bad `Content-Length`)
/// come as plain text, and are rewritten here with the status kept.
fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => crate::wire::ErrorCode::PayloadTooLarge,
        StatusCode::METHOD_NOT_ALLOWED => crate::wire::ErrorCode::MethodNotFound,
        s if s.is_server_error() => crate::wire::ErrorCode::InternalError,
        _ => crate::wire::ErrorCode::InvalidRequest,
    };
    let message = status.canonical_reason().unwrap_or("error").to_lowercase();
    let mut json =
        ApiError::with_status(status.as_u16(), crate::wire::RpcError::new(code, message))
            .into_response();
    // Headers of the original (`Allow` of a 405) stay.
    for (name, value) in resp.headers() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            json.headers_mut().insert(name.clone(), value.clone());
        }
    }
    json
}

/// The path parameters that are ids, by their route names.
pub(crate) const PATH_IDS: [(&str, &str); 5] = [
    ("id", "id"),
    ("pid", "processId"),
    ("tid", "terminalId"),
    ("turnId", "turnId"),
    ("interactionId", "interactionId"),
];

/// Every id in a matched route's path obeys the id rule
/// ([`crate::wire::id`]) before any handler sees it (400, -32602,
/// `invalid_id`): ids reach logs, the store and the executor.
fn check_path_ids(params: &RawPathParams) -> Result<(), Response> {
    for (name, value) in params.iter() {
        if let Some((_, field)) = PATH_IDS.iter().find(|(n, _)| *n == name) {
            if let Err(e) = crate::wire::id::check(field, value) {
                return Err(ApiError::invalid_id(e).into_response());
            }
        }
    }
    Ok(())
}

/// Constant-time comparison of two secrets (API token, relay ticket).
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// What a route asks of a request before its handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Checks a secret of its own (the executors' connect, the relays,
    /// upload and download tickets), not the API token.
    OwnSecret,
    /// An enrollment route a device calls before it has a credential.
    Enroll(throttle::EnrollRoute),
    /// The console's page, assets, `/console/session` and logout.
    ConsolePage,
    /// `POST /console/login`: the API token in the body.
    Login,
    /// Everything else: the API token, or the console's cookie.
    Api,
}

fn access(method: &http::Method, path: &str) -> Access {
    if path == CONNECT_PATH
        || path.starts_with(RELAYS)
        || under(path, crate::harness::api::artifacts::UPLOAD_PATH)
        || under(path, crate::harness::api::skills::DOWNLOAD_PATH)
    {
        return Access::OwnSecret;
    }
    if let Some(route) = enrollments::public_route(method, path) {
        return Access::Enroll(route);
    }
    if path == "/console/login" {
        return Access::Login;
    }
    if console::is_public(path) {
        return Access::ConsolePage;
    }
    Access::Api
}

/// The `Content-Length` a request declares.
fn declared_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// `--api-token`: every API route but the executors' (the connect route
/// and the terminal relay, which have credentials of their own) needs
/// `Authorization: Bearer <token>`, or the web console's session cookie
/// (with its CSRF token on state-changing requests and the harness's own
/// `Origin` on WebSockets: [`console::auth`]). Without an API token,
/// every request must come from this harness's own origin (if from a
/// page) to a loopback host name ([`console::auth::open_mode`]).
///
/// Per source ([`throttle`]): a source that showed too many wrong
/// credentials gets 429 on every request that shows one, before it is
/// checked; enrollment routes have rates of their own; and a body larger
/// than an unauthenticated route takes is refused by its declared length
/// before it is read. A wrong credential (a 401 of a route that checks
/// one) is counted against its source.
///
/// A request that passes with a credential (or any request, when no API
/// token is configured) takes its connection off the unauthenticated list of
/// the listener's [`Gate`](listener::Gate).
async fn api_auth(app: &App, req: Request, next: Next) -> Response {
    let pass = req.extensions().get::<listener::ConnPass>().cloned();
    let source = req
        .extensions()
        .get::<throttle::Source>()
        .copied()
        .unwrap_or(throttle::Source::Local);
    let local_socket = source == throttle::Source::Local;
    let access = access(req.method(), req.uri().path());
    let config = &app.shared.config;
    let open = config.api_token.is_none();
    if open {
        let v = console::open_check(
            config,
            req.method(),
            req.headers(),
            access == Access::OwnSecret,
            local_socket,
        );
        if let console::auth::Verdict::Forbidden(r) = v {
            app.throttles.count(throttle::Event::Refused, source);
            tracing::debug!(reason = r.reason(), "request refused without an API token");
            return console::forbidden(r).into_response();
        }
        if let Some(p) = &pass {
            p.authenticated();
        }
    }
    let shows_credential = match access {
        Access::OwnSecret | Access::Login => true,
        Access::Api => !open,
        Access::Enroll(_) | Access::ConsolePage => false,
    };
    if shows_credential {
        if let Some(wait) = app.throttles.blocked(source) {
            app.throttles.count(throttle::Event::Throttled, source);
            return too_many_failures(wait);
        }
    }
    let body_limit = match access {
        Access::Enroll(route) => {
            if let Err(wait) = app.throttles.enroll(route, source) {
                app.throttles.count(throttle::Event::Throttled, source);
                return enrollments::rate_limited(wait);
            }
            Some(enrollments::MAX_BODY)
        }
        Access::Login | Access::ConsolePage => Some(console::MAX_LOGIN_BODY),
        Access::Api if !open => {
            // Bearer, or the console's cookie with its CSRF and Origin rules.
            match app
                .console
                .check(config, req.method(), req.headers(), local_socket)
            {
                console::auth::Verdict::Pass => {
                    if let Some(p) = &pass {
                        p.authenticated();
                    }
                }
                console::auth::Verdict::Unauthorized => {
                    // A wrong Bearer token is a guess; a stale cookie
                    // (256 random bits, forgotten at a restart) is not.
                    if transport::bearer(req.headers()).is_some() {
                        app.throttles.failed(source);
                    }
                    return ApiError::unauthorized().into_response();
                }
                console::auth::Verdict::Forbidden(r) => {
                    app.throttles.count(throttle::Event::Refused, source);
                    tracing::debug!(reason = r.reason(), "browser request refused");
                    return console::forbidden(r).into_response();
                }
            }
            None
        }
        Access::OwnSecret | Access::Api => None,
    };
    if let Some(max) = body_limit {
        if declared_length(&req).is_some_and(|n| n > max as u64) {
            return ApiError::rpc(crate::wire::RpcError::payload_too_large(format!(
                "this route takes a body of at most {max} bytes"
            )))
            .into_response();
        }
    }
    let resp = next.run(req).await;
    if shows_credential && access != Access::Api && resp.status() == StatusCode::UNAUTHORIZED {
        app.throttles.failed(source);
    }
    resp
}

/// A request's body, at most `max` bytes: one that declares more is
/// refused before a byte of it is read, one without a declared length is
/// read only up to the limit; either is `too_large()`. A body that breaks
/// off (or misses its deadline: [`body_deadline`]) is a 400.
pub(crate) async fn limited_body(
    req: Request,
    max: usize,
    too_large: impl Fn() -> ApiError,
) -> Result<Bytes, ApiError> {
    if declared_length(&req).is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(req.into_body(), max)
        .await
        .map_err(|e| {
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if over {
                too_large()
            } else {
                ApiError::bad_request(format!("body: {e}"))
            }
        })
}

/// 429 for a source out of failure budget, with when to try again.
fn too_many_failures(wait: std::time::Duration) -> Response {
    let mut r = ApiError::with_status(
        429,
        crate::wire::RpcError::new(
            crate::wire::ErrorCode::ResourceUnavailable,
            "too many wrong credentials from this address: try again later",
        )
        .with_reason("too_many_failures"),
    )
    .into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, retry_after(wait));
    r
}

/// `Retry-After` in whole seconds, rounded up (at least 1).
pub(crate) fn retry_after(wait: std::time::Duration) -> HeaderValue {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    HeaderValue::from(secs.max(1))
}

/// Whether `path` is below `prefix` (`prefix/…`): without allocating,
/// since every request asks.
fn under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.starts_with('/'))
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"ok": true}))
}

async fn openapi() -> Json<serde_json::Value> {
    Json(openapi::document())
}

/// `GET /v1/executor/connect`: bearer → 401 without upgrade, subprotocol →
/// 400, then 101 and the connection actor.
async fn connect(State(app): State<App>, req: Request) -> Response {
    let shared = app.shared.clone();
    let headers = req.headers();
    let Some(executor_id) = shared.authenticate(transport::bearer(headers)) else {
        // Counted per source and logged in aggregate (`api_auth`).
        tracing::debug!("executor upgrade refused: bad credential");
        return ApiError::unauthorized().into_response();
    };
    if let Some(p) = req.extensions().get::<listener::ConnPass>() {
        p.authenticated();
    }
    let Some(accept) = transport::ws_accept(headers) else {
        return ApiError::bad_request("expected a WebSocket upgrade").into_response();
    };
    let Some(proto) = transport::negotiate(headers, &shared.config.subprotocols) else {
        return ApiError::rpc(
            crate::wire::RpcError::new(
                crate::wire::ErrorCode::UnsupportedProtocol,
                "no common subprotocol",
            )
            .with_reason("no_common_subprotocol"),
        )
        .into_response();
    };
    let on_upgrade = hyper::upgrade::on(req);
    let max = shared.config.max_mcp_frame_bytes;
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let io = hyper_util::rt::TokioIo::new(upgraded);
                let t = transport::from_upgraded(Box::new(io), proto, max).await;
                connection::start(shared, t, executor_id).await;
            }
            Err(e) => tracing::info!(error = %e, "executor upgrade failed"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept)
        .header(header::SEC_WEBSOCKET_PROTOCOL, proto.name())
        .body(Body::empty())
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Parse a JSON body; an empty body is `{}`. A body must be an object,
/// and its id fields obey the id rule ([`crate::wire::id`]).
/// A member of a body given as `null`. No request schema of the API has a
/// nullable member (docs/api.md), so `null` is refused rather than read as
/// "absent": what the server accepts is exactly what the OpenAPI document
/// says (a client that means absent leaves the member out). Free-form
/// values (`metadata`, a tool's `input`) are not looked into.
pub(crate) fn refuse_null_members(v: &serde_json::Value) -> Result<(), ApiError> {
    match null_member(v) {
        Some(k) => {
            let name: String = k.chars().take(64).collect();
            Err(ApiError::bad_request(format!(
                "{name:?}: null is not allowed; leave the member out"
            )))
        }
        None => Ok(()),
    }
}

/// Members whose values are the client's own JSON, kept as given.
const FREE_FORM_MEMBERS: [&str; 3] = ["metadata", "input", "resources"];

/// The name of the first member that is `null`, in objects at any depth
/// (also inside arrays), not looking into [`FREE_FORM_MEMBERS`]. The depth
/// is bounded by the JSON parser's own nesting limit (128).
fn null_member(v: &serde_json::Value) -> Option<&str> {
    match v {
        serde_json::Value::Object(o) => o.iter().find_map(|(k, v)| {
            if v.is_null() {
                Some(k.as_str())
            } else if FREE_FORM_MEMBERS.contains(&k.as_str()) {
                None
            } else {
                null_member(v)
            }
        }),
        serde_json::Value::Array(a) => a.iter().find_map(null_member),
        _ => None,
    }
}

fn body<T: DeserializeOwned>(bytes: &Bytes) -> Result<T, ApiError> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    let v: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| ApiError::bad_request(format!("body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("body must be a JSON object"));
    }
    refuse_null_members(&v)?;
    crate::wire::id::check_fields(&v).map_err(ApiError::invalid_id)?;
    serde_json::from_value(v).map_err(|e| ApiError::bad_request(format!("body: {e}")))
}

pub(crate) fn executor_views(shared: &Shared) -> Vec<ExecutorView> {
    let mut v: Vec<ExecutorView> = shared
        .conns
        .iter()
        .filter(|e| {
            e.registered
                && shared
                    .executors
                    .get(&e.executor_id)
                    .is_some_and(|c| *c == e.conn)
        })
        .map(|e| {
            let mut active: Vec<String> = shared
                .sessions
                .iter()
                .filter(|s| {
                    s.state != super::types::SessionState::Ended
                        && s.connection_id.as_deref() == Some(e.connection_id.as_str())
                })
                .map(|s| s.session_id.clone())
                .collect();
            active.sort();
            ExecutorView {
                executor_id: e.executor_id.clone(),
                connection_id: e.connection_id.clone(),
                state: if e.draining { "draining" } else { "ready" }.into(),
                name: e.info.as_ref().map(|i| i.name.clone()).unwrap_or_default(),
                version: e
                    .info
                    .as_ref()
                    .map(|i| i.version.clone())
                    .unwrap_or_default(),
                active_sessions: active,
                connected_at: e.connected_at.clone(),
                last_heartbeat_at: e.last_heartbeat_at.clone(),
                protocol: Some(e.link.version().as_str().to_owned()),
                capabilities: e.capabilities.clone(),
                replica: None,
            }
        })
        .collect();
    v.sort_by(|a, b| a.executor_id.cmp(&b.executor_id));
    v
}

/// `GET /v1/executors`. Over several replicas, every live replica's
/// executors (this replica's own as it holds them, the others' from the
/// database: [`crate::harness::api::executors`]), each with its
/// `replica`; a database that fails answers 503 `store_unavailable`
/// rather than a list that silently lacks the others'. A call carrying
/// the forwarded marker asks what this replica holds itself.
async fn list_executors(
    State(app): State<App>,
    headers: http::HeaderMap,
) -> Result<Response, ApiError> {
    use crate::harness::api::executors::{from_row, merge};
    use crate::harness::store::pg_replicas::EXECUTORS_MAX;
    let local = executor_views(&app.shared);
    let Some(r) = app.shared.replica.get() else {
        return Ok(Json(serde_json::json!({ "executors": local })).into_response());
    };
    let stored = if headers.contains_key(forward::FORWARDED) {
        Vec::new()
    } else {
        let (db, alive) = (r.db.clone(), app.shared.config.lease_ttl_ms);
        tokio::task::spawn_blocking(move || db.executors_elsewhere(alive, EXECUTORS_MAX))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| crate::harness::actors::leases::store_unavailable(e.to_string()))?
    };
    let all = merge(local, stored.into_iter().map(from_row).collect(), r.db.id());
    Ok(Json(serde_json::json!({ "executors": all })).into_response())
}

/// `POST /v1/executors/{id}/drain` → the executor's `{accepted,
/// activeSessions}` (docs/api.md "Executors").
async fn drain_executor(
    State(app): State<App>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let req: crate::harness::api::drain::DrainRequest = body(&bytes)?;
    let r = crate::harness::api::drain::drain(&app.shared, &id, req).await?;
    Ok(Json(r).into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
}

/// `GET /v1/sessions?after=&limit=`: one page by session id, at most
/// [`PAGE_MAX`](crate::harness::api::listing::PAGE_MAX). Over several
/// replicas, every replica's sessions (read from the database, this
/// replica's own as it holds them); a database that fails answers 503
/// `store_unavailable` rather than a page that silently lacks the others'.
async fn list_sessions(
    State(app): State<App>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    use crate::harness::api::listing::{merge_page, PAGE_MAX};
    let Query(q) = query.map_err(|e| ApiError::bad_request(format!("query: {e}")))?;
    let limit = q.limit.unwrap_or(PAGE_MAX);
    if !(1..=PAGE_MAX).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be 1 to {PAGE_MAX}"
        )));
    }
    let stored = match app.shared.replica.get() {
        Some(r) => {
            let (db, after) = (r.db.clone(), q.after.clone());
            tokio::task::spawn_blocking(move || db.sessions_page(after.as_deref(), limit))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .map_err(|e| crate::harness::actors::leases::store_unavailable(e.to_string()))?
        }
        None => Vec::new(),
    };
    let page = merge_page(app.sessions().list(), stored, q.after.as_deref(), limit);
    let mut v = serde_json::json!({ "sessions": page.sessions });
    if let Some(next) = page.next {
        v["next"] = next.into();
    }
    Ok(Json(v).into_response())
}

async fn create_session(State(app): State<App>, bytes: Bytes) -> Result<Response, ApiError> {
    let req: CreateSession = body(&bytes)?;
    let s = app.sessions().create(req).await?;
    let info = s
        .info()
        .ok_or_else(|| ApiError::internal("the session vanished"))?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn get_session(State(app): State<App>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let info = app
        .sessions()
        .get(&id)
        .ok_or_else(|| ApiError::unknown_session(&id))?;
    Ok(Json(info).into_response())
}

async fn delete_session(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let info = app.sessions().session(&id).stop().await?;
    Ok(Json(info).into_response())
}

async fn list_processes(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let p = app.sessions().session(&id).list_processes().await?;
    Ok(Json(serde_json::json!({ "processes": p })).into_response())
}

async fn start_process(
    State(app): State<App>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let params = process_start_body(&bytes, &id)?;
    let state = app.sessions().session(&id).start_process(params).await?;
    Ok(Json(state).into_response())
}

/// The `process.start` params of a `POST …/processes` body: the session
/// from the path, a generated process id when the body has none.
fn process_start_body(bytes: &Bytes, session_id: &str) -> Result<ProcessStartParams, ApiError> {
    let mut v: serde_json::Value = body(bytes)?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("body must be an object"))?;
    obj.insert("sessionId".into(), session_id.into());
    obj.entry("processId")
        .or_insert_with(|| format!("p-{}", uuid::Uuid::new_v4().simple()).into());
    let params: ProcessStartParams =
        serde_json::from_value(v).map_err(|e| ApiError::bad_request(format!("body: {e}")))?;
    if params.argv.is_empty() && params.file_transfer.is_none() {
        return Err(ApiError::bad_request("argv must not be empty"));
    }
    Ok(params)
}

/// Every JSON body this module decodes, picked by `selector`, for the fuzz
/// targets ([`crate::fuzz::api_body`]): decoding must end in a value or an
/// [`ApiError`] with a 4xx status, never a panic or a 5xx.
pub(crate) fn decode_body_for_fuzz(selector: u8, bytes: &Bytes) {
    fn check<T>(r: Result<T, ApiError>) {
        if let Err(e) = r {
            let status = e.into_response().status();
            assert!(status.is_client_error(), "a bad body answered {status}");
        }
    }
    match selector % 6 {
        0 => check(body::<CreateSession>(bytes)),
        1 => check(process_start_body(bytes, "s1")),
        2 => check(body::<StdinBody>(bytes)),
        3 => check(body::<TerminateBody>(bytes)),
        4 => check(tool_call_body(bytes)),
        _ => check(body::<OpenTerminal>(bytes)),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OutputQuery {
    stream: Option<Stream>,
    cursor: Option<u64>,
    max_bytes: Option<u64>,
    wait_ms: Option<u64>,
}

async fn read_output(
    State(app): State<App>,
    Path((id, pid)): Path<(String, String)>,
    query: Result<Query<OutputQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::bad_request(format!("query: {e}")))?;
    let r = app
        .sessions()
        .session(&id)
        .read(ReadRequest {
            process_id: pid,
            stream: q.stream.unwrap_or(Stream::Stdout),
            cursor: q.cursor.unwrap_or(0),
            max_bytes: q.max_bytes,
            wait_ms: q.wait_ms,
        })
        .await?;
    Ok(Json(r).into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct StdinBody {
    /// Base64 bytes.
    data: Option<String>,
    /// Or text, sent as UTF-8.
    text: Option<String>,
    #[serde(default)]
    close_stdin: bool,
}

async fn write_stdin(
    State(app): State<App>,
    Path((id, pid)): Path<(String, String)>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let b: StdinBody = body(&bytes)?;
    let mut data = match b.data {
        Some(d) => crate::wire::blob::base64_decode(&d)
            .map_err(|e| ApiError::bad_request(format!("data is not base64: {e}")))?,
        None => Vec::new(),
    };
    if let Some(t) = b.text {
        data.extend_from_slice(t.as_bytes());
    }
    let r = app
        .sessions()
        .session(&id)
        .write(&pid, data, b.close_stdin)
        .await?;
    Ok(Json(r).into_response())
}

async fn interrupt(
    State(app): State<App>,
    Path((id, pid)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let r = app.sessions().session(&id).interrupt(&pid).await?;
    Ok(Json(r).into_response())
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TerminateBody {
    grace_ms: Option<u64>,
}

async fn terminate(
    State(app): State<App>,
    Path((id, pid)): Path<(String, String)>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let b: TerminateBody = body(&bytes)?;
    let r = app
        .sessions()
        .session(&id)
        .terminate(&pid, b.grace_ms)
        .await?;
    Ok(Json(r).into_response())
}

/// A `POST …/tools` body: `input`, when given, is an object (every tool's
/// input is one; the executor would refuse anything else, but the body is
/// checked here, before the session is looked up).
fn tool_call_body(bytes: &Bytes) -> Result<ToolCall, ApiError> {
    let call: ToolCall = body(bytes)?;
    if !(call.input.is_object() || call.input.is_null()) {
        return Err(ApiError::bad_request("input must be a JSON object"));
    }
    Ok(call)
}

async fn call_tool(
    State(app): State<App>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let call = tool_call_body(&bytes)?;
    let r = app.sessions().session(&id).call_tool(call).await?;
    Ok(Json(r).into_response())
}

async fn list_terminals(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let t = app.terminals().list(&id)?;
    Ok(Json(serde_json::json!({ "terminals": t })).into_response())
}

async fn open_terminal(
    State(app): State<App>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let req: OpenTerminal = body(&bytes)?;
    let t = app.terminals().open(&id, req).await?;
    Ok(Json(t).into_response())
}

async fn get_terminal(
    State(app): State<App>,
    Path((id, tid)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    app.terminals().list(&id)?;
    let t = app
        .shared
        .terminals
        .view(&id, &tid)
        .ok_or_else(|| unknown_terminal(&id, &tid))?;
    Ok(Json(t).into_response())
}

async fn close_terminal(
    State(app): State<App>,
    Path((id, tid)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let r = app.terminals().close(&id, &tid).await?;
    Ok(Json(r).into_response())
}

async fn attach_terminal(
    State(app): State<App>,
    Path((id, tid)): Path<(String, String)>,
    query: Result<Query<AttachQuery>, QueryRejection>,
    req: Request,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::bad_request(format!("query: {e}")))?;
    Ok(relay::viewer_attach(app.shared.clone(), id, tid, q, req).await)
}

/// Every relay route (terminals, display) is under this prefix and
/// carries its own one-time ticket instead of the API token.
const RELAYS: &str = "/v1/relay/";

async fn rfb_offer(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Json<rfb::RfbOffer>, ApiError> {
    rfb::offer(app.shared.clone(), id).await.map(Json)
}

async fn rfb_viewer(State(app): State<App>, Path(ticket): Path<String>, req: Request) -> Response {
    rfb::viewer(app.shared.clone(), ticket, req).await
}

async fn relay_dial(State(app): State<App>, Path(ticket): Path<String>, req: Request) -> Response {
    relay::executor_dial(app.shared.clone(), ticket, req).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn under_means_below_the_prefix_not_beside_it() {
        assert!(under("/v1/artifact-uploads/t-1", "/v1/artifact-uploads"));
        assert!(!under("/v1/artifact-uploads", "/v1/artifact-uploads"));
        assert!(!under("/v1/artifact-uploadsx/t-1", "/v1/artifact-uploads"));
        assert!(!under("/v1/sessions/s-1", "/v1/artifact-uploads"));
    }

    #[test]
    fn null_members_are_found_at_any_depth_but_not_in_free_form_values() {
        assert_eq!(null_member(&json!({"a": 1, "b": null})), Some("b"));
        assert_eq!(
            null_member(&json!({"config": {"thinkingLevel": null}})),
            Some("thinkingLevel")
        );
        assert_eq!(null_member(&json!({"servers": [{"k": null}]})), Some("k"));
        assert_eq!(null_member(&json!({"metadata": null})), Some("metadata"));
        assert_eq!(null_member(&json!({"metadata": {"k": null}})), None);
        assert_eq!(null_member(&json!({"input": {"limit": null}})), None);
        assert_eq!(null_member(&json!({"a": [1, "x", {"b": 2}]})), None);
    }

    #[test]
    fn bodies_refuse_nulls_and_tool_input_must_be_an_object() {
        let b = |s: &str| Bytes::from(s.to_owned());
        let e = body::<CreateSession>(&b(r#"{"restoreFrom": null}"#)).unwrap_err();
        assert_eq!(e.into_response().status(), 400);
        assert!(body::<CreateSession>(&b(r#"{"metadata": {"k": null}}"#)).is_ok());
        let e = tool_call_body(&b(r#"{"tool": "bash", "input": [null, null]}"#)).unwrap_err();
        assert_eq!(e.into_response().status(), 400);
        assert!(tool_call_body(&b(r#"{"tool": "list_files"}"#)).is_ok());
        assert!(tool_call_body(&b(r#"{"tool": "bash", "input": {"command": "true"}}"#)).is_ok());
    }
}
