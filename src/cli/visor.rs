//! `bmx visor`: serve (no subcommand), or a client of a running visor's
//! socket (`ls`, `start`, `send`, `screen`, `stop`, `events`, `purge`,
//! `workdir …`, `hook`), with human output or `--json`.

use super::attach::{tty_size, RawMode};
use super::text::{self, cell, say, say_json, warn_line};
use bmx::visor::client::{self, ClientError};
use bmx::visor::{home_dir, socket_path};
use clap::{Args, Subcommand};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::ExitCode;
use tokio_tungstenite::tungstenite::Message;

/// Run the local supervisor of agent and shell sessions, or talk to it.
#[derive(Debug, Args)]
pub struct VisorArgs {
    /// The visor's home (lock, socket): else $BMX_HOME, else ~/.bmx.
    #[arg(long, global = true)]
    pub home: Option<PathBuf>,
    /// The socket (default <home>/visor.sock).
    #[arg(long, global = true)]
    pub socket: Option<PathBuf>,
    /// Machine-readable output (one JSON document, or one per line for
    /// `events`).
    #[arg(long, global = true)]
    pub json: bool,
    /// The daemon shows the tool calls a local executor holds for a person
    /// (`always_ask`) as `request` events: the executor's confirmation
    /// socket to watch (repeatable; default: the default executor's,
    /// `$TMPDIR/bmx-work/confirm/confirm.sock`).
    #[arg(long, value_name = "PATH")]
    pub confirm_socket: Vec<PathBuf>,
    /// Watch no executor's confirmations.
    #[arg(long, conflicts_with = "confirm_socket")]
    pub no_executor_confirm: bool,
    #[command(subcommand)]
    pub command: Option<VisorCommand>,
}

