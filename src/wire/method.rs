//! The method table of PROTOCOL.md §12: the one source of truth for method
//! names, who sends them, whether they are answered, the protocol version
//! that introduced them, what makes them idempotent, and which actor kind
//! owns them. The router, the capability checks and the docs all read it.

use std::fmt;

/// Which peer sends the method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Executor → harness.
    ToHarness,
    /// Harness → executor.
    ToExecutor,
    /// Either side.
    Both,
}

/// Whether the method expects an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Request,
    Notification,
    /// `terminal.input`: either form is allowed.
    Either,
}

/// Negotiated protocol versions, ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Version {
    V1,
    V1_1,
}

impl Version {
    pub fn as_str(self) -> &'static str {
        match self {
            Version::V1 => "1",
            Version::V1_1 => "1.1",
        }
    }
}

/// The actor kind that owns a method on its receiving side: the one the
/// receiving router hands the request to. The executor's router is generated
/// from this column (see [`super::request`]), so a reader finds any handler
/// by the method's name, and a row that names the wrong owner does not
/// compile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The receiving side's connection actor: on the harness, register,
    /// heartbeat, token refresh, capabilities, close and the executor-scoped
    /// terminal notifications; on the executor, drain.
    Connection,
    /// The executor's sessions supervisor (assign: creates session actors).
    Sessions,
    /// One session actor, by `sessionId`. It owns its process and tool-call
    /// registries, so it starts processes and tool calls (idempotency by id)
    /// and forwards the process controls that need them.
    Session,
    /// One process actor, by `sessionId` + `processId`, reached straight
    /// through the router's process map (the hot `read`/`write` path).
    Process,
    /// One MCP server actor, by `sessionId` + `serverKey`; on the harness,
    /// the MCP channel of that session and server.
    Mcp,
    /// A session's agent turn, by `sessionId`: the session actor holds
    /// its one turn at a time and hands the request to the turn actor.
    Turn,
    /// The executor's terminals supervisor, by `terminalId`.
    Terminal,
    /// The harness's leases actor: its view of each session (fencing,
    /// deliveries to the platform).
    HarnessSession,
}

macro_rules! methods {
    ($( $variant:ident = $name:literal, $dir:ident, $kind:ident, $since:ident, $idem:expr, $owner:ident; )*) => {
        /// Every method of PROTOCOL.md §12.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Method { $($variant),* }

        /// The table itself.
        pub const METHODS: &[MethodSpec] = &[
            $(MethodSpec {
                method: Method::$variant,
                name: $name,
                direction: Direction::$dir,
                kind: Kind::$kind,
                since: Version::$since,
                idempotent_by: $idem,
                owner: Owner::$owner,
            }),*
        ];

        impl Method {
            pub fn as_str(self) -> &'static str {
                match self { $(Method::$variant => $name),* }
            }

            /// Look a method up by its wire name.
            pub fn from_name(name: &str) -> Option<Method> {
                match name { $($name => Some(Method::$variant),)* _ => None }
            }
        }
    };
}

