//! `bmx attach`: a local terminal on an executor's terminal, through the
//! harness relay (docs/terminals.md, "`bmx attach`").
//!
//! Without a terminal id it opens a new terminal (the local tty's size);
//! with one it re-attaches and replays the retained scrollback. The local
//! tty is in raw mode while attached, so every key (Ctrl-C, Ctrl-D, ...)
//! reaches the remote program; only the detach sequence (Ctrl-P Ctrl-Q by
//! default) is kept, and it leaves the terminal running.

use super::text::warn_line;
use bmx::client::{ApiClient, AttachOptions, ClientError, TerminalSocket};
use bmx::harness::http::relay::close;
use bmx::terminal::frame::{self, OP_INPUT, OP_OUTPUT, OP_SNAPSHOT};
use clap::Args;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

/// Attach the local terminal to a terminal on an executor (a new one unless
/// TERMINAL_ID is given). Detach with the detach keys (default Ctrl-P
/// Ctrl-Q); the terminal keeps running. When the program ends, bmx attach
/// exits with its status.
#[derive(Debug, Args)]
pub struct AttachArgs {
    /// The harness API.
    #[arg(long, env = "BMX_HARNESS", default_value = "http://127.0.0.1:7070")]
    pub harness: String,
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// The executor (default: the only one connected).
    #[arg(long)]
    pub executor: Option<String>,
    /// Key sequence that detaches: comma-separated `ctrl-<key>` or single
    /// characters, as docker's. An empty string disables detaching.
    #[arg(long, env = "BMX_DETACH_KEYS", default_value = "ctrl-p,ctrl-q")]
    pub detach_keys: String,
    /// Watch without typing (do not take the writer role).
    #[arg(long)]
    pub read_only: bool,
    /// Working directory of a new terminal.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Re-attach to this terminal (default: open a new one).
    pub terminal_id: Option<String>,
    /// Program of a new terminal (default: the executor's login shell).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Parse `ctrl-p,ctrl-q` style keys into bytes.
pub fn parse_detach_keys(spec: &str) -> Result<Vec<u8>, String> {
    if spec.trim().is_empty() {
        return Ok(Vec::new());
    }
    spec.split(',')
        .map(|k| {
            let k = k.trim();
            let lower = k.to_ascii_lowercase();
            if let Some(c) = lower.strip_prefix("ctrl-") {
                let c = c.as_bytes();
                match c {
                    [c @ b'a'..=b'z'] => Ok(c - b'a' + 1),
                    [b'@'] => Ok(0),
                    [b'['] => Ok(27),
                    [b'\\'] => Ok(28),
                    [b']'] => Ok(29),
                    [b'^'] => Ok(30),
                    [b'_'] => Ok(31),
                    _ => Err(format!("bad detach key {k:?}")),
                }
            } else if k.len() == 1 && k.is_ascii() {
                Ok(k.as_bytes()[0])
            } else {
                Err(format!(
                    "bad detach key {k:?}: use ctrl-<key> or a single character"
                ))
            }
        })
        .collect()
}

/// Finds the detach sequence in typed bytes. Bytes that may start the
/// sequence are held back until the next key decides; when it does not
/// complete the sequence they are delivered (a lone Ctrl-P followed by
/// anything else reaches the program).
#[derive(Debug, Default)]
pub struct DetachMatcher {
    keys: Vec<u8>,
    held: Vec<u8>,
}

impl DetachMatcher {
    pub fn new(keys: Vec<u8>) -> Self {
        DetachMatcher {
            keys,
            held: Vec::new(),
        }
    }