#[derive(Debug, Subcommand)]
pub enum VisorCommand {
    /// List sessions.
    Ls {
        /// Only these states (comma-separated).
        #[arg(long)]
        state: Option<String>,
    },
    /// Start a session running COMMAND (or the agent recipe --agent):
    /// on a PTY, or with `--kind wire` an ACP agent on stdio.
    Start {
        #[arg(long)]
        title: Option<String>,
        /// pty or wire (an ACP agent).
        #[arg(long, default_value = "pty")]
        kind: String,
        /// An agent of <home>/agents.toml instead of COMMAND.
        #[arg(long, conflicts_with = "command")]
        agent: Option<String>,
        /// Wire sessions: the first prompt.
        #[arg(long)]
        prompt: Option<String>,
        /// Wire sessions: the agent's session to load (ACP session/load).
        #[arg(long)]
        resume_id: Option<String>,
        /// Restart policy: none, notify or (wire) resume.
        #[arg(long, default_value = "none")]
        restart: String,
        /// Sent after a restart (wire sessions).
        #[arg(long)]
        restart_prompt: Option<String>,
        /// Working directory (absolute).
        #[arg(long)]
        cwd: Option<PathBuf>,
        /// Run in this workdir (`bmx visor workdir ls`); --cwd, if given,
        /// must be inside it.
        #[arg(long)]
        workdir: Option<String>,
        /// Labels, `k=v` (repeatable).
        #[arg(long = "label")]
        labels: Vec<String>,
        #[arg(required_unless_present = "agent", trailing_var_arg = true)]
        command: Vec<String>,
    },
    /// Type TEXT and Enter into a PTY session; prompt a wire session (now,
    /// or held for its next idle).
    Send { session: String, text: String },
    /// Print a session's screen (a wire session: its conversation).
    Screen { session: String },
    /// Stop a session (its whole process tree).
    Stop { session: String },
    /// Stream events (replay from --after, then live) until interrupted.
    Events {
        #[arg(long, default_value_t = 0)]
        after: u64,
        #[arg(long)]
        session: Option<String>,
        /// Only these event types (comma-separated).
        #[arg(long)]
        types: Option<String>,
    },
    /// Attach this terminal to a PTY session and take its writer lease;
    /// detach with Ctrl-P Ctrl-Q (the session keeps running).
    Attach { session: String },
    /// Remove exited sessions and their events.
    Purge {
        #[arg(long)]
        session: Option<String>,
    },
    /// Workdirs: a project's folder, its repository's main worktree, or a
    /// git worktree of its own on its own branch.
    Workdir {
        #[command(subcommand)]
        command: WorkdirCommand,
    },
    /// Report one hook of an agent started outside the visor: reads the
    /// hook's JSON payload on stdin and posts it; when no visor runs, the
    /// call is spooled in <home>/hooks/spool for the next one (exit 0).
    /// Prints nothing on success (a hook's stdout may reach the agent).
    Hook {
        /// The agent's name (1-64 of A-Z a-z 0-9 - _ .).
        #[arg(long)]
        agent: String,
        /// Labels of the observed session, `k=v` (repeatable).
        #[arg(long = "label")]
        labels: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum WorkdirCommand {
    /// List workdirs.
    Ls,
    /// Make a workdir (idempotent by project, kind and name).
    Create {
        /// The project folder (default: the current directory).
        #[arg(long)]
        project: Option<PathBuf>,
        /// folder, main or worktree.
        #[arg(long, default_value = "worktree")]
        kind: String,
        /// The workdir's name (a worktree's folder; default: generated).
        #[arg(long)]
        name: Option<String>,
        /// A worktree's branch (default: bmx/<name>).
        #[arg(long)]
        branch: Option<String>,
    },
    /// Archive a workdir: a worktree's folder is removed, its branch kept.
    Archive {
        id: String,
        /// Even while a live session uses it or it has uncommitted changes.
        #[arg(long)]
        force: bool,
    },
    /// Restore an archived workdir (a worktree is added again on its branch).
    Restore { id: String },
    /// Remove a workdir (a worktree's folder; its branch is kept).
    Rm {
        id: String,
        /// Even while a live session uses it or it has uncommitted changes.
        #[arg(long)]
        force: bool,
    },
}

fn fail(e: ClientError) -> ExitCode {
    warn_line!("bmx visor: {e}");
    ExitCode::from(1)
}

/// The target id of the visor in `--json` envelopes (`bmx targets`).
const TARGET: &str = "visor";

/// One `--json` answer: the visor's JSON as the envelope's `data`.
fn envelope(v: &Value) -> String {
    bmx::runner::envelope::Response::success(v, Some(TARGET)).to_line()
}

/// A failure under `--json`: one envelope line on stdout (the message on
/// stderr too), exit 1.
fn fail_json(e: ClientError) -> ExitCode {
    use bmx::runner::envelope::{ErrorCode, Response, ResponseError};
    warn_line!("bmx visor: {e}");
    let error = ResponseError::new(ErrorCode::TargetExecFailed, e.to_string());
    let line = Response::failure(error, Some(TARGET)).to_line();
    say_json(&line);
    ExitCode::from(1)
}

/// Text that spans lines on stdout ([`text::lines`]).
fn say_lines(s: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", text::lines(s));
    let _ = out.flush();
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b',' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub async fn run(args: VisorArgs) -> ExitCode {
    let home = home_dir(args.home.clone());
    let socket = socket_path(&home, args.socket.clone());
    let Some(cmd) = args.command else {
        let confirm = match (args.no_executor_confirm, args.confirm_socket.is_empty()) {
            (true, _) => Vec::new(),
            (false, true) => vec![bmx::visor::confirm::default_socket()],
            (false, false) => args.confirm_socket.clone(),
        };
        return serve(home, socket, confirm).await;
    };
    let json = args.json;
    let r = match cmd {
        VisorCommand::Ls { state } => {
            let path = match state {
                Some(s) => format!("/v1/sessions?state={}", enc(&s)),
                None => "/v1/sessions".into(),
            };
            client::request(&socket, "GET", &path, None).await.map(|v| {
                if json {
                    say_json(&envelope(&v));
                } else {
                    say!(
                        "{:<16} {:<9} {:<8} {:>7}  TITLE",
                        "ID",
                        "STATE",
                        "KIND",
                        "PID"
                    );
                    for s in v["sessions"].as_array().into_iter().flatten() {
                        // Escaped per cell: a title is anyone's text.
                        say!(
                            "{:<16} {:<9} {:<8} {:>7}  {}",
                            cell(&s["id"], ""),
                            cell(&s["state"], ""),
                            cell(&s["kind"], ""),
                            s["pid"].as_u64().map(|p| p.to_string()).unwrap_or_default(),
                            cell(&s["title"], "")
                        );
                    }
                }
            })
        }
        VisorCommand::Start {
            title,
            kind,
            agent,
            prompt,
            resume_id,
            restart,
            restart_prompt,
            cwd,
            workdir,
            labels,
            command,
        } => {
            // In a workdir, its folder is the default working directory.
            let cwd = match &workdir {
                Some(_) => cwd,
                None => cwd.or_else(|| std::env::current_dir().ok()),
            }
            .map(|p| p.display().to_string());
            let labels: serde_json::Map<String, Value> = labels
                .iter()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_owned(), Value::from(v)))
                .collect();
            let mut body = json!({"kind": kind, "title": title,
                "workingDir": cwd, "labels": labels, "restart": {"mode": restart}});
            match agent {
                Some(a) => body["agent"] = a.into(),
                None => body["command"] = command.into(),
            }
            for (k, v) in [
                ("prompt", prompt),
                ("resumeId", resume_id),
                ("workdir", workdir),
            ] {
                if let Some(v) = v {
                    body[k] = v.into();
                }
            }
            if let Some(p) = restart_prompt {
                body["restart"]["prompt"] = p.into();
            }
            client::request(&socket, "POST", "/v1/sessions", Some(&body))
                .await
                .map(|v| {
                    if json {
                        say_json(&envelope(&v));
                    } else {
                        say!("{}", v["id"].as_str().unwrap_or(""));
                    }
                })
        }
        VisorCommand::Send { session, text } => {
            let path = format!("/v1/sessions/{}/send", enc(&session));
            client::request(&socket, "POST", &path, Some(&json!({"text": text})))
                .await
                .map(|v| {
                    if json {
                        say_json(&envelope(&v));
                    } else {
                        say!("{}", v["delivery"].as_str().unwrap_or(""));
                    }
                })
        }
        VisorCommand::Screen { session } => {
            let path = format!("/v1/sessions/{}/screen", enc(&session));
            client::request(&socket, "GET", &path, None).await.map(|v| {
                if json {
                    say_json(&envelope(&v));
                } else if v["view"] == "chat" {
                    for t in v["turns"].as_array().into_iter().flatten() {
                        let tool = &t["tool"];
                        match t["role"].as_str().unwrap_or("") {
                            "tool" => say!(
                                "tool: {} ({})",
                                t["text"].as_str().unwrap_or(""),
                                tool["status"].as_str().unwrap_or("")
                            ),
                            // A turn's text spans lines: kept, the rest escaped.
                            role => say_lines(&format!(
                                "{}: {}",
                                text::one_line(role),
                                t["text"].as_str().unwrap_or("")
                            )),
                        }
                    }
                    for p in v["pending"].as_array().into_iter().flatten() {
                        say!(
                            "pending {}: {} {}",
                            p["id"].as_str().unwrap_or(""),
                            p["kind"].as_str().unwrap_or(""),
                            p["tool"]["name"].as_str().unwrap_or("")
                        );
                    }
                } else {
                    for l in v["lines"].as_array().into_iter().flatten() {
                        say!("{}", l.as_str().unwrap_or("").trim_end());
                    }
                }
            })
        }
        VisorCommand::Stop { session } => {
            let path = format!("/v1/sessions/{}/stop", enc(&session));
            client::request(&socket, "POST", &path, None)
                .await
                .map(|v| {
                    if json {
                        say_json(&envelope(&v));
                    } else {
                        say!(
                            "{} {} (exit code {})",
                            v["id"].as_str().unwrap_or(""),
                            v["state"].as_str().unwrap_or(""),
                            v["exitCode"]
                        );
                    }
                })
        }
        VisorCommand::Purge { session } => {
            let body = json!({"session": session});
            client::request(&socket, "POST", "/v1/purge", Some(&body))
                .await
                .map(|v| {
                    if json {
                        say_json(&envelope(&v));
                    } else {
                        for id in v["purged"].as_array().into_iter().flatten() {
                            say!("{}", id.as_str().unwrap_or(""));
                        }
                    }
                })
        }
        VisorCommand::Workdir { command } => workdir(&socket, command, json).await,
        VisorCommand::Hook { agent, labels } => {
            return hook(&home, &socket, &agent, &labels, json).await
        }
        VisorCommand::Attach { session } => return attach(&socket, &session).await,
        VisorCommand::Events {
            after,
            session,
            types,
        } => return events(&socket, after, session, types, json).await,
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if json => fail_json(e),
        Err(e) => fail(e),
    }
}

/// One workdir as a line: id, state, kind, branch, path.
fn workdir_line(w: &Value) -> String {
    format!(
        "{:<15} {:<8} {:<8} {:<24} {}",
        cell(&w["id"], ""),
        cell(&w["state"], ""),
        cell(&w["kind"], ""),
        cell(&w["branch"], "-"),
        cell(&w["path"], "")
    )
}

async fn workdir(
    socket: &std::path::Path,
    cmd: WorkdirCommand,
    json: bool,
) -> Result<(), ClientError> {
    let force_q = |force: bool| if force { "?force=true" } else { "" };
    let (v, list) = match cmd {
        WorkdirCommand::Ls => (
            client::request(socket, "GET", "/v1/workdirs", None).await?,
            true,
        ),
        WorkdirCommand::Create {
            project,
            kind,
            name,
            branch,
        } => {
            let cwd = std::env::current_dir().unwrap_or_default();
            let project = match project {
                Some(p) if p.is_relative() => cwd.join(p),
                Some(p) => p,
                None => cwd,
            };
            let mut body = json!({"project": project.display().to_string(), "kind": kind});
            if let Some(n) = name {
                body["name"] = n.into();
            }
            if let Some(b) = branch {
                body["branch"] = b.into();
            }
            let v = client::request(socket, "POST", "/v1/workdirs", Some(&body)).await?;
            (v, false)
        }
        WorkdirCommand::Archive { id, force } => {
            let path = format!("/v1/workdirs/{}/archive{}", enc(&id), force_q(force));
            (client::request(socket, "POST", &path, None).await?, false)
        }
        WorkdirCommand::Restore { id } => {
            let path = format!("/v1/workdirs/{}/restore", enc(&id));
            (client::request(socket, "POST", &path, None).await?, false)
        }
        WorkdirCommand::Rm { id, force } => {
            let path = format!("/v1/workdirs/{}{}", enc(&id), force_q(force));
            let v = client::request(socket, "DELETE", &path, None).await?;
            if !json {
                say!("removed {}", workdir_line(&v["removed"]));
                return Ok(());
            }
            (v, false)
        }
    };
    if json {
        say_json(&envelope(&v));
    } else if list {
        say!(
            "{:<15} {:<8} {:<8} {:<24} PATH",
            "ID",
            "STATE",
            "KIND",
            "BRANCH"
        );
        for w in v["workdirs"].as_array().into_iter().flatten() {
            say!("{}", workdir_line(w));
        }
    } else {
        say!("{}", workdir_line(&v));
    }
    Ok(())
}

/// How long `bmx visor hook` waits for its payload and for the visor: a
/// hook must never hold its agent up for long.
const HOOK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Stdin, at most `limit` bytes, within [`HOOK_WAIT`]; read on a thread of
/// its own so that a stdin that never ends does not hold the exit.
async fn read_payload(limit: usize) -> Result<Vec<u8>, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        use std::io::Read as _;
        let mut buf = Vec::new();
        let r = std::io::stdin()
            .lock()
            .take(limit as u64 + 1)
            .read_to_end(&mut buf)
            .map(|_| buf);
        let _ = tx.send(r);
    });
    match tokio::time::timeout(HOOK_WAIT, rx).await {
        Ok(Ok(Ok(b))) if b.len() > limit => {
            Err(format!("the hook payload is larger than {limit} bytes"))
        }
        Ok(Ok(Ok(b))) => Ok(b),
        Ok(Ok(Err(e))) => Err(format!("cannot read the hook payload: {e}")),
        Ok(Err(_)) => Err("cannot read the hook payload".into()),
        Err(_) => Err(format!(
            "no hook payload on stdin within {} s",
            HOOK_WAIT.as_secs()
        )),
    }
}

