//! The web console (issue 16; docs/console.md): the page at `/`, its
//! assets under `/console/assets/<hash>/…`, and the browser login
//! (`/console/login`, `/console/logout`, `/console/session`).
//!
//! The page only uses the public HTTP API (`/v1/…`) and the terminal
//! relay; what this module adds is serving and the cookie login whose
//! rules live in [`auth`] (a sans-IO core).

pub mod assets;
pub mod auth;

use super::App;
use crate::harness::config::HarnessConfig;
use crate::harness::error::ApiError;
use crate::wire::transport;
use crate::wire::{ErrorCode, RpcError};
use auth::{Facts, Policy, Refusal, SessionTable, Verdict};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use serde::Deserialize;
use std::sync::Mutex;
use std::time::Instant;

/// The console's Content-Security-Policy: scripts, styles, images and
/// connections from this origin only; no inline script or style, no
/// framing, no plugins, no form posts anywhere.
///
/// One exception: `img-src` also allows `data:`. noVNC decodes the
/// display's JPEG and PNG rectangles (Tight encoding) by loading them as
/// `data:` images, and draws the remote cursor as a `data:` URL in CSS
/// `cursor`. A `data:` image cannot run script; the alternative (asking
/// the VNC server for raw or zlib encodings only) would cost bandwidth on
/// every frame.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
img-src 'self' data:; font-src 'self'; connect-src 'self'; manifest-src 'self'; \
base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Largest login (and logout) body; the route's body limit too, so a
/// larger one is never read whole.
pub(crate) const MAX_LOGIN_BODY: usize = 4096;

/// The console's state: the browser sessions.
pub(crate) struct Console {
    table: Mutex<SessionTable>,
}

impl Console {
    pub(crate) fn new() -> Console {
        Console {
            table: Mutex::new(SessionTable::new(auth::MAX_SESSIONS, auth::SESSION_TTL)),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, SessionTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decide on a request to an API route (Bearer, cookie + CSRF +
    /// Origin, or the loopback rule): see [`auth::decide`].
    pub(crate) fn check(
        &self,
        config: &HarnessConfig,
        method: &Method,
        h: &HeaderMap,
        local_socket: bool,
    ) -> Verdict {
        let public_origin = origin_if_asked(config, h);
        let policy = policy(config, public_origin.as_deref());
        let facts = facts(method, h, local_socket);
        auth::decide(policy, facts, |id| {
            self.table().csrf(id, Instant::now()).map(str::to_owned)
        })
    }
}

/// The rule of a harness without an API token, for any route
/// ([`auth::open_mode`]).
pub(crate) fn open_check(
    config: &HarnessConfig,
    method: &Method,
    h: &HeaderMap,
    host_exempt: bool,
    local_socket: bool,
) -> Verdict {
    let public_origin = origin_if_asked(config, h);
    auth::open_mode(
        policy(config, public_origin.as_deref()),
        facts(method, h, local_socket),
        host_exempt,
    )
}

/// The public URL's origin, only worked out when the request has an
/// `Origin` to compare it with.
fn origin_if_asked(config: &HarnessConfig, h: &HeaderMap) -> Option<String> {
    if h.contains_key(header::ORIGIN) {
        public_origin(config)
    } else {
        None
    }
}

fn policy<'a>(config: &'a HarnessConfig, public_origin: Option<&'a str>) -> Policy<'a> {
    Policy {
        token: config.api_token.as_ref().map(|t| t.expose()),
        public_origin,
        open_network: config.allow_open_api,
    }
}

fn facts<'a>(method: &Method, h: &'a HeaderMap, local_socket: bool) -> Facts<'a> {
    let cookies = h
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok());
    Facts {
        unsafe_method: !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS),
        websocket: is_websocket(h),
        bearer: transport::bearer(h),
        cookie: auth::cookie_value(cookies),
        csrf: text(h, auth::CSRF_HEADER),
        origin: text(h, header::ORIGIN.as_str()),
        host: text(h, header::HOST.as_str()),
        local_socket,
    }
}

fn text<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

fn is_websocket(h: &HeaderMap) -> bool {
    h.get_all(header::UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| {
            v.split(',')
                .any(|p| p.trim().eq_ignore_ascii_case("websocket"))
        })
}

fn public_origin(config: &HarnessConfig) -> Option<String> {
    config.public_url.as_deref().and_then(auth::origin_of)
}

/// The cookie gets `Secure` when the harness is reached over https.
fn secure(config: &HarnessConfig) -> bool {
    public_origin(config).is_some_and(|o| o.starts_with("https://"))
}

/// Routes the browser reaches before it has a session: the page, its
/// assets and the login endpoints (which check what they need themselves).
pub(crate) fn is_public(path: &str) -> bool {
    path == "/"
        || path == "/console/login"
        || path == "/console/logout"
        || path == "/console/session"
        || super::under(path, assets::ASSETS_PATH)
}

/// Served at all: with an API token, or on a loopback address. Without
/// a token on another address (`--allow-open-api`) a page would hand the
/// whole API to anyone who can reach it, so it is not served.
fn served(config: &HarnessConfig) -> bool {
    config.api_token.is_some() || config.listen.ip().is_loopback()
}

fn not_served() -> Response {
    ApiError::with_status(
        404,
        RpcError::not_found("the console is served only with --api-token or on a loopback address")
            .with_reason("console_off"),
    )
    .into_response()
}

pub(crate) fn forbidden(r: Refusal) -> ApiError {
    ApiError::with_status(
        403,
        RpcError::new(ErrorCode::Forbidden, r.message()).with_reason(r.reason()),
    )
}

/// Headers every console page and asset carries: its own CSP, which
/// allows the page's scripts, then the ones every answer carries
/// ([`super::security_headers::apply`]).
fn hardened(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    super::security_headers::apply(h);
    r
}

