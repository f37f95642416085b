//! The requests an executor routes, one enum per owning actor, generated
//! from the method table.
//!
//! Why: a request used to be matched three times on its way (router, then
//! by session scope, then in the session) and its params decoded twice (once
//! for `sessionId`, once for the method's type). Here [`decode`] reads a
//! frame's params once, into the variant of its owner's enum, and the router
//! is one match on [`Request`]: the owner's key is a field of the decoded
//! params. Each variant is named after its [`Method`] and holds that method's
//! params; a variant whose method the table gives another owner fails to
//! compile, so the table and the routing cannot drift apart.
//!
//! Methods no executor actor receives yet (`turn.*`, ...) have no
//! variant: [`routed`] says `None` for them and the router refuses them for
//! their capability before decoding anything.

use super::error::RpcError;
use super::frame::Inbound;
use super::method::{Method, Owner};
use super::types::{
    ArtifactUploadParams, AssignParams, DisplayRfbParams, DrainParams, InteractionResponseParams,
    McpCloseParams, McpFrameParams, McpOpenParams, ProcessReadParams, ProcessRefParams,
    ProcessStartParams, ProcessTerminateParams, ProcessWriteParams, SessionCloseParams,
    SessionRefParams, SkillInstallParams, StopParams, TerminalAttachParams, TerminalCloseParams,
    TerminalInputParams, TerminalOpenParams, TerminalResizeParams, ToolCallParams,
    ToolCancelParams, TurnCancelParams, TurnInputParams, TurnStartParams, WorkspaceBackupParams,
};

/// Generates, per owner: the enum, `method()`, one accessor per key field
/// (`by ...`), and a compile-time check of the owner column; then the union
/// [`Request`], [`routed`] and [`decode`].
///
/// `forwards Variant(Enum)` adds one variant holding another owner's request
/// that this owner may be handed instead (the session, for process requests
/// whose process the router's map does not hold yet).
macro_rules! requests {
    ($(
        $(#[$doc:meta])*
        $owner:ident => $enum:ident
            $(by [$($key:ident),+])?
            $(forwards $fwd:ident($fwd_ty:ident))?
        {
            $( $variant:ident($params:ty), )*
        }
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Debug)]
            pub enum $enum {
                $( $variant($params), )*
                $( $fwd($fwd_ty), )?
            }

            impl $enum {
                /// The method this request came as.
                pub fn method(&self) -> Method {
                    match self {
                        $( $enum::$variant(_) => Method::$variant, )*
                        $( $enum::$fwd(r) => r.method(), )?
                    }
                }
            }

            requests!(@keys $enum [$($variant)*] [$($fwd)?] $($($key)+)?);

            $(
                const _: () = assert!(
                    matches!(Method::$variant.owner(), Owner::$owner),
                    concat!(
                        "the method table does not give ",
                        stringify!($variant),
                        " to ",
                        stringify!($owner)
                    ),
                );
            )*
        )*

        /// A decoded request, by the actor that owns it.
        #[derive(Debug)]
        pub enum Request {
            $( $owner($enum), )*
        }

        impl Request {
            pub fn owner(&self) -> Owner {
                match self {
                    $( Request::$owner(_) => Owner::$owner, )*
                }
            }

            pub fn method(&self) -> Method {
                match self {
                    $( Request::$owner(r) => r.method(), )*
                }
            }
        }

        /// The owner the executor routes `method` to, or `None` when no
        /// executor actor receives it (yet).
        pub fn routed(method: Method) -> Option<Owner> {
            match method {
                $($( Method::$variant => Some(Owner::$owner), )*)*
                _ => None,
            }
        }

        /// Decode `frame`'s params once, into its owner's request. Bad params
        /// are -32602 (as [`Inbound::params`] says); a method with no owner
        /// on the executor is -32601.
        pub fn decode(method: Method, frame: &Inbound) -> Result<Request, RpcError> {
            match method {
                $($(
                    Method::$variant => frame
                        .params::<$params>()
                        .map(|p| Request::$owner($enum::$variant(p))),
                )*)*
                other => Err(RpcError::method_not_found(other.as_str())),
            }
        }
    };

    // One accessor per key field, by recursion (the keys and the variants
    // are independent repetitions).
    (@keys $enum:ident $variants:tt $fwd:tt) => {};
    (@keys $enum:ident $variants:tt $fwd:tt $key:ident $($rest:ident)*) => {
        requests!(@key $enum $variants $fwd $key);
        requests!(@keys $enum $variants $fwd $($rest)*);
    };
    (@key $enum:ident [$($variant:ident)*] [$($fwd:ident)?] $key:ident) => {
        impl $enum {
            /// The routing key, from the decoded params.
            pub fn $key(&self) -> &str {
                match self {
                    $( $enum::$variant(p) => &p.$key, )*
                    $( $enum::$fwd(r) => r.$key(), )?
                }
            }
        }
    };
}

