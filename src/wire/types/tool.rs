//! `tool.*` methods (PROTOCOL.md §6).

use serde_json::Value;

wire_struct! {
    pub struct Permission {
        pub mode: String,
    }
}

wire_struct! {
    pub struct ToolCallParams {
        pub session_id: String,
        pub tool_call_id: String,
        pub tool: String,
        #[cfg_attr(test, proptest(strategy = "super::arb::json()"))]
        #[serde(default)]
        pub input: Value,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub deadline_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub permission: Option<Permission>,
    }
}

wire_enum! {
    pub enum Outcome { Succeeded, Failed, Canceled }
}

wire_enum! {
    pub enum ContentType { Text, Image, Resource, Artifact }
}

wire_struct! {
    /// A content block of a tool result.
    pub struct ContentBlock {
        #[serde(rename = "type")]
        pub kind: ContentType,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub text: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub data: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub mime_type: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub url: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub artifact_id: Option<String>,
    }
}

impl ContentBlock {
    pub fn text(text: impl Into<String>) -> Self {
        ContentBlock {
            kind: ContentType::Text,
            text: Some(text.into()),
            data: None,
            mime_type: None,
            url: None,
            artifact_id: None,
        }
    }
}

wire_struct! {
    pub struct ToolResultParams {
        pub session_id: String,
        pub tool_call_id: String,
        pub outcome: Outcome,
        pub is_error: bool,
        #[serde(default)]
        pub content: Vec<ContentBlock>,
        #[serde(default)]
        #[cfg_attr(test, proptest(strategy = "super::arb::json_vec()"))]
        pub artifacts: Vec<Value>,
        pub duration_ms: u64,
        /// `reason` of a failed outcome (`workspace_boundary`, `timeout`,
        /// `invalid_input`, ...): a bmx extension documented in docs/protocol.md.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub reason: Option<String>,
    }
}

wire_struct! {
    pub struct ToolCancelParams {
        pub session_id: String,
        pub tool_call_id: String,
        #[serde(default)]
        pub reason: String,
    }
}

wire_struct! {
    pub struct ToolCancelResult {
        pub canceled: bool,
    }
}

wire_struct! {
    pub struct ToolProgressParams {
        pub session_id: String,
        pub tool_call_id: String,
        pub message: String,
    }
}
