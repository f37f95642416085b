//! `glob`: files matching a glob pattern, newest first.
//!
//! Newest first because the files a session touched most recently are the
//! ones it most likely wants again. The walk is [`super::walk::Walk`]: it
//! honours `.gitignore`, never follows symlinks and lists every directory
//! through a descriptor opened beneath the workspace, so neither a link to
//! `/etc` nor a directory swapped for one mid-walk can pull outside names
//! into the results.
//!
//! Pattern semantics follow ripgrep's `--glob`: a pattern without `/` is
//! matched against the file name at any depth (`*.rs`), a pattern with `/`
//! against the path relative to the search directory (`src/**/*.rs`), where
//! `*` does not cross `/` and `**` spans directories.

use std::path::Path;
use std::time::SystemTime;

use globset::{GlobBuilder, GlobMatcher};
use serde::Deserialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::output::truncate_text;
use super::read::io_failure;
use super::walk::{Kind, Walk};
use super::{boundary, parse_input, run_blocking, Tool, ToolContext, ToolOutput};

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GlobInput {
    path: Option<String>,
    pattern: String,
}

/// The `glob` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobTool;

#[async_trait::async_trait]
impl Tool for GlobTool {
    fn name(&self) -> &str {
        "glob"
    }

    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput {
        let input: GlobInput = match parse_input("glob", &input) {
            Ok(input) => input,
            Err(out) => return out,
        };
        let workspace = ctx.workspace.clone();
        let limit = ctx.inline_limit;
        run_blocking(&ctx, move |cancel| {
            glob_files(&workspace, &input, limit, &cancel)
        })
        .await
    }
}

/// A compiled ripgrep-style path pattern (see the module docs).
pub(super) struct PathPattern {
    matcher: GlobMatcher,
    whole_path: bool,
}

impl PathPattern {
    /// Compiles `pattern`; the error text is meant for the model.
    pub(super) fn new(pattern: &str) -> Result<Self, String> {
        let trimmed = pattern.strip_prefix("./").unwrap_or(pattern);
        let whole_path = trimmed.contains('/');
        let trimmed = trimmed.strip_prefix('/').unwrap_or(trimmed);
        if trimmed.is_empty() {
            return Err("pattern must not be empty".to_string());
        }
        let glob = GlobBuilder::new(trimmed)
            .literal_separator(true)
            .backslash_escape(true)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            matcher: glob.compile_matcher(),
            whole_path,
        })
    }

    /// Whether the file at `rel` (relative to the search directory) matches.
    pub(super) fn is_match(&self, rel: &Path) -> bool {
        if self.whole_path {
            self.matcher.is_match(rel)
        } else {
            rel.file_name()
                .is_some_and(|name| self.matcher.is_match(name))
        }
    }
}

/// Resolves the optional search path of `glob`/`grep` (default: the
/// workspace) and checks it exists.
pub(super) fn resolve_base(
    workspace: &Path,
    path: Option<&str>,
) -> Result<std::path::PathBuf, ToolOutput> {
    let base = boundary::resolve(workspace, path.unwrap_or(""))?;
    if let Err(err) = std::fs::symlink_metadata(&base) {
        return Err(io_failure(&boundary::display(workspace, &base), &err));
    }
    Ok(base)
}

/// The path of `entry` relative to `base`, for pattern matching; a file
/// given as the base itself is matched by its name.
pub(super) fn relative_to_base<'a>(path: &'a Path, base: &Path) -> &'a Path {
    match path.strip_prefix(base) {
        Ok(rel) if !rel.as_os_str().is_empty() => rel,
        _ => path.file_name().map_or(path, Path::new),
    }
}

fn glob_files(
    workspace: &Path,
    input: &GlobInput,
    inline_limit: usize,
    cancel: &CancellationToken,
) -> ToolOutput {
    let pattern = match PathPattern::new(&input.pattern) {
        Ok(pattern) => pattern,
        Err(err) => {
            return ToolOutput::invalid_input(format!(
                "invalid input for glob: field `pattern`: {err}"
            ))
        }
    };
    let base = match resolve_base(workspace, input.path.as_deref()) {
        Ok(base) => base,
        Err(out) => return out,
    };
    let walk = match Walk::new(workspace, &base) {
        Ok(walk) => walk,
        Err(err) => return io_failure(&boundary::display(workspace, &base), &err),
    };
    let mut found: Vec<(SystemTime, String)> = Vec::new();
    for (seen, entry) in walk.enumerate() {
        if seen % 1024 == 0 && cancel.is_cancelled() {
            return ToolOutput::canceled("canceled");
        }
        if entry.kind == Kind::Dir {
            continue;
        }
        if !pattern.is_match(relative_to_base(&entry.path, &base)) {
            continue;
        }
        let modified = entry.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        found.push((modified, boundary::display(workspace, &entry.path)));
    }
    if found.is_empty() {
        return ToolOutput::success("No files found");
    }
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let mut text = String::new();
    for (_, path) in &found {
        text.push_str(path);
        text.push('\n');
    }
    let rendered = truncate_text(&text, inline_limit);
    let truncated = rendered.truncated();
    let mut text = rendered.text;
    if truncated {
        text.push_str(&format!(
            "[{} files matched; list cut at {inline_limit} bytes, narrow the pattern or path]\n",
            found.len()
        ));
    }
    ToolOutput::success(text)
}

