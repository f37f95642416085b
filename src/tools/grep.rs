//! `grep`: lines matching a regular expression, as `path:line:text`.
//!
//! The walk is [`super::walk::Walk`] (honours `.gitignore`, never follows
//! symlinks, lists directories through descriptors beneath the workspace); symlinked files are skipped rather than opened, since opening
//! follows the link. Binary files (a NUL in the first 8 KiB) are skipped like
//! ripgrep does. Matching is on bytes so files that are not valid UTF-8 are
//! still searched; matched lines are shown lossily. Results stream through a
//! [`HeadTail`], so a pattern that matches everything costs bounded memory.

use std::io::{self, BufReader, Read};
use std::path::Path;

use regex::bytes::{Regex, RegexBuilder};
use serde::Deserialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::beneath::{self, Beneath, Kind};
use super::glob::{relative_to_base, resolve_base, PathPattern};
use super::output::HeadTail;
use super::read::{io_failure, sniff};
use super::walk::Walk;
use super::{boundary, parse_input, run_blocking, Tool, ToolContext, ToolOutput};

/// Longest line text shown per match; minified files have megabyte lines.
const MAX_LINE_BYTES: usize = 2000;
/// Bytes of one line the pattern is matched against: a longer line (a
/// 1.5 GB minified file) is matched on its head and the rest is read and
/// dropped, so one line costs at most this much memory (issue 18,
/// finding 5) and the read of the rest stays cancellable.
const MAX_MATCHED_LINE: usize = 1 << 20;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GrepInput {
    path: Option<String>,
    pattern: String,
    glob: Option<String>,
}

/// The `grep` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrepTool;

#[async_trait::async_trait]
impl Tool for GrepTool {
    fn name(&self) -> &str {
        "grep"
    }

    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput {
        let input: GrepInput = match parse_input("grep", &input) {
            Ok(input) => input,
            Err(out) => return out,
        };
        let workspace = ctx.workspace.clone();
        let limit = ctx.inline_limit;
        run_blocking(&ctx, move |cancel| {
            grep_files(&workspace, &input, limit, &cancel)
        })
        .await
    }
}

struct Search<'a> {
    beneath: &'a Beneath,
    regex: &'a Regex,
    shown: String,
    collected: &'a mut HeadTail,
    matches: &'a mut u64,
    cancel: &'a CancellationToken,
}

impl Search<'_> {
    /// Searches one file; unreadable and binary files are skipped silently,
    /// as a recursive grep does.
    fn file(&mut self, path: &Path) -> io::Result<()> {
        // Opened beneath the workspace handle: the walk saw a plain file,
        // and a symlink swapped in since is refused, not followed.
        let mut file = self.beneath.open_read(path)?;
        if beneath::kind_of(&file)? != Kind::File {
            return Ok(());
        }
        let prefix = sniff(&mut file)?;
        if prefix.contains(&0) {
            return Ok(());
        }
        let mut reader = BufReader::new(io::Cursor::new(prefix).chain(file));
        let mut line = Vec::new();
        let mut number: u64 = 0;
        loop {
            line.clear();
            match super::read::read_line_capped(
                &mut reader,
                &mut line,
                MAX_MATCHED_LINE,
                self.cancel,
            )? {
                Some(0) | None => return Ok(()),
                Some(_) => {}
            }
            number += 1;
            if number.is_multiple_of(4096) && self.cancel.is_cancelled() {
                return Ok(());
            }
            while matches!(line.last(), Some(b'\n' | b'\r')) {
                line.pop();
            }
            if !self.regex.is_match(&line) {
                continue;
            }
            *self.matches += 1;
            let text = if line.len() > MAX_LINE_BYTES {
                let mut cut = String::from_utf8_lossy(&line[..MAX_LINE_BYTES]).into_owned();
                cut.push_str(" …");
                cut
            } else {
                String::from_utf8_lossy(&line).into_owned()
            };
            self.collected
                .push(format!("{}:{number}:{text}\n", self.shown).as_bytes());
        }
    }
}

