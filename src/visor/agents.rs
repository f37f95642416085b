//! Agents (VISOR.md §6): named launch recipes in `<home>/agents.toml`.
//!
//! ```toml
//! [agents.claude]
//! binary = "claude-code-acp"
//! args = []
//! kind = "wire"
//! resumeArgs = ["--resume", "{vendorId}"]
//! env = { CLAUDE_CONFIG_DIR = "/home/me/.claude" }
//! capabilities = { permissions = true, resume = true, steer = false, structured = true, terminal = false }
//! ```
//!
//! The file is read when it is used (a start with `agent`, `GET
//! /v1/agents`), so an edit needs no restart of the visor. It is bounded
//! before it is parsed, parsed strictly (unknown fields are errors), and a
//! malformed file is refused with the line and column the TOML parser
//! names. There are no built-in recipes: VISOR.md asks for none.

use super::types::Kind;
use super::VisorError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Largest `agents.toml`.
pub const MAX_FILE: u64 = 256 << 10;
/// Recipes in one file.
pub const MAX_AGENTS: usize = 64;
/// Arguments (and resume arguments) of one recipe.
const MAX_ARGS: usize = 256;
/// Environment variables of one recipe.
const MAX_ENV: usize = 256;
/// How long `binary --version` may take, and how much of it is kept.
const VERSION_WAIT: Duration = Duration::from_secs(3);
const VERSION_BYTES: usize = 200;
/// Replaced by the session's vendor id in `resumeArgs`.
pub const VENDOR_ID: &str = "{vendorId}";

/// What an agent can do (reported, and used where the visor needs it:
/// `resume` allows the recipe's `resumeArgs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Capabilities {
    #[serde(default)]
    pub permissions: bool,
    #[serde(default)]
    pub resume: bool,
    #[serde(default)]
    pub steer: bool,
    #[serde(default)]
    pub structured: bool,
    #[serde(default)]
    pub terminal: bool,
}

/// One recipe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Recipe {
    pub binary: String,
    #[serde(default)]
    pub args: Vec<String>,
    pub kind: Kind,
    #[serde(default)]
    pub resume_args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub capabilities: Capabilities,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    agents: BTreeMap<String, Recipe>,
}

fn invalid(path: &Path, m: impl std::fmt::Display) -> VisorError {
    VisorError::Invalid(format!("{}: {m}", path.display()))
}

/// A name of `agents.toml` (and of `bmx visor hook --agent`): 1-64 of
/// `A-Z a-z 0-9 - _ .`.
pub fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Parse the text of an `agents.toml` (`path` names it in errors).
///
/// # Errors
/// `invalid`, naming the file and, for a TOML or field error, its line.
pub fn parse(path: &Path, text: &str) -> Result<BTreeMap<String, Recipe>, VisorError> {
    let file: File = toml::from_str(text).map_err(|e| {
        let at = e
            .span()
            .map(|s| {
                let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                format!("line {line}: ")
            })
            .unwrap_or_default();
        invalid(path, format!("{at}{}", e.message()))
    })?;
    if file.agents.len() > MAX_AGENTS {
        return Err(invalid(path, format!("at most {MAX_AGENTS} agents")));
    }
    for (name, r) in &file.agents {
        let bad = |m: &str| invalid(path, format!("agent {name:?}: {m}"));
        if !valid_name(name) {
            return Err(bad("names are 1-64 of A-Z a-z 0-9 - _ ."));
        }
        if r.binary.is_empty() || r.binary.contains('\0') {
            return Err(bad("binary is empty or has a NUL byte"));
        }
        if r.kind == Kind::Observed {
            return Err(bad("kind is pty or wire"));
        }
        if r.args.len() > MAX_ARGS || r.resume_args.len() > MAX_ARGS {
            return Err(bad(&format!("at most {MAX_ARGS} args and resumeArgs")));
        }
        if r.args
            .iter()
            .chain(&r.resume_args)
            .any(|a| a.contains('\0'))
        {
            return Err(bad("an argument has a NUL byte"));
        }
        if r.env.len() > MAX_ENV
            || r.env.iter().any(|(k, v)| {
                k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0')
            })
        {
            return Err(bad(&format!(
                "env: at most {MAX_ENV} variables, names without '=' or NUL"
            )));
        }
    }
    Ok(file.agents)
}

/// `<home>/agents.toml`.
pub fn file(home: &Path) -> PathBuf {
    home.join("agents.toml")
}

