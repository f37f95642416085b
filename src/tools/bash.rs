//! `bash`: runs a shell command in the workspace.
//!
//! Design points, each for a failure seen in agent runtimes:
//!
//! * **Process ownership.** The command runs in its own process group
//!   (`process_group(0)`) with stdin at `/dev/null` (a command waiting for
//!   input would otherwise hang until its timeout). A call owns everything
//!   it starts: on timeout or cancel [`kill_tree`] kills the group *and*
//!   descendants that left it (`setsid`), and when the shell exits normally
//!   whatever it left running in its group is killed too, so no call leaks
//!   processes into the executor or keeps its output pipes open.
//! * **Bounded memory, no deadlock.** stdout and stderr are read
//!   concurrently by two tasks (a child blocked writing to a full stderr
//!   pipe while we wait on stdout would deadlock), each keeping only head
//!   and tail in memory ([`HeadTail`]) while counting every byte. Once a
//!   stream grows past what could be shown inline it is spilled, as it
//!   arrives, to `.bmx/tool-output/<toolCallId>.stdout|.stderr`, so the full
//!   output exists on disk without ever being held in RAM.
//! * **stderr survives.** stderr has its own budget (a quarter of the inline
//!   limit, more when stdout is short), so a flood of stdout can never push
//!   the error message at the end of stderr out of the result.
//! * **One environment policy.** The child's environment is built by
//!   `ctx.env` ([`crate::process::env`]), as for processes and terminals:
//!   no `BMX_*` secret and no denied name reaches it or may be set through
//!   `env`, and it always carries the call's scope tag (`ctx.scope`), so a
//!   descendant that left the group with `setsid` is still killed on
//!   timeout, on cancel and when the session ends.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::process::env::{EnvError, Tty};
use crate::process::sys;
use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use tokio::time::{Instant, Interval};
use tokio_util::sync::CancellationToken;

use super::output::HeadTail;
use super::{boundary, disk, parse_input, reason, Tool, ToolContext, ToolOutput};

/// Timeout when the input gives none.
pub const DEFAULT_TIMEOUT_MS: u64 = 120_000;

/// Workspace-relative directory of spilled full outputs.
pub const SPILL_DIR: &str = ".bmx/tool-output";

/// A spill file keeps at most the first `SPILL_HEAD` bytes of a stream...
pub const SPILL_HEAD: u64 = 16 << 20;
/// ...and its last `SPILL_TAIL` bytes; what lies between is dropped and
/// counted, so `yes` cannot fill the disk through a tool call.
pub const SPILL_TAIL: usize = 1 << 20;

/// How long output is still read after the command ended. Only matters
/// when a process outside the killed group (e.g. started with `setsid`)
/// inherited the pipes; we then stop reading rather than wait for it.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Bound on waiting for the killed shell to be reaped; SIGKILL makes this
/// immediate in practice, the bound only guards against kernel oddities.
const REAP_GRACE: Duration = Duration::from_secs(5);

const READ_CHUNK: usize = 64 * 1024;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct BashInput {
    command: String,
    cwd: Option<String>,
    env: Option<BTreeMap<String, String>>,
    timeout_ms: Option<u64>,
}

/// The `bash` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct BashTool;

#[async_trait::async_trait]
impl Tool for BashTool {
    fn name(&self) -> &str {
        "bash"
    }

    async fn run(&self, ctx: ToolContext, input: Value) -> ToolOutput {
        let input: BashInput = match parse_input("bash", &input) {
            Ok(input) => input,
            Err(out) => return out,
        };
        run_bash(&ctx, input).await
    }
}

/// `bash` if it is installed, else POSIX `sh`.
fn shell() -> &'static Path {
    static SHELL: OnceLock<PathBuf> = OnceLock::new();
    SHELL.get_or_init(|| {
        find_executable("bash")
            .or_else(|| find_executable("sh"))
            .unwrap_or_else(|| PathBuf::from("/bin/sh"))
    })
}

