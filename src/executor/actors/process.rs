//! One process: a child (pipes or a PTY) in its own process group, its
//! stdout/stderr rings, long-poll readers, stdin, signals and timeout.
//!
//! Output is read straight into the ring (`write_slot`/`commit`) by a pump
//! task per stream on a non-blocking pipe with a 1 MiB buffer, so the child
//! never waits on bmx: a full ring drops its oldest bytes instead. Readers
//! are tasks woken by a watch channel when bytes arrive or the process ends
//! (no polling loops). The actor owns the process's lifecycle; the rings
//! are shared with the pump and reader tasks behind a mutex held only for a
//! copy.
//!
//! The rules of the lifecycle (which kill reason wins, who waits for the
//! end, when SIGKILL follows SIGTERM, when a read is answered) live in the
//! sans-IO [`crate::process::lifecycle`]; this actor feeds it inputs with
//! the tokio clock and executes the effects it returns.

use super::session::SessionMsg;
use crate::executor::config::env_refusal;
use crate::executor::Shared;
use crate::process::env::Tty;
use crate::process::lifecycle::{
    Effect, Ending, ExitStatus, Lifecycle, Outcome, ReadPoll, ReadStep, StreamView,
};
use crate::process::ring::OutputRing;
use crate::process::{exits, sys};
use crate::wire::types::{
    now_rfc3339, Accepted, Cursors, FileTransferResult, IoMode, OutputPolicy, ProcState,
    ProcessReadParams, ProcessReadResult, ProcessStartParams, ProcessState, ProcessStatusParams,
    ProcessWriteParams, StderrMode, StdinMode, Stream,
};
use crate::wire::{BlobRef, Codec, Method, Responder, RpcError};
use bytes::Bytes;
use nix::sys::signal::Signal;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tokio::time::Instant;

/// Bytes one pump read asks for.
const READ_CHUNK: usize = 1 << 20;
/// Pipe buffer for stdout/stderr (`F_SETPIPE_SZ`).
const PIPE_BYTES: usize = 1 << 20;
/// Queued stdin writes before -32015.
const STDIN_QUEUE: usize = 64;

pub enum ProcessMsg {
    /// Answer `process.start` (after `waitMs` if given).
    Started {
        reply: Responder,
        wait_ms: Option<u64>,
    },
    GetState(RpcReplyPort<ProcessState>),
    Read(ProcessReadParams, Responder),
    Write(ProcessWriteParams, Responder),
    Interrupt(Responder),
    /// SIGTERM to the group, SIGKILL to the tree after `grace`.
    Terminate {
        grace: Duration,
        reason: String,
        reply: Option<Responder>,
        done: Option<oneshot::Sender<()>>,
    },
    /// SIGKILL the tree now.
    Kill(String),
    /// The child exited (from the wait task).
    Exited(std::process::ExitStatus),
    /// A file transfer ended (from its task): exit code 0 when it
    /// succeeded, 1 when its result carries an error.
    Transferred(FileTransferResult),
    /// A timer the lifecycle asked for fired (`timeoutMs`, the end of a
    /// grace period, a `waitMs` of `process.start`); the lifecycle decides
    /// what is due.
    Tick,
    /// Test hook: panic in the handler (a crash the tests inject).
    #[doc(hidden)]
    Panic,
}

impl ProcessMsg {
    /// Answer whatever responder the message carries with `error`.
    pub fn fail(self, error: RpcError) {
        match self {
            ProcessMsg::Started { reply, .. }
            | ProcessMsg::Read(_, reply)
            | ProcessMsg::Write(_, reply)
            | ProcessMsg::Interrupt(reply)
            | ProcessMsg::Terminate {
                reply: Some(reply), ..
            } => reply.err(error),
            _ => {}
        }
    }
}

/// One output stream: the ring, the end cursor as a watch (readers wait on
/// it), whether the pipe reached EOF, and, for `outputPolicy: "lossless"`,
/// its backpressure.
pub struct StreamBuf {
    ring: Mutex<OutputRing>,
    end: watch::Sender<u64>,
    closed: AtomicBool,
    flow: Option<Flow>,
}

