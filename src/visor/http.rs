//! The visor's HTTP/1.1 API on its Unix socket (VISOR.md §1–3): parse,
//! check sizes, route to the session actors or the sessions owner, answer
//! with the error envelope. No session state lives here.

use super::events::{Cursor, Filter};
use super::session::{AnswerSpec, SessionMsg, Writer};
use super::sessions::SessionsMsg;
use super::state::State as SessionState;
use super::types::{Hello, Info, Kind, StartSpec, PROTOCOL};
use super::{Visor, VisorError};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use futures_util::{SinkExt, StreamExt};
use http::{header, StatusCode};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_tungstenite::tungstenite::protocol::{frame::coding::CloseCode, CloseFrame, Role};
use tokio_tungstenite::tungstenite::Message;

/// Largest request body.
pub const MAX_BODY: usize = 1 << 20;
/// Largest `keys` payload (decoded).
pub const MAX_KEYS: usize = 64 << 10;
/// Largest `paste` / `send` text.
pub const MAX_TEXT: usize = 256 << 10;
/// A client that does not take a frame within this is closed (1008).
pub const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a call into a session actor may take.
const CALL_MS: u64 = 20_000;

/// The visor's Unix listener, answering only peers of the visor's own
/// user (issue 56, item 6), like the executor's confirmation socket
/// (`executor::confirm`): the socket file is 0600 in a 0700 directory,
/// which keeps other users out, but not root, and root's answers would
/// otherwise be taken (a confirmation the executor's own socket refuses
/// to root). Every accepted connection's `SO_PEERCRED` uid must equal the
/// visor's effective uid; another peer gets one 403 (`forbidden`) and the
/// connection is closed before a request is read.
pub struct OwnUserOnly {
    listener: tokio::net::UnixListener,
    uid: u32,
}

impl OwnUserOnly {
    pub fn new(listener: tokio::net::UnixListener) -> OwnUserOnly {
        OwnUserOnly {
            listener,
            uid: nix::unistd::geteuid().as_raw(),
        }
    }
}

/// What a refused peer reads.
const FORBIDDEN_BODY: &str =
    r#"{"error":{"code":"forbidden","message":"only the visor's own user may use this socket"}}"#;

impl axum::serve::Listener for OwnUserOnly {
    type Io = tokio::net::UnixStream;
    type Addr = tokio::net::unix::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = match self.listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and the like: back off rather than spin.
                    tracing::warn!(error = %e, "visor: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let peer = stream.peer_cred().map(|c| c.uid());
            if peer.as_ref().ok() == Some(&self.uid) {
                return (stream, addr);
            }
            tracing::warn!(?peer, "visor socket: a peer of another user was refused");
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut stream = stream;
                let answer = format!(
                    "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\n\
                     connection: close\r\ncontent-length: {}\r\n\r\n{FORBIDDEN_BODY}",
                    FORBIDDEN_BODY.len()
                );
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    stream.write_all(answer.as_bytes()),
                )
                .await;
                let _ = stream.shutdown().await;
            });
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

type Visor_ = State<Arc<Visor>>;
type ApiResult = Result<Response, VisorError>;

/// Set to `1` in the daemon's environment to offer the test hooks (a
/// route that makes a session actor panic); never on by default.
pub const TEST_HOOKS_ENV: &str = "BMX_VISOR_TEST_HOOKS";

