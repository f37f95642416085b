//! Issue 18, finding 9 (the rest): children inherit no descriptor above 2;
//! every HTTP error is a JSON error, 413 included; a body that is not an
//! object is a 400; a notification method sent as a request is refused
//! -32600, not left to drop its responder (-32603).
//!
//! On the code before the fix: the leaked descriptor reached the process
//! and the bash tool, the 413 was plain text, `[null, null]` created a
//! session (or failed with another status), and `terminal.exited` as a
//! request was answered -32603; every test here failed.

use crate::harness_common;
use crate::security_common;
use crate::support;
use bmx::wire::types::{Accepted, ProcessReadResult, Stream};
use bmx::wire::Method;
use security_common::{event, result_text};
use serde_json::json;
use std::os::unix::process::CommandExt;
use std::time::Duration;

/// Descriptor numbers in an `ls /proc/$$/fd` listing.
fn fds(listing: &str) -> Vec<u32> {
    // Only lines that are a number: the bash tool's result has a
    // `stdout:` header and an exit line around the listing.
    listing
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

#[tokio::test]
async fn children_inherit_only_stdin_stdout_and_stderr() {
    const LEAKED: i32 = 9;
    let mut harness = support::stand_in(support::Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    // The executor's parent leaves a descriptor open across exec, as a
    // careless supervisor would: the executor must not pass it on.
    let leak = std::fs::File::open("/dev/null").unwrap();
    let leak_fd = std::os::fd::AsRawFd::as_raw_fd(&leak);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"));
    cmd.args(["executor", "--url", &harness.url, "--work-root"])
        .arg(work.path())
        .env("BMX_TOKEN", support::TOKEN)
        .env("RUST_LOG", "warn");
    // SAFETY: dup2 only, async-signal-safe; it clears close-on-exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(leak_fd, LEAKED) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = KillOnDrop(cmd.spawn().unwrap());
    let mut conn = harness.next_conn().await;
    conn.register(10_000, 30_000).await;
    let executor_fds = std::fs::read_dir(format!("/proc/{}/fd", child.0.id()))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .collect::<Vec<_>>();
    assert!(executor_fds.contains(&LEAKED), "the executor got the leak");

    let (served, mut events) = conn.serve();
    let _: serde_json::Value = served
        .call(Method::SessionAssign, &support::assign_params("s1", 1))
        .await
        .unwrap();
    // A process.
    let _: serde_json::Value = served
        .call(
            Method::ProcessStart,
            &support::start_params("s1", "p1", &["sh", "-c", "ls /proc/$$/fd"]),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut cursor = 0;
    loop {
        let r: ProcessReadResult = served
            .call(
                Method::ProcessRead,
                &support::read_params("s1", "p1", Stream::Stdout, cursor, 5_000),
            )
            .await
            .unwrap();
        out.extend_from_slice(r.data.as_slice());
        cursor = r.next_cursor;
        if r.eof {
            break;
        }
    }
    let listing = String::from_utf8_lossy(&out);
    let seen = fds(&listing);
    assert!(!seen.is_empty(), "{listing}");
    assert!(seen.iter().all(|fd| *fd <= 2), "a process saw {seen:?}");
    // The bash tool.
    let a: Accepted = served
        .call(
            Method::ToolCall,
            &json!({"sessionId": "s1", "toolCallId": "fds", "tool": "bash",
                    // `; :` keeps bash from exec'ing `ls` in its own place
                    // (then `$$` would be `ls`, and its own directory
                    // handle fd 3 would be listed).
                    "input": {"command": "ls /proc/$$/fd; :"}}),
        )
        .await
        .unwrap();
    assert!(a.accepted);
    let r = event(&mut events, "tool.result", |v| v["toolCallId"] == "fds").await;
    let text = result_text(&r);
    let seen = fds(&text);
    assert!(!seen.is_empty(), "{text}");
    assert!(
        seen.iter().all(|fd| *fd <= 2),
        "the bash tool saw {seen:?}: {text}"
    );
    let _ = child.0.kill();
    let _ = child.0.wait();
}

#[tokio::test]
async fn every_http_error_is_a_json_error() {
    let h = harness_common::harness().await;
    let client = harness_common::api(&h);
    // Past the body limit: 413, JSON, -32013.
    let big = json!({"metadata": {"x": "y".repeat(5 << 19)}});
    let (status, v) = client.post("/v1/sessions", &big).await.unwrap();
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], -32013, "{v}");
    // Not an object.
    for body in [json!([null, null]), json!(null), json!("s"), json!(3)] {
        let (status, v) = client.post("/v1/sessions", &body).await.unwrap();
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], -32602, "{body}: {v}");
    }
    // A method the route does not have: 405, JSON.
    let (status, v) = client.delete("/v1/sessions").await.unwrap();
    assert_eq!(status, 405, "{v}");
    assert!(v["error"]["code"].is_i64(), "{v}");
    h.shutdown().await;
}

#[tokio::test]
async fn a_notification_sent_as_a_request_is_refused_32600() {
    let h = harness_common::harness().await;
    let mut fake = harness_common::dial(&h, "secret-a").await.unwrap();
    fake.register(None).await.unwrap();
    let e = fake
        .link
        .request::<_, serde_json::Value>(
            Method::TerminalExited,
            &json!({"terminalId": "t1", "exitCode": 0}),
            Duration::from_secs(5),
        )
        .await
        .expect_err("refused");
    assert_eq!(harness_common::rpc_code(&e), Some(-32600), "{e:?}");
    assert_eq!(
        harness_common::rpc_reason(&e).as_deref(),
        Some("notification_as_request")
    );
    h.shutdown().await;
}

/// The executor, killed even when an assertion fails first: a failing run
/// must not leave a daemon behind.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
