//! `edit`: replaces one exact occurrence of `oldString` with `newString`.
//!
//! Requiring exactly one occurrence makes an edit unambiguous: if the model's
//! snippet matches nowhere (stale view of the file) or in several places, we
//! refuse and say how many matches there were, so it can re-read or add
//! context. Occurrences are counted overlapping (`aa` occurs twice in `aaa`)
//! because an overlapping match is just as ambiguous. The file is rewritten
//! atomically like `write`, keeping its permissions.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::beneath::{self, Beneath, Kind};
use super::read::io_failure;
use super::write::atomic_write;
use super::{
    boundary, parse_input, reason, run_blocking_to_completion, Tool, ToolContext, ToolOutput,
};

/// The largest file `edit` changes: it holds the file and its edited copy.
pub const MAX_EDIT_BYTES: u64 = 64 << 20;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct EditInput {
    path: String,
    old_string: String,
    new_string: String,
}

/// The `edit` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct EditTool;

#[async_trait::async_trait]
impl Tool for EditTool {
    fn name(&self) -> &str {
        "edit"
    }

    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput {
        let input: EditInput = match parse_input("edit", &input) {
            Ok(input) => input,
            Err(out) => return out,
        };
        // The rewritten file needs room for at least the new text; the reserve
        // keeps the host usable (see `disk`).
        if let Err(full) = ctx
            .disk
            .check_room(&ctx.workspace, input.new_string.len() as u64)
        {
            return full;
        }
        let workspace = ctx.workspace.clone();
        run_blocking_to_completion(&ctx, move || edit_file(&workspace, &input)).await
    }
}

/// Counts occurrences of a non-empty `needle`, overlapping ones included.
fn count_occurrences(haystack: &str, needle: &str) -> usize {
    let step = needle.chars().next().map_or(1, char::len_utf8);
    let mut count = 0;
    let mut start = 0;
    while let Some(found) = haystack.get(start..).and_then(|rest| rest.find(needle)) {
        count += 1;
        start += found + step;
    }
    count
}

