//! The platform-facing session API: create a session on an executor, then
//! start processes, read their output, call tools and stop it. The HTTP API
//! is a thin layer over these calls, so an embedding platform and a remote
//! client get the same behaviour.

use crate::harness::actors::leases::{LeasesMsg, Route};
use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::harness::types::{SessionInfo, SessionState};
use crate::lease::ConnId;
use crate::wire::types::{
    Accepted, AssignParams, AssignResult, JsonMap, LeaseGrant, McpServerSpec, ProcessListResult,
    ProcessReadParams, ProcessReadResult, ProcessRefParams, ProcessStartParams, ProcessState,
    ProcessTerminateParams, ProcessWriteParams, SessionRefParams, StopParams, StopResult, Stream,
    ToolCallParams, ToolResultParams,
};
use crate::wire::{Blob, CallError, ErrorCode, Method, RpcError};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// What `POST /v1/sessions` takes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSession {
    /// Run on this executor (default: the least loaded one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_id: Option<String>,
    /// Use this id (default: a fresh `s-<uuid>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default)]
    pub metadata: JsonMap,
    /// MCP servers of the session (PROTOCOL.md §9), sent in
    /// `session.assign`; checked by [`super::mcp::validate_specs`].
    /// `secretEnv` values go to the executor only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<McpServerSpec>,
    /// Start from a workspace backup: the executor unpacks it before
    /// `session.ready` (docs/protocol.md, "Restore from a backup").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<super::files::RestoreFrom>,
}

/// A tool call (`POST /v1/sessions/{id}/tools`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCall {
    pub tool: String,
    #[serde(default)]
    pub input: serde_json::Value,
    /// Idempotency key (default: a fresh `t-<uuid>`); a repeated call with
    /// the same id gets the same result, the tool runs once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
}

impl ToolCall {
    pub fn new(tool: impl Into<String>, input: serde_json::Value) -> Self {
        ToolCall {
            tool: tool.into(),
            input,
            tool_call_id: None,
            deadline_ms: None,
        }
    }
}

/// A process read (`GET .../processes/{pid}/output`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadRequest {
    pub process_id: String,
    #[serde(default = "default_stream")]
    pub stream: Stream,
    #[serde(default)]
    pub cursor: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
}

fn default_stream() -> Stream {
    Stream::Stdout
}

/// `process.start` params for `argv`, with every option at its default.
pub fn process_params(process_id: impl Into<String>, argv: Vec<String>) -> ProcessStartParams {
    ProcessStartParams {
        session_id: String::new(),
        process_id: process_id.into(),
        argv,
        cwd: None,
        env: None,
        stdin: Default::default(),
        stderr: Default::default(),
        io_mode: Default::default(),
        timeout_ms: None,
        wait_ms: None,
        metadata: None,
        cols: None,
        rows: None,
        output_policy: Default::default(),
        package_install: None,
        git_credentials: false,
        file_transfer: None,
    }
}

/// The sessions of one harness.
#[derive(Clone)]
pub struct Sessions {
    pub(crate) shared: Arc<Shared>,
}

fn shutting_down() -> ApiError {
    ApiError::with_status(
        503,
        RpcError::internal("the harness is shutting down").with_reason("shutting_down"),
    )
}

/// Over several replicas (docs/store.md, "Several replicas"): make this
/// replica's fresh grant of `session_id` the session's row in the
/// database, conditionally on the row still being the grant it knew
/// (`previous`). Another replica's grant that won answers 409
/// `session_exists`; a failing database 503. Without replicas: nothing.
async fn claim(shared: &Shared, session_id: &str, previous: Option<u64>) -> Result<(), ApiError> {
    let Some(replica) = shared.replica.get() else {
        return Ok(());
    };
    let Some(snapshot) = shared.stored_session(session_id) else {
        return Err(ApiError::session_ended(session_id));
    };
    let db = replica.db.clone();
    let won = tokio::task::spawn_blocking(move || db.claim_session(&snapshot, previous))
        .await
        .map_err(|e| crate::harness::actors::leases::store_unavailable(e.to_string()))?
        .map_err(|e| crate::harness::actors::leases::store_unavailable(e.to_string()))?;
    if won {
        return Ok(());
    }
    tracing::info!(session = %session_id, "another replica's grant of this session won");
    Err(ApiError::rpc(RpcError::conflict(
        "session_exists",
        format!("session {session_id:?} exists (granted by another replica)"),
    )))
}

