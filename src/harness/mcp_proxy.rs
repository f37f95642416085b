//! The rules of one MCP channel on the harness side, as a sans-IO state
//! machine: one [`McpProxy`] per (session, serverKey), driven by the
//! channel actor ([`crate::harness::actors::mcp`]) with the harness clock.
//!
//! Many MCP clients (HTTP client sessions, each with its own
//! `Mcp-Session-Id`) share one server through one `mcp.frame` channel. The
//! executor forwards request ids unchanged and uses ids starting with
//! `bmx:` for its own requests, so ids must be made unique here: every
//! client request gets a harness id `h:<n>` (never reused within a proxy)
//! and its progress token, when it has one, is rewritten to the same id.
//! The answer is mapped back to the client's original id, with its JSON
//! type kept (a number stays a number).
//!
//! The invariant the actor relies on (and the property test checks):
//! **every client request that enters gets exactly one answer** — the
//! server's response, or an error made here when the request times out,
//! its client session ends, or the channel is lost ([`McpProxy::fail_all`]).
//! Nothing in flight is forgotten.
//!
//! Requests carry a reply port of a generic type `P` (the actor's channel
//! ends; plain numbers in tests). Every call returns what the caller must
//! do ([`Out`]); the proxy reads no clock and does no I/O.

use crate::mcp::raw::{write_object, Members, RawObject};
use crate::wire::{ErrorCode, RpcError};
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::collections::HashMap;

/// The prefix of the ids the harness puts on requests it forwards.
pub const HARNESS_ID_PREFIX: &str = "h:";

/// Longest client request id accepted (a string id; numbers are short).
pub const MAX_ID_CHARS: usize = 1024;

/// Longest method name accepted.
pub const MAX_METHOD_CHARS: usize = 256;

/// Bounds of one proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyLimits {
    /// Client sessions (`Mcp-Session-Id`s) at once.
    pub max_clients: usize,
    /// Requests in flight at once (clients' and the harness's own).
    pub max_in_flight: usize,
    /// A client session with nothing in flight and no open stream is
    /// forgotten after this much silence (ms).
    pub client_idle_ms: u64,
    /// A request unanswered this long (ms) is answered with a timeout error.
    pub request_timeout_ms: u64,
}

impl Default for ProxyLimits {
    fn default() -> Self {
        ProxyLimits {
            max_clients: 64,
            max_in_flight: 256,
            client_idle_ms: 600_000,
            request_timeout_ms: 60_000,
        }
    }
}

/// One JSON-RPC message from an MCP client, classified.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientMessage {
    /// Has a method and an id: gets exactly one answer.
    Request {
        id: Value,
        method: String,
        body: RawObject,
    },
    /// Has a method and no id.
    Notification { method: String, body: RawObject },
    /// A response (to a server → client request; the executor answers
    /// those itself, so the harness drops these).
    Response { id: Value },
}

impl ClientMessage {
    pub fn method(&self) -> Option<&str> {
        match self {
            ClientMessage::Request { method, .. } | ClientMessage::Notification { method, .. } => {
                Some(method)
            }
            ClientMessage::Response { .. } => None,
        }
    }
}

/// Why a client's POST body is not one JSON-RPC message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientParseError {
    #[error("the body is not JSON: {0}")]
    Parse(String),
    #[error("batches are not supported: send one JSON-RPC message per POST")]
    Batch,
    /// Not a JSON-RPC 2.0 message; `id` is the message's id when it has a
    /// usable one (the error response carries it), else `null`.
    #[error("not a JSON-RPC 2.0 message: {detail}")]
    Invalid { id: Value, detail: String },
}

impl ClientParseError {
    /// The JSON-RPC error of this failure.
    pub fn rpc(&self) -> RpcError {
        match self {
            ClientParseError::Parse(d) => RpcError::parse_error(d.clone()),
            ClientParseError::Batch => {
                RpcError::invalid_request("batch_not_supported", self.to_string())
            }
            ClientParseError::Invalid { detail, .. } => {
                RpcError::invalid_request("invalid_message", detail.clone())
            }
        }
    }

    /// The id an error response should carry.
    pub fn id(&self) -> Value {
        match self {
            ClientParseError::Invalid { id, .. } => id.clone(),
            _ => Value::Null,
        }
    }
}

fn valid_id(id: &Value) -> bool {
    match id {
        Value::String(s) => s.chars().count() <= MAX_ID_CHARS,
        Value::Number(n) => n.is_i64() || n.is_u64(),
        _ => false,
    }
}