/// Backpressure of a lossless stream. A `process.read` at cursor `c` says
/// the reader holds every byte before `c`: the pump may then drop those,
/// and no other. The acknowledgement is the *request's* cursor, not the
/// answer's end, so an answer lost with its connection is read again, whole,
/// after the resume.
struct Flow {
    /// The furthest cursor a read has asked for.
    acked: AtomicU64,
    /// Wakes the pump when `acked` moves or the stream is stopped.
    more: Notify,
    /// The process actor stopped: a pump waiting for room gives up.
    stopped: AtomicBool,
}

impl StreamBuf {
    fn new(capacity: usize, policy: OutputPolicy) -> Arc<Self> {
        Arc::new(StreamBuf {
            ring: Mutex::new(OutputRing::new(capacity)),
            end: watch::channel(0).0,
            closed: AtomicBool::new(false),
            flow: (policy == OutputPolicy::Lossless).then(|| Flow {
                acked: AtomicU64::new(0),
                more: Notify::new(),
                stopped: AtomicBool::new(false),
            }),
        })
    }

    fn end(&self) -> u64 {
        self.ring.lock().map(|r| r.end()).unwrap_or(0)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.end.send_modify(|_| {});
    }

    /// How much the pump may read into `ring` now.
    fn room(&self, ring: &OutputRing) -> usize {
        match &self.flow {
            None => READ_CHUNK,
            Some(f) => ring
                .room_keeping(f.acked.load(Ordering::SeqCst))
                .min(READ_CHUNK),
        }
    }

    /// A read asked for `cursor` (valid: at most the end): the bytes before
    /// it may be dropped.
    fn ack(&self, cursor: u64) {
        if let Some(f) = &self.flow {
            if f.acked.fetch_max(cursor, Ordering::SeqCst) < cursor {
                f.more.notify_one();
            }
        }
    }

    /// The process actor is gone: nobody will read again, so a pump
    /// waiting for room must not wait forever.
    fn stop(&self) {
        if let Some(f) = &self.flow {
            f.stopped.store(true, Ordering::SeqCst);
            f.more.notify_one();
        }
    }
}

/// Read a non-blocking fd into a stream's ring until EOF (or EIO: a PTY
/// whose slave side is gone).
pub async fn pump(fd: OwnedFd, buf: Arc<StreamBuf>) {
    let afd = match sys::async_fd(fd) {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch output");
            return buf.close();
        }
    };
    loop {
        let mut guard = match afd.readable().await {
            Ok(g) => g,
            Err(_) => break,
        };
        let step = {
            let Ok(mut ring) = buf.ring.lock() else { break };
            let room = buf.room(&ring);
            if room == 0 {
                Step::Full
            } else {
                let slot = ring.write_slot(room);
                match nix::unistd::read(afd.get_ref().as_fd(), slot) {
                    Ok(0) => Step::Eof,
                    Ok(n) => {
                        ring.commit(n);
                        Step::Read(ring.end())
                    }
                    Err(nix::errno::Errno::EAGAIN) => Step::Drained,
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => Step::Eof,
                }
            }
        };
        match step {
            Step::Read(end) => {
                buf.end.send_replace(end);
            }
            Step::Drained => guard.clear_ready(),
            Step::Full => {
                // Lossless and every held byte unread: leave the bytes in
                // the pipe (the process blocks on its next write) until a
                // read acknowledges some.
                drop(guard);
                let Some(flow) = &buf.flow else { break };
                if flow.stopped.load(Ordering::SeqCst) {
                    break;
                }
                flow.more.notified().await;
            }
            Step::Eof => break,
        }
    }
    buf.close();
}

/// What one turn of [`pump`] did.
enum Step {
    /// Bytes went into the ring; the new end.
    Read(u64),
    /// The pipe is empty for now.
    Drained,
    /// A lossless ring holds only unread bytes.
    Full,
    /// EOF, or the pipe failed.
    Eof,
}

enum StdinOp {
    Data(Bytes),
    Close,
}

async fn stdin_writer(fd: OwnedFd, mut rx: mpsc::Receiver<StdinOp>) {
    let Ok(afd) = sys::async_fd(fd) else { return };
    while let Some(StdinOp::Data(data)) = rx.recv().await {
        // EPIPE: the child closed its stdin; drop the rest.
        if !sys::write_all(&afd, &data).await {
            return;
        }
    }
}

/// A snapshot of the lifecycle, published for reader tasks.
#[derive(Debug, Clone)]
struct Status {
    state: ProcState,
    exit_code: Option<i32>,
    exit_signal: Option<i32>,
    ended_at: Option<String>,
    reason: Option<String>,
    /// A file transfer's result, once it has ended.
    file_transfer: Option<FileTransferResult>,
}