/// Over several replicas: whether the session's row still names this
/// replica and grant `token` (not ended). Without replicas, or when the
/// database cannot answer, `true` (the executor's fence still refuses a
/// stale grant).
async fn holds(shared: &Shared, session_id: &str, token: u64) -> bool {
    use crate::harness::rows::SessionRows;
    let Some(replica) = shared.replica.get() else {
        return true;
    };
    let db = replica.db.clone();
    let id = session_id.to_owned();
    match tokio::task::spawn_blocking(move || {
        let me = db.id().to_owned();
        db.holds(&id, token, &me)
    })
    .await
    {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            tracing::warn!(session = %session_id, error = %e, "cannot ask the store who holds the session; the executor's fence decides");
            true
        }
        Err(_) => true,
    }
}

/// A stop's waiter was dropped by a crashing leases actor.
struct StopLost;

pub(crate) async fn ask<T>(
    shared: &Shared,
    make: impl FnOnce(oneshot::Sender<T>) -> LeasesMsg,
) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    // A crashed leases actor is replaced by its supervisor: the request
    // waits for the new one instead of failing.
    shared
        .send_leases(make(tx))
        .await
        .map_err(|_| shutting_down())?;
    rx.await.map_err(|_| shutting_down())
}

impl Sessions {
    /// Create a session: grant its lease and send `session.assign`; returns
    /// once the executor accepted it.
    pub async fn create(&self, req: CreateSession) -> Result<Session, ApiError> {
        let shared = &self.shared;
        if let Some(id) = &req.session_id {
            crate::wire::id::check("sessionId", id).map_err(ApiError::invalid_id)?;
        }
        super::mcp::validate_specs(&req.mcp_servers)?;
        let restore = match &req.restore_from {
            Some(r) => Some(super::files::restore_digest(shared, r).await?),
            None => None,
        };
        let mcp_info = req
            .mcp_servers
            .iter()
            .map(super::mcp::McpServerInfo::from_spec)
            .collect();
        let a = ask(shared, |reply| LeasesMsg::Assign {
            session_id: req.session_id,
            executor_id: req.executor_id,
            metadata: req.metadata.clone(),
            mcp_servers: mcp_info,
            reply,
        })
        .await??;
        let session_id = a.grant.session_id.clone();
        let token = a.grant.fencing_token;
        // Over several replicas the database decides which grant of a
        // session lives: a lost claim is undone before any executor hears.
        if let Err(err) = claim(shared, &session_id, a.previous).await {
            let _ = shared
                .send_leases(LeasesMsg::AssignAnswered {
                    session_id: session_id.clone(),
                    fencing_token: token,
                    result: Err(err.clone()),
                })
                .await;
            return Err(err);
        }
        // The session's record is durable before the executor hears of it:
        // a harness killed after `session.assign` went out knows the
        // session when the executor comes back to resume it.
        if let (Some(ticket), Some(d)) = (a.durable, shared.durable.get()) {
            if let Err(e) = d.wait_durable(ticket, shared.config.request_timeout).await {
                let err = crate::harness::actors::leases::store_unavailable(e.to_string());
                let _ = shared
                    .send_leases(LeasesMsg::AssignAnswered {
                        session_id: session_id.clone(),
                        fencing_token: token,
                        result: Err(err.clone()),
                    })
                    .await;
                return Err(err);
            }
        }
        // The restore's download is minted for the executor the lease
        // went to, which must restore: else the assign is undone.
        let restore_digest = restore.clone();
        let restore = match restore
            .map(|d| super::files::restore_source(shared, a.grant.holder, d))
            .transpose()
        {
            Ok(r) => r,
            Err(err) => {
                let _ = shared
                    .send_leases(LeasesMsg::AssignAnswered {
                        session_id: session_id.clone(),
                        fencing_token: token,
                        result: Err(err.clone()),
                    })
                    .await;
                return Err(err);
            }
        };
        let mut params = AssignParams {
            session_id: session_id.clone(),
            work_id: session_id.clone(),
            agent_id: None,
            environment_id: None,
            lease: LeaseGrant {
                token: a.grant.lease_token.clone(),
                fencing_token: token,
            },
            deadline_ms: None,
            mcp_servers: req.mcp_servers,
            metadata: req.metadata,
            resources: Vec::new(),
            restore,
        };
        // Idempotent by (sessionId, fencingToken): sent again on the
        // resumed connection when the first one is lost before the answer
        // (the executor lists the session in its resume only if the
        // assign reached it; otherwise the lease ends and so does this).
        let handle = Session {
            shared: shared.clone(),
            id: session_id.clone(),
        };
        let deadline = tokio::time::Instant::now()
            + shared.config.request_timeout
            + Duration::from_millis(shared.config.lease_ttl_ms);
        let (mut link, mut conn) = (a.link.clone(), a.grant.holder);
        let answer = loop {
            let r = link
                .request::<_, AssignResult>(
                    Method::SessionAssign,
                    &params,
                    shared.config.request_timeout,
                )
                .await;
            if !matches!(r, Err(CallError::Closed)) {
                break r;
            }
            match handle
                .next_route(conn, deadline, || ApiError::from_call(CallError::Closed))
                .await
            {
                Ok(route) => (link, conn) = (route.link, route.conn),
                Err(_) => break r,
            }
            // The restore's download token is good once and may have been
            // spent by the lost send (the executor restarted mid-restore):
            // every send carries a fresh one, minted for the connection it
            // goes to; the unused one expires with its TTL.
            if let Some(d) = &restore_digest {
                match super::files::restore_source(shared, conn, d.clone()) {
                    Ok(source) => params.restore = Some(source),
                    Err(_) => break r,
                }
            }
        };
        let result = match answer {
            Ok(r) if r.accepted => Ok(()),
            Ok(_) => Err(ApiError::no_executor(
                "the executor did not accept the session",
            )),
            Err(CallError::Closed) => Err(ApiError::no_executor("the executor connection closed")),
            Err(e) => Err(ApiError::from_call(e)),
        };
        let _ = shared
            .send_leases(LeasesMsg::AssignAnswered {
                session_id: session_id.clone(),
                fencing_token: token,
                result: result.clone(),
            })
            .await;
        result?;
        // Its agent stream (events, interactions) starts at sequence 1.
        crate::harness::actors::turns::session_created(shared, &session_id).await;
        Ok(Session {
            shared: shared.clone(),
            id: session_id,
        })
    }

