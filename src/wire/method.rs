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

/// The actor kind that owns a method on its receiving side. Routing reads
/// this, so a reader finds any handler by the method's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The connection actor (register, heartbeat, drain, close).
    Connection,
    /// The sessions supervisor (assign: creates session actors).
    Sessions,
    /// One session actor, by `sessionId`.
    Session,
    /// One process actor, by `sessionId` + `processId` (through its session).
    Process,
    /// One tool-call actor, by `sessionId` + `toolCallId` (through its session).
    Tool,
    /// One MCP server actor, by `sessionId` + `serverKey`.
    Mcp,
    /// One turn actor, by `sessionId` + `turnId`.
    Turn,
    /// The terminals supervisor / one terminal actor, by `terminalId`.
    Terminal,
    /// The harness's view of the session (leases, deliveries to the platform).
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
    ToolCall = "tool.call", ToExecutor, Request, V1, Some("toolCallId"), Tool;
    ToolResult = "tool.result", ToHarness, Request, V1, Some("toolCallId"), HarnessSession;
    ToolCancel = "tool.cancel", ToExecutor, Request, V1, Some("toolCallId"), Tool;
    ToolProgress = "tool.progress", ToHarness, Notification, V1, None, HarnessSession;
    ProcessStart = "process.start", ToExecutor, Request, V1, Some("processId"), Process;
    ProcessRead = "process.read", ToExecutor, Request, V1, None, Process;
    ProcessWrite = "process.write", ToExecutor, Request, V1, None, Process;
    ProcessInterrupt = "process.interrupt", ToExecutor, Request, V1, None, Process;
    ProcessTerminate = "process.terminate", ToExecutor, Request, V1, None, Process;
    ProcessList = "process.list", ToExecutor, Request, V1, None, Session;
    ProcessStatus = "process.status", ToHarness, Notification, V1, None, HarnessSession;
    TerminalOpen = "terminal.open", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalAttach = "terminal.attach", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalClose = "terminal.close", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalResize = "terminal.resize", ToExecutor, Request, V1_1, Some("terminalId"), Terminal;
    TerminalInput = "terminal.input", ToExecutor, Either, V1_1, None, Terminal;
    TerminalOutput = "terminal.output", ToHarness, Notification, V1_1, None, HarnessSession;
    TerminalExited = "terminal.exited", ToHarness, Notification, V1_1, None, HarnessSession;
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
    pub fn spec(self) -> &'static MethodSpec {
        // The table is generated in enum order, so the discriminant indexes it.
        &METHODS[self as usize]
    }

    pub fn since(self) -> Version {
        self.spec().since
    }

    pub fn owner(self) -> Owner {
        self.spec().owner
    }

    /// Whether an executor may receive it (harness → executor or both).
    pub fn executor_receives(self) -> bool {
        matches!(
            self.spec().direction,
            Direction::ToExecutor | Direction::Both
        )
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
}
