//! A JSON-RPC peer on stdio (an MCP server, an ACP agent): a child of the
//! session, through the executor's
//! own process layer (spawned with `std` and watched by
//! [`crate::process::exits`], its own process group, tagged with its
//! scope so that it and everything it starts die with the session).
//!
//! Messages are newline-delimited JSON (MCP stdio transport). stdout is
//! read in bounded lines: a line over the frame limit is read on up to
//! [`HARD_LIMIT_FACTOR`]× the limit only to find its id (its request then
//! gets an error, not silence); past that the server is killed. stderr
//! goes to a bounded tail (for error reports) and to the debug log, with
//! secret values redacted.

use crate::process::sys;
use nix::sys::signal::Signal;
use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};

pub use crate::mcp::peer::{PeerEvent, Sink};

/// Replace every secret value in `text` (stderr lines, error messages).
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut out = text.to_owned();
    for s in secrets.iter().filter(|s| s.len() >= 3) {
        if out.contains(s.as_str()) {
            out = out.replace(s.as_str(), "<redacted>");
        }
    }
    out
}

/// How far past the frame limit an oversized line is read to find its id.
pub const HARD_LIMIT_FACTOR: usize = 4;
/// Messages queued for the server's stdin.
const STDIN_QUEUE: usize = 256;
/// stderr kept for error reports.
const STDERR_TAIL: usize = 8 << 10;
/// Longest stderr line logged.
const STDERR_LOG_LINE: usize = 1024;

pub struct StdioSpec {
    pub program: PathBuf,
    pub arg0: String,
    pub args: Vec<String>,
    pub cwd: PathBuf,
    pub env: Vec<(String, String)>,
    pub scope: String,
    pub max_message: usize,
    pub secrets: Arc<Vec<String>>,
    /// For the log lines.
    pub label: String,
    /// The server's unit of its session's sandbox (`None`: `bmx visor`'s
    /// own agents, which are the person's).
    pub unit: Option<crate::sandbox::Unit>,
}

pub struct StdioPeer {
    pid: u32,
    scope: String,
    /// Its leaf cgroup: killed at shutdown, and when dropped.
    unit: Option<Arc<crate::sandbox::Unit>>,
    stdin: Option<Stdin>,
    tail: Arc<Mutex<VecDeque<u8>>>,
    exited: watch::Receiver<bool>,
    secrets: Arc<Vec<String>>,
    tasks: Vec<tokio::task::AbortHandle>,
}

/// The server's stdin: written directly by the owner while nothing is
/// queued (no task hop on the request path), else queued in order for
/// the writer task, which waits for the pipe to drain.
struct Stdin {
    pipe: Arc<tokio::net::unix::pipe::Sender>,
    queue: mpsc::Sender<Vec<u8>>,
    /// Messages queued and not yet fully written by the writer task.
    queued: Arc<AtomicUsize>,
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}