impl Status {
    /// The published form of a final state, ended now.
    fn ended(o: &Outcome) -> Self {
        Status {
            state: match o.ending {
                Ending::Exited => ProcState::Exited,
                Ending::Killed => ProcState::Killed,
                Ending::Failed => ProcState::Failed,
            },
            exit_code: o.exit_code,
            exit_signal: o.exit_signal,
            ended_at: Some(now_rfc3339()),
            reason: o.reason.clone(),
            file_transfer: None,
        }
    }
}

/// Someone the lifecycle holds until the process ends (or a deadline).
enum Waiter {
    /// `process.terminate` (a reply) or a session stop (a completion).
    Terminate {
        reply: Option<Responder>,
        done: Option<oneshot::Sender<()>>,
    },
    /// `process.start` with `waitMs`.
    Start(Responder),
}

pub struct ProcessArgs {
    pub shared: Arc<Shared>,
    pub session: ActorRef<SessionMsg>,
    pub session_id: String,
    pub workspace: PathBuf,
    pub scope: String,
    /// The session's sandbox: every child of the process starts in it.
    pub sandbox: Arc<crate::sandbox::Sandbox>,
    pub spec: ProcessStartParams,
    pub read_slots: Arc<Semaphore>,
}

pub struct ProcessActor;

pub struct ProcessData {
    shared: Arc<Shared>,
    session: ActorRef<SessionMsg>,
    session_id: String,
    spec: ProcessStartParams,
    scope: String,
    sandbox: Arc<crate::sandbox::Sandbox>,
    /// The process's leaf of the session's cgroup: killing it ends
    /// whatever the process started (dropped with the actor).
    unit: Option<Arc<crate::sandbox::Unit>>,
    /// The session's OOM kills when this process started: more at its
    /// SIGKILL means the kernel's OOM killer ended it (`oom_killed`).
    oom_at_start: u64,
    pid: Option<u32>,
    started_at: String,
    message: Option<String>,
    status: watch::Sender<Status>,
    stdout: Arc<StreamBuf>,
    stderr: Arc<StreamBuf>,
    stdin: Option<mpsc::Sender<StdinOp>>,
    /// The rules; `status` is its published form.
    life: Lifecycle<Waiter>,
    /// Time zero of the lifecycle's clock.
    origin: Instant,
    read_slots: Arc<Semaphore>,
    /// `gitCredentials`: this process's `GIT_ASKPASS` helper, removed
    /// (dropped) when the process ends.
    askpass: Option<crate::executor::git_credentials::Askpass>,
    /// `fileTransfer`: the transfer task while it runs (there is no
    /// child; a signal cancels the task), then its result.
    transfer: Option<tokio::task::AbortHandle>,
    transferred: Option<FileTransferResult>,
}

struct Spawned {
    pid: u32,
    exit: exits::Exit,
    stdout: OwnedFd,
    stderr: Option<OwnedFd>,
    stdin: Option<OwnedFd>,
}

/// Check the parts of a spec that are refused with an RPC error (-32003)
/// rather than reported as a failed spawn.
pub fn check_spec(
    shared: &Shared,
    workspace: &std::path::Path,
    spec: &ProcessStartParams,
) -> Result<(), RpcError> {
    let cwd = resolve_cwd(workspace, spec.cwd.as_deref())?;
    // A bound executor (docs/runner.md) refuses up front what would
    // otherwise be a failed spawn: its callers need the one answer.
    if shared.config.workspace.is_some() && !cwd.is_dir() {
        return Err(RpcError::new(
            crate::wire::ErrorCode::Forbidden,
            format!(
                "invalid working directory: {} is not a directory",
                cwd.display()
            ),
        )
        .with_reason("invalid_cwd"));
    }
    shared
        .config
        .child_env()
        .check(spec.env.as_ref())
        .map_err(|e| env_refusal(&e))
}

fn resolve_cwd(workspace: &std::path::Path, cwd: Option<&str>) -> Result<PathBuf, RpcError> {
    match cwd {
        None => Ok(workspace.to_path_buf()),
        Some(c) => crate::tools::boundary::resolve(workspace, c).map_err(|e| {
            RpcError::new(
                crate::wire::ErrorCode::Forbidden,
                format!("invalid working directory: {e}"),
            )
            .with_reason("workspace_boundary")
        }),
    }
}

