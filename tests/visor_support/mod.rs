//! A real `bmx visor` on a temporary home, and plain clients of its
//! socket: hand-written HTTP/1.1 requests and tokio-tungstenite WebSockets
//! over `tokio::net::UnixStream`.
#![allow(dead_code)]

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::Message;

pub const WAIT: Duration = Duration::from_secs(30);

pub struct Visor {
    pub home: tempfile::TempDir,
    pub child: Option<Child>,
}

impl Visor {
    pub fn start() -> Visor {
        Visor::start_with(&["--no-executor-confirm"])
    }

    /// A visor with these daemon flags (`start` watches no executor).
    pub fn start_with(flags: &[&str]) -> Visor {
        let home = tempfile::tempdir().unwrap();
        let child = spawn_with(home.path(), flags);
        let v = Visor {
            home,
            child: Some(child),
        };
        let deadline = Instant::now() + WAIT;
        while std::os::unix::net::UnixStream::connect(v.socket()).is_err() {
            assert!(Instant::now() < deadline, "the visor did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        v
    }

    /// Start the visor again on the same home (stopping it first if it
    /// runs) and wait for its socket.
    pub fn restart(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
        self.child = Some(spawn(self.home.path()));
        let deadline = Instant::now() + WAIT;
        while std::os::unix::net::UnixStream::connect(self.socket()).is_err() {
            assert!(Instant::now() < deadline, "the visor did not come up again");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.home.path().join("visor.sock")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub async fn req(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        http(
            &self.socket(),
            method,
            path,
            body.map(|b| b.to_string()).as_deref(),
        )
        .await
    }

    pub async fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, v) = self.req(method, path, body).await;
        assert!(status < 300, "{method} {path}: {status} {v}");
        v
    }

    pub async fn start_pty(&self, command: &[&str], extra: Value) -> String {
        let mut body = json!({"kind": "pty", "command": command, "workingDir": "/tmp"});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        let v = self.ok("POST", "/v1/sessions", Some(body)).await;
        v["id"].as_str().unwrap().to_owned()
    }

    pub async fn session(&self, id: &str) -> Value {
        self.ok("GET", &format!("/v1/sessions/{id}"), None).await
    }

    pub async fn keys(&self, id: &str, text: &str) {
        let data = base64_simd::STANDARD.encode_to_string(text.as_bytes());
        self.ok(
            "POST",
            &format!("/v1/sessions/{id}/keys"),
            Some(json!({"data": data})),
        )
        .await;
    }

    pub async fn screen_text(&self, id: &str) -> String {
        let v = self
            .ok("GET", &format!("/v1/sessions/{id}/screen"), None)
            .await;
        v["lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap().trim_end().to_owned())
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub async fn output(&self, id: &str) -> String {
        let v = self
            .ok("GET", &format!("/v1/sessions/{id}/output"), None)
            .await;
        v["text"].as_str().unwrap().to_owned()
    }

    pub async fn ws(&self, path: &str) -> Ws {
        let s = UnixStream::connect(self.socket()).await.unwrap();
        let (ws, _) = tokio_tungstenite::client_async(format!("ws://visor{path}"), s)
            .await
            .unwrap();
        ws
    }

    /// Poll `GET` until `cond` holds on the JSON.
    pub async fn until(&self, path: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let (_, v) = self.req("GET", path, None).await;
            if cond(&v) {
                return v;
            }
            assert!(Instant::now() < deadline, "{what}: not reached; last {v}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Visor {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
    }
}

pub fn spawn(home: &Path) -> Child {
    spawn_with(home, &["--no-executor-confirm"])
}

pub fn spawn_with(home: &Path, flags: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_bmx"))
        .arg("visor")
        .args(flags)
        .arg("--home")
        .arg(home)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// One HTTP/1.1 request, written by hand, `Connection: close`.
pub async fn http(socket: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let mut s = UnixStream::connect(socket).await.unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: visor\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // A server may answer and close before reading a refused body whole.
    let _ = s.write_all(req.as_bytes()).await;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 << 10];
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut chunk))
            .await
            .expect("response in time")
        {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response head");
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut r = rest;
        loop {
            let (size, tail) = r.split_once("\r\n").unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            r = &tail[n + 2..];
        }
        out
    } else {
        rest.to_owned()
    };
    let v = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&body).unwrap_or(Value::String(body))
    };
    (status, v)
}

pub type Ws = tokio_tungstenite::WebSocketStream<UnixStream>;

/// The next text frame as JSON (binary frames skipped), within the wait.
pub async fn next_json(ws: &mut Ws) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => return serde_json::from_str(&t).unwrap(),
            Ok(Some(Ok(_))) => {}
            other => panic!("no text frame: {other:?}"),
        }
    }
}

