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