/// The child's environment, by the executor's one policy
/// (`process::env`): the executor's minus `BMX_*` and denied names, plus
/// the spec's, `TERM` for a PTY, and the scope tag.
fn build_env(
    shared: &Shared,
    sandbox: &crate::sandbox::Sandbox,
    spec: &ProcessStartParams,
    scope: &str,
) -> Result<Vec<(String, String)>, RpcError> {
    let tty = match spec.io_mode {
        IoMode::Pty => Tty::Pty,
        IoMode::Pipe => Tty::No,
    };
    sandbox
        .child_env(shared.config.child_env())
        .build(spec.env.as_ref(), tty, scope)
        .map_err(|e| env_refusal(&e))
}

fn spawn(
    spec: &ProcessStartParams,
    cwd: PathBuf,
    env: Vec<(String, String)>,
    unit: &crate::sandbox::Unit,
) -> std::io::Result<Spawned> {
    use crate::process::spawn::{Command, Group, Stdio};
    // Resolved here, against the child's own PATH (the child runs no
    // search of its own).
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str());
    let program = match sys::resolve_program(&spec.argv[0], path, &cwd) {
        Some(p) => p,
        None if spec.argv[0].contains('/') => cwd.join(&spec.argv[0]),
        None => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "not found in PATH",
            ))
        }
    };
    let mut cmd = Command::new(&program, &spec.argv)?;
    cmd.cwd(&cwd)?.env(env)?.confine(unit.confinement());
    let (stdout_r, stderr_r, stdin_w);
    match spec.io_mode {
        IoMode::Pipe => {
            let (out_r, out_w) = sys::pipe(PIPE_BYTES)?;
            let err_w = match spec.stderr {
                StderrMode::Merge => {
                    stderr_r = None;
                    out_w.try_clone()?
                }
                StderrMode::Separate => {
                    let (r, w) = sys::pipe(PIPE_BYTES)?;
                    stderr_r = Some(r);
                    w
                }
            };
            match spec.stdin {
                StdinMode::Open => {
                    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
                    sys::set_nonblocking(&w)?;
                    cmd.stdin(Stdio::Fd(r));
                    stdin_w = Some(w);
                }
                StdinMode::Closed => {
                    cmd.stdin(Stdio::Null);
                    stdin_w = None;
                }
            }
            cmd.stdout(Stdio::Fd(out_w))
                .stderr(Stdio::Fd(err_w))
                .group(Group::New);
            stdout_r = out_r;
        }
        IoMode::Pty => {
            let (master, slave) = sys::open_pty(spec.cols.unwrap_or(80), spec.rows.unwrap_or(24))?;
            cmd.stdin(Stdio::Fd(slave.try_clone()?))
                .stdout(Stdio::Fd(slave.try_clone()?))
                .stderr(Stdio::Fd(slave))
                .group(Group::Session { tty: true });
            stdin_w = match spec.stdin {
                StdinMode::Open => Some(master.try_clone()?),
                StdinMode::Closed => None,
            };
            stdout_r = master;
            stderr_r = None;
        }
    }
    // The child's ends of the pipes go with `cmd`, so EOF arrives when the
    // child (not bmx) closes them.
    let child = cmd.spawn()?;
    Ok(Spawned {
        pid: child.pid,
        exit: child.exit,
        stdout: stdout_r,
        stderr: stderr_r,
        stdin: stdin_w,
    })
}

impl ProcessData {
    fn snapshot(&self) -> ProcessState {
        let s = self.status.borrow().clone();
        ProcessState {
            accepted: true,
            process_id: self.spec.process_id.clone(),
            pid: self.pid,
            state: s.state,
            started_at: self.started_at.clone(),
            ended_at: s.ended_at,
            exit_code: s.exit_code,
            exit_signal: s.exit_signal,
            reason: s.reason,
            message: self.message.clone(),
            cursors: Cursors {
                stdout: self.stdout.end(),
                stderr: self.stderr.end(),
            },
        }
    }

    fn running(&self) -> bool {
        self.life.is_running()
    }

