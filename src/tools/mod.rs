//! Built-in tools of the executor protocol: `bash`, `read`, `write`, `edit`,
//! `glob`, `grep` and `list_files`.
//!
//! Every tool runs inside a session workspace. Paths given by the model are
//! untrusted, so each one goes through [`boundary::resolve`] before anything
//! touches the filesystem; directory walks go through [`walk::Walk`],
//! which never follows symlinks. Output that is too large for a protocol
//! message is cut by [`output`] so the head and the tail survive.
//!
//! The tools never panic on input: bad input becomes a [`ToolOutput`] with
//! `is_error` set and a machine-readable [`ToolOutput::reason`].

pub mod bash;
pub mod beneath;
pub mod boundary;
pub mod computer;
pub mod disk;
pub mod edit;
pub mod glob;
pub mod grep;
pub mod list_files;
pub mod output;
pub mod read;
pub mod walk;
pub mod write;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::process::env::ChildEnv;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// Default inline output limit: what fits comfortably in one protocol frame.
pub const DEFAULT_INLINE_LIMIT: usize = 64 * 1024;

/// Default interval between progress messages of long-running tools.
pub const DEFAULT_PROGRESS_INTERVAL: Duration = Duration::from_secs(3);

/// Machine-readable failure reasons carried in [`ToolOutput::reason`], so
/// clients can react to a class of failure without parsing the text.
pub mod reason {
    /// The input JSON did not match the tool's schema.
    pub const INVALID_INPUT: &str = "invalid_input";
    /// A path resolved outside the session workspace.
    pub const WORKSPACE_BOUNDARY: &str = "workspace_boundary";
    /// `bash` was asked to set an environment variable that is denied.
    pub const DENIED_ENV: &str = "denied_env";
    /// `bash` ran past its timeout and was killed.
    pub const TIMEOUT: &str = "timeout";
    /// The call was canceled through [`super::ToolContext::cancel`].
    pub const CANCELED: &str = "canceled";
    /// `bash` ran to completion but exited non-zero (or died from a signal).
    pub const EXIT_STATUS: &str = "exit_status";
    /// The path does not exist.
    pub const NOT_FOUND: &str = "not_found";
    /// A file was expected but the path is a directory.
    pub const IS_DIRECTORY: &str = "is_directory";
    /// A directory was expected but the path is not one.
    pub const NOT_A_DIRECTORY: &str = "not_a_directory";
    /// `read`/`edit` refuse binary (or, for `edit`, non-UTF-8) files.
    pub const BINARY_FILE: &str = "binary_file";
    /// `edit` found no occurrence of `oldString`.
    pub const NO_MATCH: &str = "no_match";
    /// `edit` found `oldString` more than once.
    pub const AMBIGUOUS_MATCH: &str = "ambiguous_match";
    /// Any other I/O failure (permissions, disk full, ...).
    pub const IO_ERROR: &str = "io_error";
    /// The workspace's file system reached the executor's free-space
    /// reserve (see [`super::disk`]): the call was refused or stopped.
    pub const DISK_FULL: &str = "disk_full";
    /// A tool task died unexpectedly; this is a bug, not a user error.
    pub const INTERNAL_ERROR: &str = "internal_error";
    /// [`super::ToolRegistry::run`] was asked for a tool it does not hold.
    pub const UNKNOWN_TOOL: &str = "unknown_tool";
}

/// Everything a tool call needs besides its input.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// Canonical session workspace; every path resolves inside it.
    pub workspace: PathBuf,
    /// Protocol id of the call; names the spill files of truncated output.
    pub tool_call_id: String,
    /// Fires when the client cancels the call.
    pub cancel: CancellationToken,
    /// The environment policy of the processes the call starts (`bash`):
    /// what they inherit, which names they may not be given.
    pub env: Arc<ChildEnv>,
    /// The scope tag (`BMX_SCOPE`) of the processes the call starts: under
    /// its session's scope in the executor, so whatever escapes the call's
    /// process group still dies with the session.
    pub scope: String,
    /// Where long-running tools send progress lines; `None` disables progress.
    pub progress: Option<tokio::sync::mpsc::UnboundedSender<String>>,
    /// Bytes of output kept inline in the result; the rest is cut.
    pub inline_limit: usize,
    /// How often long-running tools report progress.
    pub progress_interval: Duration,
    /// The call's disk bounds: a size limit per file its processes write,
    /// and the free space it never takes.
    pub disk: disk::DiskLimits,
    /// The session's sandbox: every process the call starts runs in a unit
    /// of it (`None`: none, as for a tool run outside an executor).
    pub sandbox: Option<std::sync::Arc<crate::sandbox::Sandbox>>,
}

