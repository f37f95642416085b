//! The visor daemon: one per home, its socket, hello/info and the error
//! envelope.

use crate::visor_support;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use visor_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_visor_on_the_same_home_is_refused_naming_the_holder() {
    let v = Visor::start();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["visor", "--home"])
        .arg(v.home.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("pid {}", v.pid())), "{err}");
    // The first one is untouched.
    let info = v.ok("GET", "/v1/info", None).await;
    assert_eq!(info["pid"], v.pid());
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&v.socket()), 0o600);
    assert_eq!(mode(v.home.path()), 0o700);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_socket_is_replaced() {
    let home = tempfile::tempdir().unwrap();
    let sock = home.path().join("visor.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let mut child = spawn(home.path());
    let deadline = std::time::Instant::now() + WAIT;
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "no visor on the stale socket's path"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (st, info) = http(&sock, "GET", "/v1/info", None).await;
    assert_eq!(st, 200);
    assert_eq!(info["pid"], child.id());
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    assert!(child.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_checks_the_protocol_and_errors_are_typed() {
    let v = Visor::start();
    let info = v
        .ok(
            "POST",
            "/v1/hello",
            Some(json!({"client": "test", "build": "1", "protocol": "bmx.visor.v1"})),
        )
        .await;
    assert_eq!(info["protocol"], "bmx.visor.v1");
    assert_eq!(info["client"], "test");
    assert_eq!(info["home"], v.home.path().display().to_string());
    assert!(info["seq"].as_u64().is_some());
    let (st, e) = v
        .req(
            "POST",
            "/v1/hello",
            Some(json!({"client": "t", "protocol": "bmx.visor.v9"})),
        )
        .await;
    assert_eq!((st, e["error"]["code"].as_str()), (426, Some("protocol")));
    for (method, path, body, status, code) in [
        ("POST", "/v1/hello", Some("{not json"), 400, "invalid"),
        (
            "POST",
            "/v1/sessions",
            Some(r#"{"kind":"pty"}"#),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/sessions",
            Some(r#"{"kind":"pty","command":["x"],"agent":"y"}"#),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/sessions",
            Some(r#"{"kind":"pty","command":["/no/such/program"]}"#),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/sessions",
            Some(r#"{"kind":"pty","command":["sh"],"cols":0}"#),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/sessions",
            Some(r#"{"kind":"pty","command":["sh"],"bogus":1}"#),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/sessions",
            Some(r#"{"kind":"wire","command":["/no/such/agent"]}"#),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/sessions",
            Some(r#"{"kind":"wire","agent":"nope"}"#),
            400,
            "invalid",
        ),
        ("GET", "/v1/sessions/nope", None, 404, "not_found"),
        ("POST", "/v1/sessions/nope/stop", None, 404, "not_found"),
        ("GET", "/v1/nothing-here", None, 404, "not_found"),
        ("GET", "/v1/agents/nope", None, 404, "not_found"),
        ("POST", "/v1/hook", Some("{}"), 400, "invalid"),
        ("POST", "/v1/workdirs", Some("{}"), 400, "invalid"),
        ("POST", "/v1/workdirs", Some("[1]"), 400, "invalid"),
        ("GET", "/v1/workdirs/nope", None, 404, "not_found"),
        ("DELETE", "/v1/projects/nope", None, 404, "not_found"),
        ("POST", "/v1/agents/x/install", None, 501, "unsupported"),
    ] {
        let (st, e) = http(&v.socket(), method, path, body).await;
        assert_eq!(
            (st, e["error"]["code"].as_str()),
            (status, Some(code)),
            "{method} {path}: {e}"
        );
        assert!(e["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    let huge = format!(
        r#"{{"client":"{}","protocol":"bmx.visor.v1"}}"#,
        "x".repeat(2 << 20)
    );
    let (st, _) = http(&v.socket(), "POST", "/v1/hello", Some(&huge)).await;
    assert_eq!(st, 400);
}
