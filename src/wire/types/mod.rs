//! Typed params and results for every method of PROTOCOL.md §12, shared by
//! both peers. Field names are camelCase on the wire; optional members are
//! omitted when absent, and unknown members are ignored so a newer peer can
//! add fields without breaking an older one.

/// Declares a wire struct with the derives every params/result type needs.
macro_rules! wire_struct {
    ($(#[$m:meta])* pub struct $name:ident { $($body:tt)* }) => {
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[serde(rename_all = "camelCase")]
        $(#[$m])*
        pub struct $name { $($body)* }
    };
}

/// Declares a snake_case string enum.
macro_rules! wire_enum {
    ($(#[$m:meta])* pub enum $name:ident { $($(#[$vm:meta])* $variant:ident),* $(,)? }) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[serde(rename_all = "snake_case")]
        $(#[$m])*
        pub enum $name { $($(#[$vm])* $variant),* }
    };
}

pub mod artifact;
pub mod capabilities;
pub mod display;
pub mod executor;
pub mod mcp;
pub mod other;
pub mod process;
pub mod session;
pub mod terminal;
pub mod tool;
pub mod turn;

pub use artifact::*;
pub use capabilities::*;
pub use display::*;
pub use executor::*;
pub use mcp::*;
pub use other::*;
pub use process::*;
pub use session::*;
pub use terminal::*;
pub use tool::*;
pub use turn::*;

/// A JSON object (metadata, free-form members).
pub type JsonMap = serde_json::Map<String, serde_json::Value>;

wire_struct! {
    /// `{accepted}`: the answer of many requests.
    pub struct Accepted {
        pub accepted: bool,
    }
}

impl Accepted {
    pub const YES: Accepted = Accepted { accepted: true };
}

/// The current time as an RFC 3339 string in UTC, as the protocol writes time stamps.
pub fn now_rfc3339() -> String {
    rfc3339(time::OffsetDateTime::now_utc())
}

pub fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| String::from("1970-01-01T00:00:00Z"))
}

/// Strategies for the fields proptest cannot derive.
#[cfg(test)]
pub(crate) mod arb {
    use proptest::prelude::*;
    use serde_json::Value;

    pub fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z0-9 ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(2, 8, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    pub fn json_map() -> impl Strategy<Value = super::JsonMap> {
        proptest::collection::btree_map("[a-zA-Z]{1,6}", json(), 0..4)
            .prop_map(|m| m.into_iter().collect())
    }

    /// `Some(Null)` is sent as `null` and read back as `None`: an optional
    /// JSON member never carries an explicit null.
    pub fn opt_json() -> impl Strategy<Value = Option<Value>> {
        proptest::option::of(json().prop_filter("not null", |v| !v.is_null()))
    }

    pub fn opt_json_map() -> impl Strategy<Value = Option<super::JsonMap>> {
        proptest::option::of(json_map())
    }

    pub fn json_vec() -> impl Strategy<Value = Vec<Value>> {
        proptest::collection::vec(json(), 0..3)
    }

    pub fn percent() -> impl Strategy<Value = f64> {
        (0u32..10_000).prop_map(|v| f64::from(v) / 100.0)
    }
}

#[cfg(test)]
mod roundtrip {
    use super::*;
    use crate::wire::error::RpcError;
    use proptest::prelude::*;

    fn check<T>(value: &T)
    where
        T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let json = serde_json::to_vec(value).expect("json encode");
        let back: T = serde_json::from_slice(&json).expect("json decode");
        assert_eq!(&back, value, "json: {}", String::from_utf8_lossy(&json));
        let mp = rmp_serde::to_vec_named(value).expect("msgpack encode");
        let back: T = rmp_serde::from_slice(&mp).expect("msgpack decode");
        assert_eq!(&back, value, "msgpack");
    }

    macro_rules! roundtrips {
        ($($t:ident),* $(,)?) => {
            proptest! {
                #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
                $(
                    #[test]
                    #[allow(non_snake_case)]
                    fn $t(v in any::<$t>()) { check(&v); }
                )*
            }
        };
    }

    roundtrips!(
        Accepted,
        RpcError,
        Capabilities,
        RegisterParams,
        RegisterResult,
        HeartbeatParams,
        HeartbeatResult,
        TokenRefreshParams,
        TokenRefreshResult,
        CapabilitiesUpdateParams,
        CloseParams,
        DrainParams,
        DrainResult,
        AssignParams,
        AssignResult,
        ReadyParams,
        StatusParams,
        StopParams,
        StopResult,
        EndedParams,
        SessionCloseParams,
        SessionCloseResult,
        ToolCallParams,
        ToolResultParams,
        ToolCancelParams,
        ToolCancelResult,
        ToolProgressParams,
        ProcessStartParams,
        ProcessState,
        ProcessReadParams,
        ProcessReadResult,
        ProcessWriteParams,
        ProcessRefParams,
        ProcessTerminateParams,
        SessionRefParams,
        ProcessListResult,
        ProcessStatusParams,
        TerminalOpenParams,
        TerminalOpenResult,
        TerminalAttachParams,
        TerminalAttachResult,
        TerminalInputParams,
        TerminalResizeParams,
        TerminalCloseParams,
        TerminalCloseResult,
        TerminalOutputParams,
        TerminalExitedParams,
        McpServerSpec,
        McpOpenParams,
        McpOpenResult,
        McpFrameParams,
        McpCloseParams,
        McpCloseResult,
        McpServerStatus,
        McpRestartBudget,
        TurnStartParams,
        TurnStartResult,
        SessionEventParams,
        SessionEventResult,
        EventDeltaParams,
        TurnInputParams,
        TurnCancelParams,
        TurnCancelResult,
        InteractionRequestParams,
        InteractionRequestResult,
        InteractionResponseParams,
        InteractionCancelParams,
        WorkspaceBackupParams,
        WorkspaceBackupResult,
        SkillInstallParams,
        SkillInstallResult,
        FsParams,
    );
}
