//! Agent turns, session events and interactions (PROTOCOL.md §10, v1.1).

use super::JsonMap;
use serde_json::Value;

wire_enum! {
    pub enum TurnInputType { Text, File }
}

wire_struct! {
    pub struct TurnInputItem {
        #[serde(rename = "type")]
        pub kind: TurnInputType,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub text: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub file_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub mime_type: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub size_bytes: Option<u64>,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct TurnConfig {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub model: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub cwd: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub permission_mode: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub system: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub thinking_level: Option<String>,
        /// bmx extension: which of the executor's named agents runs the
        /// turn (default: the first it advertises).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub agent: Option<String>,
    }
}

wire_struct! {
    pub struct TurnStartParams {
        pub session_id: String,
        pub turn_id: String,
        pub input_id: String,
        pub input: Vec<TurnInputItem>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub config: Option<TurnConfig>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub deadline_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub executor_session_ref: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        #[cfg_attr(test, proptest(strategy = "super::arb::opt_json_map()"))]
        pub metadata: Option<JsonMap>,
    }
}

wire_struct! {
    pub struct TurnStartResult {
        pub accepted: bool,
        pub turn_id: String,
        #[cfg_attr(test, proptest(strategy = "super::arb::json()"))]
        #[serde(default)]
        pub effective: Value,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub executor_session_ref: Option<String>,
        pub resumed: bool,
    }
}

wire_struct! {
    pub struct SessionEventParams {
        pub session_id: String,
        pub turn_id: String,
        pub event_id: String,
        pub sequence: u64,
        #[cfg_attr(test, proptest(strategy = "super::arb::json()"))]
        pub event: Value,
    }
}

wire_struct! {
    pub struct SessionEventResult {
        pub accepted: bool,
        pub acked_sequence: u64,
        pub event_id: String,
    }
}

wire_struct! {
    pub struct EventDeltaParams {
        pub session_id: String,
        pub turn_id: String,
        pub event_id: String,
        pub event_type: String,
        pub index: u64,
        pub text: String,
    }
}

wire_struct! {
    pub struct TurnInputParams {
        pub session_id: String,
        pub turn_id: String,
        pub input_id: String,
        pub input: Vec<TurnInputItem>,
    }
}

wire_struct! {
    pub struct TurnCancelParams {
        pub session_id: String,
        pub turn_id: String,
        #[serde(default)]
        pub reason: String,
    }
}

wire_struct! {
    pub struct TurnCancelResult {
        pub canceled: bool,
    }
}

wire_enum! {
    pub enum InteractionKind { Permission, Question }
}

wire_enum! {
    pub enum InteractionScope { Once, Session }
}

wire_struct! {
    pub struct QuestionOption {
        pub id: String,
        pub label: String,
    }
}

wire_struct! {
    pub struct QuestionSpec {
        pub prompt: String,
        pub options: Vec<QuestionOption>,
        #[serde(default)]
        pub multi_select: bool,
        #[serde(default)]
        pub allow_free_text: bool,
    }
}

wire_struct! {
    pub struct InteractionRequestParams {
        pub session_id: String,
        pub turn_id: String,
        pub interaction_id: String,
        pub kind: InteractionKind,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub tool_name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        #[cfg_attr(test, proptest(strategy = "super::arb::opt_json()"))]
        pub tool_input: Option<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub tool_use_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub question: Option<QuestionSpec>,
        #[serde(default)]
        pub scopes: Vec<InteractionScope>,
        pub expires_at: String,
    }
}

wire_struct! {
    pub struct InteractionRequestResult {
        pub accepted: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub platform_interaction_id: Option<String>,
    }
}

wire_enum! {
    pub enum InteractionOutcome { Allow, Deny, Answered, Canceled, Expired }
}

wire_struct! {
    pub struct InteractionResponder {
        pub actor_id: String,
        pub surface: String,
    }
}

wire_struct! {
    pub struct InteractionResponseParams {
        pub session_id: String,
        pub interaction_id: String,
        pub outcome: InteractionOutcome,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub scope: Option<InteractionScope>,
        #[serde(skip_serializing_if = "Option::is_none")]
        #[cfg_attr(test, proptest(strategy = "super::arb::opt_json()"))]
        pub answers: Option<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub deny_message: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub responder: Option<InteractionResponder>,
    }
}

wire_enum! {
    pub enum InteractionCancelReason { Expired, ResolvedLocally, ToolCanceled, TurnCanceled }
}

wire_struct! {
    pub struct InteractionCancelParams {
        pub session_id: String,
        pub interaction_id: String,
        pub reason: InteractionCancelReason,
    }
}