requests! {
    /// `executor.drain`: the executor's connection actor.
    Connection => ConnectionRequest {
        ExecutorDrain(DrainParams),
    }

    /// `session.assign`: the sessions supervisor, which creates the session.
    /// Boxed: it is the largest params and travels on as a box anyway.
    Sessions => SessionsRequest {
        SessionAssign(Box<AssignParams>),
    }

    /// What one session actor receives, by `sessionId`.
    Session => SessionRequest by [session_id] forwards Process(ProcessRequest) {
        SessionStop(StopParams),
        ProcessStart(ProcessStartParams),
        ProcessInterrupt(ProcessRefParams),
        ProcessTerminate(ProcessTerminateParams),
        ProcessList(SessionRefParams),
        ToolCall(ToolCallParams),
        ToolCancel(ToolCancelParams),
        SessionClose(SessionCloseParams),
        ArtifactUpload(ArtifactUploadParams),
        DisplayRfb(DisplayRfbParams),
        WorkspaceBackup(WorkspaceBackupParams),
        SkillInstall(SkillInstallParams),
    }

    /// Agent turns and their interactions, by `sessionId`: the session owns
    /// its turns (one at a time) and hands them on.
    Turn => TurnRequest by [session_id] {
        TurnStart(TurnStartParams),
        TurnInput(TurnInputParams),
        TurnCancel(TurnCancelParams),
        InteractionResponse(InteractionResponseParams),
    }

    /// The hot path: straight to the process actor, by `sessionId` +
    /// `processId`.
    Process => ProcessRequest by [session_id, process_id] {
        ProcessRead(ProcessReadParams),
        ProcessWrite(ProcessWriteParams),
    }

    /// One MCP server actor, by `sessionId` + `serverKey` (`mcp.frame` is a
    /// notification).
    Mcp => McpRequest by [session_id, server_key] {
        McpOpen(McpOpenParams),
        McpClose(McpCloseParams),
        McpFrame(McpFrameParams),
    }

    /// The terminals supervisor, by `terminalId` (`terminal.input` may come
    /// as a notification).
    Terminal => TerminalRequest by [terminal_id] {
        TerminalOpen(TerminalOpenParams),
        TerminalAttach(TerminalAttachParams),
        TerminalInput(TerminalInputParams),
        TerminalResize(TerminalResizeParams),
        TerminalClose(TerminalCloseParams),
    }
}

impl Request {
    /// The session a fenced request is about (PROTOCOL.md §5 and the bmx
    /// extension in docs/protocol.md, "Fencing on every session request"):
    /// every request of the session's owners (`session.stop`, `process.*`,
    /// `tool.*`, `turn.*`, `interaction.response`, `mcp.*` and the other
    /// session-scoped bmx methods) carries `sessionId`, and may carry the
    /// `fencingToken` of the grant it was sent under. `None`: not about one
    /// session (`session.assign` has its own fence, terminals and drains are
    /// the executor's).
    pub fn fenced_session(&self) -> Option<&str> {
        match self {
            Request::Session(r) => Some(r.session_id()),
            Request::Turn(r) => Some(r.session_id()),
            Request::Process(r) => Some(r.session_id()),
            Request::Mcp(r) => Some(r.session_id()),
            Request::Connection(_) | Request::Sessions(_) | Request::Terminal(_) => None,
        }
    }
}

/// -32009 `stale_fencing_token`: a request sent under grant `given` of
/// `session_id`, which the executor knows a newer grant of (`highest`).
/// `data.detail` names both tokens.
pub fn stale_fencing_token(session_id: &str, given: u64, highest: u64) -> RpcError {
    RpcError::conflict(
        "stale_fencing_token",
        format!("fencing token {given} of session {session_id:?} is below {highest}"),
    )
    .with_detail(format!("fencingToken {given} < {highest}"))
}