fn find_executable(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path_dirs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    path_dirs
        .into_iter()
        .chain([PathBuf::from("/bin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A file-name-safe form of the tool call id: ids come from clients.
fn spill_stem(tool_call_id: &str) -> String {
    let stem: String = tool_call_id
        .chars()
        .take(128)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if stem.chars().all(|c| c == '.') {
        uuid::Uuid::new_v4().simple().to_string()
    } else {
        stem
    }
}

/// Check the input; the child's whole environment when it is acceptable.
fn validate(ctx: &ToolContext, input: &BashInput) -> Result<Vec<(String, String)>, ToolOutput> {
    if input.command.contains('\0') {
        return Err(ToolOutput::invalid_input(
            "invalid input for bash: field `command` must not contain NUL bytes",
        ));
    }
    if input.timeout_ms == Some(0) {
        return Err(ToolOutput::invalid_input(
            "invalid input for bash: field `timeoutMs` must be positive",
        ));
    }
    ctx.env
        .build(input.env.as_ref(), Tty::No, &ctx.scope)
        .map_err(|e| match e {
            e if e.is_denied() => ToolOutput::failure(
                reason::DENIED_ENV,
                format!("{e}: it may not be set by tool calls"),
            ),
            EnvError::NoScope => ToolOutput::failure(reason::INTERNAL_ERROR, e.to_string()),
            e => ToolOutput::invalid_input(format!("invalid input for bash: field `env`: {e}")),
        })
}

async fn run_bash(ctx: &ToolContext, input: BashInput) -> ToolOutput {
    let env = match validate(ctx, &input) {
        Ok(env) => env,
        Err(out) => return out,
    };
    let cwd = match boundary::resolve(&ctx.workspace, input.cwd.as_deref().unwrap_or("")) {
        Ok(cwd) => cwd,
        Err(err) => return err.into(),
    };
    match fs::metadata(&cwd) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return ToolOutput::failure(
                reason::NOT_A_DIRECTORY,
                format!(
                    "cwd `{}` is not a directory",
                    boundary::display(&ctx.workspace, &cwd)
                ),
            )
        }
        Err(err) => {
            return ToolOutput::failure(
                reason::NOT_FOUND,
                format!("cwd `{}`: {err}", boundary::display(&ctx.workspace, &cwd)),
            )
        }
    }
    if ctx.cancel.is_cancelled() {
        return ToolOutput::canceled("canceled before start");
    }
    if let Err(full) = ctx.disk.check_room(&ctx.workspace, 0) {
        return full;
    }
    let timeout_ms = input.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);

    let started = start(ctx, &input.command, &cwd, env);
    let (child, stdout_r, stderr_r, unit) = match started {
        Ok(started) => started,
        Err(err) => {
            return ToolOutput::failure(
                reason::IO_ERROR,
                format!("failed to start {}: {err}", shell().display()),
            )
        }
    };
    let pid = Some(child.pid);
    // Dropped when the call ends: whatever the command left running in
    // its leaf cgroup (background jobs, `setsid` escapees) dies then.
    let unit = unit.map(Arc::new);
    let mut exit = Box::pin(child.exit.wait());
    // If this future is dropped mid-run, still kill the tree and stop the
    // readers instead of leaking them.
    let mut guard = TreeGuard { pid };
    let stop = CancellationToken::new();
    let _stop_on_drop = stop.clone().drop_guard();

    let limit = ctx.inline_limit;
    let stderr_min = limit / 4;
    let stdout_min = limit - stderr_min;
    let stem = spill_stem(&ctx.tool_call_id);
    let counter = Arc::new(AtomicU64::new(0));
    let stdout_task = Some({
        let sink = StreamSink::new("stdout", limit, stdout_min, &ctx.workspace, &stem);
        tokio::spawn(pump(stdout_r, sink, counter.clone(), stop.clone()))
    });
    let stderr_task = Some({
        let sink = StreamSink::new("stderr", limit, stderr_min, &ctx.workspace, &stem);
        tokio::spawn(pump(stderr_r, sink, counter.clone(), stop.clone()))
    });

    let deadline = Instant::now().checked_add(Duration::from_millis(timeout_ms));
    let mut ticker = match (&ctx.progress, ctx.progress_interval.is_zero()) {
        (Some(_), false) => Instant::now()
            .checked_add(ctx.progress_interval)
            .map(|start| {
                let mut ticker = tokio::time::interval_at(start, ctx.progress_interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker
            }),
        _ => None,
    };
    let mut disk_check = (ctx.disk.reserve_bytes > 0).then(|| {
        let mut check = tokio::time::interval(disk::CHECK_EVERY);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        check
    });
    let end = loop {
        tokio::select! {
            status = &mut exit => break End::Exited(status),
            () = sleep_until_opt(deadline) => break End::TimedOut,
            () = ctx.cancel.cancelled() => break End::Canceled,
            () = tick(&mut disk_check) => {
                if let Some(free) = ctx.disk.reserve_reached(&ctx.workspace) {
                    break End::DiskFull(free);
                }
            }
            () = tick(&mut ticker) => {
                if let Some(progress) = &ctx.progress {
                    let bytes = counter.load(Ordering::Relaxed);
                    let _ = progress.send(format!("running: {bytes} bytes of output so far"));
                }
            }
        }
    };

    let status = match &end {
        End::Exited(Ok(status)) => {
            guard.pid = None;
            // Reaped: kill what the shell left behind in its group (and
            // its leaf), so background jobs neither outlive the call nor
            // hold the pipes.
            if let Some(pgid) = pid.and_then(|p| i32::try_from(p).ok()).filter(|p| *p > 1) {
                sys::signal_group(pgid, nix::sys::signal::Signal::SIGKILL);
            }
            if let Some(u) = unit.as_deref() {
                u.kill();
            }
            Some(*status)
        }
        End::Exited(Err(_)) | End::TimedOut | End::Canceled | End::DiskFull(_) => {
            // The tree, the group, and whatever left both (`setsid`, then
            // re-parented away): by its leaf cgroup, else by the tag. The
            // call owns all of it.
            let root = pid.and_then(|p| i32::try_from(p).ok());
            let scope = ctx.scope.clone();
            let leaf = unit.clone();
            let _ = tokio::task::spawn_blocking(move || match leaf.as_deref() {
                Some(u) if u.contained() => u.kill(),
                _ => sys::kill_tree(root, root, &scope),
            })
            .await;
            let _ = tokio::time::timeout(REAP_GRACE, &mut exit).await;
            guard.pid = None;
            None
        }
    };

    let stopper = {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(DRAIN_GRACE).await;
            stop.cancel();
        })
    };
    let stdout = join_sink(stdout_task, "stdout").await;
    let stderr = join_sink(stderr_task, "stderr").await;
    let stopped_reading = stop.is_cancelled();
    stopper.abort();

    // Budgets: each stream keeps its minimum share; what one leaves unused
    // goes to the other. Only a stream over its budget is cut.
    let out_total = stdout.collected.total();
    let err_total = stderr.collected.total();
    let stderr_budget = if out_total <= stdout_min as u64 {
        limit - out_total as usize
    } else {
        stderr_min
    };
    let stdout_budget = if err_total <= stderr_min as u64 {
        limit - err_total as usize
    } else {
        stdout_min
    };

    let mut text = String::new();
    stdout.render_into(&mut text, stdout_budget).await;
    stderr.render_into(&mut text, stderr_budget).await;
    if stopped_reading {
        text.push_str(
            "[stopped reading output: a background process outside the command's process group still holds it open]\n",
        );
    }
    match end {
        End::Exited(Ok(_)) => {
            let status = status.unwrap_or_else(|| ExitStatus::from_raw(0));
            let (line, success) = describe_status(status);
            text.push_str(&line);
            if success {
                ToolOutput::success(text)
            } else {
                ToolOutput::failure(reason::EXIT_STATUS, text)
            }
        }
        End::Exited(Err(err)) => {
            text.push_str(&format!("failed to wait for the command: {err}"));
            ToolOutput::failure(reason::IO_ERROR, text)
        }
        End::TimedOut => {
            text.push_str(&format!(
                "timed out after {timeout_ms} ms; killed the command and its process group"
            ));
            ToolOutput::failure(reason::TIMEOUT, text)
        }
        End::Canceled => {
            text.push_str("canceled; killed the command and its process group");
            ToolOutput::canceled(text)
        }
        End::DiskFull(free) => {
            text.push_str(&ctx.disk.full_text(free));
            text.push_str("; killed the command and its process group");
            ToolOutput::failure(reason::DISK_FULL, text)
        }
    }
}

