//! `write`: creates or replaces a file with the given content.
//!
//! The replacement is atomic (a temp file in the same directory, fsynced,
//! then renamed over the target) so a crash or a concurrent reader never sees
//! a half-written file, and an existing file keeps its permissions. Missing
//! parent directories are created, but only after the whole path has been
//! checked against the workspace boundary, so no directory is ever created
//! outside it.

use std::io;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::beneath::Beneath;
use super::read::io_failure;
use super::{boundary, parse_input, run_blocking_to_completion, Tool, ToolContext, ToolOutput};

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WriteInput {
    path: String,
    content: String,
}

/// The `write` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteTool;

#[async_trait::async_trait]
impl Tool for WriteTool {
    fn name(&self) -> &str {
        "write"
    }

    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput {
        let input: WriteInput = match parse_input("write", &input) {
            Ok(input) => input,
            Err(out) => return out,
        };
        // The rewritten file needs room for at least the content; the reserve
        // keeps the host usable (see `disk`).
        if let Err(full) = ctx
            .disk
            .check_room(&ctx.workspace, input.content.len() as u64)
        {
            return full;
        }
        let workspace = ctx.workspace.clone();
        run_blocking_to_completion(&ctx, move || write_file(&workspace, &input)).await
    }
}

fn write_file(workspace: &Path, input: &WriteInput) -> ToolOutput {
    if input.path.is_empty() {
        return ToolOutput::invalid_input(
            "invalid input for write: field `path` must not be empty",
        );
    }
    let path = match boundary::resolve(workspace, &input.path) {
        Ok(path) => path,
        Err(err) => return err.into(),
    };
    let shown = boundary::display(workspace, &path);
    match atomic_write(workspace, &path, input.content.as_bytes()) {
        Ok(existed) => {
            let verb = if existed { "updated" } else { "created" };
            ToolOutput::success(format!("{verb} `{shown}` ({} bytes)", input.content.len()))
        }
        Err(err) => io_failure(&shown, &err),
    }
}

/// Atomically replaces `path` (already resolved and boundary-checked) with
/// `content`, creating parent directories. Returns whether the file existed.
///
/// Everything happens relative to a handle of the workspace
/// ([`Beneath::write_atomic`]): the temp file is created with `O_EXCL |
/// O_NOFOLLOW` in the parent's handle and renamed over the name in that
/// same handle, so a symlink planted on the way is refused and one planted
/// at the destination is replaced, never followed.
pub(super) fn atomic_write(workspace: &Path, path: &Path, content: &[u8]) -> io::Result<bool> {
    Beneath::new(workspace)?.write_atomic(path, content)
}

#[cfg(test)]
mod tests {
    use super::super::reason;
    use super::super::Outcome;
    use super::*;
    use serde_json::json;
    use std::fs;
    use std::os::unix::fs::{symlink, PermissionsExt};
    use std::path::PathBuf;

    fn setup() -> (tempfile::TempDir, PathBuf) {
        super::super::test_workspace()
    }

    async fn write(ws: &Path, input: Value) -> ToolOutput {
        WriteTool.run(ToolContext::new(ws, "call"), input).await
    }

    #[tokio::test]
    async fn creates_parents_and_replaces_atomically() {
        let (_d, ws) = setup();
        let out = write(&ws, json!({"path": "a/b/c.txt", "content": "one"})).await;
        assert_eq!(out.outcome, Outcome::Succeeded, "{}", out.text);
        assert!(out.text.contains("created"));
        assert_eq!(fs::read_to_string(ws.join("a/b/c.txt")).unwrap(), "one");
        let out = write(&ws, json!({"path": "a/b/c.txt", "content": "two"})).await;
        assert!(out.text.contains("updated"));
        assert_eq!(fs::read_to_string(ws.join("a/b/c.txt")).unwrap(), "two");
        let leftovers: Vec<_> = fs::read_dir(ws.join("a/b")).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "temp files left behind");
    }

    #[tokio::test]
    async fn keeps_permissions_of_replaced_file() {
        let (_d, ws) = setup();
        let script = ws.join("run.sh");
        fs::write(&script, "old").unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o750)).unwrap();
        write(&ws, json!({"path": "run.sh", "content": "new"})).await;
        let mode = fs::metadata(&script).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o750);
    }

    #[tokio::test]
    async fn writes_through_inside_symlink_to_target() {
        let (_d, ws) = setup();
        fs::write(ws.join("real"), "x").unwrap();
        symlink("real", ws.join("alias")).unwrap();
        write(&ws, json!({"path": "alias", "content": "y"})).await;
        assert_eq!(fs::read_to_string(ws.join("real")).unwrap(), "y");
        assert!(fs::symlink_metadata(ws.join("alias"))
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[tokio::test]
    async fn boundary_is_enforced_and_nothing_created_outside() {
        let (_d, ws) = setup();
        let (_o, other) = setup();
        symlink("/etc", ws.join("link")).unwrap();
        symlink(&other, ws.join("other")).unwrap();
        symlink(other.join("dangling-target"), ws.join("dangling")).unwrap();
        let name = format!("bmx-write-test-{}", uuid::Uuid::new_v4().simple());
        let cases = [
            format!("link/{name}"),
            format!("/etc/{name}"),
            format!("../{name}"),
            "other/sub/file".to_string(),
            "dangling".to_string(),
        ];
        for path in &cases {
            let out = write(&ws, json!({"path": path, "content": "pwned"})).await;
            assert!(out.is_error, "{path}");
            assert_eq!(
                out.reason.as_deref(),
                Some(reason::WORKSPACE_BOUNDARY),
                "{path}"
            );
        }
        assert!(!Path::new("/etc").join(&name).exists());
        assert!(
            fs::read_dir(&other).unwrap().next().is_none(),
            "created outside"
        );
        assert!(!ws.parent().unwrap().join(&name).exists());
    }

    #[tokio::test]
    async fn directory_and_bad_input() {
        let (_d, ws) = setup();
        fs::create_dir(ws.join("d")).unwrap();
        let out = write(&ws, json!({"path": "d", "content": "x"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::IS_DIRECTORY));
        let out = write(&ws, json!({"path": "f"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        assert!(out.text.contains("`content`"));
        let out = write(&ws, json!({"path": "", "content": "x"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        fs::write(ws.join("file"), "x").unwrap();
        let out = write(&ws, json!({"path": "file/child", "content": "x"})).await;
        assert!(out.is_error);
    }
}