pub fn router(visor: Arc<Visor>) -> Router {
    let hooks = std::env::var(TEST_HOOKS_ENV).is_ok_and(|v| v == "1");
    let r = Router::new();
    let r = if hooks {
        r.route("/v1/sessions/{id}/debug/panic", post(panic_hook))
    } else {
        r
    };
    r.route("/v1/hello", post(hello))
        .route("/v1/info", get(info))
        .route("/v1/sessions", get(list).post(start))
        .route("/v1/sessions/{id}", get(get_one))
        .route("/v1/sessions/{id}/screen", get(screen))
        .route("/v1/sessions/{id}/output", get(output))
        .route("/v1/sessions/{id}/keys", post(keys))
        .route("/v1/sessions/{id}/paste", post(paste))
        .route("/v1/sessions/{id}/send", post(send))
        .route("/v1/sessions/{id}/resize", post(resize))
        .route("/v1/sessions/{id}/interrupt", post(interrupt))
        .route("/v1/sessions/{id}/answer", post(answer))
        .route("/v1/sessions/{id}/stop", post(stop))
        .route("/v1/sessions/{id}/attach", get(super::attach::attach))
        .route("/v1/purge", post(purge))
        .route("/v1/events", get(events))
        .route("/v1/agents", get(agents))
        .route("/v1/agents/{name}", get(agent))
        .route("/v1/agents/{name}/{*rest}", any(not_offered))
        .route("/v1/workdirs", get(workdirs).post(workdir_create))
        .route("/v1/workdirs/{id}", get(workdir).delete(workdir_delete))
        .route("/v1/workdirs/{id}/archive", post(workdir_archive))
        .route("/v1/workdirs/{id}/restore", post(workdir_restore))
        .route("/v1/projects", get(projects))
        .route("/v1/projects/{id}", axum::routing::delete(project_forget))
        .route("/v1/hook", post(hook))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .with_state(visor)
}

/// Test hook: make the session's current run panic in its handler.
async fn panic_hook(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    let actor = v
        .session(&id)?
        .actor()
        .ok_or_else(|| VisorError::State("the session is not running".into()))?;
    let _ = actor.send_message(SessionMsg::Panic);
    Ok(Json(json!({"accepted": true})).into_response())
}

async fn not_found() -> VisorError {
    VisorError::NotFound("no such route".into())
}

async fn not_allowed() -> VisorError {
    VisorError::Invalid("method not allowed on this route".into())
}

/// Parts of VISOR.md this visor does not build yet: said so, never faked.
async fn not_offered(req: Request) -> VisorError {
    VisorError::Unsupported(format!(
        "{} is not offered by this visor yet",
        req.uri().path()
    ))
}

/// Read and parse a JSON body (empty = `{}`), bounded before parsing.
pub async fn json_body<T: DeserializeOwned>(req: Request) -> Result<T, VisorError> {
    let bytes = axum::body::to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|_| VisorError::Invalid(format!("body larger than {MAX_BODY} bytes")))?;
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &bytes
    };
    serde_json::from_slice(text).map_err(|e| VisorError::Invalid(format!("body: {e}")))
}

fn percent_decode(s: &str) -> Result<String, VisorError> {
    let bad = || VisorError::Invalid("query: bad percent-encoding".into());
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = b.get(i + 1..i + 3).ok_or_else(bad)?;
                let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// The query string as `name → values` (repeated names and comma lists
/// both add values).
pub fn query(uri: &http::Uri) -> Result<BTreeMap<String, Vec<String>>, VisorError> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let Some(q) = uri.query() else {
        return Ok(out);
    };
    if q.len() > 8192 {
        return Err(VisorError::Invalid("query longer than 8192 bytes".into()));
    }
    for pair in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (k, v) = (percent_decode(k)?, percent_decode(v)?);
        let values = out.entry(k.clone()).or_default();
        if k == "label" {
            values.push(v);
        } else {
            values.extend(v.split(',').filter(|s| !s.is_empty()).map(str::to_owned));
        }
    }
    Ok(out)
}

pub fn query_u64(q: &BTreeMap<String, Vec<String>>, name: &str) -> Result<Option<u64>, VisorError> {
    match q.get(name).and_then(|v| v.first()) {
        None => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| VisorError::Invalid(format!("{name} must be a non-negative integer"))),
    }
}

fn labels(q: &BTreeMap<String, Vec<String>>) -> Result<Vec<(String, String)>, VisorError> {
    q.get("label")
        .into_iter()
        .flatten()
        .map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| VisorError::Invalid("label must be k=v".into()))
        })
        .collect()
}

fn info_of(v: &Visor, client: Option<String>) -> Info {
    Info {
        protocol: PROTOCOL,
        build: v.build.clone(),
        client,
        home: v.home.display().to_string(),
        pid: std::process::id(),
        seq: v.hub.latest(),
    }
}