impl StdioPeer {
    pub fn start(spec: StdioSpec, sink: Sink) -> std::io::Result<StdioPeer> {
        let (in_r, in_w) = pipe()?;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        use crate::process::spawn::{Command, Group, Stdio};
        let argv: Vec<&str> = std::iter::once(spec.arg0.as_str())
            .chain(spec.args.iter().map(String::as_str))
            .collect();
        let mut cmd = Command::new(&spec.program, &argv)?;
        cmd.cwd(&spec.cwd)?
            .env(spec.env.iter().map(|(k, v)| (k, v)))?
            .stdin(Stdio::Fd(in_r))
            .stdout(Stdio::Fd(out_w))
            .stderr(Stdio::Fd(err_w))
            .group(Group::New)
            .run_as(spec.unit.is_some())
            .confine(spec.unit.as_ref().and_then(|u| u.confinement()));
        let child = cmd.spawn()?;
        let mut unit = spec.unit;
        if let Some(u) = unit.as_mut() {
            u.started();
        }
        let (pid, exit) = (child.pid, child.exit);
        let stdin_pipe = tokio::net::unix::pipe::Sender::from_owned_fd(in_w)?;
        let stdout_pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(out_r)?;
        let stderr_pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(err_r)?;
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL)));
        let (stdin_tx, stdin_rx) = mpsc::channel(STDIN_QUEUE);
        let stdin_pipe = Arc::new(stdin_pipe);
        let queued = Arc::new(AtomicUsize::new(0));
        let (exited_tx, exited_rx) = watch::channel(false);
        let (out_done_tx, out_done_rx) = tokio::sync::oneshot::channel::<()>();
        let mut tasks = Vec::new();
        tasks.push(
            tokio::spawn(write_stdin(stdin_pipe.clone(), stdin_rx, queued.clone())).abort_handle(),
        );
        tasks.push(
            tokio::spawn({
                let sink = sink.clone();
                let max = spec.max_message;
                async move {
                    read_stdout(stdout_pipe, max, &sink).await;
                    let _ = out_done_tx.send(());
                }
            })
            .abort_handle(),
        );
        tasks.push(
            tokio::spawn(read_stderr(
                stderr_pipe,
                tail.clone(),
                spec.secrets.clone(),
                spec.label.clone(),
            ))
            .abort_handle(),
        );
        let tail2 = tail.clone();
        let secrets = spec.secrets.clone();
        tasks.push(
            tokio::spawn(async move {
                let status = exit.wait().await;
                let _ = exited_tx.send(true);
                // What the server wrote before it went is relayed first
                // (a grandchild holding stdout open cannot hold this up).
                let _ = tokio::time::timeout(Duration::from_secs(1), out_done_rx).await;
                let why = match status {
                    Ok(s) => format!("exited ({s})"),
                    Err(_) => "exited".to_owned(),
                };
                let last = tail_text(&tail2, &secrets);
                let why = match last.lines().last() {
                    Some(line) if !line.trim().is_empty() => format!("{why}: {}", line.trim()),
                    _ => why,
                };
                sink(PeerEvent::Closed(why));
            })
            .abort_handle(),
        );
        Ok(StdioPeer {
            pid,
            scope: spec.scope,
            unit: unit.map(Arc::new),
            stdin: Some(Stdin {
                pipe: stdin_pipe,
                queue: stdin_tx,
                queued,
            }),
            tail,
            exited: exited_rx,
            secrets: spec.secrets,
            tasks,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Write one message (and its newline). While nothing is queued it is
    /// written here, without blocking; what the pipe does not take at once
    /// goes to the writer task, and so does everything after it until the
    /// queue is empty again, so the order is kept. The owner is the only
    /// writer (`&self` of one actor).
    pub fn send(&self, message: String) -> Result<(), String> {
        let Some(stdin) = &self.stdin else {
            return Err("stdin closed".into());
        };
        let mut bytes = message.into_bytes();
        bytes.push(b'\n');
        if stdin.queued.load(Ordering::Acquire) == 0 {
            match stdin.pipe.try_write(&bytes) {
                Ok(n) if n == bytes.len() => return Ok(()),
                Ok(n) => {
                    bytes.drain(..n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return Err("the server's stdin is closed".to_owned()),
            }
        }
        stdin.queued.fetch_add(1, Ordering::AcqRel);
        stdin.queue.try_send(bytes).map_err(|e| {
            stdin.queued.fetch_sub(1, Ordering::AcqRel);
            match e {
                mpsc::error::TrySendError::Full(_) => {
                    "the server is not reading its stdin".to_owned()
                }
                mpsc::error::TrySendError::Closed(_) => "the server's stdin is closed".to_owned(),
            }
        })
    }

    pub fn stderr_tail(&self) -> String {
        tail_text(&self.tail, &self.secrets)
    }

    /// MCP's stdio shutdown: close stdin, give it a moment, SIGTERM the
    /// group, then SIGKILL everything in the server's scope.
    pub async fn shutdown(&mut self) {
        self.stdin = None;
        let mut exited = self.exited.clone();
        let wait = |ms: u64, exited: &mut watch::Receiver<bool>| {
            let mut exited = exited.clone();
            async move {
                let _ =
                    tokio::time::timeout(Duration::from_millis(ms), exited.wait_for(|e| *e)).await;
            }
        };
        wait(300, &mut exited).await;
        if !*exited.borrow() {
            sys::signal_group(self.pid as i32, Signal::SIGTERM);
            wait(1_500, &mut exited).await;
        }
        let (pid, scope, unit) = (self.pid as i32, self.scope.clone(), self.unit.clone());
        let _ = tokio::task::spawn_blocking(move || match unit.as_deref() {
            Some(u) if u.contained() => {
                u.kill();
                sys::signal_group(pid, Signal::SIGKILL);
            }
            _ => sys::kill_tree(Some(pid), Some(pid), &scope),
        })
        .await;
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for StdioPeer {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        if !*self.exited.borrow() {
            // Dropped without a shutdown (a panicking actor): no orphans.
            let (pid, scope) = (self.pid as i32, self.scope.clone());
            std::thread::spawn(move || sys::kill_tree(Some(pid), Some(pid), &scope));
        }
    }
}

fn tail_text(tail: &Mutex<VecDeque<u8>>, secrets: &[String]) -> String {
    let bytes: Vec<u8> = tail
        .lock()
        .map(|t| t.iter().copied().collect())
        .unwrap_or_default();
    redact(&String::from_utf8_lossy(&bytes), secrets)
}

/// What [`StdioPeer::send`] could not write at once, in order. The pipe
/// is closed (EOF for the server) when the peer drops its queue and this
/// task its `Arc` of the pipe.
async fn write_stdin(
    pipe: Arc<tokio::net::unix::pipe::Sender>,
    mut rx: mpsc::Receiver<Vec<u8>>,
    queued: Arc<AtomicUsize>,
) {
    while let Some(msg) = rx.recv().await {
        let mut rest = &msg[..];
        while !rest.is_empty() {
            if pipe.writable().await.is_err() {
                return;
            }
            match pipe.try_write(rest) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
        queued.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn read_stdout(mut pipe: tokio::net::unix::pipe::Receiver, max: usize, sink: &Sink) {
    let hard = max.saturating_mul(HARD_LIMIT_FACTOR);
    let mut buf = vec![0u8; 64 << 10];
    let mut line: Vec<u8> = Vec::new();
    let mut batch: Vec<String> = Vec::new();
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut chunk = &buf[..n];
        while let Some(pos) = chunk.iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&chunk[..pos]);
            chunk = &chunk[pos + 1..];
            if let Some(over) = take_line(std::mem::take(&mut line), max, &mut batch) {
                flush(&mut batch, sink);
                sink(over);
            }
        }
        flush(&mut batch, sink);
        line.extend_from_slice(chunk);
        if line.len() > hard {
            sink(PeerEvent::Oversized(None));
            sink(PeerEvent::Closed(format!(
                "the server wrote a message over {hard} bytes"
            )));
            return;
        }
    }
}

/// Send the lines of one read: bounded by the read buffer (64 KiB).
fn flush(batch: &mut Vec<String>, sink: &Sink) {
    match batch.len() {
        0 => {}
        1 => sink(PeerEvent::Message(batch.pop().unwrap_or_default())),
        _ => sink(PeerEvent::Messages(std::mem::take(batch))),
    }
}

/// A complete line: into `batch`, or the event for one over `max`.
fn take_line(mut line: Vec<u8>, max: usize, batch: &mut Vec<String>) -> Option<PeerEvent> {
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    if line.iter().all(|b| b.is_ascii_whitespace()) {
        return None;
    }
    let text = String::from_utf8_lossy(&line);
    if line.len() > max {
        Some(PeerEvent::Oversized(crate::mcp::message::id_of(&text)))
    } else {
        batch.push(text.into_owned());
        None
    }
}

async fn read_stderr(
    mut pipe: tokio::net::unix::pipe::Receiver,
    tail: Arc<Mutex<VecDeque<u8>>>,
    secrets: Arc<Vec<String>>,
    label: String,
) {
    let mut buf = vec![0u8; 8 << 10];
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Ok(mut t) = tail.lock() {
            t.extend(&buf[..n]);
            let excess = t.len().saturating_sub(STDERR_TAIL);
            t.drain(..excess);
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            for line in String::from_utf8_lossy(&buf[..n]).lines() {
                let line: String = line.chars().take(STDERR_LOG_LINE).collect();
                tracing::debug!(server = %label, stderr = %redact(&line, &secrets), "mcp server stderr");
            }
        }
    }
}
