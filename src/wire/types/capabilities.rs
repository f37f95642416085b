//! `capabilities` of PROTOCOL.md §4. A missing member means "not offered":
//! an executor advertises only what it really runs.

use super::JsonMap;

wire_struct! {
    /// The advertised capabilities. Every member optional.
    #[derive(Default)]
    pub struct Capabilities {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub process: Option<ProcessCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub terminal: Option<TerminalCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub mcp: Option<McpCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub agent: Option<AgentCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub files: Option<FilesCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub artifacts: Option<ArtifactsCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub workspace: Option<WorkspaceCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub skills: Option<SkillsCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub fs: Option<FsCapability>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub shell: Option<ShellCapability>,
        /// `display`: advertised only when `Xvfb` is found at start.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub display: Option<DisplayCapability>,
        /// `tools` (a bmx extension, docs/protocol.md): the tool-call
        /// permission modes honored.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tools: Option<ToolsCapability>,
        /// `maxFrameBytes` (a bmx extension): the largest frame this peer
        /// reads before closing with 1009. The harness refuses a request
        /// that would not fit instead of sending it; a peer that does not
        /// say is taken to accept PROTOCOL.md's default 1 MiB.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub max_frame_bytes: Option<u64>,
        /// `sandbox` (a bmx extension, issue 48): how sessions are
        /// confined.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub sandbox: Option<SandboxCapability>,
        /// Members this version does not know, kept so a newer peer's
        /// advertisement survives a round trip.
        #[serde(flatten, default, skip_serializing_if = "JsonMap::is_empty")]
        #[cfg_attr(test, proptest(value = "JsonMap::new()"))]
        pub other: JsonMap,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct ProcessCapability {
        pub enabled: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_processes: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub buffer_bytes: Option<u64>,
        #[serde(default)]
        pub pty: bool,
        #[serde(default)]
        pub file_transfer: bool,
        #[serde(default)]
        pub git_credentials: bool,
        #[serde(default)]
        pub package_install: bool,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct TerminalCapability {
        pub enabled: bool,
        #[serde(default)]
        pub kinds: Vec<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_sessions: Option<u32>,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct McpCapability {
        #[serde(default)]
        pub stdio: bool,
        #[serde(default)]
        pub http: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_servers: Option<u32>,
        #[serde(default)]
        pub secret_env: bool,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct AgentCapability {
        pub enabled: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_sessions: Option<u32>,
        #[serde(default)]
        pub models: Vec<String>,
        #[serde(default)]
        pub permission_modes: Vec<String>,
        #[serde(default)]
        pub interaction_kinds: Vec<String>,
        #[serde(default)]
        pub file_inputs: bool,
        #[serde(default)]
        pub turn_resume: bool,
        /// bmx extension: the named agents `turn.start.config.agent` may
        /// pick (the first is the default). Names only: a command line may
        /// hold what is not the harness's to see.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub agents: Vec<AgentInfo>,
    }
}

wire_struct! {
    pub struct AgentInfo {
        pub name: String,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct FilesCapability {
        pub enabled: bool,
        #[serde(default)]
        pub read_roots: Vec<String>,
        #[serde(default)]
        pub write_roots: Vec<String>,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct ArtifactsCapability {
        #[serde(default)]
        pub upload: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_bytes: Option<u64>,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct WorkspaceCapability {
        #[serde(default)]
        pub backup: bool,
        /// bmx extension: `session.assign.restore` is honored (a backup
        /// unpacked into the fresh workspace before `session.ready`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub restore: bool,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct SkillsCapability {
        #[serde(default)]
        pub install: bool,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct FsCapability {
        #[serde(default)]
        pub fuse: bool,
        #[serde(default)]
        pub views: Vec<String>,
    }
}

wire_struct! {
    #[derive(Default)]
    pub struct ShellCapability {
        pub enabled: bool,
    }
}

wire_struct! {
    /// `capabilities.display` (the seed's `DisplayCapability`): a virtual
    /// desktop for `computer_observe` / `computer_action`, and whether it
    /// can be watched over RFB (VNC).
    #[derive(Default)]
    pub struct DisplayCapability {
        pub desktop: bool,
        #[serde(default)]
        pub rfb: bool,
    }
}

wire_struct! {
    /// `capabilities.tools` (a bmx extension): which
    /// `tool.call.permission.mode`s this executor honors, and whether a
    /// person at its machine can answer `always_ask` (`bmx confirm`).
    #[derive(Default)]
    pub struct ToolsCapability {
        #[serde(default)]
        pub permission_modes: Vec<String>,
        #[serde(default)]
        pub local_confirmation: bool,
    }
}

wire_struct! {
    /// `capabilities.sandbox` (a bmx extension, issue 48): what confines
    /// each session on this executor, as the kernel enforces it.
    /// `filesystem`: `landlock` or `none`; `cgroup`: `v2`, `hybrid`, `v1`
    /// or `none` (containment: a session's processes end with it);
    /// `network`: `full`, `none`, or `unenforced` (asked for, not
    /// available); `scoped`: signals and abstract Unix sockets confined to
    /// the session.
    #[derive(Default)]
    pub struct SandboxCapability {
        pub filesystem: String,
        pub cgroup: String,
        pub network: String,
        #[serde(default)]
        pub scoped: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub landlock_abi: Option<u32>,
        #[serde(default)]
        pub limits: SandboxLimits,
    }
}

wire_struct! {
    /// The bounds: which this executor can enforce, and its own (every
    /// session's, and the most `session.assign.metadata.sandbox` may ask).
    #[derive(Default)]
    pub struct SandboxLimits {
        #[serde(default)]
        pub available: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub memory_max: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub pids_max: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[cfg_attr(test, proptest(strategy = "proptest::option::of(0.01f64..1000.0)"))]
        pub cpu_max: Option<f64>,
    }
}