/// Read frames until a text frame satisfies `cond`; binary payloads are
/// appended to `out` (data after the 9-byte header).
pub async fn until_json(
    ws: &mut Ws,
    out: &mut Vec<u8>,
    what: &str,
    cond: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => {
                let v: Value = serde_json::from_str(&t).unwrap();
                if cond(&v) {
                    return v;
                }
            }
            Ok(Some(Ok(Message::Binary(b)))) => out.extend_from_slice(&b[9.min(b.len())..]),
            Ok(Some(Ok(_))) => {}
            other => panic!("{what}: not seen ({other:?})"),
        }
    }
}

/// Read binary frames until their data contains `needle`.
pub async fn until_output(ws: &mut Ws, out: &mut Vec<u8>, needle: &str) {
    let deadline = Instant::now() + WAIT;
    while !String::from_utf8_lossy(out).contains(needle) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => out.extend_from_slice(&b[9.min(b.len())..]),
            Ok(Some(Ok(_))) => {}
            other => panic!(
                "{needle:?} not seen ({other:?}); got {:?}",
                String::from_utf8_lossy(out)
            ),
        }
    }
}

pub async fn send_json(ws: &mut Ws, v: Value) {
    ws.send(Message::Text(v.to_string().into())).await.unwrap();
}

/// Pids of live processes whose environment has `BMX_VISOR_SESSION=id`.
pub fn session_pids(id: &str) -> Vec<i32> {
    let needle = format!("BMX_VISOR_SESSION={id}");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        if !zombie && env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) {
            out.push(pid);
        }
    }
    out
}

pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not reached");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The offline ACP test agent (tests/peers/agent, on the official SDK).
pub fn agent_argv() -> Vec<String> {
    vec![
        "node".into(),
        format!(
            "{}/tests/peers/agent/test-agent.mjs",
            env!("CARGO_MANIFEST_DIR")
        ),
    ]
}

impl Visor {
    /// Start a wire session with the test agent in `dir` (the agent keeps
    /// its sessions there); its id.
    pub async fn start_wire(&self, dir: &Path, extra: Value) -> String {
        let mut body = json!({"kind": "wire", "command": agent_argv(), "workingDir": dir.display().to_string()});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        let v = self.ok("POST", "/v1/sessions", Some(body)).await;
        v["id"].as_str().unwrap().to_owned()
    }

    /// Wait for the session's state.
    pub async fn until_state(&self, id: &str, state: &str) -> Value {
        self.until(&format!("/v1/sessions/{id}"), state, |s| {
            s["state"] == state
        })
        .await
    }

    /// `send` text; the delivery.
    pub async fn send(&self, id: &str, text: &str) -> String {
        let v = self
            .ok(
                "POST",
                &format!("/v1/sessions/{id}/send"),
                Some(json!({"text": text})),
            )
            .await;
        v["delivery"].as_str().unwrap().to_owned()
    }
}

/// Events from a stream until one satisfies `cond` (all of them, in order,
/// that one last).
pub async fn events_until(ws: &mut Ws, what: &str, cond: impl Fn(&Value) -> bool) -> Vec<Value> {
    let mut out = Vec::new();
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => serde_json::from_str::<Value>(&t).unwrap(),
            Ok(Some(Ok(_))) => continue,
            other => panic!("{what}: not seen ({other:?}); got {out:?}"),
        };
        let done = cond(&e);
        out.push(e);
        if done {
            return out;
        }
    }
}

/// `git -C dir args…` (an author set, no signing); its stdout. Panics
/// with git's stderr when it fails.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "commit.gpgsign=false"])
        .args(args)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@example.com")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@example.com")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A git repository with one commit on `main`.
pub fn repo() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    git(d.path(), &["init", "-q", "-b", "main"]);
    std::fs::write(d.path().join("README"), "hi\n").unwrap();
    git(d.path(), &["add", "README"]);
    git(d.path(), &["commit", "-q", "-m", "first"]);
    d
}

/// `bmx visor --home HOME ARGS…` with `stdin` written to it; its output.
pub fn cli(home: &Path, args: &[&str], stdin: &str) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["visor", "--no-executor-confirm", "--home"])
        .arg(home)
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let _ = input.write_all(stdin.as_bytes());
    drop(input);
    child.wait_with_output().unwrap()
}