    /// The lifecycle's `now`.
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    /// Execute what the lifecycle decided, in order.
    fn apply(&mut self, myself: &ActorRef<ProcessMsg>, effects: Vec<Effect<Waiter>>) {
        for effect in effects {
            match effect {
                Effect::Signal(sig) if self.transfer.is_some() => self.cancel_transfer(myself, sig),
                Effect::KillTree if self.transfer.is_some() => {
                    self.cancel_transfer(myself, Signal::SIGKILL)
                }
                Effect::Signal(sig) => self.signal(sig),
                Effect::KillTree => {
                    tracing::info!(
                        process = %self.spec.process_id,
                        reason = self.life.reason().unwrap_or_default(),
                        "killing the group"
                    );
                    self.kill_tree_now();
                }
                Effect::ArmTimer(at) => {
                    let after = at.saturating_sub(self.now());
                    myself.send_after(after, || ProcessMsg::Tick);
                }
                Effect::Ended(outcome) => {
                    // The git credential helper goes before anyone hears
                    // of the end (issue 15).
                    self.askpass = None;
                    self.status.send_replace(Status {
                        file_transfer: self.transferred.clone(),
                        ..Status::ended(&outcome)
                    });
                    self.announce();
                }
                Effect::ReapLeftovers => self.kill_tree_now(),
                Effect::CloseStdin => self.stdin = None,
                Effect::Answer(waiter) => self.answer(waiter),
            }
        }
    }

    fn answer(&self, waiter: Waiter) {
        match waiter {
            Waiter::Terminate { reply, done } => {
                if let Some(r) = reply {
                    r.ok(&self.snapshot());
                }
                if let Some(d) = done {
                    let _ = d.send(());
                }
            }
            Waiter::Start(reply) => reply.ok(&self.snapshot()),
        }
    }

    /// A signal to a file transfer: it has no handler, so any signal ends
    /// it. The task is aborted (dropping its temp file removes it) and
    /// the end is reported as a death by `sig`, like a child's.
    fn cancel_transfer(&mut self, myself: &ActorRef<ProcessMsg>, sig: Signal) {
        let Some(task) = self.transfer.take() else {
            return;
        };
        task.abort();
        let path = self
            .spec
            .file_transfer
            .as_ref()
            .map(|f| f.local_path.clone())
            .unwrap_or_default();
        self.transferred = Some(
            crate::executor::file_transfer::Failure {
                code: crate::executor::file_transfer::code::CANCELED,
                message: format!("canceled by {}", sig.as_str()),
                current_digest: None,
            }
            .into_result(&path),
        );
        let _ = myself.send_message(ProcessMsg::Exited(std::process::ExitStatus::from_raw(
            sig as i32,
        )));
    }

    fn pgid(&self) -> Option<i32> {
        self.pid.map(|p| p as i32)
    }

    fn signal(&self, sig: Signal) {
        if let Some(g) = self.pgid() {
            sys::signal_group(g, sig);
        }
    }

    fn kill_tree_now(&self) {
        let (pid, scope, unit) = (self.pgid(), self.scope.clone(), self.unit.clone());
        // /proc walks and kills are blocking: off the actor's thread.
        tokio::task::spawn_blocking(move || {
            match unit.as_deref() {
                // Its leaf holds everything it started, escapees included.
                Some(u) if u.contained() => {
                    u.kill();
                    sys::signal_group(pid.unwrap_or(0), Signal::SIGKILL);
                }
                _ => sys::kill_tree(pid, pid, &scope),
            }
        });
    }

    fn announce(&self) {
        let ps = self.snapshot();
        let _ = self
            .session
            .send_message(SessionMsg::ProcessChanged(ps.clone()));
        if let Some(link) = self.shared.link() {
            let _ = link.notify(
                Method::ProcessStatus,
                &ProcessStatusParams {
                    session_id: self.session_id.clone(),
                    process_id: ps.process_id,
                    state: ps.state,
                    exit_code: ps.exit_code,
                    exit_signal: ps.exit_signal,
                    ended_at: ps.ended_at,
                    reason: ps.reason,
                    observed_at: now_rfc3339(),
                },
            );
        }
    }
}