    /// A handle to a session by id (not checked: its calls fail with 404
    /// if the session does not exist).
    pub fn session(&self, session_id: &str) -> Session {
        Session {
            shared: self.shared.clone(),
            id: session_id.to_owned(),
        }
    }

    pub fn get(&self, session_id: &str) -> Option<SessionInfo> {
        self.shared.sessions.get(session_id).map(|s| s.clone())
    }

    /// Every session known, live and recently ended, by id.
    pub fn list(&self) -> Vec<SessionInfo> {
        let mut v: Vec<SessionInfo> = self.shared.sessions.iter().map(|s| s.clone()).collect();
        v.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        v
    }
}

/// One session of the platform.
#[derive(Clone)]
pub struct Session {
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: String,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({})", self.id)
    }
}

impl Session {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The session as the harness sees it now.
    pub fn info(&self) -> Option<SessionInfo> {
        self.shared.sessions.get(&self.id).map(|s| s.clone())
    }

    /// The session's MCP servers: state, restarts, last error and tools
    /// (`GET /v1/sessions/{id}/mcp`). Clients reach a server through the
    /// HTTP endpoint `/v1/sessions/{id}/mcp/{serverKey}` (docs/mcp.md).
    ///
    /// # Errors
    ///
    /// 404 for an unknown session.
    pub fn mcp_servers(&self) -> Result<Vec<super::mcp::McpServerView>, ApiError> {
        super::mcp::list(&self.shared, &self.id)
    }

