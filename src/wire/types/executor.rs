//! `executor.*` methods (PROTOCOL.md §3).

use super::Capabilities;

wire_struct! {
    /// Who the executor is: `executor` in the register params.
    pub struct ExecutorInfo {
        pub name: String,
        pub version: String,
        pub os: String,
        pub arch: String,
    }
}

wire_struct! {
    /// `resume` of a reconnecting register.
    pub struct Resume {
        pub executor_id: String,
        pub last_connection_id: String,
        pub active_sessions: Vec<String>,
        /// bmx extension (docs/protocol.md, "Fencing on every session
        /// request"): the highest fencing token the executor holds for each
        /// session of `activeSessions`. A seed peer omits it.
        #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
        pub fencing_tokens: std::collections::BTreeMap<String, u64>,
    }
}

wire_struct! {
    pub struct RegisterParams {
        pub protocol: String,
        pub executor: ExecutorInfo,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub environment_id: Option<String>,
        #[serde(default)]
        pub capabilities: Capabilities,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub resume: Option<Resume>,
    }
}

wire_struct! {
    /// Limits the harness sets for this connection (register result).
    /// Absent members take the protocol defaults (see the accessors).
    #[derive(Default)]
    pub struct Limits {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_process_read_bytes: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_concurrent_process_reads: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_process_write_bytes: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_processes_per_session: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_sessions: Option<u32>,
    }
}

impl Limits {
    pub const DEFAULT_PROCESS_READ_BYTES: u64 = 1 << 20;
    pub const DEFAULT_CONCURRENT_PROCESS_READS: u32 = 16;
    pub const DEFAULT_PROCESS_WRITE_BYTES: u64 = 1 << 20;

    pub fn process_read_bytes(&self) -> u64 {
        self.max_process_read_bytes
            .unwrap_or(Self::DEFAULT_PROCESS_READ_BYTES)
    }
    pub fn concurrent_process_reads(&self) -> u32 {
        self.max_concurrent_process_reads
            .unwrap_or(Self::DEFAULT_CONCURRENT_PROCESS_READS)
    }
    pub fn process_write_bytes(&self) -> u64 {
        self.max_process_write_bytes
            .unwrap_or(Self::DEFAULT_PROCESS_WRITE_BYTES)
    }
}

wire_struct! {
    pub struct RegisterResult {
        pub executor_id: String,
        pub connection_id: String,
        pub protocol: String,
        pub heartbeat_interval_ms: u64,
        pub lease_ttl_ms: u64,
        #[serde(default)]
        pub limits: Limits,
        pub max_control_frame_bytes: u64,
        pub max_mcp_frame_bytes: u64,
        pub server_time: String,
        #[serde(default)]
        pub drain: bool,
    }
}

impl RegisterResult {
    pub const DEFAULT_HEARTBEAT_MS: u64 = 10_000;
    pub const DEFAULT_LEASE_TTL_MS: u64 = 30_000;
    pub const DEFAULT_CONTROL_FRAME_BYTES: u64 = 1 << 20;
    pub const DEFAULT_MCP_FRAME_BYTES: u64 = 4 << 20;
}

wire_struct! {
    pub struct Load {
        #[cfg_attr(test, proptest(strategy = "super::arb::percent()"))]
        pub cpu_percent: f64,
        #[cfg_attr(test, proptest(strategy = "super::arb::percent()"))]
        pub memory_percent: f64,
    }
}

wire_struct! {
    pub struct HeartbeatParams {
        pub connection_id: String,
        pub active_sessions: Vec<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub load: Option<Load>,
    }
}

wire_struct! {
    pub struct HeartbeatResult {
        pub lease_ttl_ms: u64,
        pub server_time: String,
        #[serde(default)]
        pub drain: bool,
    }
}

wire_struct! {
    pub struct TokenRefreshParams {
        /// Never printed (`Debug` shows `***`).
        pub token: crate::wire::Secret,
    }
}

wire_struct! {
    pub struct TokenRefreshResult {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub expires_at: Option<String>,
    }
}

wire_struct! {
    pub struct CapabilitiesUpdateParams {
        pub capabilities: Capabilities,
    }
}

wire_struct! {
    /// `executor.close {reason}`.
    pub struct CloseParams {
        pub reason: String,
    }
}

wire_struct! {
    pub struct DrainParams {
        pub reason: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub deadline_ms: Option<u64>,
    }
}

wire_struct! {
    pub struct DrainResult {
        pub accepted: bool,
        pub active_sessions: Vec<String>,
    }
}