async fn hello(State(v): Visor_, req: Request) -> ApiResult {
    let h: Hello = json_body(req).await?;
    if h.protocol != PROTOCOL {
        return Err(VisorError::Protocol(format!(
            "this visor speaks {PROTOCOL}, not {:?}",
            h.protocol
        )));
    }
    Ok(Json(info_of(&v, Some(h.client))).into_response())
}

async fn info(State(v): Visor_) -> Json<Info> {
    Json(info_of(&v, None))
}

async fn list(State(v): Visor_, req: Request) -> ApiResult {
    let q = query(req.uri())?;
    let states: Vec<SessionState> = q
        .get("state")
        .into_iter()
        .flatten()
        .map(|s| {
            SessionState::parse(s)
                .ok_or_else(|| VisorError::Invalid(format!("unknown state {s:?}")))
        })
        .collect::<Result<_, _>>()?;
    let want = |name: &str, value: Option<&str>| {
        q.get(name)
            .is_none_or(|l| l.is_empty() || value.is_some_and(|v| l.iter().any(|x| x == v)))
    };
    let labels = labels(&q)?;
    let mut out: Vec<_> = v
        .sessions
        .iter()
        .map(|d| d.view())
        .filter(|s| {
            (states.is_empty() || states.contains(&s.state))
                && want("kind", Some(s.kind.as_str()))
                && want("role", Some(&s.role))
                && want("agent", s.agent.as_deref())
                && want("workdir", s.workdir.as_deref())
                && labels.iter().all(|(k, val)| s.labels.get(k) == Some(val))
        })
        .collect();
    out.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
    Ok(Json(json!({"sessions": out})).into_response())
}

async fn start(State(v): Visor_, req: Request) -> ApiResult {
    let mut spec: StartSpec = json_body(req).await?;
    // A session in a workdir: the registry stays locked until the session
    // has started, so the workdir cannot be archived or removed under it.
    let _workdirs = match spec.workdir.clone() {
        Some(id) => {
            let reg = v.workdirs.lock().await;
            spec.working_dir = Some(reg.session_dir(&id, spec.working_dir.as_deref())?);
            Some(reg)
        }
        None => None,
    };
    let recipe = match &spec.agent {
        Some(name) => Some(super::agents::recipe(&v.home, name)?),
        None => None,
    };
    let checked = spec.check(recipe.as_ref())?;
    if v.is_closing() {
        return Err(VisorError::Closed("the visor is shutting down".into()));
    }
    let owner = v
        .owner()
        .ok_or_else(|| VisorError::Closed("the sessions owner is restarting".into()))?;
    let view = ractor::call_t!(owner, SessionsMsg::Start, CALL_MS, Box::new(checked))
        .map_err(|_| VisorError::Closed("the sessions owner is gone".into()))??;
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

async fn get_one(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    Ok(Json(v.session(&id)?.view()).into_response())
}

/// `GET …/screen`: the screen model of a PTY session; the conversation
/// of a wire session (`view=chat`, the default for it).
async fn screen(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let d = v.session(&id)?;
    let q = query(req.uri())?;
    let after = query_u64(&q, "after")?.unwrap_or(0);
    let view = q.get("view").and_then(|l| l.first()).map(String::as_str);
    match (d.checked.spec.kind, view) {
        (Kind::Pty, None | Some("terminal")) => Ok(Json(d.screen_view()).into_response()),
        (Kind::Wire, None | Some("chat")) => Ok(Json(chat_view(&d, after)).into_response()),
        (_, Some(other @ ("terminal" | "chat"))) => Err(VisorError::State(format!(
            "a {} session has no {other} view",
            d.checked.spec.kind.as_str()
        ))),
        (_, Some(other)) => Err(VisorError::Invalid(format!("unknown view {other:?}"))),
        (_, None) => Err(VisorError::State(format!(
            "a {} session has no screen",
            d.checked.spec.kind.as_str()
        ))),
    }
}

/// The chat view: turns after `after` (bounded by the conversation's own
/// bounds), the open requests, the held count.
pub fn chat_view(d: &super::session::SessionData, after: u64) -> Value {
    let c = d.chat();
    json!({"view": "chat", "turns": c.turns_after(after), "pending": c.pending_views(),
        "held": c.held(), "seq": c.last_seq(), "state": d.state()})
}

/// `GET /v1/agents`.
async fn agents(State(v): Visor_) -> ApiResult {
    let all = super::agents::load(&v.home)?;
    let reports =
        futures_util::future::join_all(all.iter().map(|(n, r)| super::agents::report(n, r))).await;
    Ok(Json(json!({"agents": reports})).into_response())
}

/// `GET /v1/agents/{name}`.
async fn agent(State(v): Visor_, Path(name): Path<String>) -> ApiResult {
    let all = super::agents::load(&v.home)?;
    let r = all
        .get(&name)
        .ok_or_else(|| VisorError::NotFound(format!("no agent {name:?}")))?;
    Ok(Json(super::agents::report(&name, r).await).into_response())
}

/// `GET /v1/workdirs`.
async fn workdirs(State(v): Visor_) -> ApiResult {
    let list = v.workdirs.lock().await.registry().workdirs().to_vec();
    Ok(Json(json!({ "workdirs": list })).into_response())
}

/// `GET /v1/workdirs/{id}`.
async fn workdir(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    let w = v.workdirs.lock().await.registry().get(&id).cloned();
    let w = w.ok_or_else(|| VisorError::NotFound(format!("no workdir {id:?}")))?;
    Ok(Json(w).into_response())
}

/// `POST /v1/workdirs`: 201 when made, 200 when it existed.
async fn workdir_create(State(v): Visor_, req: Request) -> ApiResult {
    let spec: super::workdirs::CreateSpec = json_body(req).await?;
    let (w, made) = v.workdirs.lock().await.create(spec).await?;
    let status = if made {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(w)).into_response())
}

