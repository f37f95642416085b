//! `terminal.*` methods (PROTOCOL.md §8, v1.1).

use crate::wire::Blob;
use std::collections::BTreeMap;

wire_struct! {
    pub struct TerminalOpenParams {
        pub terminal_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub kind: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub argv: Option<Vec<String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub shell: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub cwd: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub env: Option<BTreeMap<String, String>>,
        pub cols: u16,
        pub rows: u16,
    }
}

wire_struct! {
    pub struct TerminalOpenResult {
        pub terminal_id: String,
        pub pid: u32,
        pub cols: u16,
        pub rows: u16,
        pub created_at: String,
        pub epoch: u64,
        pub earliest_seq: u64,
        pub latest_seq: u64,
    }
}

wire_struct! {
    /// `host` of `terminal.attach`: where the executor dials to stream bytes.
    pub struct AttachHost {
        pub url: String,
        pub ticket: String,
    }
}

wire_struct! {
    pub struct TerminalAttachParams {
        pub terminal_id: String,
        pub stream_id: String,
        pub from_seq: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub ack_seq: Option<u64>,
        #[serde(default)]
        pub can_write: bool,
        #[serde(default)]
        pub epoch: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub host: Option<AttachHost>,
    }
}

wire_struct! {
    pub struct TerminalAttachResult {
        pub accepted: bool,
        pub writer_epoch: u64,
    }
}

wire_struct! {
    pub struct TerminalInputParams {
        pub terminal_id: String,
        pub stream_id: String,
        pub epoch: u64,
        pub data: Blob,
    }
}

wire_struct! {
    pub struct TerminalResizeParams {
        pub terminal_id: String,
        pub cols: u16,
        pub rows: u16,
        /// The stream asking: resize is accepted from the writer only.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub stream_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub epoch: Option<u64>,
    }
}

wire_struct! {
    pub struct TerminalCloseParams {
        pub terminal_id: String,
        #[serde(default)]
        pub reason: String,
    }
}

wire_struct! {
    pub struct TerminalCloseResult {
        pub closed: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub exit_code: Option<i32>,
    }
}

wire_struct! {
    pub struct TerminalOutputParams {
        pub terminal_id: String,
        pub stream_id: String,
        pub seq: u64,
        pub data: Blob,
    }
}

wire_struct! {
    pub struct TerminalExitedParams {
        pub terminal_id: String,
        pub exit_code: i32,
    }
}