/// Classify one client message (the body of a POST).
///
/// # Errors
///
/// [`ClientParseError`] when the bytes are not JSON (-32700), are a batch
/// array, or are not a JSON-RPC 2.0 request, notification or response
/// (-32600). MCP ids must be strings or integers.
pub fn parse_client(bytes: &[u8]) -> Result<ClientMessage, ClientParseError> {
    let parse = |e: &dyn std::fmt::Display| ClientParseError::Parse(e.to_string());
    let text = std::str::from_utf8(bytes).map_err(|e| parse(&e))?;
    let first = text
        .trim_start_matches([' ', '\t', '\n', '\r'])
        .as_bytes()
        .first()
        .copied();
    if first != Some(b'{') {
        // Not an object: malformed, a batch, or another JSON value.
        serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| parse(&e))?;
        if first == Some(b'[') {
            return Err(ClientParseError::Batch);
        }
        return Err(ClientParseError::Invalid {
            id: Value::Null,
            detail: "a message is a JSON object".into(),
        });
    }
    let body = RawObject::parse(text.to_owned()).map_err(|e| parse(&e))?;
    // A member's text is JSON already checked: reading it cannot fail.
    let id = body
        .get("id")
        .map(|t| serde_json::from_str::<Value>(t).unwrap_or(Value::Null));
    let usable_id = id.clone().filter(valid_id).unwrap_or(Value::Null);
    let invalid = |detail: &str| ClientParseError::Invalid {
        id: usable_id.clone(),
        detail: detail.to_owned(),
    };
    if str_member(&body, "jsonrpc").as_deref() != Some("2.0") {
        return Err(invalid("\"jsonrpc\" must be \"2.0\""));
    }
    // A JSON-RPC error is an object; refused here whatever else the
    // message holds, so nothing downstream sees `"error": false`.
    if body.get("error").is_some_and(|e| !e.starts_with('{')) {
        return Err(invalid("error must be an object"));
    }
    match body.get("method") {
        Some(_) => {
            let Some(method) = str_member(&body, "method") else {
                return Err(invalid("the method must be a string"));
            };
            if method.is_empty() || method.chars().count() > MAX_METHOD_CHARS {
                return Err(invalid("the method must be 1 to 256 characters"));
            }
            if body
                .get("params")
                .is_some_and(|p| !p.starts_with('{') && !p.starts_with('['))
            {
                return Err(invalid("params must be an object or an array"));
            }
            let method = method.into_owned();
            match id {
                None => Ok(ClientMessage::Notification { method, body }),
                Some(id) if valid_id(&id) => Ok(ClientMessage::Request { id, method, body }),
                Some(_) => Err(invalid(
                    "an id is a string (at most 1024 characters) or an integer",
                )),
            }
        }
        None => {
            let answered = body.contains_key("result") || body.contains_key("error");
            match id {
                Some(id) if answered && valid_id(&id) => Ok(ClientMessage::Response { id }),
                _ => Err(invalid(
                    "a message has a method (request, notification) or an id and a result or error (response)",
                )),
            }
        }
    }
}

/// Member `key` when it is a JSON string: borrowed when it has no escapes.
fn str_member<'a>(body: &'a RawObject, key: &str) -> Option<Cow<'a, str>> {
    str_text(body.get(key)?)
}

/// The string a JSON text holds, when it is a string.
fn str_text(t: &str) -> Option<Cow<'_, str>> {
    let inner = t.strip_prefix('"')?.strip_suffix('"')?;
    if inner.contains('\\') {
        serde_json::from_str::<String>(t).ok().map(Cow::Owned)
    } else {
        Some(Cow::Borrowed(inner))
    }
}

/// The `params._meta.progressToken` of a request (any JSON value), when
/// it asked for progress.
pub fn progress_token(body: &RawObject) -> Option<Value> {
    let params = body.get("params")?;
    // Only params that spell the name out, or hold a `\u` escape (the one
    // way to escape a letter of it), can hold it: the rest are not parsed,
    // however many other escapes (`\n` in a file's text) they have.
    if !params.contains("progressToken") && !params.contains("\\u") {
        return None;
    }
    let params: Value = serde_json::from_str(params).ok()?;
    params.get("_meta")?.get("progressToken").cloned()
}

/// A JSON-RPC error response as a string.
pub fn error_response(id: &Value, error: &RpcError) -> String {
    let v = serde_json::json!({"jsonrpc": "2.0", "id": id, "error": error});
    v.to_string()
}

/// The error an MCP client gets for a request that timed out (-32001, as
/// the MCP SDKs' `RequestTimeout`; `data.reason: "timeout"`).
pub fn timeout_error(timeout_ms: u64) -> RpcError {
    RpcError {
        code: -32001,
        message: "request timed out".into(),
        data: None,
    }
    .with_reason("timeout")
    .with_detail(format!(
        "no answer from the MCP server within {timeout_ms} ms"
    ))
}

/// The error for requests in flight when the channel is lost (-32603).
pub fn failure(reason: &str, message: &str) -> RpcError {
    RpcError::new(ErrorCode::InternalError, message).with_reason(reason)
}

/// Who sent a request in flight.
#[derive(Debug)]
enum Origin<P> {
    Client {
        client: String,
        /// The client's own id, put back on the answer.
        original: Value,
        /// The client's progress token, when it asked for progress.
        token: Option<Value>,
        port: P,
    },
    /// A request of the harness itself (`tools/list`).
    Internal { method: String },
}

#[derive(Debug)]
struct InFlight<P> {
    origin: Origin<P>,
    deadline: u64,
}

#[derive(Debug, Clone)]
struct ClientState {
    last_seen: u64,
    in_flight: usize,
    streaming: bool,
}

/// What the caller must do.
#[derive(Debug, PartialEq)]
pub enum Out<P> {
    /// Answer a client request, once: `message` is the response with the
    /// client's own id.
    Answer { port: P, message: String },
    /// A progress notification for the request `request` (a harness id;
    /// find its port with [`McpProxy::port`]), with the client's token.
    Progress { request: String, message: String },
    /// A server notification for every client's stream, as it came.
    Broadcast { message: String },
    /// The server's tool list changed (also broadcast): list it again.
    ToolsChanged,
    /// The answer to a request of the harness's own.
    Internal {
        method: String,
        result: Result<Value, Value>,
    },
    /// Send this payload to the server (`notifications/cancelled` of a
    /// request given up on).
    Send { payload: String },
    /// Nothing to do; why, for a debug log (never the payload).
    Ignored { why: &'static str },
}

/// Why a client request was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("unknown or ended MCP client session")]
    UnknownClient,
    #[error("too many requests in flight on this MCP server")]
    TooMany,
    #[error("a request with this id is already in flight for this client session")]
    DuplicateId,
}