/// `?force=` (`true`/`1`; anything else but `false`/`0`/empty is 400).
fn force(req: &Request) -> Result<bool, VisorError> {
    let q = query(req.uri())?;
    match q.get("force").and_then(|l| l.first()).map(String::as_str) {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(other) => Err(VisorError::Invalid(format!(
            "force is true or false, not {other:?}"
        ))),
    }
}

/// The live sessions using workdir `id` (none for an unknown id).
fn users_of(v: &Visor, reg: &super::workdirs::Workdirs, id: &str) -> Vec<String> {
    reg.registry()
        .get(id)
        .map(|w| super::workdirs::users(v, w))
        .unwrap_or_default()
}

/// `POST /v1/workdirs/{id}/archive[?force=true]`.
async fn workdir_archive(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let force = force(&req)?;
    let mut reg = v.workdirs.lock().await;
    let users = users_of(&v, &reg, &id);
    let w = reg.archive(&id, &users, force).await?;
    Ok(Json(w).into_response())
}

/// `POST /v1/workdirs/{id}/restore`.
async fn workdir_restore(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    let w = v.workdirs.lock().await.restore(&id).await?;
    Ok(Json(w).into_response())
}

/// `DELETE /v1/workdirs/{id}[?force=true]`.
async fn workdir_delete(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let force = force(&req)?;
    let mut reg = v.workdirs.lock().await;
    let users = users_of(&v, &reg, &id);
    let w = reg.remove(&id, &users, force).await?;
    Ok(Json(json!({"removed": w})).into_response())
}

/// `GET /v1/projects`.
async fn projects(State(v): Visor_) -> ApiResult {
    Ok(Json(v.workdirs.lock().await.projects_view()).into_response())
}

/// `DELETE /v1/projects/{id}`: forget it (files untouched).
async fn project_forget(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    let mut reg = v.workdirs.lock().await;
    let out = reg.forget(&id, |w| super::workdirs::users(&v, w))?;
    Ok(Json(out).into_response())
}

/// `POST /v1/hook`: one hook call of an agent started outside the visor.
async fn hook(State(v): Visor_, req: Request) -> ApiResult {
    let call: super::hooks::HookCall = json_body(req).await?;
    let view = super::hooks::intake(&v, call, false).await?;
    Ok(Json(view).into_response())
}