impl Actor for ProcessActor {
    type Msg = ProcessMsg;
    type State = ProcessData;
    type Arguments = ProcessArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ProcessMsg>,
        args: ProcessArgs,
    ) -> Result<ProcessData, ActorProcessingErr> {
        let capacity = args.shared.config.process_buffer_bytes;
        let mut state = ProcessData {
            stdout: StreamBuf::new(capacity, args.spec.output_policy),
            stderr: StreamBuf::new(capacity, args.spec.output_policy),
            status: watch::channel(Status {
                state: ProcState::Running,
                exit_code: None,
                exit_signal: None,
                ended_at: None,
                reason: None,
                file_transfer: None,
            })
            .0,
            shared: args.shared.clone(),
            session: args.session,
            session_id: args.session_id,
            scope: args.scope,
            oom_at_start: args.sandbox.oom_kills(),
            sandbox: args.sandbox.clone(),
            unit: None,
            pid: None,
            started_at: now_rfc3339(),
            message: None,
            stdin: None,
            // Until the spawn below succeeds.
            life: Lifecycle::spawn_failed(),
            origin: Instant::now(),
            read_slots: args.read_slots,
            askpass: None,
            transfer: None,
            transferred: None,
            spec: args.spec,
        };
        if let Some(ft) = state.spec.file_transfer.clone() {
            // No child: the transfer runs as a task of this actor, which
            // keeps the process's lifecycle (timeout, terminate, kill,
            // the end state) exactly as for a child (docs/protocol.md).
            state.stdout.close();
            state.stderr.close();
            let (me, ws, sid) = (
                myself.clone(),
                args.workspace.clone(),
                state.session_id.clone(),
            );
            let task = tokio::spawn(async move {
                let r = crate::executor::file_transfer::run(ws, sid, *ft).await;
                let _ = me.send_message(ProcessMsg::Transferred(r));
            });
            state.transfer = Some(task.abort_handle());
            let timeout = state.spec.timeout_ms.map(Duration::from_millis);
            let (life, effects) = Lifecycle::started(state.now(), timeout);
            state.life = life;
            state.apply(&myself, effects);
            return Ok(state);
        }
        // Granted before the spawn; a refused grant is a failed spawn with
        // the reason as its message (never the secret: see GrantError).
        let askpass = state.spec.git_credentials.then(|| {
            crate::executor::git_credentials::grant(&args.shared.config, args.sandbox.tmp())
        });
        let spawned = resolve_cwd(&args.workspace, state.spec.cwd.as_deref())
            .map_err(|e| {
                e.message
                    + &e.data
                        .and_then(|d| d.detail)
                        .map(|d| format!(": {d}"))
                        .unwrap_or_default()
            })
            .and_then(|cwd| {
                let mut env = build_env(&args.shared, &state.sandbox, &state.spec, &state.scope)
                    .map_err(|e| e.message)?;
                if let Some(granted) = &askpass {
                    let helper = granted.as_ref().map_err(|e| e.to_string())?;
                    for (k, v) in helper.env() {
                        env.retain(|(name, _)| *name != k);
                        env.push((k, v));
                    }
                }
                let mut unit = state.sandbox.unit().map_err(|e| e.to_string())?;
                let spawned = spawn(&state.spec, cwd, env, &unit)
                    .map_err(|e| format!("{}: {e}", state.spec.argv[0]));
                unit.started();
                state.unit = Some(Arc::new(unit));
                spawned
            });
        match spawned {
            Ok(s) => {
                state.pid = Some(s.pid);
                state.askpass = askpass.and_then(Result::ok);
                tokio::spawn(pump(s.stdout, state.stdout.clone()));
                match s.stderr {
                    Some(fd) => {
                        tokio::spawn(pump(fd, state.stderr.clone()));
                    }
                    None => state.stderr.close(),
                }
                if let Some(fd) = s.stdin {
                    let (tx, rx) = mpsc::channel(STDIN_QUEUE);
                    tokio::spawn(stdin_writer(fd, rx));
                    state.stdin = Some(tx);
                }
                let (me, exit) = (myself.clone(), s.exit);
                tokio::spawn(async move {
                    if let Ok(status) = exit.wait().await {
                        let _ = me.send_message(ProcessMsg::Exited(status));
                    }
                });
                let timeout = state.spec.timeout_ms.map(Duration::from_millis);
                let (life, effects) = Lifecycle::started(state.now(), timeout);
                state.life = life;
                state.apply(&myself, effects);
            }
            Err(message) => {
                tracing::info!(process = %state.spec.process_id, %message, "spawn failed");
                state.message = Some(message);
                if let Some(outcome) = state.life.outcome() {
                    state.status.send_replace(Status::ended(outcome));
                }
                state.stdout.close();
                state.stderr.close();
            }
        }
        Ok(state)
    }

    async fn post_start(
        &self,
        _myself: ActorRef<ProcessMsg>,
        state: &mut ProcessData,
    ) -> Result<(), ActorProcessingErr> {
        state.announce();
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ProcessMsg>,
        state: &mut ProcessData,
    ) -> Result<(), ActorProcessingErr> {
        state.stdout.stop();
        state.stderr.stop();
        if let Some(task) = state.transfer.take() {
            task.abort();
        }
        if state.running() {
            let (pid, scope) = (state.pgid(), state.scope.clone());
            let _ = tokio::task::spawn_blocking(move || sys::kill_tree(pid, pid, &scope)).await;
        }
        for waiter in state.life.abandon() {
            match waiter {
                Waiter::Start(reply) => reply.err(RpcError::internal("process actor stopped")),
                // Dropped: the responder answers for itself, the session's
                // stop stops waiting.
                Waiter::Terminate { .. } => {}
            }
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ProcessMsg>,
        msg: ProcessMsg,
        state: &mut ProcessData,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ProcessMsg::Started { reply, wait_ms } => {
                let wait = Duration::from_millis(wait_ms.unwrap_or(0));
                let effects = state
                    .life
                    .await_start(state.now(), wait, Waiter::Start(reply));
                state.apply(&myself, effects);
            }
            ProcessMsg::GetState(port) => {
                let _ = port.send(state.snapshot());
            }
            ProcessMsg::Read(p, reply) => self.read(state, p, reply),
            ProcessMsg::Write(p, reply) => {
                let limit = state.shared.limits().process_write_bytes();
                if p.data.len() as u64 > limit {
                    {
                        reply.err(RpcError::payload_too_large(format!(
                            "maxProcessWriteBytes is {limit}"
                        )));
                        return Ok(());
                    }
                }
                let Some(tx) = state.stdin.as_ref() else {
                    {
                        reply.err(RpcError::conflict("stdin_closed", "stdin is closed"));
                        return Ok(());
                    }
                };
                if !p.data.is_empty() && tx.try_send(StdinOp::Data(p.data.0)).is_err() {
                    {
                        reply.err(RpcError::resource_unavailable("stdin queue is full"));
                        return Ok(());
                    }
                }
                if p.close_stdin {
                    let _ = tx.try_send(StdinOp::Close);
                    state.stdin = None;
                }
                reply.ok(&Accepted::YES);
            }
            ProcessMsg::Interrupt(reply) => {
                let effects = state.life.interrupt();
                state.apply(&myself, effects);
                reply.ok(&state.snapshot());
            }
            ProcessMsg::Terminate {
                grace,
                reason,
                reply,
                done,
            } => {
                let waiter = Waiter::Terminate { reply, done };
                let effects = state.life.terminate(state.now(), grace, reason, waiter);
                state.apply(&myself, effects);
            }
            ProcessMsg::Kill(reason) => {
                let effects = state.life.kill(state.now(), reason);
                state.apply(&myself, effects);
            }
            ProcessMsg::Panic => panic!("injected panic (test hook)"),
            ProcessMsg::Tick => {
                let effects = state.life.tick(state.now());
                state.apply(&myself, effects);
            }
            ProcessMsg::Transferred(r) => {
                // Canceled meanwhile: the cancel's end stands.
                if state.transfer.take().is_some() {
                    let code = i32::from(r.error.is_some());
                    state.transferred = Some(r);
                    let effects = state.life.exited(ExitStatus {
                        code: Some(code),
                        signal: None,
                    });
                    state.apply(&myself, effects);
                }
            }
            ProcessMsg::Exited(status) => {
                if status.signal() == Some(libc::SIGKILL)
                    && state.sandbox.oom_kills() > state.oom_at_start
                {
                    state.life.oom_killed();
                }
                let effects = state.life.exited(ExitStatus {
                    code: status.code(),
                    signal: status.signal(),
                });
                state.apply(&myself, effects);
            }
        }
        Ok(())
    }
}