/// Start the shell with `command`: its stdout and stderr pipes (the read
/// ends, for tokio), in the session's sandbox, its own process group,
/// `RLIMIT_FSIZE` from the disk bounds.
fn start(
    ctx: &ToolContext,
    command: &str,
    cwd: &Path,
    env: Vec<(String, String)>,
) -> io::Result<(
    crate::process::spawn::Child,
    tokio::net::unix::pipe::Receiver,
    tokio::net::unix::pipe::Receiver,
    Option<crate::sandbox::Unit>,
)> {
    use crate::process::spawn::{Command, Group, Stdio};
    let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let sh = shell();
    let argv = [
        sh.as_os_str(),
        std::ffi::OsStr::new("-c"),
        std::ffi::OsStr::new(command),
    ];
    let mut cmd = Command::new(sh, &argv)?;
    cmd.cwd(cwd)?
        .env(env)?
        .stdin(Stdio::Null)
        .stdout(Stdio::Fd(out_w))
        .stderr(Stdio::Fd(err_w))
        .group(Group::New)
        // A tool run outside an executor (`ToolContext::new`) runs as the
        // caller; an executor's calls run in their session's sandbox.
        .run_as(ctx.sandbox.is_some());
    // The session's own cgroup, not a leaf of the call: what a command
    // detaches on purpose (`setsid server &`, for the next call to use)
    // lives until the session ends, as it did before the sandbox; the
    // call's own group is killed at its end as ever.
    let mut unit: Option<crate::sandbox::Unit> = None;
    cmd.confine(ctx.sandbox.as_ref().and_then(|s| s.confinement()));
    if let Some(max) = ctx.disk.max_file_bytes {
        cmd.rlimit(libc::RLIMIT_FSIZE, max);
    }
    let child = cmd.spawn()?;
    if let Some(u) = unit.as_mut() {
        u.started();
    }
    Ok((
        child,
        tokio::net::unix::pipe::Receiver::from_owned_fd(out_r)?,
        tokio::net::unix::pipe::Receiver::from_owned_fd(err_r)?,
        unit,
    ))
}

enum End {
    Exited(io::Result<ExitStatus>),
    TimedOut,
    Canceled,
    /// The free-space reserve was reached (bytes still free).
    DiskFull(u64),
}

/// Kills the process tree when dropped while still armed (`pid` set).
struct TreeGuard {
    pid: Option<u32>,
}

