//! The CLI: `bmx up` runs a harness and an executor until SIGTERM, `bmx exec`
//! streams a command's output and exits with its code, `bmx ps` lists.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BMX: &str = env!("CARGO_BIN_EXE_bmx");

/// Kills the child if the test fails before it is stopped.
struct Guard(Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn up_exec_ps() {
    let port = free_port();
    let work = tempfile::tempdir().unwrap();
    let mut up = Command::new(BMX)
        .args(["up", "--port", &port.to_string(), "--work-root"])
        .arg(work.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = up.stdout.take().unwrap();
    let mut guard = Guard(Some(up));
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let url = format!("http://127.0.0.1:{port}");
    assert!(line.contains(&format!("{url}/v1")), "{line}");

    let out = Command::new(BMX)
        .args([
            "exec",
            "--harness",
            &url,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");

    let out = Command::new(BMX)
        .args(["ps", "--harness", &url, "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["data"]["executors"][0]["executorId"], "local");
    // The session bmx exec created was stopped.
    assert_eq!(v["data"]["sessions"][0]["state"], "ended");

    // SIGTERM: both sides stop, nothing is left behind.
    let mut up = guard.0.take().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(up.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "bmx up did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}