impl ToolContext {
    /// A context with the protocol defaults: this process's environment
    /// (minus `BMX_*`, as for every child) and no deny list, a scope of its
    /// own (`local-<pid>/tool-<uuid>/`), no progress channel,
    /// [`DEFAULT_INLINE_LIMIT`], [`DEFAULT_PROGRESS_INTERVAL`] and the
    /// default [`disk::DiskLimits`].
    pub fn new(workspace: impl Into<PathBuf>, tool_call_id: impl Into<String>) -> Self {
        Self {
            workspace: workspace.into(),
            tool_call_id: tool_call_id.into(),
            cancel: CancellationToken::new(),
            env: Arc::new(ChildEnv::from_process(&[])),
            scope: format!(
                "local-{}/tool-{}/",
                std::process::id(),
                uuid::Uuid::new_v4().simple()
            ),
            progress: None,
            inline_limit: DEFAULT_INLINE_LIMIT,
            progress_interval: DEFAULT_PROGRESS_INTERVAL,
            disk: disk::DiskLimits::default(),
            sandbox: None,
        }
    }
}

/// How a tool call ended, as reported in the protocol's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The tool ran and `is_error` is false.
    Succeeded,
    /// `is_error` is true: bad input, boundary, non-zero exit, timeout, ...
    Failed,
    /// The call's cancellation token fired.
    Canceled,
}

/// The result of one tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    pub outcome: Outcome,
    pub is_error: bool,
    pub text: String,
    /// Machine-readable failure class (see [`reason`]); `None` on success.
    pub reason: Option<String>,
}

impl ToolOutput {
    /// A successful result.
    pub fn success(text: impl Into<String>) -> Self {
        Self {
            outcome: Outcome::Succeeded,
            is_error: false,
            text: text.into(),
            reason: None,
        }
    }

    /// A failed result with a reason from [`reason`].
    pub fn failure(reason: &str, text: impl Into<String>) -> Self {
        Self {
            outcome: Outcome::Failed,
            is_error: true,
            text: text.into(),
            reason: Some(reason.to_string()),
        }
    }

    /// A canceled result. It is an error too: the work did not complete.
    pub fn canceled(text: impl Into<String>) -> Self {
        Self {
            outcome: Outcome::Canceled,
            is_error: true,
            text: text.into(),
            reason: Some(reason::CANCELED.to_string()),
        }
    }

    /// Shorthand for an `invalid_input` failure.
    pub fn invalid_input(text: impl Into<String>) -> Self {
        Self::failure(reason::INVALID_INPUT, text)
    }
}

/// A tool the executor can run.
#[async_trait::async_trait]
pub trait Tool: Send + Sync + 'static {
    /// The name clients call the tool by.
    fn name(&self) -> &str;
    /// Runs one call. Never panics; every failure is a [`ToolOutput`].
    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput;
}

/// A name → tool map. [`ToolRegistry::builtin`] holds the seven built-in
/// tools; an embedding platform adds its own with [`ToolRegistry::register`],
/// which replaces a tool of the same name so built-ins can be overridden.
#[derive(Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl ToolRegistry {
    /// The seven built-in tools.
    pub fn builtin() -> Self {
        let mut registry = Self::empty();
        registry.register(Arc::new(bash::BashTool));
        registry.register(Arc::new(read::ReadTool));
        registry.register(Arc::new(write::WriteTool));
        registry.register(Arc::new(edit::EditTool));
        registry.register(Arc::new(glob::GlobTool));
        registry.register(Arc::new(grep::GrepTool));
        registry.register(Arc::new(list_files::ListFilesTool));
        registry
    }

    /// A registry without any tool.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Adds `tool` under its name, replacing any tool of the same name.
    pub fn register(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.name().to_string(), tool);
    }

    /// The tool called `name`, if any.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.tools.get(name).cloned()
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }

    /// Runs the tool called `name`; an unknown name is an `unknown_tool`
    /// failure rather than a panic, since names come from clients.
    pub async fn run(&self, name: &str, ctx: ToolContext, input: Value) -> ToolOutput {
        match self.get(name) {
            Some(tool) => tool.run(ctx, input).await,
            None => ToolOutput::failure(reason::UNKNOWN_TOOL, format!("unknown tool `{name}`")),
        }
    }
}