methods! {
    ExecutorRegister = "executor.register", ToHarness, Request, V1, None, Connection;
    ExecutorHeartbeat = "executor.heartbeat", ToHarness, Request, V1, None, Connection;
    ExecutorTokenRefresh = "executor.token_refresh", ToHarness, Request, V1, None, Connection;
    ExecutorCapabilitiesUpdate = "executor.capabilities_update", ToHarness, Notification, V1, None, Connection;
    ExecutorClose = "executor.close", ToHarness, Notification, V1, None, Connection;
    ExecutorDrain = "executor.drain", ToExecutor, Request, V1, None, Connection;
    SessionAssign = "session.assign", ToExecutor, Request, V1, Some("sessionId + fencingToken"), Sessions;
    SessionReady = "session.ready", ToHarness, Request, V1, Some("sessionId"), HarnessSession;
    SessionStop = "session.stop", ToExecutor, Request, V1, Some("sessionId"), Session;
    SessionEnded = "session.ended", ToHarness, Request, V1, Some("sessionId"), HarnessSession;
    SessionStatus = "session.status", ToHarness, Notification, V1, None, HarnessSession;
    ToolCall = "tool.call", ToExecutor, Request, V1, Some("toolCallId"), Session;
    ToolResult = "tool.result", ToHarness, Request, V1, Some("toolCallId"), HarnessSession;
    ToolCancel = "tool.cancel", ToExecutor, Request, V1, Some("toolCallId"), Session;
    ToolProgress = "tool.progress", ToHarness, Notification, V1, None, HarnessSession;
    ProcessStart = "process.start", ToExecutor, Request, V1, Some("processId"), Session;
    ProcessRead = "process.read", ToExecutor, Request, V1, None, Process;
    ProcessWrite = "process.write", ToExecutor, Request, V1, None, Process;
    ProcessInterrupt = "process.interrupt", ToExecutor, Request, V1, None, Session;
    ProcessTerminate = "process.terminate", ToExecutor, Request, V1, None, Session;
    ProcessList = "process.list", ToExecutor, Request, V1, None, Session;
    ProcessStatus = "process.status", ToHarness, Notification, V1, None, HarnessSession;
    TerminalOpen = "terminal.open", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalAttach = "terminal.attach", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalClose = "terminal.close", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalResize = "terminal.resize", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalInput = "terminal.input", ToExecutor, Either, V1_1, None, Terminal;
    TerminalOutput = "terminal.output", ToHarness, Notification, V1_1, None, Connection;
    TerminalExited = "terminal.exited", ToHarness, Notification, V1_1, None, Connection;
    McpOpen = "mcp.open", Both, Request, V1_1, None, Mcp;
    McpClose = "mcp.close", Both, Request, V1_1, None, Mcp;
    McpFrame = "mcp.frame", Both, Notification, V1_1, None, Mcp;
    TurnStart = "turn.start", ToExecutor, Request, V1_1, Some("turnId"), Turn;
    TurnInput = "turn.input", ToExecutor, Request, V1_1, Some("inputId"), Turn;
    TurnCancel = "turn.cancel", ToExecutor, Request, V1_1, Some("turnId"), Turn;
    SessionEvent = "session.event", ToHarness, Request, V1_1, Some("eventId"), HarnessSession;
    SessionEventDelta = "session.event_delta", ToHarness, Notification, V1_1, None, HarnessSession;
    SessionClose = "session.close", ToExecutor, Request, V1_1, Some("sessionId"), Session;
    InteractionRequest = "interaction.request", ToHarness, Request, V1_1, Some("interactionId"), HarnessSession;
    InteractionCancel = "interaction.cancel", ToHarness, Request, V1_1, Some("interactionId"), HarnessSession;
    InteractionResponse = "interaction.response", ToExecutor, Request, V1_1, Some("interactionId"), Turn;
    WorkspaceBackup = "workspace.backup", ToExecutor, Request, V1_1, Some("backupId"), Session;
    SkillInstall = "skill.install", ToExecutor, Request, V1_1, Some("skillId"), Session;
    FsMount = "fs.mount", ToExecutor, Request, V1_1, None, Session;
    FsUnmount = "fs.unmount", ToExecutor, Request, V1_1, None, Session;
    // bmx extension (docs/protocol.md, "Artifacts, backups and skills").
    ArtifactUpload = "artifact.upload", ToExecutor, Request, V1_1, Some("sessionId + digest"), Session;
    // bmx extension (docs/protocol.md, "Computer use"): the display's VNC
    // through the relay; every request is a new stream.
    DisplayRfb = "display.rfb", ToExecutor, Request, V1_1, None, Session;
}

/// One row of the method table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodSpec {
    pub method: Method,
    pub name: &'static str,
    pub direction: Direction,
    pub kind: Kind,
    pub since: Version,
    pub idempotent_by: Option<&'static str>,
    pub owner: Owner,
}