/// `bmx visor hook`: post the call; when no visor is there (nothing
/// listens on the socket, or it is shutting down), spool it and exit 0.
/// An answer that does not come in time is not spooled: the visor may
/// have taken the call, and a hook is applied at most once.
async fn hook(
    home: &std::path::Path,
    socket: &std::path::Path,
    agent: &str,
    labels: &[String],
    json: bool,
) -> ExitCode {
    use bmx::visor::hooks::{self, HookCall};
    let bad = |m: String| {
        warn_line!("bmx visor hook: {m}");
        ExitCode::from(1)
    };
    let payload = match read_payload(hooks::MAX_PAYLOAD).await {
        Ok(p) => p,
        Err(m) => return bad(m),
    };
    let call = match HookCall::from_payload(agent, &payload, labels) {
        Ok(c) => c,
        Err(e) => return bad(e.to_string()),
    };
    let body = match serde_json::to_value(&call) {
        Ok(b) => b,
        Err(e) => return bad(e.to_string()),
    };
    let posted = tokio::time::timeout(
        HOOK_WAIT,
        client::request(socket, "POST", "/v1/hook", Some(&body)),
    )
    .await;
    match posted {
        Ok(Ok(v)) => {
            if json {
                say_json(&envelope(&v));
            }
            ExitCode::SUCCESS
        }
        Ok(Err(ClientError::Connect(..))) | Ok(Err(ClientError::Api { status: 503, .. })) => {
            let home = home.to_owned();
            let spooled =
                tokio::task::spawn_blocking(move || hooks::spool_append(&home, &call)).await;
            match spooled {
                Ok(Ok(path)) => {
                    warn_line!("bmx visor hook: no visor; spooled in {}", path.display());
                    if json {
                        let v = json!({"spooled": true, "path": path.display().to_string()});
                        say_json(&envelope(&v));
                    }
                    ExitCode::SUCCESS
                }
                Ok(Err(e)) => bad(e.to_string()),
                Err(e) => bad(e.to_string()),
            }
        }
        Ok(Err(e)) if json => fail_json(e),
        Ok(Err(e)) => fail(e),
        Err(_) => bad(format!(
            "the visor did not answer within {} s; the hook is not spooled",
            HOOK_WAIT.as_secs()
        )),
    }
}