impl Drop for TreeGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.pid.take() {
            kill_tree(pid);
        }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn tick(ticker: &mut Option<Interval>) {
    match ticker {
        Some(ticker) => {
            ticker.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// `exit code: N` (128 + signal for a signal death, as shells report it)
/// and whether it counts as success.
fn describe_status(status: ExitStatus) -> (String, bool) {
    if let Some(code) = status.code() {
        (format!("exit code: {code}"), code == 0)
    } else if let Some(signal) = status.signal() {
        (
            format!("exit code: {} (killed by signal {signal})", 128 + signal),
            false,
        )
    } else {
        ("exit code: unknown".to_string(), false)
    }
}

enum Spill {
    /// Not needed yet: everything so far could still be shown inline.
    Idle,
    Open {
        file: tokio::fs::File,
        path: PathBuf,
        /// Bytes in the file so far (at most `SPILL_HEAD`).
        written: u64,
        /// The stream's last bytes past the head (at most `SPILL_TAIL`).
        tail: std::collections::VecDeque<u8>,
        /// Bytes past the head that fell out of `tail`.
        dropped: u64,
    },
    Done(PathBuf),
    Failed(String),
}

/// One output stream: the head + tail kept in memory and its spill file.
struct StreamSink {
    name: &'static str,
    collected: HeadTail,
    /// Past this many bytes the stream may be cut, so it starts spilling.
    spill_threshold: u64,
    workspace: PathBuf,
    file_name: String,
    spill: Spill,
}

impl StreamSink {
    fn new(
        name: &'static str,
        cap: usize,
        spill_threshold: usize,
        workspace: &Path,
        stem: &str,
    ) -> Self {
        Self {
            name,
            collected: HeadTail::new(cap),
            spill_threshold: spill_threshold as u64,
            workspace: workspace.to_path_buf(),
            file_name: format!("{stem}.{name}"),
            spill: Spill::Idle,
        }
    }

    async fn absorb(&mut self, chunk: &[u8]) {
        let before = self.collected.total();
        self.collected.push(chunk);
        let spill = std::mem::replace(&mut self.spill, Spill::Idle);
        self.spill = match spill {
            Spill::Idle if self.collected.total() > self.spill_threshold => {
                // Everything before this chunk is still in the head
                // (threshold <= cap), so the file gets the exact stream.
                let earlier = usize::try_from(before)
                    .ok()
                    .and_then(|n| self.collected.head().get(..n));
                match (earlier, self.open_spill().await) {
                    (Some(earlier), Ok((file, path))) => {
                        let open = Spill::Open {
                            file,
                            path,
                            written: 0,
                            tail: Default::default(),
                            dropped: 0,
                        };
                        let open = Self::append(open, earlier).await;
                        Self::append(open, chunk).await
                    }
                    (None, _) => Spill::Failed("internal: head lost".to_string()),
                    (_, Err(err)) => Spill::Failed(err),
                }
            }
            open @ Spill::Open { .. } => Self::append(open, chunk).await,
            other => other,
        };
    }

    /// Write `chunk` to an open spill: into the file up to `SPILL_HEAD`,
    /// the rest into the bounded tail. Anything else passes through.
    async fn append(spill: Spill, chunk: &[u8]) -> Spill {
        let Spill::Open {
            mut file,
            path,
            mut written,
            mut tail,
            mut dropped,
        } = spill
        else {
            return spill;
        };
        let room = usize::try_from(SPILL_HEAD.saturating_sub(written)).unwrap_or(usize::MAX);
        let (head, rest) = chunk.split_at(chunk.len().min(room));
        if !head.is_empty() {
            if let Err(err) = file.write_all(head).await {
                return Spill::Failed(err.to_string());
            }
            written += head.len() as u64;
        }
        tail.extend(rest);
        if tail.len() > SPILL_TAIL {
            let over = tail.len() - SPILL_TAIL;
            tail.drain(..over);
            dropped += over as u64;
        }
        Spill::Open {
            file,
            path,
            written,
            tail,
            dropped,
        }
    }

    /// Create the spill file beneath the workspace handle (`tools::beneath`):
    /// the session cannot redirect it outside by swapping `.bmx` for a
    /// symlink.
    async fn open_spill(&self) -> Result<(tokio::fs::File, PathBuf), String> {
        let rel = format!("{SPILL_DIR}/{}", self.file_name);
        let path = boundary::resolve(&self.workspace, &rel).map_err(|e| e.to_string())?;
        let workspace = self.workspace.clone();
        let target = path.clone();
        let file = tokio::task::spawn_blocking(move || {
            // As the `--run-as` user: the session may read its spill.
            let _identity = crate::process::run_as::FsIdentity::enter()?;
            super::beneath::Beneath::new(&workspace)?.create(&target)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
        Ok((tokio::fs::File::from_std(file), path))
    }

    /// Flushes the spill file (tokio's `File` writes in the background).
    async fn finish(&mut self) {
        let spill = std::mem::replace(&mut self.spill, Spill::Idle);
        self.spill = match spill {
            Spill::Open {
                mut file,
                path,
                tail,
                dropped,
                ..
            } => {
                let (a, b) = tail.as_slices();
                let marker = format!(
                    "\n[bmx: {dropped} bytes omitted here; a spill keeps the first {SPILL_HEAD} and the last {SPILL_TAIL} bytes]\n"
                );
                let end = async {
                    if dropped > 0 {
                        file.write_all(marker.as_bytes()).await?;
                    }
                    file.write_all(a).await?;
                    file.write_all(b).await?;
                    file.flush().await
                };
                match end.await {
                    Ok(()) => Spill::Done(path),
                    Err(err) => Spill::Failed(err.to_string()),
                }
            }
            other => other,
        };
    }

    /// Appends this stream's section to `text`, and deletes a spill file
    /// that turned out not to be needed.
    async fn render_into(&self, text: &mut String, budget: usize) {
        let total = self.collected.total();
        let rendered = self.collected.render(budget);
        if !rendered.truncated() {
            if let Spill::Done(path) = &self.spill {
                let _ = tokio::fs::remove_file(path).await;
            }
        }
        if total == 0 {
            return;
        }
        text.push_str(self.name);
        text.push_str(":\n");
        text.push_str(&rendered.text);
        if !rendered.text.ends_with('\n') {
            text.push('\n');
        }
        if rendered.truncated() {
            let name = self.name;
            let omitted = rendered.omitted;
            let saved = match &self.spill {
                Spill::Done(path) => format!("full {name} in {}", path.display()),
                Spill::Failed(err) => {
                    tracing::warn!(stream = name, error = %err, "could not spill tool output");
                    format!("full {name} could not be saved: {err}")
                }
                Spill::Idle | Spill::Open { .. } => format!("full {name} was not saved"),
            };
            text.push_str(&format!(
                "[{name} cut: {total} bytes in total, {omitted} omitted; {saved}]\n"
            ));
        }
    }
}

/// Reads one stream to its end (or until `stop`), feeding the sink.
async fn pump<R: AsyncRead + Unpin>(
    mut reader: R,
    mut sink: StreamSink,
    counter: Arc<AtomicU64>,
    stop: CancellationToken,
) -> StreamSink {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let read = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            read = reader.read(&mut buf) => read,
        };
        let n = match read {
            Ok(0) => break,
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        sink.absorb(&buf[..n]).await;
    }
    sink.finish().await;
    sink
}

async fn join_sink(
    task: Option<tokio::task::JoinHandle<StreamSink>>,
    name: &'static str,
) -> StreamSink {
    let empty = || StreamSink::new(name, 0, 0, Path::new("/"), "none");
    match task {
        Some(task) => task.await.unwrap_or_else(|_| empty()),
        None => empty(),
    }
}

/// Kills process `pid`, the process group it leads, and every descendant,
/// including those that left the group; see [`sys::kill_process_tree`].
pub fn kill_tree(pid: u32) {
    sys::kill_process_tree(pid);
}

#[cfg(test)]
mod tests {
    use super::super::Outcome;
    use super::*;
    use crate::process::env::ChildEnv;
    use serde_json::json;
    use std::os::unix::process::CommandExt;
    use std::time::Instant as StdInstant;

    fn setup() -> (tempfile::TempDir, PathBuf) {
        super::super::test_workspace()
    }

    async fn bash(ws: &Path, input: Value) -> ToolOutput {
        BashTool.run(ToolContext::new(ws, "call-1"), input).await
    }

    /// Live (non-zombie) processes whose command line is exactly `argv`.
    fn live_with_args(argv: &[&str]) -> Vec<i32> {
        let wanted: Vec<u8> = argv
            .iter()
            .flat_map(|a| a.bytes().chain(std::iter::once(0)))
            .collect();
        let Ok(procs) = fs::read_dir("/proc") else {
            return Vec::new();
        };
        procs
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == wanted))
            .filter(|pid| {
                fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                    s.rfind(')')
                        .and_then(|i| s[i + 1..].split_whitespace().next().map(|st| st != "Z"))
                        .unwrap_or(false)
                })
            })
            .collect()
    }

    async fn wait_for(mut done: impl FnMut() -> bool, within: Duration) -> bool {
        let start = StdInstant::now();
        while start.elapsed() < within {
            if done() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        done()
    }

    #[tokio::test]
    async fn stdout_and_exit_code_zero() {
        let (_d, ws) = setup();
        let out = bash(&ws, json!({"command": "echo hello; echo world"})).await;
        assert_eq!(out.outcome, Outcome::Succeeded, "{}", out.text);
        assert!(!out.is_error);
        assert_eq!(out.text, "stdout:\nhello\nworld\nexit code: 0");
    }

    #[tokio::test]
    async fn nonzero_exit_and_stderr() {
        let (_d, ws) = setup();
        let out = bash(&ws, json!({"command": "echo out; echo oops >&2; exit 3"})).await;
        assert_eq!(out.outcome, Outcome::Failed);
        assert!(out.is_error);
        assert_eq!(out.reason.as_deref(), Some(reason::EXIT_STATUS));
        assert_eq!(out.text, "stdout:\nout\nstderr:\noops\nexit code: 3");
        let out = bash(&ws, json!({"command": "kill -9 $$"})).await;
        assert!(
            out.text.contains("exit code: 137 (killed by signal 9)"),
            "{}",
            out.text
        );
    }

    #[tokio::test]
    async fn env_cwd_and_lossy_output() {
        let (_d, ws) = setup();
        fs::create_dir(ws.join("sub")).unwrap();
        let out = bash(
            &ws,
            json!({"command": "echo \"$GREETING\"; pwd; printf '\\377'", "cwd": "sub", "env": {"GREETING": "hi there"}}),
        )
        .await;
        assert!(!out.is_error, "{}", out.text);
        let expected = format!(
            "stdout:\nhi there\n{}\n\u{FFFD}\nexit code: 0",
            ws.join("sub").display()
        );
        assert_eq!(out.text, expected);
        let out = bash(&ws, json!({"command": "pwd"})).await;
        assert!(out.text.contains(&format!("{}\n", ws.display())));
    }

    #[tokio::test]
    async fn denied_env_is_refused_and_removed() {
        let (_d, ws) = setup();
        let mut ctx = ToolContext::new(&ws, "c");
        ctx.env = Arc::new(ChildEnv::from_process(&[
            "SECRET_TOKEN".to_string(),
            "HOME".to_string(),
        ]));
        let out = BashTool
            .run(
                ctx.clone(),
                json!({"command": "true", "env": {"SECRET_TOKEN": "x", "OK": "y"}}),
            )
            .await;
        assert_eq!(out.reason.as_deref(), Some(reason::DENIED_ENV));
        assert!(out.text.contains("SECRET_TOKEN"));
        let out = BashTool
            .run(ctx, json!({"command": "echo \"home=${HOME-unset}\""}))
            .await;
        assert!(out.text.contains("home=unset"), "{}", out.text);
    }

    #[tokio::test]
    async fn the_child_environment_follows_the_policy() {
        let (_d, ws) = setup();
        let mut ctx = ToolContext::new(&ws, "c");
        ctx.scope = "test-scope/s/tool-c/".into();
        let out = BashTool
            .run(
                ctx.clone(),
                json!({"command": "echo \"[$BMX_SCOPE][$GIVEN]\"", "env": {"GIVEN": "g"}}),
            )
            .await;
        assert!(
            out.text.contains("[test-scope/s/tool-c/][g]"),
            "{}",
            out.text
        );
        for (env, reason) in [
            (json!({"BMX_SCOPE": "elsewhere"}), reason::DENIED_ENV),
            (json!({"": "x"}), reason::INVALID_INPUT),
            (json!({"A": "x\u{0}y"}), reason::INVALID_INPUT),
        ] {
            let out = BashTool
                .run(ctx.clone(), json!({"command": "true", "env": env}))
                .await;
            assert_eq!(out.reason.as_deref(), Some(reason), "{env}: {}", out.text);
        }
    }

    /// An escapee whose parent is gone is found by its tag alone.
    #[tokio::test]
    async fn timeout_kills_an_orphaned_setsid_escapee() {
        let (_d, ws) = setup();
        let out = bash(
            &ws,
            json!({"command": "(setsid sleep 302.77 >/dev/null 2>&1 </dev/null &); sleep 302.88", "timeoutMs": 500}),
        )
        .await;
        assert_eq!(out.reason.as_deref(), Some(reason::TIMEOUT), "{}", out.text);
        let gone = wait_for(
            || live_with_args(&["sleep", "302.77"]).is_empty(),
            Duration::from_secs(5),
        )
        .await;
        for pid in live_with_args(&["sleep", "302.77"]) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        assert!(gone, "the escapee outlived its call");
    }

    #[tokio::test]
    async fn cwd_boundary_and_invalid_input() {
        let (_d, ws) = setup();
        fs::write(ws.join("file"), "").unwrap();
        std::os::unix::fs::symlink("/etc", ws.join("etc")).unwrap();
        for cwd in ["..", "/etc", "etc"] {
            let out = bash(&ws, json!({"command": "pwd", "cwd": cwd})).await;
            assert_eq!(
                out.reason.as_deref(),
                Some(reason::WORKSPACE_BOUNDARY),
                "{cwd}"
            );
        }
        let out = bash(&ws, json!({"command": "pwd", "cwd": "file"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::NOT_A_DIRECTORY));
        let out = bash(&ws, json!({"command": "pwd", "cwd": "missing"})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::NOT_FOUND));
        let out = bash(&ws, json!({})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        assert!(out.text.contains("`command`"));
        let out = bash(&ws, json!({"command": "true", "timeoutMs": "1s"})).await;
        assert!(out.text.contains("`timeoutMs`"), "{}", out.text);
        let out = bash(&ws, json!({"command": "true", "timeoutMs": 0})).await;
        assert_eq!(out.reason.as_deref(), Some(reason::INVALID_INPUT));
        let out = bash(&ws, json!({"command": "true", "env": {"A=B": "x"}})).await;
        assert!(out.text.contains("`env`"));
        let out = bash(&ws, json!({"command": "true", "env": {"A": 1}})).await;
        assert!(out.text.contains("`env`"), "{}", out.text);
    }

    #[tokio::test]
    async fn timeout_kills_sleep_and_keeps_partial_output() {
        let (_d, ws) = setup();
        let start = StdInstant::now();
        let out = bash(
            &ws,
            json!({"command": "echo before; sleep 301.11", "timeoutMs": 300}),
        )
        .await;
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "waited for sleep"
        );
        assert_eq!(out.outcome, Outcome::Failed);
        assert_eq!(out.reason.as_deref(), Some(reason::TIMEOUT));
        assert!(out.text.contains("stdout:\nbefore\n"), "{}", out.text);
        assert!(out.text.contains("timed out after 300 ms"));
        assert!(
            wait_for(
                || live_with_args(&["sleep", "301.11"]).is_empty(),
                Duration::from_secs(5)
            )
            .await
        );
    }

    #[tokio::test]
    async fn cancel_kills_running_sleep_promptly() {
        let (_d, ws) = setup();
        let ctx = ToolContext::new(&ws, "c");
        let cancel = ctx.cancel.clone();
        let start = StdInstant::now();
        let (out, ()) = tokio::join!(BashTool.run(ctx, json!({"command": "sleep 30"})), async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            cancel.cancel();
        });
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "waited for sleep"
        );
        assert_eq!(out.outcome, Outcome::Canceled);
        assert!(out.is_error);
        assert_eq!(out.reason.as_deref(), Some(reason::CANCELED));
    }

    #[tokio::test]
    async fn cancel_leaves_no_process_behind() {
        let (_d, ws) = setup();
        let ctx = ToolContext::new(&ws, "c");
        let cancel = ctx.cancel.clone();
        let command = "sh -c 'sleep 302.22 & sleep 302.22' & setsid sleep 302.33 & wait";
        let (out, ()) = tokio::join!(BashTool.run(ctx, json!({ "command": command })), async {
            let started = wait_for(
                || {
                    live_with_args(&["sleep", "302.22"]).len() == 2
                        && live_with_args(&["sleep", "302.33"]).len() == 1
                },
                Duration::from_secs(10),
            )
            .await;
            assert!(started, "processes did not start");
            cancel.cancel();
        });
        assert_eq!(out.outcome, Outcome::Canceled);
        let gone = wait_for(
            || {
                live_with_args(&["sleep", "302.22"]).is_empty()
                    && live_with_args(&["sleep", "302.33"]).is_empty()
            },
            Duration::from_secs(5),
        )
        .await;
        assert!(gone, "processes left behind");
    }

    #[tokio::test]
    async fn background_jobs_do_not_outlive_the_call() {
        let (_d, ws) = setup();
        let start = StdInstant::now();
        let out = bash(&ws, json!({"command": "sleep 303.44 & echo started"})).await;
        assert!(start.elapsed() < Duration::from_secs(10));
        assert_eq!(out.text, "stdout:\nstarted\nexit code: 0");
        assert!(
            wait_for(
                || live_with_args(&["sleep", "303.44"]).is_empty(),
                Duration::from_secs(5)
            )
            .await
        );
    }

    #[tokio::test]
    async fn dropping_the_call_kills_the_tree() {
        let (_d, ws) = setup();
        let command = "sleep 305.77 & sleep 305.77";
        let run = BashTool.run(ToolContext::new(&ws, "drop"), json!({ "command": command }));
        let running = tokio::spawn(run);
        let started = wait_for(
            || live_with_args(&["sleep", "305.77"]).len() == 2,
            Duration::from_secs(10),
        )
        .await;
        assert!(started, "processes did not start");
        running.abort();
        let _ = running.await;
        let gone = wait_for(
            || live_with_args(&["sleep", "305.77"]).is_empty(),
            Duration::from_secs(5),
        )
        .await;
        assert!(gone, "processes left behind after the call was dropped");
    }

    fn seq(from: u32, to: u32) -> String {
        (from..=to).map(|i| format!("{i}\n")).collect()
    }

    #[tokio::test]
    async fn a_spill_keeps_its_head_and_tail_and_counts_the_middle() {
        let (_d, ws) = setup();
        let total: u64 = SPILL_HEAD + 4 * SPILL_TAIL as u64;
        // `total` bytes: numbered lines, so the tail can be checked exactly.
        let command = format!("seq 1 100000000 | head -c {total}");
        let out = BashTool
            .run(ToolContext::new(&ws, "huge"), json!({ "command": command }))
            .await;
        assert!(!out.is_error, "{}", out.text);
        let spill = std::fs::read(ws.join(".bmx/tool-output/huge.stdout")).unwrap();
        let dropped = total - SPILL_HEAD - SPILL_TAIL as u64;
        let marker = format!(
            "\n[bmx: {dropped} bytes omitted here; a spill keeps the first {SPILL_HEAD} and the last {SPILL_TAIL} bytes]\n"
        );
        assert_eq!(
            spill.len() as u64,
            SPILL_HEAD + marker.len() as u64 + SPILL_TAIL as u64
        );
        let full: Vec<u8> = (1..)
            .flat_map(|i: u64| format!("{i}\n").into_bytes())
            .take(total as usize)
            .collect();
        assert_eq!(&spill[..SPILL_HEAD as usize], &full[..SPILL_HEAD as usize]);
        let tail_at = SPILL_HEAD as usize + marker.len();
        assert_eq!(&spill[SPILL_HEAD as usize..tail_at], marker.as_bytes());
        assert_eq!(&spill[tail_at..], &full[full.len() - SPILL_TAIL..]);
    }

    #[tokio::test]
    async fn truncation_keeps_head_tail_marker_and_spills_exact_output() {
        let (_d, ws) = setup();
        let mut ctx = ToolContext::new(&ws, "call/42");
        ctx.inline_limit = 4096;
        let out = BashTool.run(ctx, json!({"command": "seq 1 100000"})).await;
        assert!(!out.is_error, "{}", out.text);
        let full = seq(1, 100_000);
        assert!(out.text.starts_with("stdout:\n1\n2\n3\n"), "{}", out.text);
        assert!(out.text.contains("99999\n100000\n["), "{}", out.text);
        let kept = 4096; // stderr is empty, so stdout gets the whole budget
        let omitted = full.len() - kept;
        assert!(
            out.text.contains(&format!("[{omitted} bytes omitted]")),
            "{}",
            out.text
        );
        let spill = ws.join(".bmx/tool-output/call_42.stdout");
        assert!(
            out.text.contains(&spill.display().to_string()),
            "{}",
            out.text
        );
        assert!(out.text.contains(&format!("{} bytes in total", full.len())));
        assert_eq!(fs::read_to_string(&spill).unwrap(), full);
        assert!(out.text.len() < 4096 + 400);
    }

    #[tokio::test]
    async fn stderr_tail_survives_stdout_flood() {
        let (_d, ws) = setup();
        let mut ctx = ToolContext::new(&ws, "flood");
        ctx.inline_limit = 4096;
        let command = "seq 1 50000 >&2; echo ERR-END >&2; seq 1 100000";
        let out = BashTool.run(ctx, json!({ "command": command })).await;
        assert!(out.text.contains("ERR-END\n"), "{}", out.text);
        assert!(out.text.contains("100000\n"), "{}", out.text);
        let err_full = format!("{}ERR-END\n", seq(1, 50_000));
        assert_eq!(
            fs::read_to_string(ws.join(".bmx/tool-output/flood.stderr")).unwrap(),
            err_full
        );
        assert_eq!(
            fs::read_to_string(ws.join(".bmx/tool-output/flood.stdout")).unwrap(),
            seq(1, 100_000)
        );
        // stderr got its quarter, stdout the rest.
        let stderr_part = out.text.split("stderr:\n").nth(1).unwrap();
        let stderr_omitted = err_full.len() - 1024;
        assert!(stderr_part.contains(&format!("[{stderr_omitted} bytes omitted]")));
    }

    #[tokio::test]
    async fn short_stdout_gives_stderr_more_room_and_no_spill() {
        let (_d, ws) = setup();
        let mut ctx = ToolContext::new(&ws, "roomy");
        ctx.inline_limit = 4096;
        // 2000 bytes of stderr exceed stderr's quarter but fit the limit.
        let out = BashTool
            .run(
                ctx,
                json!({"command": "head -c 2000 /dev/zero | tr '\\0' e >&2; echo ok"}),
            )
            .await;
        assert!(!out.text.contains("omitted"), "{}", out.text);
        assert!(out.text.contains(&"e".repeat(2000)));
        assert!(!ws.join(".bmx/tool-output/roomy.stderr").exists());
    }

    #[tokio::test]
    async fn huge_concurrent_output_does_not_deadlock() {
        let (_d, ws) = setup();
        let mut ctx = ToolContext::new(&ws, "huge");
        ctx.inline_limit = 8192;
        let command = "(head -c 20000000 /dev/zero | tr '\\0' x) & (head -c 10000000 /dev/zero | tr '\\0' y >&2) & wait";
        let out = BashTool
            .run(ctx, json!({ "command": command, "timeoutMs": 100000 }))
            .await;
        assert!(!out.is_error, "{}", out.text);
        assert!(out.text.contains("20000000 bytes in total"), "{}", out.text);
        assert!(out.text.contains("10000000 bytes in total"), "{}", out.text);
        // 20 MB is past the spill cap: head + marker + tail.
        let meta = fs::metadata(ws.join(".bmx/tool-output/huge.stdout")).unwrap();
        let capped = SPILL_HEAD + SPILL_TAIL as u64;
        assert!(
            meta.len() > capped && meta.len() < capped + 200,
            "{}",
            meta.len()
        );
        let meta = fs::metadata(ws.join(".bmx/tool-output/huge.stderr")).unwrap();
        assert_eq!(meta.len(), 10_000_000);
    }

    #[tokio::test]
    async fn progress_reports_bytes_so_far() {
        let (_d, ws) = setup();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut ctx = ToolContext::new(&ws, "p");
        ctx.progress = Some(tx);
        ctx.progress_interval = Duration::from_millis(100);
        let out = BashTool
            .run(ctx, json!({"command": "echo hi; sleep 1.5"}))
            .await;
        assert!(!out.is_error);
        let mut messages = Vec::new();
        while let Ok(m) = rx.try_recv() {
            messages.push(m);
        }
        assert!(!messages.is_empty());
        assert!(messages
            .iter()
            .all(|m| m.starts_with("running: ") && m.ends_with(" bytes of output so far")));
        assert!(
            messages
                .iter()
                .any(|m| m == "running: 3 bytes of output so far"),
            "{messages:?}"
        );
    }

    #[tokio::test]
    async fn kill_tree_kills_group_and_escaped_descendants() {
        let mut command = std::process::Command::new("sh");
        command
            .arg("-c")
            .arg("sleep 304.55 & setsid sleep 304.66 & wait")
            .process_group(0);
        let mut child = command.spawn().unwrap();
        let started = wait_for(
            || {
                live_with_args(&["sleep", "304.55"]).len() == 1
                    && live_with_args(&["sleep", "304.66"]).len() == 1
            },
            Duration::from_secs(10),
        )
        .await;
        assert!(started);
        kill_tree(child.id());
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(9));
        let gone = wait_for(
            || {
                live_with_args(&["sleep", "304.55"]).is_empty()
                    && live_with_args(&["sleep", "304.66"]).is_empty()
            },
            Duration::from_secs(5),
        )
        .await;
        assert!(gone);
    }

    async fn bash_with_disk(ws: &Path, disk: disk::DiskLimits, command: &str) -> ToolOutput {
        let mut ctx = ToolContext::new(ws, "call-disk");
        ctx.disk = disk;
        BashTool
            .run(ctx, json!({"command": command, "timeoutMs": 60_000}))
            .await
    }

    #[tokio::test]
    async fn no_file_grows_past_the_size_limit() {
        let (_dir, ws) = setup();
        let limits = disk::DiskLimits {
            max_file_bytes: Some(64 * 1024),
            reserve_bytes: 0,
        };
        let out = bash_with_disk(&ws, limits, "head -c 1048576 /dev/zero > big").await;
        assert!(out.is_error, "{}", out.text);
        assert_eq!(out.reason.as_deref(), Some(reason::EXIT_STATUS));
        assert_eq!(fs::metadata(ws.join("big")).unwrap().len(), 64 * 1024);
    }

    #[tokio::test]
    async fn a_call_does_not_start_under_the_reserve() {
        let (_dir, ws) = setup();
        let free = disk::free_bytes(&ws).unwrap();
        let limits = disk::DiskLimits {
            max_file_bytes: None,
            reserve_bytes: free + (1 << 30),
        };
        let out = bash_with_disk(&ws, limits, "touch ran").await;
        assert_eq!(
            out.reason.as_deref(),
            Some(reason::DISK_FULL),
            "{}",
            out.text
        );
        assert!(!ws.join("ran").exists());
    }

    #[tokio::test]
    async fn a_call_that_eats_into_the_reserve_is_killed() {
        let (_dir, ws) = setup();
        let free = disk::free_bytes(&ws).unwrap();
        // 32 MiB of room: the loop below writes far more, in 4 MiB steps.
        let limits = disk::DiskLimits {
            max_file_bytes: None,
            reserve_bytes: free.saturating_sub(32 << 20),
        };
        let out = bash_with_disk(
            &ws,
            limits,
            "i=0; while [ $i -lt 2048 ]; do head -c 4194304 /dev/zero >> fill; i=$((i+1)); done; touch finished",
        )
        .await;
        assert_eq!(
            out.reason.as_deref(),
            Some(reason::DISK_FULL),
            "{}",
            out.text
        );
        assert!(out.text.contains("--disk-reserve"), "{}", out.text);
        assert!(!ws.join("finished").exists());
        // Stopped within a few checks, not at the end of the 8 GiB loop.
        assert!(fs::metadata(ws.join("fill")).unwrap().len() < 4 << 30);
    }

    #[test]
    fn spill_stem_is_file_name_safe() {
        assert_eq!(spill_stem("call-1_a.b"), "call-1_a.b");
        assert_eq!(spill_stem("../../etc/x"), ".._.._etc_x");
        assert_ne!(spill_stem(".."), "..");
        assert!(!spill_stem("").is_empty());
    }
}