/// Terminal output as plain text: escape sequences removed, `\r\n` → `\n`,
/// other control characters but tab dropped.
pub fn plain_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len());
    let mut it = text.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '\x1b' => match it.next() {
                Some('[') => {
                    // CSI: parameters and intermediates, then a final byte.
                    for c in it.by_ref() {
                        if ('\x40'..='\x7e').contains(&c) {
                            break;
                        }
                    }
                }
                Some(']') | Some('P') | Some('_') | Some('^') => {
                    // OSC/DCS/...: up to BEL or ST.
                    while let Some(c) = it.next() {
                        if c == '\x07' || (c == '\x1b' && it.peek() == Some(&'\\')) {
                            if c == '\x1b' {
                                it.next();
                            }
                            break;
                        }
                    }
                }
                Some('(') | Some(')') | Some('#') => {
                    it.next();
                }
                _ => {}
            },
            '\r' if it.peek() == Some(&'\n') => {}
            '\n' | '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

async fn output(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    let d = v.session(&id)?;
    let (seq, bytes) = d.output.with(|sb| {
        let r = sb.replay(0);
        let mut all = Vec::with_capacity(sb.bytes());
        for (_, c) in &r.chunks {
            all.extend_from_slice(c);
        }
        (sb.latest_seq(), all)
    });
    Ok(Json(json!({"text": plain_text(&bytes), "seq": seq})).into_response())
}

/// Observed sessions (hooks) have no process to write to or stop.
fn no_process(d: &super::session::SessionData) -> Result<(), VisorError> {
    if d.checked.spec.kind == Kind::Observed {
        return Err(VisorError::State(
            "an observed session has no process: the visor only hears its hooks".into(),
        ));
    }
    Ok(())
}

/// Send a write-type message to the session's current run.
async fn to_run(
    v: &Visor,
    id: &str,
    f: impl FnOnce(ractor::RpcReplyPort<Result<(), VisorError>>) -> SessionMsg,
) -> Result<(), VisorError> {
    ask_run(v, id, f).await
}