async fn events(
    socket: &std::path::Path,
    after: u64,
    session: Option<String>,
    types: Option<String>,
    json: bool,
) -> ExitCode {
    let mut path = format!("/v1/events?after={after}");
    if let Some(s) = session {
        path.push_str(&format!("&session={}", enc(&s)));
    }
    if let Some(t) = types {
        path.push_str(&format!("&types={}", enc(&t)));
    }
    let mut ws = match client::websocket(socket, &path).await {
        Ok(ws) => ws,
        Err(e) if json => return fail_json(e),
        Err(e) => return fail(e),
    };
    loop {
        tokio::select! {
            m = ws.next() => match m {
                Some(Ok(Message::Text(t))) => {
                    if json {
                        let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
                        say_json(&envelope(&v));
                    } else {
                        let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
                        let mut rest = v.as_object().cloned().unwrap_or_default();
                        for k in ["seq", "at", "session", "type"] {
                            rest.remove(k);
                        }
                        say!("{:>6} {} {:<16} {:<14} {}", v["seq"], v["at"].as_str().unwrap_or(""),
                            v["session"].as_str().unwrap_or(""), v["type"].as_str().unwrap_or(""), Value::Object(rest));
                    }
                }
                Some(Ok(Message::Close(_))) | None => return ExitCode::SUCCESS,
                Some(Ok(_)) => {}
                Some(Err(e)) => { warn_line!("bmx visor: {e}"); return ExitCode::from(1) }
            },
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
        }
    }
}