fn grep_files(
    workspace: &Path,
    input: &GrepInput,
    inline_limit: usize,
    cancel: &CancellationToken,
) -> ToolOutput {
    let regex = match RegexBuilder::new(&input.pattern).build() {
        Ok(regex) => regex,
        Err(err) => {
            return ToolOutput::invalid_input(format!(
                "invalid input for grep: field `pattern`: {err}"
            ))
        }
    };
    let file_filter = match input.glob.as_deref().map(PathPattern::new).transpose() {
        Ok(filter) => filter,
        Err(err) => {
            return ToolOutput::invalid_input(format!(
                "invalid input for grep: field `glob`: {err}"
            ))
        }
    };
    let base = match resolve_base(workspace, input.path.as_deref()) {
        Ok(base) => base,
        Err(out) => return out,
    };
    let beneath = match Beneath::new(workspace) {
        Ok(b) => b,
        Err(err) => return io_failure(".", &err),
    };
    let mut collected = HeadTail::new(inline_limit);
    let mut matches: u64 = 0;
    let walk = match Walk::new(workspace, &base) {
        Ok(walk) => walk,
        Err(err) => return io_failure(&boundary::display(workspace, &base), &err),
    };
    for entry in walk {
        if cancel.is_cancelled() {
            return ToolOutput::canceled("canceled");
        }
        if entry.kind != Kind::File {
            continue;
        }
        let path = entry.path.as_path();
        if let Some(filter) = &file_filter {
            if !filter.is_match(relative_to_base(path, &base)) {
                continue;
            }
        }
        let mut search = Search {
            beneath: &beneath,
            regex: &regex,
            shown: boundary::display(workspace, path),
            collected: &mut collected,
            matches: &mut matches,
            cancel,
        };
        // A file that vanished or cannot be read mid-walk is not the
        // caller's error; its partial matches stay.
        let _ = search.file(path);
    }
    if cancel.is_cancelled() {
        return ToolOutput::canceled("canceled");
    }
    if matches == 0 {
        return ToolOutput::success("No matches found");
    }
    let rendered = collected.render(inline_limit);
    let truncated = rendered.truncated();
    let mut text = rendered.text;
    if truncated {
        text.push_str(&format!(
            "[{matches} matching lines; output cut at {inline_limit} bytes, narrow the pattern, path or glob]\n"
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

    fn setup() -> (tempfile::TempDir, PathBuf) {
        super::super::test_workspace()
    }

    async fn grep(ws: &Path, input: Value) -> ToolOutput {
        GrepTool.run(ToolContext::new(ws, "call"), input).await
    }

    #[tokio::test]
    async fn reports_path_line_text() {
        let (_d, ws) = setup();
        fs::create_dir(ws.join("src")).unwrap();
        fs::write(
            ws.join("src/a.rs"),
            "fn one() {}\nfn two() {}\nlet x = 1;\n",
        )
        .unwrap();
        fs::write(ws.join("b.txt"), "nothing\r\nfn three\r\n").unwrap();
        let out = grep(&ws, json!({"pattern": "^fn \\w+"})).await;
        assert_eq!(out.outcome, Outcome::Succeeded);
        assert_eq!(
            out.text,
            "b.txt:2:fn three\nsrc/a.rs:1:fn one() {}\nsrc/a.rs:2:fn two() {}\n"
        );
        let out = grep(&ws, json!({"pattern": "fn", "glob": "*.rs"})).await;
        assert_eq!(out.text, "src/a.rs:1:fn one() {}\nsrc/a.rs:2:fn two() {}\n");
        let out = grep(&ws, json!({"pattern": "fn", "path": "b.txt"})).await;
        assert_eq!(out.text, "b.txt:2:fn three\n");
        let out = grep(&ws, json!({"pattern": "zzz"})).await;
        assert_eq!(out.text, "No matches found");
    }

    #[tokio::test]
    async fn honours_gitignore_and_skips_binary() {
        let (_d, ws) = setup();
        fs::write(ws.join(".gitignore"), "build/\n").unwrap();
        fs::create_dir(ws.join("build")).unwrap();
        fs::write(ws.join("build/out.txt"), "needle\n").unwrap();
        fs::write(ws.join("bin.dat"), b"needle\x00\n").unwrap();
        fs::write(ws.join("ok.txt"), "needle\n").unwrap();
        fs::write(ws.join("latin1.txt"), b"caf\xe9 needle\n").unwrap();
        let out = grep(&ws, json!({"pattern": "needle"})).await;
        assert_eq!(
            out.text,
            "latin1.txt:1:caf\u{FFFD} needle\nok.txt:1:needle\n"
        );
    }

    #[tokio::test]
    async fn does_not_follow_symlinks() {
        let (_d, ws) = setup();
        let (_o, other) = setup();
        fs::write(other.join("secret.txt"), "needle\n").unwrap();
        symlink(&other, ws.join("dir-link")).unwrap();
        symlink(other.join("secret.txt"), ws.join("file-link")).unwrap();
        symlink("/etc", ws.join("etc")).unwrap();
        let out = grep(&ws, json!({"pattern": "needle|root"})).await;
        assert_eq!(out.text, "No matches found");
        let out = grep(&ws, json!({"pattern": "root", "path": "etc"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::WORKSPACE_BOUNDARY));
        let out = grep(&ws, json!({"pattern": "root", "path": "/etc/passwd"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::WORKSPACE_BOUNDARY));
    }

    #[tokio::test]
    async fn invalid_regex_and_glob() {
        let (_d, ws) = setup();
        let out = grep(&ws, json!({"pattern": "("})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        assert!(out.text.contains("`pattern`"));
        let out = grep(&ws, json!({"pattern": "a", "glob": "[z"})).await;
        assert!(out.text.contains("`glob`"));
        let out = grep(&ws, json!({"pattern": ["a"]})).await;
        assert!(out.text.contains("`pattern`"));
    }

    #[tokio::test]
    async fn many_matches_are_cut() {
        let (_d, ws) = setup();
        let content: String = (0..50_000).map(|i| format!("hit {i}\n")).collect();
        fs::write(ws.join("big.txt"), content).unwrap();
        let mut ctx = ToolContext::new(&ws, "c");
        ctx.inline_limit = 1024;
        let out = GrepTool.run(ctx, json!({"pattern": "hit"})).await;
        assert!(out.text.starts_with("big.txt:1:hit 0\n"));
        assert!(out.text.contains("big.txt:50000:hit 49999\n"));
        assert!(out.text.contains("bytes omitted]"));
        assert!(out.text.contains("50000 matching lines"));
    }
}