/// Params sent under a grant: `params` with the bmx extension member
/// `fencingToken` added (the harness's side of the executor's fence).
/// `params` must serialize as a map (every params type does).
#[derive(Debug, serde::Serialize)]
pub struct Fenced<'a, P: serde::Serialize> {
    #[serde(flatten)]
    pub params: &'a P,
    #[serde(rename = "fencingToken")]
    pub fencing_token: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::codec::Codec;
    use crate::wire::frame::OutRequest;
    use crate::wire::method::METHODS;
    use crate::wire::ErrorCode;
    use bytes::Bytes;
    use proptest::prelude::*;
    use serde::Serialize;

    fn frame<P: Serialize>(codec: Codec, method: Method, params: &P) -> Inbound {
        let request = OutRequest {
            jsonrpc: "2.0",
            id: "1",
            method: method.as_str(),
            params,
        };
        let bytes = match codec {
            Codec::Json => serde_json::to_vec(&request).unwrap(),
            Codec::MsgPack => rmp_serde::to_vec_named(&request).unwrap(),
        };
        Inbound::parse(codec, Bytes::from(bytes)).unwrap()
    }

    #[test]
    fn every_routed_method_is_owned_as_the_table_says() {
        for spec in METHODS {
            if let Some(owner) = routed(spec.method) {
                assert_eq!(owner, spec.owner, "{}", spec.name);
                assert!(spec.method.executor_receives(), "{}", spec.name);
            }
        }
    }

    #[test]
    fn bad_params_are_32602_and_unrouted_methods_32601() {
        for codec in [Codec::Json, Codec::MsgPack] {
            for spec in METHODS.iter().filter(|s| routed(s.method).is_some()) {
                let f = frame(codec, spec.method, &serde_json::json!({"sessionId": 5}));
                let e = decode(spec.method, &f).unwrap_err();
                assert_eq!(e.code, ErrorCode::InvalidParams.code(), "{}", spec.name);
            }
            let f = frame(codec, Method::FsMount, &serde_json::json!({}));
            let e = decode(Method::FsMount, &f).unwrap_err();
            assert_eq!(e.code, ErrorCode::MethodNotFound.code());
        }
    }

    #[test]
    fn missing_params_decode_as_an_empty_object() {
        let raw = br#"{"jsonrpc":"2.0","id":"1","method":"process.list"}"#;
        let f = Inbound::parse(Codec::Json, Bytes::from_static(raw)).unwrap();
        // `sessionId` is required: -32602, as before.
        assert!(decode(Method::ProcessList, &f).is_err());
    }

    /// `p` with its id fields made to follow the id rule (arbitrary strings
    /// mostly break it; those refusals have their own tests in `wire::id`).
    fn sane<P: Serialize + serde::de::DeserializeOwned>(p: P) -> P {
        let mut v = serde_json::to_value(&p).unwrap();
        if let Some(obj) = v.as_object_mut() {
            for name in crate::wire::id::ID_FIELDS {
                if let Some(serde_json::Value::String(id)) = obj.get_mut(name) {
                    let mut clean: String = id
                        .chars()
                        .filter(|c| c.is_ascii_alphanumeric() || "._:-".contains(*c))
                        .take(128)
                        .collect();
                    if clean.is_empty() || clean == "." || clean == ".." {
                        clean = "x".into();
                    }
                    *id = clean;
                }
            }
        }
        serde_json::from_value(v).unwrap()
    }

    /// Decodes `params` sent as `method` and checks the request it became.
    fn round_trip<P: Serialize + std::fmt::Debug>(
        codec: Codec,
        method: Method,
        params: &P,
        key: impl Fn(&Request) -> Vec<String>,
        expected_key: Vec<String>,
    ) -> Result<(), TestCaseError> {
        let decoded = decode(method, &frame(codec, method, params));
        // Arbitrary ids mostly break the id rule: those must be refused
        // (-32602), the rest decode into their variant.
        let ids_ok = serde_json::to_value(params)
            .map(|v| crate::wire::id::check_fields(&v).is_ok())
            .unwrap_or(true);
        if !ids_ok {
            let e = decoded
                .err()
                .ok_or_else(|| TestCaseError::fail(format!("{method}: a bad id was accepted")))?;
            prop_assert_eq!(e.code, ErrorCode::InvalidParams.code());
            return Ok(());
        }
        let r = decoded.map_err(|e| TestCaseError::fail(format!("{method}: {e}")))?;
        prop_assert_eq!(r.method(), method);
        prop_assert_eq!(r.owner(), method.owner());
        prop_assert_eq!(key(&r), expected_key);
        Ok(())
    }

    fn codec() -> impl Strategy<Value = Codec> {
        prop_oneof![Just(Codec::Json), Just(Codec::MsgPack)]
    }

    proptest! {
        #[test]
        fn session_requests_decode_once_into_their_variant(
            codec in codec(),
            stop in any::<StopParams>(),
            start in any::<ProcessStartParams>(),
            call in any::<ToolCallParams>(),
            cancel in any::<ToolCancelParams>(),
        ) {
            let stop = sane(stop);
            let start = sane(start);
            let call = sane(call);
            let cancel = sane(cancel);
            let key = |r: &Request| match r {
                Request::Session(s) => vec![s.session_id().to_owned()],
                _ => vec![],
            };
            round_trip(codec, Method::SessionStop, &stop, key, vec![stop.session_id.clone()])?;
            round_trip(codec, Method::ProcessStart, &start, key, vec![start.session_id.clone()])?;
            round_trip(codec, Method::ToolCall, &call, key, vec![call.session_id.clone()])?;
            round_trip(codec, Method::ToolCancel, &cancel, key, vec![cancel.session_id.clone()])?;
            let r = decode(Method::ProcessStart, &frame(codec, Method::ProcessStart, &start)).unwrap();
            prop_assert!(matches!(r, Request::Session(SessionRequest::ProcessStart(p)) if p == start));
        }

        #[test]
        fn process_requests_carry_both_keys(
            codec in codec(),
            read in any::<ProcessReadParams>(),
            write in any::<ProcessWriteParams>(),
            interrupt in any::<ProcessRefParams>(),
            terminate in any::<ProcessTerminateParams>(),
        ) {
            let read = sane(read);
            let write = sane(write);
            let interrupt = sane(interrupt);
            let terminate = sane(terminate);
            let key = |r: &Request| match r {
                Request::Process(p) => vec![p.session_id().to_owned(), p.process_id().to_owned()],
                Request::Session(s) => vec![s.session_id().to_owned()],
                _ => vec![],
            };
            round_trip(codec, Method::ProcessRead, &read, key,
                vec![read.session_id.clone(), read.process_id.clone()])?;
            round_trip(codec, Method::ProcessWrite, &write, key,
                vec![write.session_id.clone(), write.process_id.clone()])?;
            round_trip(codec, Method::ProcessInterrupt, &interrupt, key,
                vec![interrupt.session_id.clone()])?;
            round_trip(codec, Method::ProcessTerminate, &terminate, key,
                vec![terminate.session_id.clone()])?;
            let r = decode(Method::ProcessWrite, &frame(codec, Method::ProcessWrite, &write)).unwrap();
            prop_assert!(matches!(r, Request::Process(ProcessRequest::ProcessWrite(p)) if p == write));
        }

        #[test]
        fn terminal_requests_carry_their_terminal_id(
            codec in codec(),
            open in any::<TerminalOpenParams>(),
            input in any::<TerminalInputParams>(),
            close in any::<TerminalCloseParams>(),
        ) {
            let (open, input, close) = (sane(open), sane(input), sane(close));
            let key = |r: &Request| match r {
                Request::Terminal(t) => vec![t.terminal_id().to_owned()],
                _ => vec![],
            };
            round_trip(codec, Method::TerminalOpen, &open, key, vec![open.terminal_id.clone()])?;
            round_trip(codec, Method::TerminalInput, &input, key, vec![input.terminal_id.clone()])?;
            round_trip(codec, Method::TerminalClose, &close, key, vec![close.terminal_id.clone()])?;
        }
    }

    #[test]
    fn fenced_params_carry_the_token_and_decode_as_before() {
        for codec in [Codec::Json, Codec::MsgPack] {
            let p = StopParams {
                session_id: "s".into(),
                reason: "stopped".into(),
                deadline_ms: Some(5),
                keep_workspace: false,
            };
            let f = frame(
                codec,
                Method::SessionStop,
                &Fenced {
                    params: &p,
                    fencing_token: 4098,
                },
            );
            assert_eq!(f.fencing_token().unwrap(), Some(4098));
            let r = decode(Method::SessionStop, &f).unwrap();
            assert_eq!(r.fenced_session(), Some("s"));
            assert!(matches!(r, Request::Session(SessionRequest::SessionStop(q)) if q == p));
            // A seed peer's request: no token.
            let f = frame(codec, Method::SessionStop, &p);
            assert_eq!(f.fencing_token().unwrap(), None);
            // A token of the wrong type: -32602, never a panic.
            let f = frame(
                codec,
                Method::SessionStop,
                &serde_json::json!({"sessionId": "s", "reason": "x", "fencingToken": "high"}),
            );
            assert_eq!(
                f.fencing_token().unwrap_err().code,
                ErrorCode::InvalidParams.code()
            );
        }
        let e = stale_fencing_token("s", 1, 2);
        assert_eq!(e.code, ErrorCode::Conflict.code());
        assert_eq!(e.reason(), Some("stale_fencing_token"));
    }

    #[test]
    fn a_forwarded_process_request_keeps_its_method_and_keys() {
        let r = SessionRequest::Process(ProcessRequest::ProcessRead(ProcessReadParams {
            session_id: "s".into(),
            process_id: "p".into(),
            stream: crate::wire::types::Stream::Stdout,
            cursor: 0,
            max_bytes: None,
            wait_ms: None,
        }));
        assert_eq!(r.method(), Method::ProcessRead);
        assert_eq!(r.session_id(), "s");
    }
}