fn file(
    bytes: Vec<u8>,
    gzipped: bool,
    content_type: &'static str,
    cache: &'static str,
) -> Response {
    let mut b = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, cache)
        .header(header::VARY, "accept-encoding");
    if gzipped {
        b = b.header(header::CONTENT_ENCODING, "gzip");
    }
    let r = b
        .body(Body::from(bytes))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    hardened(r)
}

/// `GET /`: the page. Never cached, so it always names the current assets.
pub(crate) async fn index(State(app): State<App>, headers: HeaderMap) -> Response {
    if !served(&app.shared.config) {
        return not_served();
    }
    let b = assets::bundle();
    let gz = assets::accepts_gzip(text(&headers, header::ACCEPT_ENCODING.as_str()));
    match (&b.index_gzip, gz) {
        (Some(z), true) => file(z.clone(), true, "text/html; charset=utf-8", "no-cache"),
        _ => file(
            b.index.clone().into_bytes(),
            false,
            "text/html; charset=utf-8",
            "no-cache",
        ),
    }
}

/// `GET /console/assets/{hash}/{*path}`: an embedded file, if `hash` is the
/// current set's. Cached for a year: the URL changes with the content.
pub(crate) async fn asset(
    State(app): State<App>,
    Path((hash, path)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if !served(&app.shared.config) {
        return not_served();
    }
    let b = assets::bundle();
    let found = (hash == b.hash).then(|| b.get(&path)).flatten();
    let Some(a) = found else {
        return ApiError::not_found("no such console asset").into_response();
    };
    const IMMUTABLE: &str = "public, max-age=31536000, immutable";
    let gz = assets::accepts_gzip(text(&headers, header::ACCEPT_ENCODING.as_str()));
    match (&a.gzip, gz) {
        (Some(z), true) => file(z.clone(), true, a.content_type, IMMUTABLE),
        _ => file(a.bytes.to_vec(), false, a.content_type, IMMUTABLE),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoginBody {
    token: String,
}

/// A request from a page of another origin is refused (login CSRF, and
/// reading the session's CSRF token is for this origin's pages only).
fn foreign(app: &App, headers: &HeaderMap) -> Option<Response> {
    let origin = text(headers, header::ORIGIN.as_str())?;
    let public = public_origin(&app.shared.config);
    let host = text(headers, header::HOST.as_str());
    (!auth::same_origin(origin, host, public.as_deref()))
        .then(|| forbidden(Refusal::CrossOrigin).into_response())
}

/// `POST /console/login` `{"token": "<API token>"}`: a console session.
/// Answers `{csrf, expiresInSecs}` and sets the session cookie.
pub(crate) async fn login(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let config = &app.shared.config;
    if !served(config) {
        return not_served();
    }
    if let Some(r) = foreign(&app, &headers) {
        return r;
    }
    if body.len() > MAX_LOGIN_BODY {
        return ApiError::with_status(
            413,
            RpcError::new(ErrorCode::PayloadTooLarge, "login body too large"),
        )
        .into_response();
    }
    let Some(token) = config.api_token.as_ref() else {
        return ApiError::bad_request(
            "this harness has no API token: the console needs no login (loopback only)",
        )
        .into_response();
    };
    let b: LoginBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return ApiError::bad_request(format!("body: {e}")).into_response(),
    };
    if !super::same_secret(&b.token, token.expose()) {
        // Counted per source and logged in aggregate by the auth layer.
        tracing::debug!("console login refused: wrong token");
        return ApiError::unauthorized().into_response();
    }
    let (id, csrf) = (auth::mint(), auth::mint());
    app.console
        .table()
        .insert(id.clone(), csrf.clone(), Instant::now());
    tracing::info!("console login");
    let cookie = auth::set_cookie(&id, auth::SESSION_TTL, secure(config));
    let mut r = Json(serde_json::json!({
        "csrf": csrf,
        "expiresInSecs": auth::SESSION_TTL.as_secs(),
    }))
    .into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn session_id(headers: &HeaderMap) -> Option<&str> {
    auth::cookie_value(
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok()),
    )
}

/// `POST /console/logout`: ends the cookie's session and clears it.
pub(crate) async fn logout(State(app): State<App>, headers: HeaderMap) -> Response {
    if let Some(r) = foreign(&app, &headers) {
        return r;
    }
    if let Some(id) = session_id(&headers) {
        app.console.table().remove(id);
    }
    let mut r = Json(serde_json::json!({"loggedOut": true})).into_response();
    if let Ok(v) = HeaderValue::from_str(&auth::clear_cookie(secure(&app.shared.config))) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

/// `GET /console/session`: what the page needs to start: whether a login
/// is needed, whether the harness is loopback-only, and, for a live
/// cookie, its CSRF token (readable by this origin's pages only: no CORS).
pub(crate) async fn session(State(app): State<App>, headers: HeaderMap) -> Response {
    let config = &app.shared.config;
    if !served(config) {
        return not_served();
    }
    if let Some(r) = foreign(&app, &headers) {
        return r;
    }
    let now = Instant::now();
    let token_required = config.api_token.is_some();
    let mut v = serde_json::json!({
        "tokenRequired": token_required,
        "loopbackOnly": !token_required,
        "authenticated": !token_required,
    });
    if token_required {
        if let Some(id) = session_id(&headers) {
            let mut table = app.console.table();
            if let Some(csrf) = table.csrf(id, now).map(str::to_owned) {
                v["authenticated"] = true.into();
                v["csrf"] = csrf.into();
                if let Some(left) = table.remaining(id, now) {
                    v["expiresInSecs"] = left.as_secs().into();
                }
            }
        }
    }
    let mut r = Json(v).into_response();
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}