impl Refused {
    pub fn rpc(&self) -> RpcError {
        match self {
            Refused::UnknownClient => RpcError::new(ErrorCode::NotFound, self.to_string())
                .with_reason("unknown_mcp_session"),
            Refused::TooMany => RpcError::resource_unavailable(self.to_string())
                .with_reason("too_many_requests")
                .with_retryable(true),
            Refused::DuplicateId => {
                RpcError::invalid_request("duplicate_request_id", self.to_string())
            }
        }
    }
}

/// A client session could not be added: the server has `max_clients`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("too many MCP client sessions on this server (at most {0})")]
pub struct TooManyClients(pub usize);

/// What expired at a tick.
#[derive(Debug)]
pub struct Expired<P> {
    /// Answers (timeouts) and `notifications/cancelled` to send.
    pub outs: Vec<Out<P>>,
    /// Client sessions forgotten for idleness.
    pub clients: Vec<String>,
}

/// One (session, serverKey) channel's id map, progress routing and client
/// sessions.
#[derive(Debug)]
pub struct McpProxy<P> {
    limits: ProxyLimits,
    next: u64,
    in_flight: HashMap<String, InFlight<P>>,
    /// (client, canonical original id) → harness id.
    by_client: HashMap<(String, String), String>,
    clients: HashMap<String, ClientState>,
}

fn canonical(id: &Value) -> String {
    id.to_string()
}

impl<P> McpProxy<P> {
    pub fn new(limits: ProxyLimits) -> Self {
        McpProxy {
            limits,
            next: 1,
            in_flight: HashMap::new(),
            by_client: HashMap::new(),
            clients: HashMap::new(),
        }
    }

