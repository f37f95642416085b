//! Device enrollment end to end through the real binaries: `bmx enroll`,
//! `bmx enrollments approve|deny`, `bmx executor --harness` with the
//! stored credential, a harness restart on the same `--data-dir`, and
//! `bmx credentials revoke` (4001: the executor stops, exit 4, and the
//! next connect is refused).

use crate::runner_common;
use runner_common::*;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Env {
    home: tempfile::TempDir,
    data: tempfile::TempDir,
    ws: tempfile::TempDir,
    port: u16,
}

impl Env {
    fn new() -> Env {
        Env {
            home: tempfile::tempdir().unwrap(),
            data: tempfile::tempdir().unwrap(),
            ws: tempfile::tempdir().unwrap(),
            port: free_port(),
        }
    }

    fn api(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn bmx(&self) -> Command {
        let mut c = Command::new(BMX);
        c.env("BMX_HOME", self.home.path()).env("RUST_LOG", "warn");
        c
    }

    /// A harness with no static token at all: only enrolled executors.
    fn harness(&self, ttl_secs: u64, log: &Path) -> Proc {
        let mut c = self.bmx();
        c.args(["harness", "--listen", &format!("127.0.0.1:{}", self.port)])
            .arg("--data-dir")
            .arg(self.data.path())
            .args([
                "--enrollment-poll-ms",
                "100",
                "--enrollment-ttl-secs",
                &ttl_secs.to_string(),
            ])
            .env("RUST_LOG", "trace")
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            );
        let p = Proc(Some(c.spawn().unwrap()));
        eventually("the harness answers", || {
            self.bmx()
                .args(["enrollments", "ls", "--harness", &self.api()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap()
                .success()
        });
        p
    }

    /// Start `bmx enroll`; returns it and the user code it printed.
    fn enroll(&self, extra: &[&str]) -> (Proc, String, bool) {
        let mut c = self.bmx();
        c.args(["enroll", "--harness", &self.api(), "--workspace"])
            .arg(self.ws.path())
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = c.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let p = Proc(Some(child));
        let mut lines = BufReader::new(out).lines();
        while let Some(Ok(line)) = lines.next() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                // Keep reading in the background so the pipe stays open.
                std::thread::spawn(move || for _ in lines.by_ref() {});
                return (
                    p,
                    v["userCode"].as_str().unwrap().to_owned(),
                    v["resumed"].as_bool().unwrap(),
                );
            }
        }
        panic!("bmx enroll printed no user code");
    }

    fn decide(&self, verb: &str, code: &str) -> std::process::Output {
        run(self
            .bmx()
            .args(["enrollments", verb, code, "--harness", &self.api()]))
    }

    fn cred_file(&self) -> std::path::PathBuf {
        self.home
            .path()
            .join(format!("credentials/127.0.0.1_{}.json", self.port))
    }

    fn creds(&self) -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(self.cred_file()).unwrap()).unwrap()
    }

    fn ws_key(&self) -> String {
        std::fs::canonicalize(self.ws.path())
            .unwrap()
            .to_string_lossy()
            .into_owned()
    }

    fn executor(&self, log: &Path) -> Proc {
        let mut c = self.bmx();
        c.args(["executor", "--harness", &self.api(), "--workspace"])
            .arg(self.ws.path())
            .env("RUST_LOG", "trace")
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            );
        Proc(Some(c.spawn().unwrap()))
    }

    fn executors(&self) -> Vec<serde_json::Value> {
        let out = run(self.bmx().args(["ps", "--harness", &self.api(), "--json"]));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let list = if v.get("schema_version").is_some() {
            v["data"]["executors"].clone()
        } else {
            v["executors"].clone()
        };
        list.as_array().cloned().unwrap_or_default()
    }
}