/// Ask the session's current run; its answer.
async fn ask_run<T: Send + 'static>(
    v: &Visor,
    id: &str,
    f: impl FnOnce(ractor::RpcReplyPort<Result<T, VisorError>>) -> SessionMsg,
) -> Result<T, VisorError> {
    let d = v.session(id)?;
    no_process(&d)?;
    if !d.state().live() {
        return Err(VisorError::State("the session has exited".into()));
    }
    let actor = d
        .actor()
        .ok_or_else(|| VisorError::State("the session is restarting".into()))?;
    match actor.call(f, Some(Duration::from_millis(CALL_MS))).await {
        Ok(ractor::rpc::CallResult::Success(r)) => r,
        _ => Err(VisorError::State("the session's program has ended".into())),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Keys {
    data: String,
}

async fn keys(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let k: Keys = json_body(req).await?;
    if k.data.len() > MAX_KEYS / 3 * 4 + 4 {
        return Err(VisorError::Invalid(format!(
            "keys are limited to {MAX_KEYS} bytes"
        )));
    }
    let bytes = base64_simd::STANDARD
        .decode_to_vec(k.data.as_bytes())
        .map_err(|_| VisorError::Invalid("data is not base64".into()))?;
    if bytes.len() > MAX_KEYS {
        return Err(VisorError::Invalid(format!(
            "keys are limited to {MAX_KEYS} bytes"
        )));
    }
    to_run(&v, &id, |r| {
        SessionMsg::Write(Bytes::from(bytes), Writer::Api, Some(r))
    })
    .await?;
    Ok(Json(json!({"accepted": true})).into_response())
}

#[derive(Deserialize)]
struct Text {
    text: String,
    #[serde(default)]
    #[allow(dead_code)]
    attachments: Option<Value>,
}

fn check_text(t: &Text) -> Result<(), VisorError> {
    if t.text.len() > MAX_TEXT {
        return Err(VisorError::Invalid(format!(
            "text is limited to {MAX_TEXT} bytes"
        )));
    }
    Ok(())
}

async fn paste(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let t: Text = json_body(req).await?;
    check_text(&t)?;
    to_run(&v, &id, |r| SessionMsg::Paste(t.text, Writer::Api, r)).await?;
    Ok(Json(json!({"accepted": true})).into_response())
}

/// `send`: to a PTY session, the text and Enter (`prompted`); to a wire
/// session, a prompt now (`prompted`) or at the next idle (`held`).
async fn send(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let t: Text = json_body(req).await?;
    check_text(&t)?;
    let delivery = ask_run(&v, &id, |r| SessionMsg::Send(t.text, Writer::Api, r)).await?;
    Ok(Json(json!({"delivery": delivery})).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Size {
    pub cols: u16,
    pub rows: u16,
}

pub fn check_size(s: &Size) -> Result<(), VisorError> {
    let max = super::types::MAX_DIM;
    if !(1..=max).contains(&s.cols) || !(1..=max).contains(&s.rows) {
        return Err(VisorError::Invalid(format!("cols and rows are 1..={max}")));
    }
    Ok(())
}

async fn resize(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let s: Size = json_body(req).await?;
    check_size(&s)?;
    to_run(&v, &id, |r| {
        SessionMsg::Resize(s.cols, s.rows, Writer::Api, r)
    })
    .await?;
    Ok(Json(json!({"cols": s.cols, "rows": s.rows})).into_response())
}

async fn interrupt(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    to_run(&v, &id, |r| SessionMsg::Interrupt(Writer::Api, r)).await?;
    Ok(Json(json!({"accepted": true})).into_response())
}

/// `answer` a pending request (a wire agent's permission request; PTY
/// sessions have none: 404).
async fn answer(State(v): Visor_, Path(id): Path<String>, req: Request) -> ApiResult {
    let d = v.session(&id)?;
    if let Some(bridge) = v.confirm_bridges.get(&id).map(|b| b.clone()) {
        // An executor's held tool call (`visor::confirm`).
        let a: AnswerSpec = json_body(req).await?;
        let request = a.request_id.clone();
        super::confirm::ask(&bridge, a).await?;
        return Ok(Json(json!({"requestId": request, "answered": true})).into_response());
    }
    no_process(&d)?;
    let a: AnswerSpec = json_body(req).await?;
    if a.message.as_ref().is_some_and(|m| m.len() > MAX_TEXT) {
        return Err(VisorError::Invalid(format!(
            "message is limited to {MAX_TEXT} bytes"
        )));
    }
    if d.actor().is_none() {
        // Between runs, or exited: nothing is pending any more.
        let closed = !d.state().live();
        return Err(match closed {
            true => VisorError::State("the session has exited".into()),
            false => VisorError::NotFound(format!("no pending request {:?}", a.request_id)),
        });
    }
    let request = a.request_id.clone();
    to_run(&v, &id, |r| SessionMsg::Answer(a, r)).await?;
    Ok(Json(json!({"requestId": request, "answered": true})).into_response())
}

async fn stop(State(v): Visor_, Path(id): Path<String>) -> ApiResult {
    let d = v.session(&id)?;
    no_process(&d)?;
    if !d.state().live() {
        return Err(VisorError::State("the session has exited".into()));
    }
    let stopped = match d.actor() {
        Some(actor) => match actor
            .call(SessionMsg::Stop, Some(Duration::from_millis(CALL_MS)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => Some(r),
            _ => None,
        },
        None => None,
    };
    match stopped {
        Some(r) => r?,
        // No run to ask (between restarts, or it just ended): the owner.
        None if d.state().live() => {
            let owner = v
                .owner()
                .ok_or_else(|| VisorError::Closed("the sessions owner is restarting".into()))?;
            ractor::call_t!(owner, SessionsMsg::StopIdle, CALL_MS, id.clone())
                .map_err(|_| VisorError::Closed("the sessions owner is gone".into()))??;
        }
        None => {}
    }
    Ok(Json(d.view()).into_response())
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Purge {
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    agent: Option<String>,
    #[serde(default)]
    vendor_id: Option<String>,
}

async fn purge(State(v): Visor_, req: Request) -> ApiResult {
    let p: Purge = json_body(req).await?;
    if let Some(id) = &p.session {
        let d = v.session(id)?;
        if d.state().live() {
            return Err(VisorError::State(format!(
                "session {id} is live; stop it first"
            )));
        }
    }
    let matched: Vec<_> = v
        .sessions
        .iter()
        .filter(|d| p.session.as_ref().is_none_or(|s| s == &d.id))
        .filter(|d| p.agent.is_none() || d.checked.spec.agent == p.agent)
        .filter(|d| p.vendor_id.is_none() || d.chat().vendor_id == p.vendor_id)
        .map(|d| d.clone())
        .collect();
    let mut purged = Vec::new();
    for d in matched {
        if d.state().live() {
            continue;
        }
        v.sessions.remove(&d.id);
        v.hub.purge(&d.id);
        purged.push(d.id.clone());
    }
    purged.sort();
    Ok(Json(json!({"purged": purged})).into_response())
}

/// Check a WebSocket upgrade request and answer 101; `run` gets the socket.
pub fn upgrade<F, Fut>(req: Request, run: F) -> Response
where
    F: FnOnce(WsStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let headers = req.headers();
    let Some(accept) = crate::wire::transport::ws_accept(headers) else {
        return VisorError::Invalid("expected a WebSocket upgrade".into()).into_response();
    };
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let io = hyper_util::rt::TokioIo::new(upgraded);
                let config = crate::wire::transport::ws_config(MAX_BODY);
                let ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
                    io,
                    Role::Server,
                    Some(config),
                )
                .await;
                run(ws).await;
            }
            Err(e) => tracing::debug!(error = %e, "visor upgrade failed"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept)
        .body(Body::empty())
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

pub type WsStream =
    tokio_tungstenite::WebSocketStream<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>;

pub fn close(code: CloseCode, reason: &str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.to_owned().into(),
    }))
}

/// `GET /v1/events`: replay from `after`, then live.
async fn events(State(v): Visor_, req: Request) -> ApiResult {
    let q = query(req.uri())?;
    let after = query_u64(&q, "after")?.unwrap_or(0);
    let list = |n: &str| q.get(n).cloned().unwrap_or_default();
    for s in list("state") {
        if SessionState::parse(&s).is_none() {
            return Err(VisorError::Invalid(format!("unknown state {s:?}")));
        }
    }
    let filter = Filter {
        sessions: list("session"),
        kinds: list("kind"),
        states: list("state"),
        agents: list("agent"),
        labels: labels(&q)?,
        types: list("types"),
    };
    let visor = v.clone();
    Ok(upgrade(req, move |ws| {
        stream_events(visor, ws, filter, after)
    }))
}

async fn stream_events(v: Arc<Visor>, ws: WsStream, filter: Filter, after: u64) {
    let (mut sink, mut stream) = ws.split();
    let mut cursor = Cursor::new(v.hub.clone(), filter, after);
    loop {
        tokio::select! {
            frame = cursor.next() => {
                let Some(frame) = frame else { break };
                match tokio::time::timeout(SEND_TIMEOUT, sink.send(Message::Text(frame.into()))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return,
                    Err(_) => {
                        tracing::info!("event subscriber too slow; closing");
                        let _ = tokio::time::timeout(Duration::from_secs(1), sink.send(close(CloseCode::Policy, "too slow"))).await;
                        return;
                    }
                }
            }
            msg = stream.next() => match msg {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
            _ = v.shutdown.cancelled() => {
                let _ = tokio::time::timeout(Duration::from_secs(1), sink.send(close(CloseCode::Away, "closed"))).await;
                return;
            }
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_drops_escapes() {
        let t = plain_text(b"\x1b[1;31mred\x1b[0m\r\nnext\x1b]0;title\x07 line\x1b[?2004h\r\n");
        assert_eq!(t, "red\nnext line\n");
    }

    #[test]
    fn query_lists_and_labels() {
        let uri: http::Uri = "/v1/events?after=3&types=a,b&label=k%3Dv&label=x=y&session=s1"
            .parse()
            .unwrap();
        let q = query(&uri).unwrap();
        assert_eq!(q["types"], vec!["a", "b"]);
        assert_eq!(
            labels(&q).unwrap(),
            vec![("k".into(), "v".into()), ("x".into(), "y".into())]
        );
        assert_eq!(query_u64(&q, "after").unwrap(), Some(3));
        let bad: http::Uri = "/x?after=-1".parse().unwrap();
        assert!(query_u64(&query(&bad).unwrap(), "after").is_err());
    }
}