    pub fn limits(&self) -> ProxyLimits {
        self.limits
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    pub fn has_client(&self, client: &str) -> bool {
        self.clients.contains_key(client)
    }

    /// The ids of every client session.
    pub fn client_ids(&self) -> Vec<String> {
        self.clients.keys().cloned().collect()
    }

    fn mint(&mut self) -> String {
        let id = format!("{HARNESS_ID_PREFIX}{}", self.next);
        self.next += 1;
        id
    }

    /// Add a client session under `client` (minted by the caller: random,
    /// unguessable).
    ///
    /// # Errors
    ///
    /// [`TooManyClients`] when `max_clients` sessions exist.
    pub fn add_client(&mut self, client: &str, now: u64) -> Result<(), TooManyClients> {
        if self.clients.len() >= self.limits.max_clients {
            return Err(TooManyClients(self.limits.max_clients));
        }
        self.clients.insert(
            client.to_owned(),
            ClientState {
                last_seen: now,
                in_flight: 0,
                streaming: false,
            },
        );
        Ok(())
    }

    /// The client was heard from; `false` when it is unknown.
    pub fn touch(&mut self, client: &str, now: u64) -> bool {
        match self.clients.get_mut(client) {
            Some(c) => {
                c.last_seen = c.last_seen.max(now);
                true
            }
            None => false,
        }
    }

    /// A client's notification stream (GET) opened or closed: a client with
    /// an open stream is never idle.
    pub fn set_streaming(&mut self, client: &str, streaming: bool, now: u64) {
        if let Some(c) = self.clients.get_mut(client) {
            c.streaming = streaming;
            c.last_seen = c.last_seen.max(now);
        }
    }

    /// Take a client request: returns the payload to send to the server
    /// (the message with its id, and progress token, rewritten).
    ///
    /// # Errors
    ///
    /// The port back with why it was refused; the caller answers it with
    /// [`Refused::rpc`].
    pub fn request(
        &mut self,
        client: &str,
        id: Value,
        mut body: RawObject,
        port: P,
        now: u64,
    ) -> Result<String, (P, Refused)> {
        if !self.clients.contains_key(client) {
            return Err((port, Refused::UnknownClient));
        }
        if self.in_flight.len() >= self.limits.max_in_flight {
            return Err((port, Refused::TooMany));
        }
        let key = (client.to_owned(), canonical(&id));
        if self.by_client.contains_key(&key) {
            return Err((port, Refused::DuplicateId));
        }
        let hid = self.mint();
        body.set_str("id", &hid);
        let token = progress_token(&body);
        if token.is_some() {
            if let Some(mut params) = body.value("params") {
                if let Some(t) = params
                    .get_mut("_meta")
                    .and_then(|m| m.get_mut("progressToken"))
                {
                    *t = Value::String(hid.clone());
                    body.set_value("params", &params);
                }
            }
        }
        let payload = body.to_json();
        if let Some(c) = self.clients.get_mut(client) {
            c.in_flight += 1;
            c.last_seen = c.last_seen.max(now);
        }
        self.by_client.insert(key, hid.clone());
        self.in_flight.insert(
            hid,
            InFlight {
                origin: Origin::Client {
                    client: client.to_owned(),
                    original: id,
                    token,
                    port,
                },
                deadline: now.saturating_add(self.limits.request_timeout_ms),
            },
        );
        Ok(payload)
    }

    /// A request of the harness's own (`tools/list`): its payload.
    ///
    /// # Errors
    ///
    /// [`Refused::TooMany`] when the in-flight bound is reached.
    pub fn internal(&mut self, method: &str, params: Value, now: u64) -> Result<String, Refused> {
        if self.in_flight.len() >= self.limits.max_in_flight {
            return Err(Refused::TooMany);
        }
        let hid = self.mint();
        let payload =
            serde_json::json!({"jsonrpc": "2.0", "id": hid, "method": method, "params": params})
                .to_string();
        self.in_flight.insert(
            hid,
            InFlight {
                origin: Origin::Internal {
                    method: method.to_owned(),
                },
                deadline: now.saturating_add(self.limits.request_timeout_ms),
            },
        );
        Ok(payload)
    }

    /// A client notification: the payload to send, or `None` when it is
    /// not for the server. `notifications/cancelled` names the client's
    /// id: it is rewritten to the harness id (dropped when that request is
    /// not in flight).
    pub fn notification(
        &mut self,
        client: &str,
        method: &str,
        mut body: RawObject,
        now: u64,
    ) -> Option<String> {
        self.touch(client, now);
        if method == "notifications/cancelled" {
            let mut params = body.value("params")?;
            let original = params.get("requestId")?;
            let hid = self
                .by_client
                .get(&(client.to_owned(), canonical(original)))?
                .clone();
            if let Some(p) = params.as_object_mut() {
                p.insert("requestId".into(), Value::String(hid));
                body.set_value("params", &params);
            }
        } else if method == "notifications/progress" {
            // Progress of a server → client request: the executor answers
            // those itself, so there is nothing it could refer to.
            return None;
        }
        Some(body.to_json())
    }

    /// The port of a request in flight (for [`Out::Progress`]).
    pub fn port(&self, request: &str) -> Option<&P> {
        match self.in_flight.get(request).map(|f| &f.origin) {
            Some(Origin::Client { port, .. }) => Some(port),
            _ => None,
        }
    }

    /// Remove a request in flight and keep the books.
    fn take(&mut self, hid: &str) -> Option<InFlight<P>> {
        let f = self.in_flight.remove(hid)?;
        if let Origin::Client {
            client, original, ..
        } = &f.origin
        {
            self.by_client
                .remove(&(client.clone(), canonical(original)));
            if let Some(c) = self.clients.get_mut(client) {
                c.in_flight = c.in_flight.saturating_sub(1);
            }
        }
        Some(f)
    }

    /// Answer a request taken from the books with `error`.
    fn fail(f: InFlight<P>, error: &RpcError) -> Out<P> {
        match f.origin {
            Origin::Client { original, port, .. } => Out::Answer {
                port,
                message: error_response(&original, error),
            },
            Origin::Internal { method } => Out::Internal {
                method,
                result: Err(serde_json::to_value(error).unwrap_or(Value::Null)),
            },
        }
    }

    /// One message from the server (an `mcp.frame` payload).
    pub fn from_server(&mut self, payload: &str, now: u64) -> Vec<Out<P>> {
        // Only the top level is read: the answer goes on as it came but
        // for its id (docs/benchmarks.md, "Ids rewritten in place").
        let Ok(msg) = Members::parse(payload) else {
            return vec![Out::Ignored {
                why: "not a JSON-RPC object",
            }];
        };
        if let Some(method) = msg.get("method").and_then(str_text) {
            if msg.get("id").is_some() {
                return vec![Out::Ignored {
                    why: "a server request (the executor answers those)",
                }];
            }
            return match method.as_ref() {
                "notifications/progress" => match serde_json::from_str(payload) {
                    Ok(Value::Object(msg)) => self.progress(msg),
                    _ => vec![Out::Ignored {
                        why: "not a JSON-RPC object",
                    }],
                },
                "notifications/tools/list_changed" => vec![
                    Out::Broadcast {
                        message: payload.to_owned(),
                    },
                    Out::ToolsChanged,
                ],
                "notifications/cancelled" => vec![Out::Ignored {
                    why: "the server cancelled a request of its own",
                }],
                _ => vec![Out::Broadcast {
                    message: payload.to_owned(),
                }],
            };
        }
        let Some(hid) = msg.get("id").and_then(str_text) else {
            return vec![Out::Ignored {
                why: "a response without a harness id",
            }];
        };
        let Some(f) = self.take(&hid) else {
            return vec![Out::Ignored {
                why: "a response to no request in flight",
            }];
        };
        match f.origin {
            Origin::Client {
                client,
                original,
                port,
                ..
            } => {
                self.touch(&client, now);
                let mut message = String::with_capacity(payload.len() + 16);
                write_object(&msg, &[("id", &original.to_string())], &mut message);
                vec![Out::Answer { port, message }]
            }
            Origin::Internal { method } => {
                let parse = |t: &str| serde_json::from_str(t).unwrap_or(Value::Null);
                let result = match (msg.get("result"), msg.get("error")) {
                    (Some(r), _) => Ok(parse(r)),
                    (None, Some(e)) => Err(parse(e)),
                    (None, None) => Err(Value::Null),
                };
                vec![Out::Internal { method, result }]
            }
        }
    }

    fn progress(&mut self, mut msg: Map<String, Value>) -> Vec<Out<P>> {
        let Some(token) = msg
            .get("params")
            .and_then(|p| p.get("progressToken"))
            .and_then(Value::as_str)
            .map(str::to_owned)
        else {
            return vec![Out::Ignored {
                why: "progress without a harness token",
            }];
        };
        let original = match self.in_flight.get(&token).map(|f| &f.origin) {
            Some(Origin::Client {
                token: Some(original),
                ..
            }) => original.clone(),
            _ => {
                return vec![Out::Ignored {
                    why: "progress for no request in flight",
                }]
            }
        };
        if let Some(p) = msg.get_mut("params").and_then(Value::as_object_mut) {
            p.insert("progressToken".into(), original);
        }
        vec![Out::Progress {
            request: token,
            message: Value::Object(msg).to_string(),
        }]
    }

    /// Answer every request in flight with `error` (the channel is lost:
    /// the executor disconnected, closed the channel, or the session
    /// ended). Client sessions stay.
    pub fn fail_all(&mut self, error: &RpcError) -> Vec<Out<P>> {
        let mut ids: Vec<String> = self.in_flight.keys().cloned().collect();
        ids.sort();
        ids.into_iter()
            .filter_map(|hid| self.take(&hid))
            .map(|f| Self::fail(f, error))
            .collect()
    }

    /// End a client session (DELETE): its requests in flight are answered
    /// with `client_session_ended` and cancelled at the server. `None` when
    /// it is unknown.
    pub fn remove_client(&mut self, client: &str) -> Option<Vec<Out<P>>> {
        self.clients.remove(client)?;
        Some(self.drop_requests_of(client))
    }

    fn drop_requests_of(&mut self, client: &str) -> Vec<Out<P>> {
        let mut ids: Vec<String> = self
            .in_flight
            .iter()
            .filter(|(_, f)| matches!(&f.origin, Origin::Client { client: c, .. } if c == client))
            .map(|(k, _)| k.clone())
            .collect();
        ids.sort();
        let error = failure("client_session_ended", "the MCP client session ended");
        let mut outs = Vec::new();
        for hid in ids {
            if let Some(f) = self.take(&hid) {
                outs.push(Out::Send {
                    payload: cancelled(&hid, "client session ended"),
                });
                outs.push(Self::fail(f, &error));
            }
        }
        outs
    }

    /// Time out requests past their deadline (answered with
    /// [`timeout_error`], cancelled at the server) and forget idle client
    /// sessions.
    pub fn expire(&mut self, now: u64) -> Expired<P> {
        let mut due: Vec<String> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(k, _)| k.clone())
            .collect();
        due.sort();
        let error = timeout_error(self.limits.request_timeout_ms);
        let mut outs = Vec::new();
        for hid in due {
            if let Some(f) = self.take(&hid) {
                outs.push(Out::Send {
                    payload: cancelled(&hid, "timeout"),
                });
                outs.push(Self::fail(f, &error));
            }
        }
        let idle = self.limits.client_idle_ms;
        let mut clients: Vec<String> = self
            .clients
            .iter()
            .filter(|(_, c)| {
                !c.streaming && c.in_flight == 0 && now.saturating_sub(c.last_seen) >= idle
            })
            .map(|(k, _)| k.clone())
            .collect();
        clients.sort();
        for c in &clients {
            self.clients.remove(c);
        }
        Expired { outs, clients }
    }