async fn serve(home: PathBuf, socket: PathBuf, confirm: Vec<PathBuf>) -> ExitCode {
    let stop = async {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => std::future::pending::<()>().await,
        }
    };
    // The state dir (`visor`, or `visor-<hash>` for another --home):
    // marked running once the socket accepts, stopped when dropped.
    let state = bmx::runner::claims::claim_visor(&home, &socket);
    let served = bmx::visor::serve(home, socket, confirm, stop).await;
    drop(state);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            warn_line!("bmx visor: {e}");
            ExitCode::from(1)
        }
    }
}

/// Stdin on a thread of its own (a blocking read in tokio's pool would
/// hold the runtime at exit); it polls so it notices `stop`.
fn stdin_reader(
    tx: tokio::sync::mpsc::Sender<Vec<u8>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    use std::os::fd::AsRawFd;
    std::thread::spawn(move || {
        let fd = std::io::stdin().as_raw_fd();
        let mut buf = [0u8; 4096];
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut p, 1, 100) };
            if r <= 0 {
                if r < 0
                    && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
                {
                    break;
                }
                continue;
            }
            // SAFETY: reads into our buffer, at most its length.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 || tx.blocking_send(buf[..n as usize].to_vec()).is_err() {
                break;
            }
        }
    })
}