    /// The bytes to send now, and whether the sequence completed (bytes
    /// typed after it in the same read are dropped).
    pub fn feed(&mut self, input: &[u8]) -> (Vec<u8>, bool) {
        let mut out = Vec::with_capacity(input.len());
        if self.keys.is_empty() {
            out.extend_from_slice(input);
            return (out, false);
        }
        for &b in input {
            self.held.push(b);
            while !self.keys.starts_with(&self.held) {
                out.push(self.held.remove(0));
            }
            if self.held == self.keys {
                self.held.clear();
                return (out, true);
            }
        }
        (out, false)
    }
}

/// The local tty in raw mode; restored when dropped (every exit path,
/// including errors and panics that unwind).
pub(super) struct RawMode {
    saved: nix::sys::termios::Termios,
}

impl RawMode {
    pub(super) fn enter() -> Option<RawMode> {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let saved = tcgetattr(&stdin).ok()?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(&stdin, SetArg::TCSANOW, &raw).ok()?;
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        use nix::sys::termios::{tcsetattr, SetArg};
        let _ = tcsetattr(std::io::stdin(), SetArg::TCSANOW, &self.saved);
    }
}

/// The local tty's size (stdin, stdout or stderr, whichever is a tty).
pub(super) fn tty_size() -> Option<(u16, u16)> {
    for fd in [0, 1, 2] {
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes a winsize into the pointer we pass.
        let r = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
        if r == 0 && ws.ws_col > 0 && ws.ws_row > 0 {
            return Some((ws.ws_col, ws.ws_row));
        }
    }
    None
}

/// Reads stdin on a thread of its own (a blocking read in tokio's pool
/// would keep the runtime from shutting down), polling so it can stop
/// before the tty is restored.
struct StdinReader {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StdinReader {
    fn start(tx: mpsc::Sender<Vec<u8>>) -> StdinReader {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let fd = std::io::stdin().as_raw_fd();
            let mut buf = [0u8; 4096];
            while !flag.load(Ordering::Relaxed) {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                let r = unsafe { libc::poll(&mut p, 1, 100) };
                if r < 0 {
                    if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    break;
                }
                if r == 0 {
                    continue;
                }
                // SAFETY: reads into our buffer, at most its length.
                let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 {
                    if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    break;
                }
                if n == 0 || tx.blocking_send(buf[..n as usize].to_vec()).is_err() {
                    break;
                }
            }
        });
        StdinReader {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for StdinReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn api_error(v: &Value) -> String {
    match v.get("error") {
        Some(e) => {
            let mut s = e["message"].as_str().unwrap_or("error").to_owned();
            if let Some(r) = e["data"]["reason"].as_str() {
                s.push_str(&format!(" ({r})"));
            }
            s
        }
        None => v.to_string(),
    }
}

/// The executor to use: the one named, else the only one connected.
async fn pick_executor(client: &ApiClient, named: Option<String>) -> Result<String, String> {
    if let Some(e) = named {
        return Ok(e);
    }
    let (status, v) = client.executors().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(api_error(&v));
    }
    let ids: Vec<String> = v["executors"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["executorId"].as_str().map(str::to_owned))
        .collect();
    match ids.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err("no executor is connected".into()),
        many => Err(format!(
            "{} executors are connected ({}): choose one with --executor",
            many.len(),
            many.join(", ")
        )),
    }
}

/// How an attach ended.
#[derive(Debug, PartialEq)]
enum End {
    Detached,
    Exited(i32),
    Closed,
    Lost(String),
    Signal(i32),
}

fn out(bytes: &[u8]) -> bool {
    let mut o = std::io::stdout().lock();
    o.write_all(bytes).and_then(|_| o.flush()).is_ok()
}

fn end_of_close(frame: Option<&tokio_tungstenite::tungstenite::protocol::CloseFrame>) -> End {
    let Some(f) = frame else {
        return End::Lost("the harness closed the connection".into());
    };
    let code = u16::from(f.code);
    let reason = f.reason.as_str();
    match code {
        close::EXITED => match reason.strip_prefix("exited ").and_then(|c| c.parse().ok()) {
            Some(c) => End::Exited(c),
            None => End::Lost(format!("closed: {reason}")),
        },
        close::TERMINAL_CLOSED => End::Closed,
        _ => End::Lost(format!("closed with {code}: {reason}")),
    }
}

pub async fn run(args: AttachArgs) -> ExitCode {
    let keys = match parse_detach_keys(&args.detach_keys) {
        Ok(k) => k,
        Err(e) => {
            warn_line!("bmx attach: {e}");
            return ExitCode::from(2);
        }
    };
    if args.terminal_id.is_some() && !args.command.is_empty() {
        warn_line!("bmx attach: a command only applies to a new terminal (no TERMINAL_ID)");
        return ExitCode::from(2);
    }
    let client = match ApiClient::new(&args.harness) {
        Ok(c) => c
            .token(args.api_token.clone())
            .timeout(Duration::from_secs(60)),
        Err(e) => {
            warn_line!("bmx attach: {e}");
            return ExitCode::from(2);
        }
    };
    let executor = match pick_executor(&client, args.executor.clone()).await {
        Ok(e) => e,
        Err(e) => {
            warn_line!("bmx attach: {}: {e}", args.harness);
            return ExitCode::from(1);
        }
    };
    let (cols, rows) = tty_size().unwrap_or((80, 24));
    let (terminal_id, reattach) = match &args.terminal_id {
        Some(t) => (t.clone(), true),
        None => {
            let mut body = json!({"cols": cols, "rows": rows});
            if !args.command.is_empty() {
                body["argv"] = json!(args.command);
            }
            if let Some(c) = &args.cwd {
                body["cwd"] = json!(c);
            }
            match client.open_terminal(&executor, &body).await {
                Ok((200, v)) => (
                    v["terminalId"].as_str().unwrap_or_default().to_owned(),
                    false,
                ),
                Ok((_, v)) => {
                    warn_line!("bmx attach: cannot open a terminal: {}", api_error(&v));
                    return ExitCode::from(1);
                }
                Err(e) => {
                    warn_line!("bmx attach: {}: {e}", args.harness);
                    return ExitCode::from(1);
                }
            }
        }
    };
    let opts = AttachOptions {
        from_seq: None,
        write: !args.read_only,
        stream_id: None,
    };
    let ws = match client.attach_terminal(&executor, &terminal_id, &opts).await {
        Ok(ws) => ws,
        Err(ClientError::Refused { body, .. }) => {
            warn_line!(
                "bmx attach: cannot attach to {terminal_id:?}: {}",
                api_error(&body)
            );
            return ExitCode::from(1);
        }
        Err(e) => {
            warn_line!("bmx attach: {e}");
            return ExitCode::from(1);
        }
    };
    let end = {
        let raw = RawMode::enter();
        if reattach && raw.is_some() {
            // The replay redraws from the oldest retained output.
            out(b"\x1b[H\x1b[2J");
        }
        let end = session(ws, DetachMatcher::new(keys), &args).await;
        drop(raw);
        end
    };
    let again = format!("bmx attach --executor {executor} {terminal_id}");
    match end {
        End::Detached => {
            eprint!("\r\n");
            warn_line!("bmx attach: detached from terminal {terminal_id} (still running); re-attach with: {again}");
            ExitCode::SUCCESS
        }
        End::Exited(c) => ExitCode::from((c & 0xff) as u8),
        End::Closed => {
            eprint!("\r\n");
            warn_line!("bmx attach: terminal {terminal_id} was closed");
            ExitCode::from(1)
        }
        End::Signal(s) => {
            eprint!("\r\n");
            warn_line!("bmx attach: signal {s}: detached; terminal {terminal_id} keeps running; re-attach with: {again}");
            ExitCode::from((128 + s).clamp(0, 255) as u8)
        }
        End::Lost(why) => {
            eprint!("\r\n");
            warn_line!("bmx attach: {why}; re-attach with: {again}");
            ExitCode::from(1)
        }
    }
}

/// Pump until the program ends, the user detaches or the connection goes.
async fn session(mut ws: TerminalSocket, mut detach: DetachMatcher, args: &AttachArgs) -> End {
    use tokio::signal::unix::{signal, SignalKind};
    let (tx, mut typed) = mpsc::channel::<Vec<u8>>(64);
    let _reader = StdinReader::start(tx);
    let (Ok(mut winch), Ok(mut term), Ok(mut hup), Ok(mut int)) = (
        signal(SignalKind::window_change()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
        signal(SignalKind::interrupt()),
    ) else {
        return End::Lost("cannot install signal handlers".into());
    };
    let write = !args.read_only;
    let resize = || {
        tty_size().map(|(c, r)| {
            Message::text(json!({"type": "resize", "cols": c, "rows": r}).to_string())
        })
    };
    // A re-attached terminal may have another size than this tty.
    if write {
        if let Some(m) = resize() {
            if ws.send(m).await.is_err() {
                return End::Lost("the connection closed".into());
            }
        }
    }
    let mut last_seq = 0u64;
    let mut stdin_open = true;
    let mut told_read_only = false;
    loop {
        tokio::select! {
            m = ws.next() => match m {
                Some(Ok(Message::Binary(b))) => match frame::parse(&b) {
                    // Duplicates (seq already shown) fall through to `_`.
                    Some((OP_SNAPSHOT, seq, data)) if data.is_empty() && seq > last_seq => {
                        last_seq = seq;
                        out(b"\x1b[0m\r\n[bmx attach: some earlier output was lost]\r\n");
                    }
                    Some((OP_OUTPUT | OP_SNAPSHOT, seq, data)) if seq > last_seq && !data.is_empty() => {
                        last_seq = seq;
                        if !out(&data) {
                            return End::Lost("cannot write to stdout".into());
                        }
                    }
                    _ => {}
                },
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                    let read_only = (v["type"] == "attached" && v["writer"] == false && write)
                        || (v["type"] == "error" && v["reason"] == "not_writer");
                    if read_only && !told_read_only {
                        told_read_only = true;
                        eprint!("\r\n[bmx attach: another viewer holds the writer role; typing is ignored]\r\n");
                    } else if v["type"] == "error" && v["reason"] != "not_writer" {
                        tracing::debug!(notice = %v, "relay notice");
                    }
                }
                Some(Ok(Message::Close(f))) => return end_of_close(f.as_ref()),
                None => return End::Lost("the connection closed".into()),
                Some(Err(e)) => return End::Lost(format!("connection error: {e}")),
                Some(Ok(_)) => {}
            },
            bytes = typed.recv(), if stdin_open => match bytes {
                Some(bytes) => {
                    let (send, detached) = detach.feed(&bytes);
                    if !send.is_empty() && write {
                        let f = frame::frame(OP_INPUT, 0, &send);
                        if ws.send(Message::Binary(f)).await.is_err() {
                            return End::Lost("the connection closed".into());
                        }
                    }
                    if detached {
                        let _ = ws.close(None).await;
                        return End::Detached;
                    }
                }
                None => stdin_open = false,
            },
            _ = winch.recv() => {
                if write {
                    if let Some(m) = resize() {
                        let _ = ws.send(m).await;
                    }
                }
            }
            _ = term.recv() => { let _ = ws.close(None).await; return End::Signal(libc::SIGTERM) }
            _ = hup.recv() => { let _ = ws.close(None).await; return End::Signal(libc::SIGHUP) }
            _ = int.recv() => { let _ = ws.close(None).await; return End::Signal(libc::SIGINT) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detach_keys_parse() {
        assert_eq!(parse_detach_keys("ctrl-p,ctrl-q").unwrap(), vec![16, 17]);
        assert_eq!(parse_detach_keys("ctrl-[, x").unwrap(), vec![27, b'x']);
        assert_eq!(parse_detach_keys("").unwrap(), Vec::<u8>::new());
        assert!(parse_detach_keys("ctrl-").is_err());
        assert!(parse_detach_keys("alt-x").is_err());
    }

    #[test]
    fn a_lone_prefix_is_delivered() {
        let mut m = DetachMatcher::new(vec![16, 17]);
        assert_eq!(m.feed(b"ab"), (b"ab".to_vec(), false));
        // Ctrl-P alone is held until the next key decides.
        assert_eq!(m.feed(&[16]), (vec![], false));
        assert_eq!(m.feed(b"x"), (vec![16, b'x'], false));
        // Ctrl-P Ctrl-P Ctrl-Q: the first Ctrl-P is delivered, then detach.
        assert_eq!(m.feed(&[16, 16, 17, b'z']), (vec![16], true));
        // Split across reads.
        assert_eq!(m.feed(&[b'a', 16]), (vec![b'a'], false));
        assert_eq!(m.feed(&[17]), (vec![], true));
    }

    #[test]
    fn overlapping_sequences_are_found() {
        let mut m = DetachMatcher::new(b"aab".to_vec());
        assert_eq!(m.feed(b"xaaab"), (b"xa".to_vec(), true));
        let mut none = DetachMatcher::new(Vec::new());
        assert_eq!(none.feed(&[16, 17]), (vec![16, 17], false));
    }

    #[test]
    fn close_frames_tell_the_end() {
        use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
        use tokio_tungstenite::tungstenite::protocol::CloseFrame;
        let f = |code: u16, reason: &str| CloseFrame {
            code: CloseCode::from(code),
            reason: reason.to_owned().into(),
        };
        assert_eq!(end_of_close(Some(&f(1000, "exited 3"))), End::Exited(3));
        assert_eq!(end_of_close(Some(&f(4100, "terminal closed"))), End::Closed);
        assert!(matches!(end_of_close(Some(&f(4102, "x"))), End::Lost(_)));
        assert!(matches!(end_of_close(None), End::Lost(_)));
    }
}
