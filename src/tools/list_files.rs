//! `list_files`: the entries of one directory, like `ls -a`.
//!
//! Entries are sorted by name and directories carry a trailing `/` so the
//! model can tell what to descend into. The listing does not recurse (use
//! `glob` for that) and does not follow symlinks: a symlink is shown by its
//! own name, never as the directory it points to, so listing cannot reveal
//! anything outside the workspace. A symlinked *path* given as input is
//! resolved by [`boundary::resolve`] and refused if it leaves.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::beneath::Beneath;
use super::output::truncate_text;
use super::read::io_failure;
use super::{boundary, parse_input, reason, run_blocking, Tool, ToolContext, ToolOutput};

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListFilesInput {
    path: Option<String>,
}

/// The `list_files` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct ListFilesTool;

#[async_trait::async_trait]
impl Tool for ListFilesTool {
    fn name(&self) -> &str {
        "list_files"
    }

    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput {
        let input: ListFilesInput = match parse_input("list_files", &input) {
            Ok(input) => input,
            Err(out) => return out,
        };
        let workspace = ctx.workspace.clone();
        let limit = ctx.inline_limit;
        run_blocking(&ctx, move |cancel| list(&workspace, &input, limit, &cancel)).await
    }
}

fn list(
    workspace: &Path,
    input: &ListFilesInput,
    inline_limit: usize,
    cancel: &CancellationToken,
) -> ToolOutput {
    let dir = match boundary::resolve(workspace, input.path.as_deref().unwrap_or("")) {
        Ok(dir) => dir,
        Err(err) => return err.into(),
    };
    let shown = boundary::display(workspace, &dir);
    // Listed through a descriptor opened beneath the workspace handle: a
    // directory swapped for a symlink since `resolve` is refused.
    let fd = match Beneath::new(workspace).and_then(|b| b.open_dir(&dir)) {
        Ok(fd) => fd,
        Err(err) if err.raw_os_error() == Some(libc::ENOTDIR) => {
            return ToolOutput::failure(
                reason::NOT_A_DIRECTORY,
                format!("`{shown}` is not a directory"),
            )
        }
        Err(err) => return io_failure(&shown, &err),
    };
    let mut reader = match nix::dir::Dir::from_fd(fd) {
        Ok(reader) => reader,
        Err(err) => return io_failure(&shown, &err.into()),
    };
    let mut entries: Vec<(std::ffi::OsString, bool)> = Vec::new();
    let mut unknown = Vec::new();
    for (i, entry) in reader.iter().filter_map(Result::ok).enumerate() {
        if i % 1024 == 0 && cancel.is_cancelled() {
            return ToolOutput::canceled("canceled");
        }
        let name = std::ffi::OsStr::from_bytes(entry.file_name().to_bytes());
        if name == "." || name == ".." {
            continue;
        }
        // The entry's own type: a symlink is not followed.
        match entry.file_type() {
            Some(t) => entries.push((name.to_owned(), t == nix::dir::Type::Directory)),
            None => unknown.push(name.to_owned()),
        }
    }
    // File systems that do not fill in d_type: ask, still not following.
    for name in unknown {
        let is_dir = nix::sys::stat::fstatat(
            &reader,
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
        entries.push((name, is_dir));
    }
    if entries.is_empty() {
        return ToolOutput::success(format!("(`{shown}` is empty)"));
    }
    entries.sort();
    let mut text = String::new();
    for (name, is_dir) in &entries {
        text.push_str(&name.to_string_lossy());
        if *is_dir {
            text.push('/');
        }
        text.push('\n');
    }
    let rendered = truncate_text(&text, inline_limit);
    let truncated = rendered.truncated();
    let mut text = rendered.text;
    if truncated {
        text.push_str(&format!(
            "[{} entries; listing cut at {inline_limit} bytes, use glob to narrow it]\n",
            entries.len()
        ));
    }
    ToolOutput::success(text)
}

#[cfg(test)]
mod tests {
    use super::super::Outcome;
    use super::*;
    use serde_json::json;
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    fn setup() -> (tempfile::TempDir, PathBuf) {
        super::super::test_workspace()
    }

    async fn ls(ws: &Path, input: Value) -> ToolOutput {
        ListFilesTool.run(ToolContext::new(ws, "call"), input).await
    }

    #[tokio::test]
    async fn sorted_with_directory_slash() {
        let (_d, ws) = setup();
        fs::create_dir_all(ws.join("src/inner")).unwrap();
        fs::write(ws.join("b.txt"), "").unwrap();
        fs::write(ws.join("a.txt"), "").unwrap();
        fs::write(ws.join(".hidden"), "").unwrap();
        fs::write(ws.join("src/main.rs"), "").unwrap();
        symlink("/etc", ws.join("etc-link")).unwrap();
        let out = ls(&ws, json!({})).await;
        assert_eq!(out.outcome, Outcome::Succeeded);
        assert_eq!(out.text, ".hidden\na.txt\nb.txt\netc-link\nsrc/\n");
        let out = ls(&ws, json!({"path": "src"})).await;
        assert_eq!(out.text, "inner/\nmain.rs\n");
        let out = ls(&ws, json!({"path": "src/inner"})).await;
        assert!(out.text.contains("empty"));
    }

    #[tokio::test]
    async fn errors_and_boundary() {
        let (_d, ws) = setup();
        fs::write(ws.join("f"), "").unwrap();
        symlink("/etc", ws.join("etc-link")).unwrap();
        let out = ls(&ws, json!({"path": "f"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::NOT_A_DIRECTORY));
        let out = ls(&ws, json!({"path": "missing"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::NOT_FOUND));
        for path in ["..", "/etc", "etc-link", "etc-link/ssl"] {
            let out = ls(&ws, json!({ "path": path })).await;
            assert_eq!(
                out.reason.as_deref(),
                Some(reason::WORKSPACE_BOUNDARY),
                "{path}"
            );
        }
        let out = ls(&ws, json!({"path": 1})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
    }
}