#[cfg(test)]
mod tests {
    use super::super::{reason, Outcome};
    use super::*;
    use serde_json::json;
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;
    use std::time::Duration;

    fn setup() -> (tempfile::TempDir, PathBuf) {
        super::super::test_workspace()
    }

    async fn glob(ws: &Path, input: Value) -> ToolOutput {
        GlobTool.run(ToolContext::new(ws, "call"), input).await
    }

    fn touch(path: &Path, secs_after_epoch: u64) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, "x").unwrap();
        let file = fs::File::options().write(true).open(path).unwrap();
        file.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs_after_epoch))
            .unwrap();
    }

    #[tokio::test]
    async fn newest_first() {
        let (_d, ws) = setup();
        touch(&ws.join("old.rs"), 1_000);
        touch(&ws.join("src/new.rs"), 3_000);
        touch(&ws.join("src/mid.rs"), 2_000);
        touch(&ws.join("notes.txt"), 4_000);
        let out = glob(&ws, json!({"pattern": "*.rs"})).await;
        assert_eq!(out.outcome, Outcome::Succeeded);
        assert_eq!(out.text, "src/new.rs\nsrc/mid.rs\nold.rs\n");
    }

    #[tokio::test]
    async fn path_patterns_and_search_dir() {
        let (_d, ws) = setup();
        touch(&ws.join("a.rs"), 1);
        touch(&ws.join("src/b.rs"), 2);
        touch(&ws.join("src/deep/c.rs"), 3);
        let out = glob(&ws, json!({"pattern": "src/*.rs"})).await;
        assert_eq!(out.text, "src/b.rs\n");
        let out = glob(&ws, json!({"pattern": "**/*.rs"})).await;
        assert_eq!(out.text, "src/deep/c.rs\nsrc/b.rs\na.rs\n");
        let out = glob(&ws, json!({"path": "src", "pattern": "deep/*.rs"})).await;
        assert_eq!(out.text, "src/deep/c.rs\n");
        let out = glob(&ws, json!({"pattern": "*.py"})).await;
        assert_eq!(out.text, "No files found");
    }

    #[tokio::test]
    async fn gitignore_is_honoured_without_git() {
        let (_d, ws) = setup();
        fs::write(ws.join(".gitignore"), "target/\nsecret.rs\n").unwrap();
        touch(&ws.join("target/gen.rs"), 1);
        touch(&ws.join("secret.rs"), 1);
        touch(&ws.join("lib.rs"), 1);
        let out = glob(&ws, json!({"pattern": "*.rs"})).await;
        assert_eq!(out.text, "lib.rs\n");
    }

    #[tokio::test]
    async fn symlinks_are_not_followed() {
        let (_d, ws) = setup();
        let (_o, other) = setup();
        touch(&other.join("outside.rs"), 1);
        symlink(&other, ws.join("out-link")).unwrap();
        symlink("/etc", ws.join("etc-link")).unwrap();
        touch(&ws.join("in.rs"), 1);
        let out = glob(&ws, json!({"pattern": "**/*.rs"})).await;
        assert_eq!(out.text, "in.rs\n");
        let out = glob(&ws, json!({"pattern": "passwd"})).await;
        assert_eq!(out.text, "No files found");
        let out = glob(&ws, json!({"path": "etc-link", "pattern": "*"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::WORKSPACE_BOUNDARY));
        let out = glob(&ws, json!({"path": "/etc", "pattern": "*"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::WORKSPACE_BOUNDARY));
    }

    #[tokio::test]
    async fn bad_pattern_and_missing_path() {
        let (_d, ws) = setup();
        let out = glob(&ws, json!({"pattern": "a[b"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        assert!(out.text.contains("`pattern`"));
        let out = glob(&ws, json!({"path": "nope", "pattern": "*"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::NOT_FOUND));
        let out = glob(&ws, json!({})).await;
        assert!(out.text.contains("`pattern`"));
    }
}
