//! Log output of the real binary: no terminal escape codes when stderr is
//! not a terminal, and `--log-format json` writes one JSON object a line.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run `bmx harness` until it is up, stop it with SIGTERM, return stderr.
fn harness_stderr(extra: &[&str]) -> String {
    // A data dir of its own: never the user's `~/.bmx/harness`, which
    // another harness of the same run would open at the same moment.
    let data = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args([
            "harness",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "exec-1=logs-test-secret",
        ])
        .arg("--data-dir")
        .arg(data.path())
        .args(extra)
        .env_remove("RUST_LOG")
        .env_remove("BMX_LOG_FORMAT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The harness prints its address on stdout once it listens.
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "the harness started");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the harness did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    err
}

#[test]
fn text_logs_to_a_pipe_carry_no_escape_codes() {
    let err = harness_stderr(&[]);
    assert!(err.contains("shutting down"), "{err}");
    assert!(!err.contains('\u{1b}'), "escape codes in {err:?}");
}

#[test]
fn json_logs_are_one_object_a_line() {
    let err = harness_stderr(&["--log-format", "json"]);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    let mut saw_shutdown = false;
    for l in lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}"));
        assert!(v["level"].is_string() && v["timestamp"].is_string(), "{l}");
        saw_shutdown |= v["fields"]["message"] == "shutting down";
    }
    assert!(saw_shutdown, "{err}");
}
