//! `read`: a text file with `cat -n` style line numbers.
//!
//! Line numbers let the model cite and page through files (`offset` is
//! 1-based like the numbers it sees). Binary files are refused rather than
//! dumped, since their bytes are useless to a model and can be huge. The
//! file is streamed through a [`HeadTail`] so a giant file costs bounded
//! memory even without `limit`.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::beneath::{self, Beneath, Kind};
use super::output::HeadTail;
use super::{boundary, parse_input, reason, run_blocking, Tool, ToolContext, ToolOutput};

/// How many leading bytes are sniffed for a NUL to call a file binary.
pub const BINARY_SNIFF_BYTES: usize = 8 * 1024;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReadInput {
    path: String,
    /// 1-based first line; 0 is treated as 1.
    offset: Option<u64>,
    /// Maximum number of lines.
    limit: Option<u64>,
}

/// The `read` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadTool;

#[async_trait::async_trait]
impl Tool for ReadTool {
    fn name(&self) -> &str {
        "read"
    }

    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput {
        let input: ReadInput = match parse_input("read", &input) {
            Ok(input) => input,
            Err(out) => return out,
        };
        let workspace = ctx.workspace.clone();
        let limit = ctx.inline_limit;
        run_blocking(&ctx, move |cancel| {
            read_file(&workspace, &input, limit, &cancel)
        })
        .await
    }
}

/// Reads up to [`BINARY_SNIFF_BYTES`] from the start of `file`.
pub(super) fn sniff(file: &mut File) -> io::Result<Vec<u8>> {
    let mut prefix = Vec::with_capacity(BINARY_SNIFF_BYTES);
    file.by_ref()
        .take(BINARY_SNIFF_BYTES as u64)
        .read_to_end(&mut prefix)?;
    Ok(prefix)
}

/// Maps an I/O error on `shown` to a result with a specific reason where
/// the model can act on it.
pub(super) fn io_failure(shown: &str, err: &io::Error) -> ToolOutput {
    if beneath::is_swapped(err) {
        return ToolOutput::failure(
            reason::WORKSPACE_BOUNDARY,
            format!("`{shown}` changed while in use: a symbolic link appeared on its path"),
        );
    }
    match err.kind() {
        io::ErrorKind::NotFound => {
            ToolOutput::failure(reason::NOT_FOUND, format!("`{shown}` does not exist"))
        }
        io::ErrorKind::IsADirectory => {
            ToolOutput::failure(reason::IS_DIRECTORY, format!("`{shown}` is a directory"))
        }
        io::ErrorKind::NotADirectory => ToolOutput::failure(
            reason::NOT_A_DIRECTORY,
            format!("a parent of `{shown}` is not a directory"),
        ),
        _ => ToolOutput::failure(reason::IO_ERROR, format!("`{shown}`: {err}")),
    }
}