impl ProcessActor {
    fn read(&self, state: &ProcessData, p: ProcessReadParams, reply: Responder) {
        let buf = match p.stream {
            Stream::Stdout => state.stdout.clone(),
            Stream::Stderr => state.stderr.clone(),
        };
        let limits = state.shared.limits();
        let frame = state
            .shared
            .registration()
            .map(|r| r.max_control_frame_bytes)
            .unwrap_or(1 << 20);
        // The answer must fit one control frame: leave room for the
        // envelope, and for base64's 4/3 in JSON.
        let room = frame.saturating_sub(2048);
        let frame_cap = match reply.link().codec() {
            Codec::Json => room / 4 * 3,
            Codec::MsgPack => room,
        };
        // `maxBytes: 0` asks for no data: the cursors, `truncated` (were
        // bytes ready?) and the state, at once. Any other read takes at
        // least one byte, whatever the caps.
        let max = match p.max_bytes {
            Some(0) => 0,
            asked => asked
                .unwrap_or(u64::MAX)
                .min(limits.process_read_bytes())
                .min(frame_cap)
                .max(1) as usize,
        };
        let status = state.status.subscribe();
        let slots = state.read_slots.clone();
        let shared = state.shared.clone();
        tokio::spawn(read_task(buf, status, slots, p, max, reply, shared));
    }
}

