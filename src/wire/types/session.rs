//! `session.*` methods (PROTOCOL.md §5).

use super::{JsonMap, McpServerSpec};
use serde_json::Value;

wire_struct! {
    /// `lease` of `session.assign`.
    pub struct LeaseGrant {
        pub token: String,
        pub fencing_token: u64,
    }
}

wire_struct! {
    pub struct AssignParams {
        pub session_id: String,
        pub work_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub agent_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub environment_id: Option<String>,
        pub lease: LeaseGrant,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub deadline_ms: Option<u64>,
        #[serde(default)]
        pub mcp_servers: Vec<McpServerSpec>,
        #[serde(default)]
        #[cfg_attr(test, proptest(strategy = "super::arb::json_map()"))]
        pub metadata: JsonMap,
        #[serde(default)]
        #[cfg_attr(test, proptest(strategy = "super::arb::json_vec()"))]
        pub resources: Vec<Value>,
        /// Restore a workspace backup into the fresh workspace before
        /// `session.ready` (bmx extension, docs/protocol.md "Restore").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub restore: Option<RestoreSource>,
    }
}

wire_struct! {
    /// `session.assign.restore`: the archive (a `workspace.backup` tar,
    /// zstd-compressed or not) and the one-time download of it.
    pub struct RestoreSource {
        /// `sha256:<hex>`: checked before the archive is read.
        pub digest: String,
        pub download_url: String,
        pub download_token: String,
        pub download_expires_at: String,
    }
}

wire_struct! {
    pub struct AssignResult {
        pub accepted: bool,
        pub session_id: String,
    }
}

wire_struct! {
    pub struct ReadyParams {
        pub session_id: String,
        pub work_id: String,
        pub lease_token: String,
    }
}

wire_enum! {
    pub enum SessionStatus { Starting, Running, Idle, Stopping, Stopped, Error }
}

wire_struct! {
    /// `session.status` notification.
    pub struct StatusParams {
        pub session_id: String,
        pub status: SessionStatus,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub detail: Option<String>,
        /// bmx extension: the session's MCP servers, when it has any.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub mcp_servers: Vec<super::McpServerStatus>,
    }
}

wire_struct! {
    pub struct StopParams {
        pub session_id: String,
        pub reason: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub deadline_ms: Option<u64>,
        /// Keep the workspace directory instead of removing it (PROTOCOL.md
        /// §5 "unless told to keep it").
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub keep_workspace: bool,
    }
}

wire_struct! {
    pub struct StopResult {
        pub stopped: bool,
    }
}

/// The end reasons bmx itself produces in `session.ended.reason`. The
/// field stays a string on the wire: the reason of a `session.stop` is the
/// harness's own word and is reported back as given.
pub struct EndReason;

impl EndReason {
    /// The executor stopped (or was told to stop the session without a reason).
    pub const SHUTDOWN: &'static str = "shutdown";
    /// The connection stayed away longer than the lease TTL.
    pub const LEASE_EXPIRED: &'static str = "lease_expired";
    /// A drain's deadline passed with the session still running.
    pub const DRAIN_DEADLINE: &'static str = "drain_deadline";
    /// The session's actor crashed: it is ended, never silently recreated.
    pub const INTERNAL_ERROR: &'static str = "internal_error";
}

wire_struct! {
    pub struct EndedParams {
        pub session_id: String,
        pub reason: String,
    }
}

wire_struct! {
    pub struct SessionCloseParams {
        pub session_id: String,
        pub reason: String,
    }
}

wire_struct! {
    pub struct SessionCloseResult {
        pub closed: bool,
    }
}
