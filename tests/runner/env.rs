//! `bmx env`, `bmx targets`, `bmx status`, `bmx ps --json` through the
//! real binary, with a temporary `BMX_HOME` (so parallel tests and the
//! user's own runtimes are never touched) and `--port 0`. Every JSON line
//! is validated against `docs/schemas/`; every process started under the
//! temporary home is killed when the test ends.

use crate::runner_common;
use runner_common::schema::{errors, line};
use runner_common::{eventually, harness, text, Proc, BMX};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// A temporary `BMX_HOME`; on drop, every process whose environment or
/// command line names it is killed (the daemons `bmx env start` leaves).
struct Home(tempfile::TempDir);

impl Home {
    fn new() -> Home {
        Home(tempfile::tempdir().unwrap())
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    fn bmx(&self) -> Command {
        let mut c = Command::new(BMX);
        c.env("BMX_HOME", self.path()).env("RUST_LOG", "warn");
        c
    }

    fn out(&self, args: &[&str]) -> Output {
        self.bmx().args(args).output().unwrap()
    }

    /// `bmx env VERB --json [extra]`, validated.
    fn env(&self, verb: &str, extra: &[&str]) -> Value {
        let mut args = vec!["env", verb, "--json"];
        args.extend_from_slice(extra);
        line(&self.out(&args), "environment-status")
    }

    fn state(&self, id: &str) -> PathBuf {
        self.path().join("state").join(id)
    }

    /// Live processes that name this home.
    fn processes(&self) -> Vec<u32> {
        processes_naming(self.path())
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        for pid in self.processes() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Processes (not zombies, not this one) whose environ or cmdline
/// contains `dir`.
fn processes_naming(dir: &Path) -> Vec<u32> {
    let needle = dir.as_os_str().as_encoded_bytes();
    let me = std::process::id();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        {
            continue;
        }
        let names = |f: &str| {
            std::fs::read(format!("/proc/{pid}/{f}"))
                .map(|b| b.windows(needle.len()).any(|w| w == needle))
                .unwrap_or(false)
        };
        if names("environ") || names("cmdline") {
            found.push(pid);
        }
    }
    found
}

fn alive(pid: u64) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    !stat.is_empty()
        && !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
}

/// `GET /v1/health` at `url` (`http://HOST:PORT`) answers 200.
fn healthy(url: &str) -> bool {
    let addr = url.trim_start_matches("http://");
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = write!(s, "GET /v1/health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut head = String::new();
    let _ = s.read_to_string(&mut head);
    head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")
}

fn signal(pid: u64, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap();
}

#[test]
fn the_schemas_reject_what_they_must() {
    let good = json!({"schema_version": 1, "ok": false,
        "error": {"code": "TARGET_NOT_FOUND", "message": "x"},
        "trace": {"request_id": "r", "source": "bmx"}});
    assert!(errors(None, &good).is_empty());
    let mut bad_code = good.clone();
    bad_code["error"]["code"] = json!("NOPE");
    assert!(!errors(None, &bad_code).is_empty());
    let ok_without_data = json!({"schema_version": 1, "ok": true,
        "trace": {"request_id": "r", "source": "bmx"}});
    assert!(!errors(None, &ok_without_data).is_empty());
    let both = json!({"schema_version": 1, "ok": false, "data": {},
        "error": {"code": "TARGET_NOT_FOUND", "message": "x"},
        "trace": {"request_id": "r", "source": "bmx"}});
    assert!(!errors(None, &both).is_empty());
    let wrong_data = json!({"schema_version": 1, "ok": true, "data": {"targets": [{"id": "BAD"}]},
        "trace": {"request_id": "r", "source": "bmx"}});
    assert!(errors(None, &wrong_data).is_empty());
    assert!(!errors(Some("targets"), &wrong_data).is_empty());
}

#[test]
fn start_status_diagnose_stop_round_trip() {
    let home = Home::new();

    let s = home.env("status", &[]);
    assert_eq!(s["ok"], true);
    assert_eq!(s["trace"]["target_id"], "local");
    assert_eq!(s["data"]["runtime"]["state"], "not_started");
    assert_eq!(s["data"]["runtime"]["failure_code"], "runtime_not_started");
    assert_eq!(s["data"]["target"]["status"], "not_configured");
    let d = home.env("diagnose", &[]);
    assert_eq!(
        d["data"]["diagnostics"]["failure_code"],
        "runtime_not_started"
    );

    // Stop when nothing runs: blocked, not an error.
    let s = home.env("stop", &[]);
    assert_eq!(s["ok"], true);
    let op = &s["data"]["operation"];
    assert_eq!(op["performed"], false);
    assert_eq!(op["availability"], "blocked");
    assert_eq!(op["reason_code"], "runtime_not_started");

    let s = home.env("start", &["--port", "0"]);
    assert_eq!(s["ok"], true, "{s}");
    assert_eq!(s["data"]["operation"]["performed"], true);
    let rt = &s["data"]["runtime"];
    assert_eq!(rt["state"], "running");
    assert_eq!(rt["ready"], true);
    let pid = rt["pid"].as_u64().unwrap();
    let url = rt["local_ui_url"].as_str().unwrap().to_owned();
    assert!(alive(pid), "the daemon {pid} is not running");
    assert!(healthy(&url), "{url} does not answer");
    assert_ne!(pid, u64::from(std::process::id()));
    // It is a daemon of its own: a session leader, started with our home.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let sid: u64 = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(3)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(sid, pid);
    assert!(home.processes().contains(&(pid as u32)));
    assert!(home.state("local").join("runtime.log").exists());

    // Twice: blocked, the same daemon keeps running.
    let again = home.env("start", &["--port", "0"]);
    assert_eq!(again["ok"], true);
    assert_eq!(again["data"]["operation"]["performed"], false);
    assert_eq!(
        again["data"]["operation"]["reason_code"],
        "runtime_already_running"
    );
    assert_eq!(again["data"]["runtime"]["pid"], pid);

    let d = home.env("diagnose", &[]);
    let diag = &d["data"]["diagnostics"];
    assert_eq!(diag["lock_held"], true);
    assert_eq!(diag["lock_pid"], pid);
    assert_eq!(diag["pid_alive"], true);
    assert_eq!(diag["socket_reachable"], true);
    assert!(diag.get("failure_code").is_none());
    assert_eq!(
        diag["control_socket_path"].as_str().unwrap(),
        url.trim_start_matches("http://")
    );

    let st = line(&home.out(&["status", "--json"]), "status");
    assert_eq!(st["data"]["runtime"]["state"], "running");
    assert_eq!(st["data"]["target_status"], "available");
    let human = home.out(&["status"]);
    assert!(human.status.success());
    assert!(
        text(&human.stdout).contains("running"),
        "{}",
        text(&human.stdout)
    );

    let ps = line(&home.out(&["ps", "--harness", &url, "--json"]), "ps");
    assert!(ps["data"]["executors"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["executorId"] == "local"));

    let t = line(&home.out(&["targets", "--json"]), "targets");
    let local = &t["data"]["targets"][0];
    assert_eq!(local["id"], "local");
    assert_eq!(local["status"], "available");
    assert_eq!(local["local_ui_url"], url.as_str());

    let s = home.env("stop", &[]);
    assert_eq!(s["ok"], true, "{s}");
    assert_eq!(s["data"]["operation"]["performed"], true);
    assert_eq!(s["data"]["runtime"]["state"], "stopped");
    assert!(!alive(pid), "the daemon {pid} survived stop");
    assert!(!healthy(&url));
    assert_eq!(home.processes(), Vec::<u32>::new(), "processes left behind");
    let d = home.env("diagnose", &[]);
    assert_eq!(d["data"]["runtime"]["state"], "stopped");
    assert_eq!(d["data"]["diagnostics"]["lock_held"], false);
    assert!(d["data"]["diagnostics"].get("lock_pid").is_none());
    let s = home.env("stop", &[]);
    assert_eq!(s["data"]["operation"]["reason_code"], "runtime_not_started");
}

#[test]
fn diagnose_tells_a_hung_runtime_and_a_killed_one_apart() {
    let home = Home::new();
    let s = home.env("start", &["--port", "0"]);
    assert_eq!(s["ok"], true, "{s}");
    let pid = s["data"]["runtime"]["pid"].as_u64().unwrap();

    // Stopped (SIGSTOP): the lock is held by a live pid, the socket does
    // not answer.
    signal(pid, nix::sys::signal::Signal::SIGSTOP);
    eventually("the runtime is stopped", || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
    });
    let d = home.env("diagnose", &[]);
    signal(pid, nix::sys::signal::Signal::SIGCONT);
    assert_eq!(d["data"]["runtime"]["state"], "unreachable");
    assert_eq!(
        d["data"]["runtime"]["failure_code"],
        "runtime_socket_unreachable"
    );
    assert_eq!(d["data"]["diagnostics"]["lock_held"], true);
    assert_eq!(d["data"]["diagnostics"]["pid_alive"], true);
    assert_eq!(d["data"]["diagnostics"]["socket_reachable"], false);

    // Killed: the flock is free, the pid dead, the files still name it.
    signal(pid, nix::sys::signal::Signal::SIGKILL);
    eventually("the runtime is dead", || !alive(pid));
    let d = home.env("diagnose", &[]);
    let diag = &d["data"]["diagnostics"];
    assert_eq!(d["data"]["runtime"]["state"], "stale");
    assert_eq!(d["data"]["runtime"]["failure_code"], "runtime_lock_stale");
    assert_eq!(diag["failure_code"], "runtime_lock_stale");
    assert_eq!(diag["lock_pid"], pid);
    assert_eq!(diag["lock_held"], false);
    assert_eq!(diag["pid_alive"], false);
    assert_eq!(diag["socket_reachable"], false);
    // Stop has nothing to stop; start takes the stale lock over.
    let s = home.env("stop", &[]);
    assert_eq!(s["data"]["operation"]["reason_code"], "runtime_not_started");
    let s = home.env("restart", &[]);
    assert_eq!(s["ok"], true, "{s}");
    let pid2 = s["data"]["runtime"]["pid"].as_u64().unwrap();
    assert_ne!(pid2, pid);
    assert_eq!(s["data"]["runtime"]["state"], "running");
    let s = home.env("stop", &[]);
    assert_eq!(s["data"]["operation"]["performed"], true);
    assert!(!alive(pid2));
    assert_eq!(home.processes(), Vec::<u32>::new());
}

#[test]
fn bad_state_files_and_targets_are_one_error_line() {
    let home = Home::new();
    let not_found = home.env("status", &["--target", "nope"]);
    assert_eq!(not_found["error"]["code"], "TARGET_NOT_FOUND");
    let not_found = home.env("status", &["--target", "../state"]);
    assert_eq!(not_found["error"]["code"], "TARGET_NOT_FOUND");
    let human = home.out(&["env", "status", "--target", "nope"]);
    assert!(!human.status.success());
    assert!(text(&human.stderr).contains("TARGET_NOT_FOUND"));

    let dir = home.state("local");
    std::fs::create_dir_all(&dir).unwrap();
    /// A case: its name, and the files of the state dir.
    type Files = &'static [(&'static str, &'static [u8])];
    let cases: &[(&str, Files)] = &[
        (
            "runtime.json garbage",
            &[
                ("lock", b""),
                ("config.json", b"{}"),
                ("runtime.json", b"{\"state\": "),
            ],
        ),
        (
            "runtime.json missing",
            &[("lock", b""), ("config.json", b"{}")],
        ),
        (
            "lock garbage",
            &[
                ("lock", b"\x00\xffxx"),
                ("config.json", b"{}"),
                ("runtime.json", b"{}"),
            ],
        ),
    ];
    for (name, files) in cases {
        for f in ["lock", "config.json", "runtime.json"] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        for (f, bytes) in *files {
            std::fs::write(dir.join(f), bytes).unwrap();
        }
        for verb in ["status", "diagnose", "stop"] {
            let v = home.env(verb, &[]);
            assert_eq!(v["ok"], false, "{name}, {verb}: {v}");
            assert_eq!(
                v["error"]["code"], "ENVIRONMENT_STATUS_FAILED",
                "{name}, {verb}"
            );
        }
        let st = line(&home.out(&["status", "--json"]), "status");
        assert_eq!(st["error"]["code"], "ENVIRONMENT_STATUS_FAILED", "{name}");
        // Discovery still lists it, marked unreadable.
        let t = line(&home.out(&["targets", "--json"]), "targets");
        assert_eq!(
            t["data"]["targets"][0]["unavailable_reason_code"], "state_unreadable",
            "{name}"
        );
    }
    // A state root that is a file: discovery fails as a whole.
    let other = Home::new();
    std::fs::write(other.path().join("state"), b"").unwrap();
    let t = line(&other.out(&["targets", "--json"]), "targets");
    assert_eq!(t["error"]["code"], "TARGET_DISCOVERY_FAILED");
    // A harness that is not there.
    let ps = line(
        &home.out(&["ps", "--harness", "http://127.0.0.1:1", "--json"]),
        "ps",
    );
    assert_eq!(ps["error"]["code"], "TARGET_EXEC_FAILED");
}

#[test]
fn targets_lists_a_bound_executor_and_the_visor_while_they_run() {
    let home = Home::new();
    let h = harness(&[]);
    let ws = tempfile::tempdir().unwrap();
    let mut exec = Proc(Some(
        home.bmx()
            .args([
                "executor",
                "--url",
                &h.ws,
                "--token",
                "s3cret",
                "--workspace",
            ])
            .arg(ws.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let mut visor = Proc(Some(
        home.bmx()
            .arg("visor")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let targets = || line(&home.out(&["targets", "--json"]), "targets")["data"]["targets"].clone();
    let find = |t: &Value, kind: &str| {
        t.as_array()
            .unwrap()
            .iter()
            .find(|x| x["kind"] == kind && x["id"] != "local")
            .cloned()
    };
    eventually("both targets available", || {
        let t = targets();
        let avail = |x: Option<Value>| x.is_some_and(|x| x["status"] == "available");
        avail(find(&t, "local_environment"))
            && avail(
                t.as_array()
                    .unwrap()
                    .iter()
                    .find(|x| x["id"] == "visor")
                    .cloned(),
            )
    });
    let t = targets();
    let w = find(&t, "local_environment").unwrap();
    let wid = w["id"].as_str().unwrap().to_owned();
    assert!(wid.starts_with("workspace-"), "{w}");
    assert!(w["label"]
        .as_str()
        .unwrap()
        .contains(&*ws.path().canonicalize().unwrap().to_string_lossy()));
    let v = t
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == "visor")
        .unwrap()
        .clone();
    assert_eq!(
        v["runtime_control_socket_path"],
        home.path().join("visor.sock").to_str().unwrap()
    );
    assert_eq!(t[0]["id"], "local");
    assert_eq!(t[0]["status"], "not_configured");

    let s = home.env("status", &["--target", &wid]);
    assert_eq!(s["data"]["runtime"]["pid"], exec.pid());
    assert_eq!(
        s["data"]["operations"]["start"]["availability"],
        "unavailable"
    );
    let s = home.env("diagnose", &["--target", "visor"]);
    assert_eq!(s["data"]["runtime"]["pid"], visor.pid());
    assert_eq!(s["data"]["diagnostics"]["socket_reachable"], true);

    // The visor's own `--json` answers are envelope lines too, failures
    // included (one line on stdout, exit 1).
    let ls = home.out(&["visor", "ls", "--json"]);
    let v: Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert!(errors(None, &v).is_empty(), "{v}");
    assert_eq!(
        (v["ok"].clone(), v["data"]["sessions"].clone()),
        (json!(true), json!([]))
    );
    assert_eq!(v["trace"]["target_id"], "visor");
    let bad = home.out(&["visor", "stop", "s-nope", "--json"]);
    let v: Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert!(errors(None, &v).is_empty(), "{v}");
    assert_eq!(v["error"]["code"], "TARGET_EXEC_FAILED");
    assert!(!bad.status.success());

    // env stop works on any running target: SIGTERM to its lock holder.
    let s = home.env("stop", &["--target", &wid]);
    assert_eq!(s["data"]["operation"]["performed"], true, "{s}");
    assert_eq!(exec.wait_exit(), Some(0));
    let s = home.env("stop", &["--target", "visor"]);
    assert_eq!(s["data"]["operation"]["performed"], true, "{s}");
    assert_eq!(visor.wait_exit(), Some(0));
    let t = targets();
    for x in t.as_array().unwrap().iter().filter(|x| x["id"] != "local") {
        assert_eq!(x["status"], "configured", "{x}");
    }
    let s = home.env("status", &["--target", "visor"]);
    assert_eq!(s["data"]["runtime"]["state"], "stopped");
}