fn read_file(
    workspace: &Path,
    input: &ReadInput,
    inline_limit: usize,
    cancel: &CancellationToken,
) -> ToolOutput {
    if input.path.is_empty() {
        return ToolOutput::invalid_input("invalid input for read: field `path` must not be empty");
    }
    let path = match boundary::resolve(workspace, &input.path) {
        Ok(path) => path,
        Err(err) => return err.into(),
    };
    let shown = boundary::display(workspace, &path);
    // Opened beneath the workspace handle: what is read is what resolve
    // checked, even if the session swaps a component for a symlink.
    let mut file = match Beneath::new(workspace).and_then(|b| b.open_read(&path)) {
        Ok(file) => file,
        Err(err) => return io_failure(&shown, &err),
    };
    match beneath::kind_of(&file) {
        Ok(Kind::Dir) => {
            return ToolOutput::failure(
                reason::IS_DIRECTORY,
                format!("`{shown}` is a directory; use list_files to see its entries"),
            )
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
    let prefix = match sniff(&mut file) {
        Ok(prefix) => prefix,
        Err(err) => return io_failure(&shown, &err),
    };
    if prefix.contains(&0) {
        return ToolOutput::failure(
            reason::BINARY_FILE,
            format!(
                "`{shown}` looks like a binary file (NUL byte in the first 8 KiB); read only shows text files"
            ),
        );
    }
    let first = input.offset.unwrap_or(1).max(1);
    let max_lines = input.limit.unwrap_or(u64::MAX);
    let mut reader = BufReader::new(io::Cursor::new(prefix).chain(file));
    let mut collected = HeadTail::new(inline_limit);
    let mut line = Vec::new();
    let mut number: u64 = 0;
    let mut shown_lines: u64 = 0;
    while shown_lines < max_lines {
        line.clear();
        // A line longer than could ever be shown is kept only up to the
        // inline limit: a 2 GB single-line file costs that, not 2 GB.
        let whole = match read_line_capped(&mut reader, &mut line, inline_limit.max(1), cancel) {
            Ok(None) => return ToolOutput::canceled("canceled"),
            Ok(Some(0)) => break,
            Ok(Some(n)) => n,
            Err(err) => return io_failure(&shown, &err),
        };
        let cut = whole > line.len() as u64;
        number += 1;
        if number.is_multiple_of(4096) && cancel.is_cancelled() {
            return ToolOutput::canceled("canceled");
        }
        if number < first {
            continue;
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        }
        collected.push(format!("{number:>6}\t").as_bytes());
        collected.push(&line);
        if cut {
            collected.push(format!(" [line cut: {whole} bytes]").as_bytes());
        }
        collected.push(b"\n");
        shown_lines += 1;
    }
    if shown_lines == 0 {
        if number == 0 && first == 1 {
            return ToolOutput::success(format!("(`{shown}` is empty)"));
        }
        if max_lines > 0 {
            return ToolOutput::invalid_input(format!(
                "invalid input for read: field `offset`: {first} is past the end of `{shown}` ({number} lines)"
            ));
        }
    }
    let rendered = collected.render(inline_limit);
    let truncated = rendered.truncated();
    let mut text = rendered.text;
    if truncated {
        text.push_str(&format!(
            "[output cut at {inline_limit} bytes; use offset and limit to read the omitted lines]\n"
        ));
    }
    ToolOutput::success(text)
}

/// Read one line (up to and with its `\n`) into `line`, keeping at most
/// `cap` bytes of it; the rest is read and dropped. Returns the line's
/// whole length (0 at the end of the file), `None` if `cancel` fired
/// while a giant line was being skipped.
pub(super) fn read_line_capped(
    reader: &mut impl BufRead,
    line: &mut Vec<u8>,
    cap: usize,
    cancel: &CancellationToken,
) -> io::Result<Option<u64>> {
    let mut total: u64 = 0;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(Some(total));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        let room = cap.saturating_sub(line.len());
        line.extend_from_slice(&buf[..take.min(room)]);
        reader.consume(take);
        total += take as u64;
        if done {
            return Ok(Some(total));
        }
        // One atomic load per buffer: cheap next to the read.
        if cancel.is_cancelled() {
            return Ok(None);
        }
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

    async fn read(ws: &Path, input: Value) -> ToolOutput {
        ReadTool.run(ToolContext::new(ws, "call"), input).await
    }

    #[tokio::test]
    async fn a_giant_line_is_kept_only_up_to_the_inline_limit() {
        let (_d, ws) = setup();
        let giant = "g".repeat(5_000_000);
        fs::write(ws.join("one-line"), format!("{giant}\nsecond\n")).unwrap();
        let mut ctx = ToolContext::new(&ws, "call");
        ctx.inline_limit = 4096;
        let out = ReadTool
            .run(ctx, json!({"path": "one-line", "limit": 1}))
            .await;
        assert_eq!(out.outcome, Outcome::Succeeded);
        assert!(
            out.text.contains("[line cut: 5000001 bytes]"),
            "{}",
            &out.text[out.text.len() - 200..]
        );
        assert!(out.text.len() < 8192, "{}", out.text.len());
        let out = read(&ws, json!({"path": "one-line", "offset": 2})).await;
        assert_eq!(out.text, "     2\tsecond\n");
    }

    #[tokio::test]
    async fn numbers_lines_like_cat_n() {
        let (_d, ws) = setup();
        fs::write(ws.join("a.txt"), "alpha\nbeta\ngamma").unwrap();
        let out = read(&ws, json!({"path": "a.txt"})).await;
        assert_eq!(out.outcome, Outcome::Succeeded);
        assert_eq!(out.text, "     1\talpha\n     2\tbeta\n     3\tgamma\n");
    }

    #[tokio::test]
    async fn offset_and_limit_page_through() {
        let (_d, ws) = setup();
        let content: String = (1..=20).map(|i| format!("line {i}\n")).collect();
        fs::write(ws.join("a.txt"), content).unwrap();
        let out = read(&ws, json!({"path": "a.txt", "offset": 5, "limit": 2})).await;
        assert_eq!(out.text, "     5\tline 5\n     6\tline 6\n");
        let out = read(&ws, json!({"path": "a.txt", "offset": 20})).await;
        assert_eq!(out.text, "    20\tline 20\n");
        let out = read(&ws, json!({"path": "a.txt", "offset": 21})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        assert!(out.text.contains("20 lines"), "{}", out.text);
    }

    #[tokio::test]
    async fn empty_and_missing_and_directory() {
        let (_d, ws) = setup();
        fs::write(ws.join("empty"), "").unwrap();
        let out = read(&ws, json!({"path": "empty"})).await;
        assert!(!out.is_error);
        assert!(out.text.contains("empty"));
        let out = read(&ws, json!({"path": "nope"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::NOT_FOUND));
        fs::create_dir(ws.join("d")).unwrap();
        let out = read(&ws, json!({"path": "d"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::IS_DIRECTORY));
        let out = read(&ws, json!({"path": 3})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        assert!(out.text.contains("`path`"));
    }

    #[tokio::test]
    async fn binary_file_is_refused() {
        let (_d, ws) = setup();
        fs::write(ws.join("bin"), b"ELF\x00\x01\x02").unwrap();
        let out = read(&ws, json!({"path": "bin"})).await;
        assert!(out.is_error);
        assert_eq!(out.reason.as_deref(), Some(reason::BINARY_FILE));
        assert!(out.text.contains("binary"));
    }

    #[tokio::test]
    async fn non_utf8_is_lossy() {
        let (_d, ws) = setup();
        fs::write(ws.join("latin1"), b"caf\xe9\n").unwrap();
        let out = read(&ws, json!({"path": "latin1"})).await;
        assert_eq!(out.text, "     1\tcaf\u{FFFD}\n");
    }

    #[tokio::test]
    async fn boundary_is_enforced() {
        let (_d, ws) = setup();
        symlink("/etc", ws.join("link")).unwrap();
        for path in ["../x", "/etc/passwd", "link/passwd"] {
            let out = read(&ws, json!({ "path": path })).await;
            assert!(out.is_error, "{path}");
            assert_eq!(
                out.reason.as_deref(),
                Some(reason::WORKSPACE_BOUNDARY),
                "{path}"
            );
            assert!(!out.text.contains("root:"), "{path}");
        }
        let abs = ws.join("in.txt");
        fs::write(&abs, "ok\n").unwrap();
        let out = read(&ws, json!({ "path": abs })).await;
        assert_eq!(out.text, "     1\tok\n");
    }

    #[tokio::test]
    async fn large_file_is_cut_head_and_tail() {
        let (_d, ws) = setup();
        let content: String = (1..=100_000).map(|i| format!("row {i}\n")).collect();
        fs::write(ws.join("big"), content).unwrap();
        let mut ctx = ToolContext::new(&ws, "c");
        ctx.inline_limit = 2048;
        let out = ReadTool.run(ctx, json!({"path": "big"})).await;
        assert!(!out.is_error);
        assert!(out.text.starts_with("     1\trow 1\n"));
        assert!(out.text.contains("100000\trow 100000\n"));
        assert!(out.text.contains("bytes omitted]"));
        assert!(out.text.len() < 2048 + 200);
    }
}