async fn read_task(
    buf: Arc<StreamBuf>,
    mut status: watch::Receiver<Status>,
    slots: Arc<Semaphore>,
    p: ProcessReadParams,
    max: usize,
    reply: Responder,
    shared: Arc<Shared>,
) {
    let mut end_rx = buf.end.subscribe();
    // The poll's clock starts with the task.
    let origin = Instant::now();
    let mut poll = ReadPoll::new(Duration::ZERO, p.wait_ms);
    let mut _slot = None;
    loop {
        let closed = buf.closed.load(Ordering::SeqCst);
        let snapshot = status.borrow_and_update().clone();
        let (until, take_slot) = {
            // One lock: the span, the end and the earliest cursor are one
            // consistent snapshot of the ring. The answer is encoded under
            // it, straight from the ring's memory (no copy of the bytes
            // first); the pump waits at most one encode (a memcpy of
            // `max` bytes in MessagePack), and the pipe absorbs that.
            let Ok(ring) = buf.ring.lock() else {
                return reply.err(RpcError::internal("output buffer poisoned"));
            };
            end_rx.borrow_and_update();
            let (span, first, second) = match ring.slices(p.cursor, max) {
                Ok(s) => s,
                Err(e) => return reply.err(RpcError::invalid_params(e.to_string())),
            };
            buf.ack(p.cursor);
            let (end, earliest) = (ring.end(), ring.earliest());
            let view = StreamView {
                // A zero-byte read never waits: its answer is ready now.
                has_bytes: span.next > span.from || max == 0,
                ended: snapshot.state.is_final(),
                closed,
                at_end: span.next == end,
            };
            match poll.decide(origin.elapsed(), view) {
                ReadStep::Park {
                    poll: next,
                    until,
                    take_slot,
                } => {
                    poll = next;
                    (until, take_slot)
                }
                ReadStep::Answer { eof } => {
                    // A span across the ring's physical end is joined once.
                    let joined;
                    let data = if second.is_empty() {
                        first
                    } else {
                        joined = [first, second].concat();
                        &joined[..]
                    };
                    let answer = ProcessReadResult {
                        process_id: p.process_id,
                        stream: p.stream,
                        data: BlobRef(data),
                        from_cursor: span.from,
                        next_cursor: span.next,
                        earliest_cursor: earliest,
                        gap: span.gap,
                        truncated: span.truncated,
                        eof,
                        state: snapshot.state,
                        exit_code: snapshot.exit_code,
                        exit_signal: snapshot.exit_signal,
                        ended_at: snapshot.ended_at,
                        reason: snapshot.reason,
                        file_transfer: snapshot.file_transfer,
                    };
                    let stream = match p.stream {
                        Stream::Stdout => "stdout",
                        Stream::Stderr => "stderr",
                    };
                    shared.metrics.read_answered(stream, data.len(), span.gap);
                    return reply.ok_sized(&answer, data.len());
                }
            }
        };
        if take_slot {
            match slots.clone().try_acquire_owned() {
                Ok(s) => _slot = Some(s),
                Err(_) => {
                    return reply.err(RpcError::resource_unavailable(
                        "maxConcurrentProcessReads waiting reads in this session",
                    ))
                }
            }
        }
        tokio::select! {
            _ = end_rx.changed() => {}
            _ = status.changed() => {}
            _ = tokio::time::sleep_until(origin + until) => {}
        }
    }
}
