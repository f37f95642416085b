//! `mcp.*` methods and `session.assign.mcpServers[]` (PROTOCOL.md §9, v1.1).

use std::collections::BTreeMap;

wire_enum! {
    pub enum ConnectionOrigin { Environment, Service }
}

wire_enum! {
    pub enum McpTransportType { Stdio, Http }
}

wire_struct! {
    pub struct McpTransport {
        #[serde(rename = "type")]
        pub kind: McpTransportType,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub command: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub args: Option<Vec<String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub cwd: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub env: Option<BTreeMap<String, String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub secret_env: Option<BTreeMap<String, String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub command_sha256: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub url: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub timeout_ms: Option<u64>,
    }
}

wire_struct! {
    pub struct McpServerSpec {
        pub server_key: String,
        pub connection_origin: ConnectionOrigin,
        pub transport: McpTransport,
        /// bmx extension: how often a crashed server is restarted before it
        /// is reported `unavailable` (default 3 restarts in 60 s).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub restart_budget: Option<McpRestartBudget>,
    }
}

wire_struct! {
    #[derive(Copy)]
    pub struct McpRestartBudget {
        pub max_restarts: u32,
        pub window_ms: u64,
    }
}

impl Default for McpRestartBudget {
    fn default() -> Self {
        McpRestartBudget {
            max_restarts: 3,
            window_ms: 60_000,
        }
    }
}

wire_enum! {
    /// Where one MCP server of a session stands.
    pub enum McpServerState {
        /// Started, `initialize` not answered yet.
        Starting,
        /// Initialized: requests reach it.
        Ready,
        /// Crashed; restarting after a backoff.
        Restarting,
        /// Not started, failed, or crashed past its restart budget: every
        /// request to it gets an MCP error. `reason` says why.
        Unavailable,
    }
}

wire_struct! {
    /// bmx extension of `session.status`: one entry per MCP server of the
    /// session, sent on every change of any of them.
    pub struct McpServerStatus {
        pub server_key: String,
        pub state: McpServerState,
        /// Restarts so far (crashes that were restarted).
        pub restarts: u32,
        /// snake_case, when `unavailable`: `command_sha256_mismatch`,
        /// `spawn_failed`, `initialize_failed`, `restart_budget_exhausted`,
        /// `unsupported_transport`, `invalid_spec`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub reason: Option<String>,
        /// The last error seen (never a secret value).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub last_error: Option<String>,
    }
}

wire_struct! {
    pub struct McpOpenParams {
        pub session_id: String,
        pub server_key: String,
    }
}

wire_struct! {
    pub struct McpOpenResult {
        pub opened: bool,
    }
}

wire_struct! {
    pub struct McpFrameParams {
        pub session_id: String,
        pub server_key: String,
        pub payload: String,
    }
}

wire_struct! {
    pub struct McpCloseParams {
        pub session_id: String,
        pub server_key: String,
        #[serde(default)]
        pub reason: String,
    }
}

wire_struct! {
    pub struct McpCloseResult {
        pub closed: bool,
    }
}