fn edit_file(workspace: &Path, input: &EditInput) -> ToolOutput {
    if input.path.is_empty() {
        return ToolOutput::invalid_input("invalid input for edit: field `path` must not be empty");
    }
    if input.old_string.is_empty() {
        return ToolOutput::invalid_input(
            "invalid input for edit: field `oldString` must not be empty (use write to create a file)",
        );
    }
    let path = match boundary::resolve(workspace, &input.path) {
        Ok(path) => path,
        Err(err) => return err.into(),
    };
    let shown = boundary::display(workspace, &path);
    // Read beneath the workspace handle (see `beneath`): a component
    // swapped for a symlink since `resolve` is refused, not followed.
    let mut file = match Beneath::new(workspace).and_then(|b| b.open_read(&path)) {
        Ok(file) => file,
        Err(err) => return io_failure(&shown, &err),
    };
    match beneath::kind_of(&file) {
        Ok(Kind::Dir) => {
            return ToolOutput::failure(reason::IS_DIRECTORY, format!("`{shown}` is a directory"))
        }
        // FIFOs and devices would block or never end.
        Ok(Kind::Other | Kind::Symlink) => {
            return ToolOutput::failure(
                reason::IO_ERROR,
                format!("`{shown}` is not a regular file"),
            )
        }
        Ok(Kind::File) => {}
        Err(err) => return io_failure(&shown, &err),
    }
    // The whole file is held (twice, with the edit): bound it.
    match file.metadata() {
        Ok(meta) if meta.len() > MAX_EDIT_BYTES => {
            return ToolOutput::failure(
                reason::IO_ERROR,
                format!(
                    "`{shown}` is {} bytes; edit changes files of at most {MAX_EDIT_BYTES} bytes (use bash for bigger ones)",
                    meta.len()
                ),
            )
        }
        Ok(_) => {}
        Err(err) => return io_failure(&shown, &err),
    }
    let mut bytes = Vec::new();
    let limited = &mut std::io::Read::take(&mut file, MAX_EDIT_BYTES + 1);
    if let Err(err) = std::io::Read::read_to_end(limited, &mut bytes) {
        return io_failure(&shown, &err);
    }
    if bytes.len() as u64 > MAX_EDIT_BYTES {
        return ToolOutput::failure(
            reason::IO_ERROR,
            format!("`{shown}` grew past {MAX_EDIT_BYTES} bytes while being read"),
        );
    }
    let Ok(text) = String::from_utf8(bytes) else {
        return ToolOutput::failure(
            reason::BINARY_FILE,
            format!("`{shown}` is not valid UTF-8 text; edit only changes text files"),
        );
    };
    match count_occurrences(&text, &input.old_string) {
        0 => ToolOutput::failure(
            reason::NO_MATCH,
            format!(
                "oldString was not found in `{shown}` (0 occurrences); read the file again and copy the text exactly"
            ),
        ),
        1 => {
            let updated = text.replacen(&input.old_string, &input.new_string, 1);
            match atomic_write(workspace, &path, updated.as_bytes()) {
                Ok(_) => ToolOutput::success(format!("edited `{shown}`: replaced 1 occurrence")),
                Err(err) => io_failure(&shown, &err),
            }
        }
        n => ToolOutput::failure(
            reason::AMBIGUOUS_MATCH,
            format!(
                "oldString occurs {n} times in `{shown}` ({n} occurrences); it must occur exactly once, so include more surrounding context"
            ),
        ),
    }
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

    async fn edit(ws: &Path, path: &str, old: &str, new: &str) -> ToolOutput {
        let input = json!({"path": path, "oldString": old, "newString": new});
        EditTool.run(ToolContext::new(ws, "call"), input).await
    }

    #[tokio::test]
    async fn replaces_single_occurrence() {
        let (_d, ws) = setup();
        fs::write(ws.join("f.rs"), "fn main() {\n    old();\n}\n").unwrap();
        let out = edit(&ws, "f.rs", "old()", "new()").await;
        assert_eq!(out.outcome, Outcome::Succeeded, "{}", out.text);
        assert_eq!(
            fs::read_to_string(ws.join("f.rs")).unwrap(),
            "fn main() {\n    new();\n}\n"
        );
    }

    #[tokio::test]
    async fn zero_occurrences_says_zero() {
        let (_d, ws) = setup();
        fs::write(ws.join("f"), "abc").unwrap();
        let out = edit(&ws, "f", "xyz", "q").await;
        assert!(out.is_error);
        assert_eq!(out.reason.as_deref(), Some(reason::NO_MATCH));
        assert!(out.text.contains("0 occurrences"), "{}", out.text);
        assert_eq!(fs::read_to_string(ws.join("f")).unwrap(), "abc");
    }

    #[tokio::test]
    async fn two_occurrences_says_two() {
        let (_d, ws) = setup();
        fs::write(ws.join("f"), "x = 1;\nx = 1;\n").unwrap();
        let out = edit(&ws, "f", "x = 1;", "x = 2;").await;
        assert!(out.is_error);
        assert_eq!(out.reason.as_deref(), Some(reason::AMBIGUOUS_MATCH));
        assert!(out.text.contains("2 times"), "{}", out.text);
        assert_eq!(
            fs::read_to_string(ws.join("f")).unwrap(),
            "x = 1;\nx = 1;\n"
        );
        fs::write(ws.join("g"), "aaa").unwrap();
        let out = edit(&ws, "g", "aa", "b").await;
        assert!(out.text.contains("2 times"), "overlapping: {}", out.text);
    }

    #[tokio::test]
    async fn errors_for_bad_input_missing_and_binary() {
        let (_d, ws) = setup();
        let out = edit(&ws, "missing", "a", "b").await;
        assert_eq!(out.reason.as_deref(), Some(reason::NOT_FOUND));
        fs::write(ws.join("f"), "abc").unwrap();
        let out = edit(&ws, "f", "", "b").await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        let out = EditTool
            .run(
                ToolContext::new(&ws, "c"),
                json!({"path": "f", "oldString": "a"}),
            )
            .await;
        assert!(out.text.contains("`newString`"), "{}", out.text);
        fs::write(ws.join("bin"), b"\xff\xfe a").unwrap();
        let out = edit(&ws, "bin", "a", "b").await;
        assert_eq!(out.reason.as_deref(), Some(reason::BINARY_FILE));
    }

    #[tokio::test]
    async fn boundary_is_enforced() {
        let (_d, ws) = setup();
        symlink("/etc", ws.join("link")).unwrap();
        for path in ["../x", "/etc/passwd", "link/passwd"] {
            let out = edit(&ws, path, "root", "toor").await;
            assert_eq!(
                out.reason.as_deref(),
                Some(reason::WORKSPACE_BOUNDARY),
                "{path}"
            );
        }
    }

    #[test]
    fn counts_multibyte_and_overlaps() {
        assert_eq!(count_occurrences("ééé", "éé"), 2);
        assert_eq!(count_occurrences("abcabc", "abc"), 2);
        assert_eq!(count_occurrences("abc", "d"), 0);
    }
}
