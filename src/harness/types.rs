//! What the harness shows a platform: executors, sessions, and events.

use crate::harness::api::mcp::McpServerInfo;
use crate::wire::types::{
    Capabilities, EventDeltaParams, JsonMap, McpServerStatus, ProcessStatusParams,
    SessionEventParams, SessionStatus, ToolProgressParams, ToolResultParams,
};
use serde::{Deserialize, Serialize};

/// One live executor connection (`GET /v1/executors`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecutorView {
    pub executor_id: String,
    pub connection_id: String,
    /// `ready`, or `draining` once told to drain (`POST …/drain`).
    pub state: String,
    pub name: String,
    pub version: String,
    /// Sessions leased to this connection.
    pub active_sessions: Vec<String>,
    pub connected_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    #[serde(default)]
    pub capabilities: Capabilities,
    /// Over several replicas (docs/store.md, "Several replicas"): the id
    /// of the replica holding the connection. Absent without replicas, so
    /// a single harness answers as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
}

/// Where a session is in its life; its rules are in [`crate::lease::session_view`].
pub use crate::lease::SessionState;

/// A session (`GET /v1/sessions/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionInfo {
    pub session_id: String,
    pub executor_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connection_id: Option<String>,
    pub fencing_token: u64,
    pub lease_token: String,
    pub state: SessionState,
    /// Whether `session.ready` arrived.
    pub ready: bool,
    /// The last `session.status` of the executor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<SessionStatus>,
    /// The `detail` of that `session.status` (e.g. why a restore failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_detail: Option<String>,
    pub created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_reason: Option<String>,
    #[serde(default)]
    pub metadata: JsonMap,
    /// The last `process.status` of every process, by process id order.
    #[serde(default)]
    pub processes: Vec<ProcessStatusParams>,
    /// The session's MCP servers: their specs (`secretEnv` values
    /// redacted) and their last state from `session.status`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<McpServerInfo>,
}

impl SessionInfo {
    /// A session as its grant starts it: not ready, no status, no
    /// processes, no metadata or MCP servers yet, not ended.
    pub fn new(
        session_id: String,
        executor_id: String,
        fencing_token: u64,
        lease_token: String,
        state: SessionState,
        created_at: String,
    ) -> SessionInfo {
        SessionInfo {
            session_id,
            executor_id,
            connection_id: None,
            fencing_token,
            lease_token,
            state,
            ready: false,
            status: None,
            status_detail: None,
            created_at,
            ended_at: None,
            ended_reason: None,
            metadata: JsonMap::default(),
            processes: Vec::new(),
            mcp_servers: Vec::new(),
        }
    }
}

/// Something a platform may want to react to. Delivered on
/// [`HarnessHandle::events`](super::HarnessHandle::events) and to the
/// callback of [`HarnessBuilder::on_event`](super::HarnessBuilder::on_event).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HarnessEvent {
    ExecutorConnected {
        executor_id: String,
        connection_id: String,
    },
    ExecutorDisconnected {
        executor_id: String,
        connection_id: String,
        /// The WebSocket close code, when one was seen (4004 replaced, 4008 silent, ...).
        code: Option<u16>,
        reason: String,
    },
    SessionAssigned {
        session_id: String,
        executor_id: String,
        fencing_token: u64,
    },
    SessionReady {
        session_id: String,
    },
    SessionStatus {
        session_id: String,
        status: SessionStatus,
        detail: Option<String>,
        /// The state of each MCP server (bmx extension), when it has any.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        mcp_servers: Vec<McpServerStatus>,
    },
    SessionEnded {
        session_id: String,
        reason: String,
    },
    ProcessStatus(ProcessStatusParams),
    ToolProgress(ToolProgressParams),
    /// Delivered once per `toolCallId`, duplicates from the executor are not repeated.
    ToolResult(ToolResultParams),
    /// An agent event, once per sequence (resends are not repeated).
    SessionEvent(SessionEventParams),
    SessionEventDelta(EventDeltaParams),
    /// An interaction became pending, or was answered, canceled or expired.
    Interaction(Box<crate::harness::interactions::InteractionView>),
    /// A v1.1 frame the harness does not act on (terminals),
    /// passed through as it came. MCP frames never appear here: their
    /// payloads may carry secrets.
    Other {
        method: String,
        params: serde_json::Value,
    },
}
