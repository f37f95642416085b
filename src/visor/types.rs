//! The visor's JSON types (VISOR.md §1–2), camelCase on the wire, and the
//! checks a start spec passes before anything is spawned.

use super::agents::Recipe;
use super::error::VisorError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The protocol this visor speaks.
pub const PROTOCOL: &str = "bmx.visor.v1";

/// Most argv entries, labels, bytes of a title.
const MAX_ARGS: usize = 1024;
const MAX_ARG_BYTES: usize = 64 << 10;
const MAX_LABELS: usize = 64;
const MAX_LABEL_BYTES: usize = 256;
const MAX_TITLE: usize = 512;
/// Largest `prompt` / `restart.prompt`.
const MAX_PROMPT: usize = 256 << 10;
/// Largest terminal we open.
pub const MAX_DIM: u16 = 1000;

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hello {
    pub client: String,
    #[serde(default)]
    pub build: Option<String>,
    pub protocol: String,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Info {
    pub protocol: &'static str,
    pub build: String,
    pub client: Option<String>,
    pub home: String,
    pub pid: u32,
    pub seq: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RestartMode {
    #[default]
    None,
    Notify,
    Resume,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestartSpec {
    #[serde(default)]
    pub mode: RestartMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Pty,
    Wire,
    Observed,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Pty => "pty",
            Kind::Wire => "wire",
            Kind::Observed => "observed",
        }
    }
}

/// `POST /v1/sessions`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartSpec {
    pub kind: Kind,
    #[serde(default)]
    pub command: Option<Vec<String>>,
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub cols: Option<u16>,
    #[serde(default)]
    pub rows: Option<u16>,
    #[serde(default)]
    pub restart: RestartSpec,
    #[serde(default)]
    pub resume_id: Option<String>,
    #[serde(default)]
    pub mcp_servers: Option<serde_json::Value>,
    #[serde(default)]
    pub model: Option<String>,
}

/// A checked spec: what the session actor runs.
#[derive(Debug, Clone)]
pub struct Checked {
    /// The spec; with an agent, its `env` is the recipe's overlaid by the
    /// spec's own.
    pub spec: StartSpec,
    pub argv: Vec<String>,
    /// The agent recipe's `resumeArgs` (when its capabilities say
    /// `resume`), appended on a `resume` restart.
    pub resume_args: Vec<String>,
    pub role: String,
    pub title: String,
    pub cwd: std::path::PathBuf,
    pub cols: u16,
    pub rows: u16,
}

fn invalid(m: impl Into<String>) -> VisorError {
    VisorError::Invalid(m.into())
}