    pub(crate) async fn route(&self) -> Result<Route, ApiError> {
        let id = self.id.clone();
        ask(&self.shared, |reply| LeasesMsg::Route {
            session_id: id,
            reply,
        })
        .await?
    }

    pub(crate) async fn request<P: Serialize, R: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        params: &P,
        timeout: Duration,
    ) -> Result<R, ApiError> {
        let route = self.route().await?;
        route
            .request(method, params, timeout)
            .await
            .map_err(ApiError::from_call)
    }

    fn count_resend(&self, method: Method) {
        self.shared
            .metrics
            .resends
            .get_or_create(&crate::harness::metrics::MethodLabel {
                method: method.as_str().to_owned(),
            })
            .inc();
    }

    /// [`ApiError::from_call`], counting requests refused as too large.
    fn call_error(&self, e: CallError) -> ApiError {
        if matches!(e, CallError::TooLarge { .. }) {
            self.shared.metrics.frames_refused.inc();
        }
        ApiError::from_call(e)
    }

    /// The route to this session on a connection other than `stale`: the
    /// one its executor resumed it on. Waits (woken by the leases actor,
    /// see [`Shared::route_changes`]) while the executor is away, at most
    /// until `deadline`.
    ///
    /// # Errors
    ///
    /// The route's own error once it is final (the session ended: its
    /// lease expired, or the executor came back without it), or `lost`
    /// when `deadline` passes first.
    async fn next_route(
        &self,
        stale: ConnId,
        deadline: tokio::time::Instant,
        lost: impl Fn() -> ApiError,
    ) -> Result<Route, ApiError> {
        let mut changes = self.shared.route_changes();
        loop {
            changes.borrow_and_update();
            match self.route().await {
                Ok(r) if r.conn != stale => return Ok(r),
                Ok(_) => {}
                Err(e) if e.error.reason() == Some("executor_disconnected") => {}
                Err(e) => return Err(e),
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(shutting_down()),
                Err(_) => return Err(lost()),
            }
        }
    }

    /// An idempotent request (the executor dedupes it by its id, or it has
    /// no effect): when the connection is lost before the answer, it is
    /// sent again on the connection that resumes the session, until it is
    /// answered or the session's lease is over. So a call in flight during
    /// a drop gets its answer instead of 502 (docs/api.md, "Dropped
    /// connections").
    ///
    /// # Errors
    ///
    /// As [`Session::request`]; when the executor does not come back
    /// within the lease TTL, the session's error (410, `lease_expired`).
    pub(crate) async fn request_resending<P: Serialize, R: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        params: &P,
        timeout: Duration,
    ) -> Result<R, ApiError> {
        let mut route = self.route().await?;
        let deadline = tokio::time::Instant::now()
            + timeout
            + Duration::from_millis(self.shared.config.lease_ttl_ms);
        loop {
            match route.request(method, params, timeout).await {
                Err(CallError::Closed) => {
                    tracing::debug!(session = %self.id, %method, "connection lost with a request in flight: waiting to send it again");
                    route = self
                        .next_route(route.conn, deadline, || {
                            ApiError::from_call(CallError::Closed)
                        })
                        .await?;
                    self.count_resend(method);
                }
                r => return r.map_err(|e| self.call_error(e)),
            }
        }
    }

    /// `process.start`; `params.session_id` is set to this session. A
    /// `fileTransfer` gets its data path filled in here
    /// ([`Session::prepare_transfer`]).
    pub async fn start_process(
        &self,
        mut params: ProcessStartParams,
    ) -> Result<ProcessState, ApiError> {
        if let Some(mut ft) = params.file_transfer.take() {
            // An upload ticket minted here ends with its TTL: this call
            // does not wait for the transfer to end.
            self.prepare_transfer(&mut ft).await?;
            params.file_transfer = Some(ft);
        }
        self.start_process_raw(params).await
    }

    /// `process.start` as given (a file transfer's data path filled in).
    pub(crate) async fn start_process_raw(
        &self,
        mut params: ProcessStartParams,
    ) -> Result<ProcessState, ApiError> {
        params.session_id = self.id.clone();
        if params.process_id.is_empty() {
            params.process_id = format!("p-{}", uuid::Uuid::new_v4().simple());
        }
        let timeout =
            self.shared.config.request_timeout + Duration::from_millis(params.wait_ms.unwrap_or(0));
        // Deduped by `processId` (same spec: the current state).
        self.request_resending(Method::ProcessStart, &params, timeout)
            .await
    }

    pub async fn list_processes(&self) -> Result<Vec<ProcessState>, ApiError> {
        let r: ProcessListResult = self
            .request_resending(
                Method::ProcessList,
                &SessionRefParams {
                    session_id: self.id.clone(),
                },
                self.shared.config.request_timeout,
            )
            .await?;
        Ok(r.processes)
    }

    /// `process.read`, a long poll when `wait_ms` is given (capped by the
    /// harness's `max_read_wait_ms`).
    pub async fn read(&self, req: ReadRequest) -> Result<ProcessReadResult, ApiError> {
        let wait = req
            .wait_ms
            .map(|w| w.min(self.shared.config.max_read_wait_ms));
        let params = ProcessReadParams {
            session_id: self.id.clone(),
            process_id: req.process_id,
            stream: req.stream,
            cursor: req.cursor,
            max_bytes: req.max_bytes,
            wait_ms: wait,
        };
        let timeout = self.shared.config.request_timeout + Duration::from_millis(wait.unwrap_or(0));
        let stream = params.stream;
        // A read has no effect on the executor: sending it again is safe.
        let r: ProcessReadResult = self
            .request_resending(Method::ProcessRead, &params, timeout)
            .await?;
        self.shared
            .metrics
            .output_bytes
            .get_or_create(&crate::harness::metrics::StreamLabel {
                stream: match stream {
                    Stream::Stdout => "stdout",
                    Stream::Stderr => "stderr",
                }
                .to_owned(),
            })
            .inc_by(r.data.len() as u64);
        if r.gap {
            self.shared.metrics.ring_gaps.inc();
        }
        Ok(r)
    }

    /// `process.write`: bytes to stdin, optionally closing it.
    pub async fn write(
        &self,
        process_id: &str,
        data: Vec<u8>,
        close_stdin: bool,
    ) -> Result<Accepted, ApiError> {
        let params = ProcessWriteParams {
            session_id: self.id.clone(),
            process_id: process_id.to_owned(),
            data: Blob::from(data),
            close_stdin,
        };
        self.request(
            Method::ProcessWrite,
            &params,
            self.shared.config.request_timeout,
        )
        .await
    }

    pub async fn interrupt(&self, process_id: &str) -> Result<ProcessState, ApiError> {
        let params = ProcessRefParams {
            session_id: self.id.clone(),
            process_id: process_id.to_owned(),
        };
        self.request(
            Method::ProcessInterrupt,
            &params,
            self.shared.config.request_timeout,
        )
        .await
    }

    pub async fn terminate(
        &self,
        process_id: &str,
        grace_ms: Option<u64>,
    ) -> Result<ProcessState, ApiError> {
        let params = ProcessTerminateParams {
            session_id: self.id.clone(),
            process_id: process_id.to_owned(),
            grace_ms,
        };
        let timeout =
            self.shared.config.request_timeout + Duration::from_millis(grace_ms.unwrap_or(5_000));
        self.request(Method::ProcessTerminate, &params, timeout)
            .await
    }

    /// Call a tool and wait for its result. The result is delivered once
    /// per `toolCallId`; if the executor is lost and its lease expires
    /// first, the call fails with 502 `tool_outcome_unknown`.
    pub async fn call_tool(&self, call: ToolCall) -> Result<ToolResultParams, ApiError> {
        let started = std::time::Instant::now();
        let r = self.call_tool_once(call).await;
        let outcome = match &r {
            Ok(r) => match serde_json::to_value(r.outcome) {
                Ok(serde_json::Value::String(s)) => s,
                _ => "unknown".to_owned(),
            },
            Err(e) => match e.error.reason() {
                Some(
                    reason @ ("tool_outcome_unknown" | "frame_too_large" | "executor_disconnected"),
                ) => reason.to_owned(),
                _ if e.status == 504 => "timeout".to_owned(),
                _ if e.status < 500 => "refused".to_owned(),
                _ => "error".to_owned(),
            },
        };
        self.shared
            .metrics
            .tool_call(&outcome, started.elapsed().as_secs_f64());
        r
    }

    async fn call_tool_once(&self, call: ToolCall) -> Result<ToolResultParams, ApiError> {
        if call.tool.is_empty() {
            return Err(ApiError::bad_request("tool is required"));
        }
        let tool_call_id = call
            .tool_call_id
            .clone()
            .unwrap_or_else(|| format!("t-{}", uuid::Uuid::new_v4().simple()));
        if tool_call_id.is_empty() || tool_call_id.len() > 256 {
            return Err(ApiError::bad_request(
                "toolCallId must be 1 to 256 characters",
            ));
        }
        let (wtx, mut wrx) = oneshot::channel();
        let (sid, tid) = (self.id.clone(), tool_call_id.clone());
        let route = ask(&self.shared, |reply| LeasesMsg::ToolWait {
            session_id: sid,
            tool_call_id: tid,
            waiter: wtx,
            reply,
        })
        .await??;
        let forget = || {
            if let Some(leases) = self.shared.leases() {
                let _ = leases.send_message(LeasesMsg::ToolForget {
                    session_id: self.id.clone(),
                    tool_call_id: tool_call_id.clone(),
                });
            }
        };
        let limit = match call.deadline_ms {
            Some(d) => Duration::from_millis(d) + Duration::from_secs(5),
            None => self.shared.config.tool_timeout,
        };
        let deadline = tokio::time::Instant::now() + limit;
        let params = ToolCallParams {
            session_id: self.id.clone(),
            tool_call_id: tool_call_id.clone(),
            tool: call.tool.clone(),
            input: call.input.clone(),
            deadline_ms: call.deadline_ms,
            permission: None,
        };
        // Send `tool.call` until the executor has accepted it once. A
        // connection lost (or silent) before the answer leaves the call's
        // fate unknown: it is sent again on the connection that resumes
        // the session (the executor runs a `toolCallId` at most once and
        // sends its result again), so a call lost in a drop is not left
        // hanging. When the session ends instead (lease expired), its
        // waiter gets `tool_outcome_unknown` from the leases actor.
        let send = async {
            let Some(mut route) = route else {
                return Ok(());
            };
            loop {
                let sent = route
                    .request::<_, serde_json::Value>(
                        Method::ToolCall,
                        &params,
                        self.shared.config.request_timeout,
                    )
                    .await;
                match sent {
                    Ok(_) => return Ok(()),
                    Err(CallError::Closed) | Err(CallError::Timeout(_)) => {
                        tracing::debug!(session = %self.id, tool_call = %tool_call_id, "tool.call unanswered on a lost connection: sending it again on the resumed one");
                        match self
                            .next_route(route.conn, deadline, || {
                                ApiError::from_call(CallError::Closed)
                            })
                            .await
                        {
                            Ok(r) => {
                                route = r;
                                self.count_resend(Method::ToolCall);
                            }
                            // Over: the waiter is answered (or times out).
                            Err(_) => return Ok(()),
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        tokio::pin!(send);
        let expired = tokio::time::sleep_until(deadline);
        tokio::pin!(expired);
        let mut sending = true;
        loop {
            tokio::select! {
                r = &mut wrx => return match r {
                    Ok(r) => r,
                    // The leases actor crashed with the waiter; its
                    // successor does not know the call, so its outcome is
                    // unknown to us.
                    Err(_) if !self.shared.shutdown.is_cancelled() => {
                        Err(ApiError::tool_outcome_unknown(&tool_call_id))
                    }
                    Err(_) => Err(shutting_down()),
                },
                sent = &mut send, if sending => {
                    sending = false;
                    if let Err(e) = sent {
                        // The executor refused the call: the waiter may
                        // still have got a result (a repeated id); prefer it.
                        if let Ok(Ok(r)) = wrx.try_recv() {
                            return Ok(r);
                        }
                        drop(wrx);
                        forget();
                        return Err(self.call_error(e));
                    }
                }
                _ = &mut expired => {
                    drop(wrx);
                    forget();
                    return Err(ApiError::rpc(RpcError::timeout(format!(
                        "no result for tool call {tool_call_id:?} within {limit:?}"
                    ))));
                }
            }
        }
    }

    /// Stop the session: `session.stop`, then wait for `session.ended` or
    /// the stop deadline; returns the ended session.
    pub async fn stop(&self) -> Result<SessionInfo, ApiError> {
        match self.stop_once().await {
            // The leases actor crashed with the waiter: ask its successor.
            Err(StopLost) if !self.shared.shutdown.is_cancelled() => self
                .stop_once()
                .await
                .unwrap_or_else(|StopLost| Err(shutting_down())),
            Err(StopLost) => Err(shutting_down()),
            Ok(r) => r,
        }
    }

    async fn stop_once(&self) -> Result<Result<SessionInfo, ApiError>, StopLost> {
        let (wtx, wrx) = oneshot::channel();
        let sid = self.id.clone();
        let route = match ask(&self.shared, |reply| LeasesMsg::Stop {
            session_id: sid,
            waiter: wtx,
            reply,
        })
        .await
        {
            Ok(Ok(route)) => route,
            Ok(Err(e)) | Err(e) => return Ok(Err(e)),
        };
        let deadline_ms = self.shared.config.stop_deadline_ms;
        if let Some(route) = route {
            let params = StopParams {
                session_id: self.id.clone(),
                reason: "stopped".into(),
                deadline_ms: Some(deadline_ms),
                keep_workspace: false,
            };
            // The database decides before every stop (issue 54): only
            // while the row names this replica and this grant.
            if !holds(&self.shared, &self.id, route.fencing_token).await {
                let _ = self
                    .shared
                    .send_leases(LeasesMsg::Superseded {
                        session_id: self.id.clone(),
                        fencing_token: route.fencing_token,
                    })
                    .await;
                return Ok(Err(ApiError::rpc(
                    RpcError::conflict(
                        "session_moved",
                        format!(
                            "session {:?} is held by another replica; ask again",
                            self.id
                        ),
                    )
                    .with_retryable(true),
                )));
            }
            let r = route
                .request::<_, StopResult>(
                    Method::SessionStop,
                    &params,
                    self.shared.config.request_timeout,
                )
                .await;
            if let Err(e) = r {
                tracing::info!(session = %self.id, error = %e, "session.stop failed");
                // The executor does not know the session: nothing will end it.
                if matches!(&e, CallError::Rpc(r) if r.kind() == Some(ErrorCode::SessionNotActive))
                {
                    self.force_end("stopped");
                }
            }
        }
        let limit = Duration::from_millis(deadline_ms) + Duration::from_secs(2);
        let mut wrx = wrx;
        Ok(match tokio::time::timeout(limit, &mut wrx).await {
            Ok(Ok(info)) => Ok(info),
            Ok(Err(_)) => return Err(StopLost),
            Err(_) => {
                self.force_end("stop_timeout");
                match tokio::time::timeout(Duration::from_secs(2), wrx).await {
                    Ok(Ok(info)) => Ok(info),
                    _ => self
                        .info()
                        .filter(|i| i.state == SessionState::Ended)
                        .ok_or_else(shutting_down),
                }
            }
        })
    }

    fn force_end(&self, reason: &str) {
        if let Some(leases) = self.shared.leases() {
            let _ = leases.send_message(LeasesMsg::ForceEnd {
                session_id: self.id.clone(),
                reason: reason.to_owned(),
            });
        }
    }
}