/// `bmx visor attach`: snapshot and output to stdout, keys (after taking
/// the writer lease) to the session; Ctrl-P Ctrl-Q detaches.
async fn attach(socket: &std::path::Path, session: &str) -> ExitCode {
    use futures_util::SinkExt;
    use std::io::Write;
    let path = format!("/v1/sessions/{}/attach", enc(session));
    let mut ws = match client::websocket(socket, &path).await {
        Ok(ws) => ws,
        Err(e) => return fail(e),
    };
    let control = json!({"type": "control"}).to_string();
    if ws.send(Message::Text(control.into())).await.is_err() {
        warn_line!("bmx visor: the visor closed the stream");
        return ExitCode::from(1);
    }
    if let Some((cols, rows)) = tty_size() {
        let r = json!({"type": "resize", "cols": cols, "rows": rows}).to_string();
        let _ = ws.send(Message::Text(r.into())).await;
    }
    let raw = RawMode::enter();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = stdin_reader(tx, stop.clone());
    let mut detach = super::attach::DetachMatcher::new(vec![0x10, 0x11]);
    let mut code = ExitCode::SUCCESS;
    let mut note = String::new();
    loop {
        tokio::select! {
            m = ws.next() => match m {
                Some(Ok(Message::Binary(b))) if b.len() >= 9 => {
                    let mut out = std::io::stdout();
                    let _ = out.write_all(&b[9..]);
                    let _ = out.flush();
                }
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
                    match v["type"].as_str() {
                        Some("ended") => {
                            note = format!("session ended ({})", v["reason"].as_str().unwrap_or(""));
                            let c = v["exitCode"].as_i64().unwrap_or(0).clamp(0, 255) as u8;
                            code = ExitCode::from(c);
                            break;
                        }
                        Some("lease") if v["holder"] == "other" => {
                            note = "another client took the writer lease".into();
                        }
                        Some("error") => note = format!("{}: {}", v["code"].as_str().unwrap_or(""), v["message"].as_str().unwrap_or("")),
                        _ => {}
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                    note = "the visor closed the stream".into();
                    code = ExitCode::from(1);
                    break;
                }
                Some(Ok(_)) => {}
            },
            keys = rx.recv() => {
                let Some(keys) = keys else { break };
                let (send, detached) = detach.feed(&keys);
                if !send.is_empty() {
                    let f = bmx::terminal::frame::frame(bmx::terminal::frame::OP_INPUT, 0, &send);
                    if ws.send(Message::Binary(f)).await.is_err() {
                        break;
                    }
                }
                if detached {
                    note = "detached".into();
                    break;
                }
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = reader.join();
    drop(raw);
    let _ = ws.close(None).await;
    if !note.is_empty() {
        eprint!("\r\n");
        warn_line!("bmx visor: {note}");
    }
    code
}