impl Method {
    /// This method's row of [`METHODS`].
    pub const fn spec(self) -> &'static MethodSpec {
        // The table is generated in enum order, so the discriminant indexes it.
        &METHODS[self as usize]
    }

    pub fn since(self) -> Version {
        self.spec().since
    }

    /// `const` so the request enums can check their owner at compile time.
    pub const fn owner(self) -> Owner {
        self.spec().owner
    }

    /// Whether an executor may receive it (harness → executor or both).
    pub fn executor_receives(self) -> bool {
        matches!(
            self.spec().direction,
            Direction::ToExecutor | Direction::Both
        )
    }

    /// Whether the table makes it a notification (sent without an id).
    pub fn is_notification(self) -> bool {
        matches!(self.spec().kind, Kind::Notification)
    }

    /// Whether a harness may receive it.
    pub fn harness_receives(self) -> bool {
        matches!(
            self.spec().direction,
            Direction::ToHarness | Direction::Both
        )
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_indexed_by_discriminant_and_names_are_unique() {
        let mut names = std::collections::HashSet::new();
        for (i, spec) in METHODS.iter().enumerate() {
            assert_eq!(spec.method as usize, i);
            assert_eq!(spec.method.spec(), spec);
            assert!(names.insert(spec.name), "duplicate {}", spec.name);
            assert_eq!(Method::from_name(spec.name), Some(spec.method));
        }
        assert_eq!(Method::from_name("nope.nope"), None);
    }

    #[test]
    fn versions_and_directions_follow_the_protocol() {
        assert_eq!(Method::ProcessStart.since(), Version::V1);
        assert_eq!(Method::TerminalOpen.since(), Version::V1_1);
        assert!(Method::SessionAssign.executor_receives());
        assert!(!Method::SessionAssign.harness_receives());
        assert!(Method::McpFrame.executor_receives() && Method::McpFrame.harness_receives());
    }

    /// The owner column, written out: where each method is handled today
    /// (executor: `executor::actors::router`, whose routing is generated
    /// from the column; harness: `harness::actors::connection`, which hands
    /// `HarnessSession` rows to the leases actor). A change to the table
    /// must change this list too, on purpose.
    #[test]
    fn owners_are_where_the_code_handles_them() {
        use Method::*;
        use Owner::*;
        let expected: &[(Method, Owner)] = &[
            (ExecutorRegister, Connection),
            (ExecutorHeartbeat, Connection),
            (ExecutorTokenRefresh, Connection),
            (ExecutorCapabilitiesUpdate, Connection),
            (ExecutorClose, Connection),
            (ExecutorDrain, Connection),
            (SessionAssign, Sessions),
            (SessionReady, HarnessSession),
            (SessionStop, Session),
            (SessionEnded, HarnessSession),
            (SessionStatus, HarnessSession),
            // The session owns the tool-call registry (at most once by id).
            (ToolCall, Session),
            (ToolResult, HarnessSession),
            (ToolCancel, Session),
            (ToolProgress, HarnessSession),
            // The session owns the process registry (idempotent starts) and
            // forwards the controls; only read and write skip it.
            (ProcessStart, Session),
            (ProcessRead, Process),
            (ProcessWrite, Process),
            (ProcessInterrupt, Session),
            (ProcessTerminate, Session),
            (ProcessList, Session),
            (ProcessStatus, HarnessSession),
            (TerminalOpen, Terminal),
            (TerminalAttach, Terminal),
            (TerminalClose, Terminal),
            (TerminalResize, Terminal),
            (TerminalInput, Terminal),
            // Executor-scoped notifications the harness connection handles.
            (TerminalOutput, Connection),
            (TerminalExited, Connection),
            (McpOpen, Mcp),
            (McpClose, Mcp),
            (McpFrame, Mcp),
            (TurnStart, Turn),
            (TurnInput, Turn),
            (TurnCancel, Turn),
            (SessionEvent, HarnessSession),
            (SessionEventDelta, HarnessSession),
            (SessionClose, Session),
            (InteractionRequest, HarnessSession),
            (InteractionCancel, HarnessSession),
            (InteractionResponse, Turn),
            (WorkspaceBackup, Session),
            (SkillInstall, Session),
            (FsMount, Session),
            (FsUnmount, Session),
            (ArtifactUpload, Session),
            (DisplayRfb, Session),
        ];
        assert_eq!(expected.len(), METHODS.len());
        for (i, (method, owner)) in expected.iter().enumerate() {
            assert_eq!(METHODS[i].method, *method, "row {i}");
            assert_eq!(method.owner(), *owner, "{method}");
        }
    }

    #[test]
    fn owners_sit_on_the_receiving_side() {
        for spec in METHODS {
            let on_harness = matches!(spec.owner, Owner::HarnessSession);
            let on_executor = matches!(
                spec.owner,
                Owner::Sessions | Owner::Session | Owner::Process | Owner::Terminal | Owner::Turn
            );
            if on_harness {
                assert_eq!(spec.direction, Direction::ToHarness, "{}", spec.name);
            }
            if on_executor {
                assert_eq!(spec.direction, Direction::ToExecutor, "{}", spec.name);
            }
        }
    }
}