impl fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolRegistry")
            .field("tools", &self.names())
            .finish()
    }
}

/// Deserializes a tool's input, turning serde's error into an
/// `invalid_input` result that names the offending field.
fn parse_input<T: DeserializeOwned>(tool: &str, input: &Value) -> Result<T, ToolOutput> {
    match T::deserialize(input) {
        Ok(parsed) => Ok(parsed),
        Err(err) => Err(ToolOutput::invalid_input(describe_input_error::<T>(
            tool, input, &err,
        ))),
    }
}

/// Inputs with more fields than this are not probed for the culprit field.
const MAX_PROBED_FIELDS: usize = 32;

/// serde names the field for missing and unknown fields but not for type
/// errors; for those, find the field whose removal makes the type error go
/// away, so the model learns exactly which field to fix.
fn describe_input_error<T: DeserializeOwned>(
    tool: &str,
    input: &Value,
    err: &serde_json::Error,
) -> String {
    let message = err.to_string();
    let Some(object) = input.as_object() else {
        let kind = match input {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Number(_) => "a number",
            Value::String(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        };
        return format!("invalid input for {tool}: expected a JSON object, got {kind}");
    };
    if message.starts_with("missing field") || message.starts_with("unknown field") {
        return format!("invalid input for {tool}: {message}");
    }
    // Each probe re-decodes the whole input: with thousands of keys (a
    // 1 MiB frame holds ~100 000) that is quadratic work on the runtime's
    // threads. Real tool inputs have a handful of fields.
    if object.len() > MAX_PROBED_FIELDS {
        return format!("invalid input for {tool}: {message}");
    }
    for key in object.keys() {
        let mut without = object.clone();
        without.remove(key);
        let culprit = match T::deserialize(&Value::Object(without)) {
            Ok(_) => true,
            Err(e) => e.to_string() == format!("missing field `{key}`"),
        };
        if culprit {
            return format!("invalid input for {tool}: field `{key}`: {message}");
        }
    }
    format!("invalid input for {tool}: {message}")
}

/// Runs blocking filesystem work off the async runtime and stops waiting
/// for it when the call is canceled. The closure gets the token too so long
/// walks can stop early instead of running on unobserved.
async fn run_blocking<F>(ctx: &ToolContext, work: F) -> ToolOutput
where
    F: FnOnce(CancellationToken) -> ToolOutput + Send + 'static,
{
    if ctx.cancel.is_cancelled() {
        return ToolOutput::canceled("canceled before start");
    }
    let token = ctx.cancel.clone();
    let handle = tokio::task::spawn_blocking(move || as_session_user(|| work(token)));
    tokio::select! {
        biased;
        joined = handle => joined.unwrap_or_else(|e| {
            ToolOutput::failure(reason::INTERNAL_ERROR, format!("tool task failed: {e}"))
        }),
        _ = ctx.cancel.cancelled() => ToolOutput::canceled("canceled"),
    }
}

/// Run a tool's file work with the `--run-as` user's filesystem identity
/// on this thread (`process::run_as::FsIdentity`): the kernel judges its
/// accesses as that user's and what it creates is that user's.
fn as_session_user(work: impl FnOnce() -> ToolOutput) -> ToolOutput {
    match crate::process::run_as::FsIdentity::enter() {
        Ok(_identity) => work(),
        Err(e) => ToolOutput::failure(
            reason::INTERNAL_ERROR,
            format!("cannot take the session user's identity: {e}"),
        ),
    }
}

/// Runs blocking work that mutates files to completion even if the call is
/// canceled midway, so the result always tells the truth about whether the
/// file changed. Cancellation is only honoured before the work starts.
async fn run_blocking_to_completion<F>(ctx: &ToolContext, work: F) -> ToolOutput
where
    F: FnOnce() -> ToolOutput + Send + 'static,
{
    if ctx.cancel.is_cancelled() {
        return ToolOutput::canceled("canceled before start");
    }
    tokio::task::spawn_blocking(|| as_session_user(work))
        .await
        .unwrap_or_else(|e| {
            ToolOutput::failure(reason::INTERNAL_ERROR, format!("tool task failed: {e}"))
        })
}

/// A canonical temporary workspace for the tools' unit tests.
#[cfg(test)]
pub(crate) fn test_workspace() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ws = std::fs::canonicalize(dir.path()).expect("canonical tempdir");
    (dir, ws)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[allow(dead_code)]
    struct Sample {
        path: String,
        timeout_ms: Option<u64>,
    }

    #[test]
    fn invalid_input_names_missing_field() {
        let err = parse_input::<Sample>("t", &json!({})).unwrap_err();
        assert_eq!(err.reason.as_deref(), Some(reason::INVALID_INPUT));
        assert!(err.text.contains("`path`"), "{}", err.text);
        assert_eq!(err.outcome, Outcome::Failed);
    }

    #[test]
    fn invalid_input_names_mistyped_field() {
        let err =
            parse_input::<Sample>("t", &json!({"path": "a", "timeoutMs": "soon"})).unwrap_err();
        assert!(err.text.contains("`timeoutMs`"), "{}", err.text);
        let err = parse_input::<Sample>("t", &json!({"path": 5})).unwrap_err();
        assert!(err.text.contains("`path`"), "{}", err.text);
    }

    #[test]
    fn invalid_input_names_unknown_field_and_non_object() {
        let err = parse_input::<Sample>("t", &json!({"path": "a", "bogus": 1})).unwrap_err();
        assert!(err.text.contains("`bogus`"), "{}", err.text);
        let err = parse_input::<Sample>("t", &json!("a")).unwrap_err();
        assert!(err.text.contains("JSON object"), "{}", err.text);
    }

    struct Echo(&'static str);

    #[async_trait::async_trait]
    impl Tool for Echo {
        fn name(&self) -> &str {
            "bash"
        }
        async fn run(&self, _ctx: ToolContext, input: Value) -> ToolOutput {
            ToolOutput::success(format!("{}: {input}", self.0))
        }
    }

    #[test]
    fn builtin_registry_holds_seven_tools() {
        let registry = ToolRegistry::builtin();
        assert_eq!(
            registry.names(),
            [
                "bash",
                "edit",
                "glob",
                "grep",
                "list_files",
                "read",
                "write"
            ]
        );
        for name in registry.names() {
            let tool = registry.get(&name).expect("registered");
            assert_eq!(tool.name(), name);
        }
        assert!(registry.get("nope").is_none());
        assert!(ToolRegistry::empty().names().is_empty());
    }

    #[tokio::test]
    async fn register_replaces_tool_of_same_name() {
        let mut registry = ToolRegistry::builtin();
        registry.register(Arc::new(Echo("custom")));
        assert_eq!(registry.names().len(), 7);
        let dir = tempfile::tempdir().unwrap();
        let ctx = ToolContext::new(dir.path(), "call-1");
        let out = registry.run("bash", ctx.clone(), json!({"x": 1})).await;
        assert_eq!(out, ToolOutput::success(r#"custom: {"x":1}"#));
        let out = registry.run("missing", ctx, json!({})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::UNKNOWN_TOOL));
    }

    #[tokio::test]
    async fn register_adds_custom_tool_by_name() {
        struct Custom;
        #[async_trait::async_trait]
        impl Tool for Custom {
            fn name(&self) -> &str {
                "deploy"
            }
            async fn run(&self, _ctx: ToolContext, _input: Value) -> ToolOutput {
                ToolOutput::success("deployed")
            }
        }
        let mut registry = ToolRegistry::empty();
        registry.register(Arc::new(Custom));
        assert_eq!(registry.names(), ["deploy"]);
        let dir = tempfile::tempdir().unwrap();
        let tool = registry.get("deploy").unwrap();
        let out = tool.run(ToolContext::new(dir.path(), "c"), json!({})).await;
        assert_eq!(out.text, "deployed");
        assert_eq!(out.outcome, Outcome::Succeeded);
    }

    #[tokio::test]
    async fn run_blocking_reports_cancel() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = ToolContext::new(dir.path(), "c");
        ctx.cancel.cancel();
        let out = run_blocking(&ctx, |_| ToolOutput::success("x")).await;
        assert_eq!(out.outcome, Outcome::Canceled);
        let ctx = ToolContext::new(dir.path(), "c");
        let token = ctx.cancel.clone();
        let out = tokio::join!(
            run_blocking(&ctx, |t| {
                while !t.is_cancelled() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                ToolOutput::success("late")
            }),
            async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                token.cancel();
            }
        )
        .0;
        assert_eq!(out.outcome, Outcome::Canceled);
    }
}