    /// When [`expire`](Self::expire) next has something to do.
    pub fn next_deadline(&self) -> Option<u64> {
        let requests = self.in_flight.values().map(|f| f.deadline).min();
        let idle = self
            .clients
            .values()
            .filter(|c| !c.streaming && c.in_flight == 0)
            .map(|c| c.last_seen.saturating_add(self.limits.client_idle_ms))
            .min();
        match (requests, idle) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// `notifications/cancelled` for a request of ours the server may still run.
fn cancelled(hid: &str, reason: &str) -> String {
    serde_json::json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": hid, "reason": reason}})
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;
    use std::collections::{BTreeMap, BTreeSet};

    fn body(v: Value) -> RawObject {
        RawObject::parse(v.to_string()).unwrap()
    }

    fn req(id: Value, method: &str) -> RawObject {
        body(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": {}}))
    }

    fn proxy() -> McpProxy<u32> {
        McpProxy::new(ProxyLimits {
            max_clients: 4,
            max_in_flight: 8,
            client_idle_ms: 1_000,
            request_timeout_ms: 500,
        })
    }

    fn sent_id(payload: &str) -> String {
        let v: Value = serde_json::from_str(payload).unwrap();
        v["id"].as_str().unwrap().to_owned()
    }

    fn answer_id(out: &Out<u32>) -> (u32, Value) {
        match out {
            Out::Answer { port, message } => {
                let v: Value = serde_json::from_str(message).unwrap();
                (*port, v["id"].clone())
            }
            other => panic!("not an answer: {other:?}"),
        }
    }

    #[test]
    fn parse_classifies_and_refuses() {
        let r = parse_client(br#"{"jsonrpc":"2.0","id":7,"method":"tools/list"}"#).unwrap();
        assert!(matches!(r, ClientMessage::Request { ref id, .. } if id == &json!(7)));
        let n = parse_client(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#).unwrap();
        assert!(matches!(n, ClientMessage::Notification { .. }));
        let a = parse_client(br#"{"jsonrpc":"2.0","id":"x","result":{}}"#).unwrap();
        assert_eq!(a, ClientMessage::Response { id: json!("x") });
        assert!(matches!(
            parse_client(b"{nope"),
            Err(ClientParseError::Parse(_))
        ));
        assert_eq!(parse_client(b"[]"), Err(ClientParseError::Batch));
        let e = parse_client(br#"{"jsonrpc":"1.0","id":3,"method":"m"}"#).unwrap_err();
        assert_eq!(e.id(), json!(3));
        assert_eq!(e.rpc().code, -32600);
        for bad in [
            r#"{"jsonrpc":"2.0","id":null,"method":"m"}"#,
            r#"{"jsonrpc":"2.0","id":1.5,"method":"m"}"#,
            r#"{"jsonrpc":"2.0","id":{},"method":"m"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":""}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"m","params":3}"#,
            r#"{"jsonrpc":"2.0","id":1}"#,
            r#"{"jsonrpc":"2.0","id":"s","error":false}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"m","error":3}"#,
            r#"5"#,
        ] {
            assert!(
                matches!(
                    parse_client(bad.as_bytes()),
                    Err(ClientParseError::Invalid { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn two_clients_with_the_same_id_get_their_own_answers() {
        let mut p = proxy();
        p.add_client("a", 0).unwrap();
        p.add_client("b", 0).unwrap();
        let pa = p
            .request("a", json!(1), req(json!(1), "tools/call"), 10, 0)
            .unwrap();
        let pb = p
            .request("b", json!(1), req(json!(1), "tools/call"), 20, 0)
            .unwrap();
        let (ha, hb) = (sent_id(&pa), sent_id(&pb));
        assert_ne!(ha, hb);
        assert!(ha.starts_with(HARNESS_ID_PREFIX) && !ha.starts_with("bmx:"));
        // Answers in the other order.
        let out = p.from_server(
            &json!({"jsonrpc":"2.0","id": hb, "result": {"b": 1}}).to_string(),
            1,
        );
        assert_eq!(answer_id(&out[0]), (20, json!(1)));
        let out = p.from_server(
            &json!({"jsonrpc":"2.0","id": ha, "result": {"a": 1}}).to_string(),
            1,
        );
        assert_eq!(answer_id(&out[0]), (10, json!(1)));
        assert_eq!(p.in_flight(), 0);
        // A string id stays a string.
        let ps = p
            .request("a", json!("1"), req(json!("1"), "ping"), 30, 2)
            .unwrap();
        let out = p.from_server(
            &json!({"jsonrpc":"2.0","id": sent_id(&ps), "result": {}}).to_string(),
            3,
        );
        assert_eq!(answer_id(&out[0]), (30, json!("1")));
    }

    #[test]
    fn messages_go_on_as_they_came_but_for_the_id() {
        let mut p = proxy();
        p.add_client("a", 0).unwrap();
        // Escapes and number spellings are kept; only the id changes.
        let raw = br#"{"jsonrpc":"2\u002e0","id":9,"method":"tools/call","params":{"n":1E9,"s":"\u00e9"}}"#;
        let Ok(ClientMessage::Request { id, method, body }) = parse_client(raw) else {
            panic!("a request");
        };
        assert_eq!((&id, method.as_str()), (&json!(9), "tools/call"));
        let sent = p.request("a", id, body, 1, 0).unwrap();
        let hid = sent_id(&sent);
        assert_eq!(
            sent,
            format!(
                r#"{{"jsonrpc":"2\u002e0","id":"{hid}","method":"tools/call","params":{{"n":1E9,"s":"\u00e9"}}}}"#
            )
        );
        let answer = format!(r#"{{"result":{{"n":1E9,"t":"a\"b"}},"jsonrpc":"2.0","id":"{hid}"}}"#);
        match &p.from_server(&answer, 1)[0] {
            Out::Answer { port, message } => {
                assert_eq!(*port, 1);
                assert_eq!(
                    message,
                    r#"{"result":{"n":1E9,"t":"a\"b"},"jsonrpc":"2.0","id":9}"#
                );
            }
            other => panic!("{other:?}"),
        }
        // A progress token spelt with an escape is still found and rewritten.
        let raw = br#"{"jsonrpc":"2.0","id":"q","method":"m","params":{"_meta":{"progress\u0054oken":5}}}"#;
        let Ok(ClientMessage::Request { id, body, .. }) = parse_client(raw) else {
            panic!("a request");
        };
        assert_eq!(progress_token(&body), Some(json!(5)));
        let plain = br#"{"jsonrpc":"2.0","id":"r","method":"m","params":{"text":"a\nb"}}"#;
        let Ok(ClientMessage::Request { body: plain, .. }) = parse_client(plain) else {
            panic!("a request");
        };
        assert_eq!(progress_token(&plain), None);
        let sent: Value = serde_json::from_str(&p.request("a", id, body, 2, 0).unwrap()).unwrap();
        assert_eq!(sent["params"]["_meta"]["progressToken"], sent["id"]);
    }

    #[test]
    fn duplicate_ids_of_one_client_are_refused_and_limits_hold() {
        let mut p = proxy();
        p.add_client("a", 0).unwrap();
        p.request("a", json!(1), req(json!(1), "m"), 1, 0).unwrap();
        let (port, why) = p
            .request("a", json!(1), req(json!(1), "m"), 2, 0)
            .unwrap_err();
        assert_eq!((port, why), (2, Refused::DuplicateId));
        let (_, why) = p
            .request("zz", json!(1), req(json!(1), "m"), 3, 0)
            .unwrap_err();
        assert_eq!(why, Refused::UnknownClient);
        for i in 2..9 {
            p.request("a", json!(i), req(json!(i), "m"), i, 0).unwrap();
        }
        let (_, why) = p
            .request("a", json!(99), req(json!(99), "m"), 99, 0)
            .unwrap_err();
        assert_eq!(why, Refused::TooMany);
        for c in ["b", "c", "d"] {
            p.add_client(c, 0).unwrap();
        }
        assert_eq!(p.add_client("e", 0), Err(TooManyClients(4)));
    }

    #[test]
    fn progress_goes_to_its_request_with_the_clients_token() {
        let mut p = proxy();
        p.add_client("a", 0).unwrap();
        let mut b = req(json!(5), "tools/call");
        b.set_value(
            "params",
            &json!({"name": "x", "_meta": {"progressToken": 77}}),
        );
        let payload = p.request("a", json!(5), b, 1, 0).unwrap();
        let v: Value = serde_json::from_str(&payload).unwrap();
        let hid = v["id"].as_str().unwrap().to_owned();
        assert_eq!(v["params"]["_meta"]["progressToken"], json!(hid));
        let note = json!({"jsonrpc":"2.0","method":"notifications/progress",
            "params":{"progressToken": hid, "progress": 1, "total": 2}});
        let out = p.from_server(&note.to_string(), 1);
        match &out[0] {
            Out::Progress { request, message } => {
                assert_eq!(request, &hid);
                assert_eq!(p.port(request), Some(&1));
                let m: Value = serde_json::from_str(message).unwrap();
                assert_eq!(m["params"]["progressToken"], json!(77));
            }
            other => panic!("{other:?}"),
        }
        // Progress for a token nobody has is dropped.
        let stray = json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"h:999","progress":1}});
        assert!(matches!(
            p.from_server(&stray.to_string(), 1)[0],
            Out::Ignored { .. }
        ));
    }

    #[test]
    fn notifications_broadcast_and_list_changed_refreshes() {
        let mut p = proxy();
        let out = p.from_server(
            r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#,
            0,
        );
        assert!(matches!(out[0], Out::Broadcast { .. }));
        assert_eq!(out[1], Out::ToolsChanged);
        let out = p.from_server(
            r#"{"jsonrpc":"2.0","method":"notifications/message","params":{}}"#,
            0,
        );
        assert!(matches!(out[0], Out::Broadcast { .. }));
        let out = p.from_server(r#"{"jsonrpc":"2.0","id":"bmx:1","method":"ping"}"#, 0);
        assert!(matches!(out[0], Out::Ignored { .. }));
        assert!(matches!(
            p.from_server("garbage", 0)[0],
            Out::Ignored { .. }
        ));
    }

    #[test]
    fn cancellation_is_rewritten_to_the_harness_id() {
        let mut p = proxy();
        p.add_client("a", 0).unwrap();
        let payload = p
            .request("a", json!("r1"), req(json!("r1"), "m"), 1, 0)
            .unwrap();
        let hid = sent_id(&payload);
        let c = body(
            json!({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"r1"}}),
        );
        let sent = p
            .notification("a", "notifications/cancelled", c, 0)
            .unwrap();
        let v: Value = serde_json::from_str(&sent).unwrap();
        assert_eq!(v["params"]["requestId"], json!(hid));
        let other = body(
            json!({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"nope"}}),
        );
        assert_eq!(
            p.notification("a", "notifications/cancelled", other, 0),
            None
        );
    }

    #[test]
    fn timeouts_idle_clients_and_internal_requests() {
        let mut p = proxy();
        p.add_client("a", 0).unwrap();
        p.add_client("idle", 0).unwrap();
        p.request("a", json!(1), req(json!(1), "m"), 1, 0).unwrap();
        let internal = p.internal("tools/list", json!({}), 0).unwrap();
        assert_eq!(p.next_deadline(), Some(500));
        let e = p.expire(499);
        assert!(e.outs.is_empty() && e.clients.is_empty());
        let e = p.expire(500);
        let answers: Vec<_> = e
            .outs
            .iter()
            .filter(|o| matches!(o, Out::Answer { .. }))
            .collect();
        assert_eq!(answers.len(), 1);
        if let Out::Answer { message, .. } = answers[0] {
            let v: Value = serde_json::from_str(message).unwrap();
            assert_eq!(v["error"]["code"], -32001);
            assert_eq!(v["id"], 1);
        }
        assert!(e.outs.iter().any(
            |o| matches!(o, Out::Internal { method, result: Err(_) } if method == "tools/list")
        ));
        assert_eq!(
            e.outs
                .iter()
                .filter(|o| matches!(o, Out::Send { .. }))
                .count(),
            2
        );
        let _ = internal;
        p.set_streaming("a", true, 500);
        let e = p.expire(1_000);
        assert_eq!(e.clients, vec!["idle".to_owned()]);
        assert!(p.has_client("a"), "a streaming client is never idle");
        p.set_streaming("a", false, 1_000);
        assert_eq!(p.next_deadline(), Some(2_000));
        assert_eq!(p.expire(2_000).clients, vec!["a".to_owned()]);
    }

    #[test]
    fn removing_a_client_answers_its_requests() {
        let mut p = proxy();
        p.add_client("a", 0).unwrap();
        p.add_client("b", 0).unwrap();
        p.request("a", json!(1), req(json!(1), "m"), 1, 0).unwrap();
        p.request("b", json!(1), req(json!(1), "m"), 2, 0).unwrap();
        let outs = p.remove_client("a").unwrap();
        let answers: Vec<_> = outs
            .iter()
            .filter(|o| matches!(o, Out::Answer { .. }))
            .map(answer_id)
            .collect();
        assert_eq!(answers, vec![(1, json!(1))]);
        assert!(p.remove_client("a").is_none());
        assert_eq!(p.in_flight(), 1);
        let outs = p.fail_all(&failure("executor_disconnected", "executor disconnected"));
        assert_eq!(outs.len(), 1);
        assert_eq!(answer_id(&outs[0]), (2, json!(1)));
    }

    /// One step of a random history.
    #[derive(Debug, Clone)]
    enum Op {
        AddClient(u8),
        RemoveClient(u8),
        /// client, id (small, so clients collide), numeric or string
        Request(u8, u8, bool),
        /// answer the k-th request in flight (as the server would)
        Answer(u8),
        /// a duplicate answer or a stray id
        Stray(u8),
        Progress(u8),
        Advance(u16),
        Disconnect,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (0u8..5).prop_map(Op::AddClient),
            1 => (0u8..5).prop_map(Op::RemoveClient),
            4 => (0u8..5, 0u8..4, any::<bool>()).prop_map(|(c, i, n)| Op::Request(c, i, n)),
            4 => any::<u8>().prop_map(Op::Answer),
            1 => any::<u8>().prop_map(Op::Stray),
            1 => any::<u8>().prop_map(Op::Progress),
            1 => (0u16..400).prop_map(Op::Advance),
            1 => Just(Op::Disconnect),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Ids always map back; every request that entered gets exactly one
        /// answer, with its own id; nothing in flight survives a disconnect;
        /// ids sent to the server are unique among those in flight and
        /// never the executor's `bmx:`.
        #[test]
        fn every_request_gets_exactly_one_answer(ops in proptest::collection::vec(op(), 1..120)) {
            let mut p: McpProxy<u32> = proxy();
            let mut now = 0u64;
            let mut next_port = 0u32;
            // port → (the client's id) for requests taken
            let mut expected: BTreeMap<u32, Value> = BTreeMap::new();
            let mut answered: BTreeSet<u32> = BTreeSet::new();
            // harness ids sent and not answered yet (in send order)
            let mut sent: Vec<String> = Vec::new();
            let mut all_sent: BTreeSet<String> = BTreeSet::new();
            let handle = |outs: Vec<Out<u32>>, answered: &mut BTreeSet<u32>, expected: &BTreeMap<u32, Value>| {
                for o in outs {
                    if let Out::Answer { port, message } = o {
                        prop_assert!(answered.insert(port), "port {} answered twice", port);
                        let v: Value = serde_json::from_str(&message).unwrap();
                        prop_assert_eq!(&v["id"], &expected[&port]);
                    }
                }
                Ok(())
            };
            for op in ops {
                match op {
                    Op::AddClient(c) => { let _ = p.add_client(&format!("c{c}"), now); }
                    Op::RemoveClient(c) => {
                        if let Some(outs) = p.remove_client(&format!("c{c}")) {
                            handle(outs, &mut answered, &expected)?;
                        }
                    }
                    Op::Request(c, i, numeric) => {
                        let id = if numeric { json!(i) } else { json!(i.to_string()) };
                        let mut b = req(id.clone(), "tools/call");
                        b.set_value("params", &json!({"_meta": {"progressToken": i}}));
                        let port = next_port;
                        next_port += 1;
                        match p.request(&format!("c{c}"), id.clone(), b, port, now) {
                            Ok(payload) => {
                                let hid = sent_id(&payload);
                                prop_assert!(!hid.starts_with("bmx:"));
                                prop_assert!(all_sent.insert(hid.clone()), "id {} reused", hid);
                                expected.insert(port, id);
                                sent.push(hid);
                            }
                            Err((back, _)) => prop_assert_eq!(back, port),
                        }
                    }
                    Op::Answer(k) if !sent.is_empty() => {
                        let hid = sent.remove(k as usize % sent.len());
                        let outs = p.from_server(&json!({"jsonrpc":"2.0","id":hid,"result":{}}).to_string(), now);
                        handle(outs, &mut answered, &expected)?;
                    }
                    Op::Answer(_) => {}
                    Op::Stray(k) => {
                        let hid = format!("h:{}", k);
                        if !sent.contains(&hid) {
                            let outs = p.from_server(&json!({"jsonrpc":"2.0","id":hid,"result":{}}).to_string(), now);
                            let answers = outs.iter().filter(|o| matches!(o, Out::Answer { .. })).count();
                            prop_assert_eq!(answers, 0, "a stray id answered a request");
                        }
                    }
                    Op::Progress(k) if !sent.is_empty() => {
                        let hid = sent[k as usize % sent.len()].clone();
                        let note = json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":hid,"progress":1}});
                        for o in p.from_server(&note.to_string(), now) {
                            if let Out::Progress { request, .. } = o {
                                prop_assert!(p.port(&request).is_some());
                            }
                        }
                    }
                    Op::Progress(_) => {}
                    Op::Advance(ms) => {
                        now += u64::from(ms);
                        let e = p.expire(now);
                        handle(e.outs, &mut answered, &expected)?;
                    }
                    Op::Disconnect => {
                        let outs = p.fail_all(&failure("executor_disconnected", "x"));
                        handle(outs, &mut answered, &expected)?;
                        sent.clear();
                    }
                }
                // Whatever is not answered is still in flight.
                prop_assert_eq!(expected.len() - answered.len() + internal_count(&p), p.in_flight());
            }
            let outs = p.fail_all(&failure("executor_disconnected", "x"));
            handle(outs, &mut answered, &expected)?;
            prop_assert_eq!(answered.len(), expected.len(), "every request answered");
            prop_assert_eq!(p.in_flight(), 0);
        }
    }

    fn internal_count(p: &McpProxy<u32>) -> usize {
        p.in_flight
            .values()
            .filter(|f| matches!(f.origin, Origin::Internal { .. }))
            .count()
    }
}