impl StartSpec {
    /// Check everything that needs no process. `recipe`: the agent the
    /// spec names, looked up by the caller in `agents.toml`.
    ///
    /// # Errors
    /// `invalid` for a malformed spec.
    pub fn check(mut self, recipe: Option<&Recipe>) -> Result<Checked, VisorError> {
        match (&self.command, &self.agent) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(invalid("exactly one of command and agent"))
            }
            _ => {}
        }
        if self.kind == Kind::Observed {
            return Err(invalid(
                "observed sessions are created by hooks, not started",
            ));
        }
        let mut resume_args = Vec::new();
        match (&self.agent, recipe) {
            (Some(name), Some(r)) => {
                if r.kind != self.kind {
                    return Err(invalid(format!(
                        "agent {name:?} is a {} agent, not {}",
                        r.kind.as_str(),
                        self.kind.as_str()
                    )));
                }
                let mut argv = vec![r.binary.clone()];
                argv.extend(r.args.iter().cloned());
                self.command = Some(argv);
                let mut env = r.env.clone();
                env.extend(self.env.take().unwrap_or_default());
                self.env = Some(env);
                if r.capabilities.resume {
                    resume_args = r.resume_args.clone();
                }
            }
            (Some(name), None) => return Err(invalid(format!("unknown agent {name:?}"))),
            (None, _) => {}
        }
        // A workdir is resolved to its folder (`workingDir`) by the caller,
        // which holds the registry: an unresolved one is a caller's bug.
        if self.workdir.is_some() && self.working_dir.is_none() {
            return Err(invalid("workdir was not resolved to a folder"));
        }
        if self.restart.mode == RestartMode::Resume && self.kind != Kind::Wire {
            return Err(invalid(
                "restart mode resume needs a wire session; use notify",
            ));
        }
        if self.kind == Kind::Pty && (self.resume_id.is_some() || self.prompt.is_some()) {
            return Err(invalid("resumeId and prompt are for wire sessions"));
        }
        if self.prompt.as_ref().is_some_and(|p| p.len() > MAX_PROMPT)
            || self
                .restart
                .prompt
                .as_ref()
                .is_some_and(|p| p.len() > MAX_PROMPT)
            || self.resume_id.as_ref().is_some_and(|r| r.len() > 256)
        {
            return Err(invalid(format!(
                "prompt and restart.prompt are limited to {MAX_PROMPT} bytes, resumeId to 256"
            )));
        }
        let argv = self.command.clone().unwrap_or_default();
        if argv.is_empty() || argv[0].is_empty() {
            return Err(invalid("command is empty"));
        }
        if argv.len() > MAX_ARGS || argv.iter().map(String::len).sum::<usize>() > MAX_ARG_BYTES {
            return Err(invalid(format!(
                "command is limited to {MAX_ARGS} arguments and {MAX_ARG_BYTES} bytes"
            )));
        }
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(invalid("command contains a NUL byte"));
        }
        let default_role = match self.kind {
            Kind::Wire => "agent",
            _ => "shell",
        };
        let role = self.role.clone().unwrap_or_else(|| default_role.into());
        if !matches!(role.as_str(), "agent" | "shell" | "script") {
            return Err(invalid("role is one of agent, shell, script"));
        }
        let title = self.title.clone().unwrap_or_else(|| argv.join(" "));
        if title.len() > MAX_TITLE {
            return Err(invalid(format!("title is limited to {MAX_TITLE} bytes")));
        }
        if self.labels.len() > MAX_LABELS
            || self.labels.iter().any(|(k, v)| {
                k.is_empty() || k.len() + v.len() > MAX_LABEL_BYTES || k.contains('=')
            })
        {
            return Err(invalid(format!(
                "at most {MAX_LABELS} labels, each a non-empty key without '=' and at most {MAX_LABEL_BYTES} bytes"
            )));
        }
        let (cols, rows) = (self.cols.unwrap_or(120), self.rows.unwrap_or(40));
        if !(1..=MAX_DIM).contains(&cols) || !(1..=MAX_DIM).contains(&rows) {
            return Err(invalid(format!("cols and rows are 1..={MAX_DIM}")));
        }
        let cwd = match &self.working_dir {
            Some(p) => std::path::PathBuf::from(p),
            None => std::env::var_os("HOME")
                .map(std::path::PathBuf::from)
                .filter(|h| h.is_dir())
                .unwrap_or_else(|| "/".into()),
        };
        if !cwd.is_absolute() || !cwd.is_dir() {
            return Err(invalid(format!(
                "workingDir {} is not an absolute path to a directory",
                cwd.display()
            )));
        }
        Ok(Checked {
            argv,
            resume_args,
            role,
            title,
            cwd,
            cols,
            rows,
            spec: self,
        })
    }
}

/// `Session` (VISOR.md §2).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionView {
    pub id: String,
    pub kind: Kind,
    pub state: super::state::State,
    pub role: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    pub title: String,
    pub labels: BTreeMap<String, String>,
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    pub working_dir: String,
    pub created_at: String,
    pub updated_at: String,
    pub seq: u64,
    pub turns: u64,
    /// Open requests (`{id, kind, tool?, input?, options?}`).
    pub pending: Vec<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub restart: RestartSpec,
    pub restarts: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vendor_id: Option<String>,
    pub cols: u16,
    pub rows: u16,
}

/// `GET …/screen`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScreenView {
    pub rows: u16,
    pub cols: u16,
    pub cursor_row: u16,
    pub cursor_col: u16,
    pub lines: Vec<String>,
    pub bracketed_paste: bool,
    /// The last output chunk the screen has taken in.
    pub seq: u64,
}