/// The recipes of `<home>/agents.toml` (none when there is no file).
///
/// # Errors
/// `invalid` for an unreadable, oversized or malformed file.
pub fn load(home: &Path) -> Result<BTreeMap<String, Recipe>, VisorError> {
    let path = file(home);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(invalid(&path, e)),
    };
    if meta.len() > MAX_FILE {
        return Err(invalid(&path, format!("larger than {MAX_FILE} bytes")));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| invalid(&path, e))?;
    parse(&path, &text)
}

/// One recipe by name.
///
/// # Errors
/// `invalid` for a malformed file or an unknown name (a start spec that
/// names it is invalid).
pub fn recipe(home: &Path, name: &str) -> Result<Recipe, VisorError> {
    load(home)?.remove(name).ok_or_else(|| {
        VisorError::Invalid(format!(
            "unknown agent {name:?} (not in {})",
            file(home).display()
        ))
    })
}

/// `resumeArgs` with the vendor id in place of `{vendorId}`.
pub fn resume_args(args: &[String], vendor_id: &str) -> Vec<String> {
    args.iter()
        .map(|a| a.replace(VENDOR_ID, vendor_id))
        .collect()
}

/// `GET /v1/agents[/{name}]`: the recipe, whether its binary is found on
/// the visor's `PATH` (or the recipe's), and what `binary --version` says.
pub async fn report(name: &str, r: &Recipe) -> serde_json::Value {
    let path = r
        .env
        .get("PATH")
        .cloned()
        .or_else(|| std::env::var("PATH").ok());
    let cwd = std::env::temp_dir();
    let found = crate::process::sys::resolve_program(&r.binary, path.as_deref(), &cwd)
        .filter(|p| p.is_file());
    let version = match &found {
        Some(p) => version(p).await,
        None => None,
    };
    serde_json::json!({
        "name": name,
        "binary": r.binary,
        "args": r.args,
        "kind": r.kind,
        "resumeArgs": r.resume_args,
        // Values may be secrets: names only.
        "env": r.env.keys().collect::<Vec<_>>(),
        "capabilities": r.capabilities,
        "found": found.is_some(),
        "path": found.map(|p| p.display().to_string()),
        "version": version,
    })
}

/// The first line of `binary --version`, bounded in time and size; the
/// process (and its group) is killed if it outstays.
async fn version(binary: &Path) -> Option<String> {
    let mut cmd = tokio::process::Command::new(binary);
    cmd.arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    let child = cmd.spawn().ok()?;
    let pid = child.id();
    let out = tokio::time::timeout(VERSION_WAIT, child.wait_with_output()).await;
    if let Some(pid) = pid {
        crate::process::sys::signal_group(pid as i32, nix::sys::signal::Signal::SIGKILL);
    }
    let out = out.ok()?.ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| !l.trim().is_empty())?.trim();
    Some(line.chars().take(VERSION_BYTES).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_recipe() {
        let text = r#"
[agents.test]
binary = "node"
args = ["agent.mjs"]
kind = "wire"
resumeArgs = ["--resume", "{vendorId}"]
env = { A = "b" }
capabilities = { permissions = true, resume = true }
"#;
        let a = parse(Path::new("agents.toml"), text).unwrap();
        let r = &a["test"];
        assert_eq!(r.kind, Kind::Wire);
        assert!(r.capabilities.resume && !r.capabilities.steer);
        assert_eq!(
            resume_args(&r.resume_args, "v-1"),
            vec!["--resume".to_owned(), "v-1".to_owned()]
        );
    }

    #[test]
    fn refuses_bad_files_with_their_line() {
        let p = Path::new("agents.toml");
        let e = parse(
            p,
            "[agents.x]\nbinary = \"a\"\nkind = \"wire\"\nbogus = 1\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("line 4"), "{e}");
        let e = parse(p, "[agents.x]\nbinary = \n").unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        let e = parse(p, "[agents.x]\nbinary = \"a\"\nkind = \"tty\"\n").unwrap_err();
        assert!(e.to_string().contains("line 3"), "{e}");
        let e = parse(p, "[agents.\"a b\"]\nbinary = \"a\"\nkind = \"pty\"\n").unwrap_err();
        assert!(e.to_string().contains("names are"), "{e}");
        let e = parse(p, "[agents.x]\nbinary = \"a\"\nkind = \"observed\"\n").unwrap_err();
        assert!(e.to_string().contains("pty or wire"), "{e}");
    }
}
