//! Shared by the runner tests: real `bmx` binaries, killed on drop.
#![allow(dead_code)]

pub mod schema;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BMX: &str = env!("CARGO_BIN_EXE_bmx");
/// Generous: the machine is shared and loaded.
pub const WAIT: Duration = Duration::from_secs(60);

/// A child process killed (and reaped) on drop.
pub struct Proc(pub Option<Child>);

impl Proc {
    pub fn pid(&self) -> u32 {
        self.0.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("running")
    }

    /// Wait for the exit (within WAIT), returning its status code.
    pub fn wait_exit(&mut self) -> Option<i32> {
        let started = Instant::now();
        loop {
            if let Some(s) = self.child().try_wait().unwrap() {
                self.0 = None;
                return s.code();
            }
            assert!(started.elapsed() < WAIT, "the process did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child().try_wait(), Ok(None))
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn term(&mut self) -> Option<i32> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        self.wait_exit()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A harness on a free port with executor credential `exec-1=s3cret`.
pub struct TestHarness {
    pub proc: Proc,
    pub api: String,
    pub ws: String,
    /// Its `--data-dir` (never the user's home).
    pub data: tempfile::TempDir,
}

pub fn harness(extra: &[&str]) -> TestHarness {
    let data = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(BMX);
    cmd.arg("--log-format=text")
        .arg("harness")
        .arg("--data-dir")
        .arg(data.path());
    cmd.args(["--listen", "127.0.0.1:0", "--token", "exec-1=s3cret"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc(Some(child));
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    // "bmx harness: API http://127.0.0.1:PORT/v1, executors connect to ws://..."
    let api = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no API url in {line:?}"))
        .trim_end_matches(',')
        .trim_end_matches("/v1")
        .to_owned();
    let ws = line
        .split_whitespace()
        .find(|w| w.starts_with("ws://"))
        .unwrap_or_else(|| panic!("no ws url in {line:?}"))
        .to_owned();
    TestHarness {
        proc,
        api,
        ws,
        data,
    }
}

impl TestHarness {
    /// `bmx ps --json`'s executors (raw API JSON).
    pub fn executors(&self) -> Vec<serde_json::Value> {
        let out = Command::new(BMX)
            .args(["ps", "--harness", &self.api, "--json"])
            .output()
            .unwrap();
        let v: serde_json::Value = match serde_json::from_slice(&out.stdout) {
            Ok(v) => v,
            Err(_) => return Vec::new(),
        };
        let list = if v.get("schema_version").is_some() {
            v["data"]["executors"].clone()
        } else {
            v["executors"].clone()
        };
        list.as_array().cloned().unwrap_or_default()
    }

    pub fn wait_registered(&self, id: &str) {
        eventually(&format!("executor {id} registered"), || {
            self.executors().iter().any(|e| e["executorId"] == id)
        });
    }
}

/// Start `bmx executor` against `h` with `args` appended.
pub fn executor(h: &TestHarness, args: &[&str], stderr_to: Option<&Path>) -> Proc {
    let mut cmd = Command::new(BMX);
    cmd.args(["executor", "--url", &h.ws, "--token", "s3cret"])
        .args(args)
        .env("RUST_LOG", "info")
        // State dirs of bound executors stay out of the user's home.
        .env("BMX_HOME", h.data.path().join("home"))
        .stdout(Stdio::null());
    match stderr_to {
        Some(p) => cmd.stderr(std::fs::File::create(p).unwrap()),
        None => cmd.stderr(Stdio::null()),
    };
    Proc(Some(cmd.spawn().unwrap()))
}

pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not reached in {WAIT:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