#[test]
fn enroll_approve_connect_restart_revoke() {
    let env = Env::new();
    let logs = tempfile::tempdir().unwrap();
    let hlog = logs.path().join("harness.log");
    let xlog = logs.path().join("executor.log");
    let mut harness = env.harness(600, &hlog);
    let (mut enroll, code, resumed) = env.enroll(&["--name", "laptop"]);
    assert!(!resumed);
    // Pending state is on disk before the approval: grab the device code.
    let device = env.creds()["pending"][env.ws_key()]["deviceCode"]
        .as_str()
        .unwrap()
        .to_owned();
    let ls = run(env
        .bmx()
        .args(["enrollments", "ls", "--json", "--harness", &env.api()]));
    assert!(text(&ls.stdout).contains(&code));
    assert!(
        !text(&ls.stdout).contains(&device),
        "the device code is secret"
    );
    let out = env.decide("approve", &code.to_lowercase());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(enroll.wait_exit(), Some(0));
    // Replayed approval: refused.
    assert!(!env.decide("approve", &code).status.success());

    let file = env.cred_file();
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(file.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    let cred = env.creds()["credentials"][env.ws_key()].clone();
    assert!(env.creds()["pending"].as_object().unwrap().is_empty());
    let token = cred["token"].as_str().unwrap().to_owned();
    let executor_id = cred["executorId"].as_str().unwrap().to_owned();
    let credential_id = cred["credentialId"].as_str().unwrap().to_owned();

    let mut exec = env.executor(&xlog);
    eventually("the enrolled executor registered", || {
        env.executors()
            .iter()
            .any(|e| e["executorId"] == executor_id.as_str())
    });
    // The harness restarts on the same data dir: the credential holds.
    assert_eq!(harness.term(), Some(0));
    let mut harness = env.harness(600, &hlog);
    eventually("the executor registered again after the restart", || {
        env.executors()
            .iter()
            .any(|e| e["executorId"] == executor_id.as_str())
    });
    assert!(exec.running());

    // Revoke: closed with 4001, the executor ends (4) and cannot come back.
    let out = run(env.bmx().args([
        "credentials",
        "revoke",
        &credential_id,
        "--harness",
        &env.api(),
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(exec.wait_exit(), Some(4));
    let mut again = env.executor(&xlog);
    assert_eq!(again.wait_exit(), Some(4));
    assert_eq!(harness.term(), Some(0));

    // Secrets never reach a log, even at trace.
    for log in [&hlog, &xlog] {
        let t = std::fs::read_to_string(log).unwrap();
        assert!(!t.is_empty());
        assert!(!t.contains(&token), "token in {}", log.display());
        assert!(!t.contains(&device), "device code in {}", log.display());
    }
}

#[test]
fn denial_expiry_resume_and_replace() {
    let env = Env::new();
    let logs = tempfile::tempdir().unwrap();
    let hlog = logs.path().join("harness.log");
    let mut harness = env.harness(600, &hlog);

    // Denied.
    let (mut e, code, _) = env.enroll(&[]);
    assert!(env.decide("deny", &code).status.success());
    assert_eq!(e.wait_exit(), Some(10));
    assert!(!env.decide("approve", &code).status.success());

    // Resume after the enrolling process is killed.
    let (mut e, code, resumed) = env.enroll(&[]);
    assert!(!resumed);
    e.kill9();
    let (mut e, code2, resumed) = env.enroll(&[]);
    assert!(resumed);
    assert_eq!(code, code2);
    // A harness that goes away mid-poll: the enroll waits it out.
    assert_eq!(harness.term(), Some(0));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut harness = env.harness(600, &hlog);
    assert!(e.running(), "the enroll survived the harness restart");
    assert!(env.decide("approve", &code).status.success());
    assert_eq!(e.wait_exit(), Some(0));

    // Already enrolled: refused without --replace.
    let out = run(env
        .bmx()
        .args(["enroll", "--harness", &env.api(), "--workspace"])
        .arg(env.ws.path()));
    assert_eq!(out.status.code(), Some(13), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("already has an active local credential"));

    // --replace starts a new one; a second --replace supersedes it.
    let (mut first, _, _) = env.enroll(&["--replace"]);
    let (mut second, code, resumed) = env.enroll(&["--replace"]);
    assert!(!resumed);
    assert_eq!(first.wait_exit(), Some(12));
    assert!(env.decide("approve", &code).status.success());
    assert_eq!(second.wait_exit(), Some(0));
    assert_eq!(harness.term(), Some(0));

    // Expiry (1 s TTL).
    let mut harness = env.harness(1, &hlog);
    let (mut e, code, _) = env.enroll(&["--replace"]);
    assert_eq!(e.wait_exit(), Some(11));
    assert!(!env.decide("approve", &code).status.success());
    assert_eq!(harness.term(), Some(0));
}
