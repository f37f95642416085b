//! Issue 18, finding 2, the rest: `bmx executor --run-as USER`. The real
//! executor binary runs as root behind an in-process stand-in harness;
//! its session's code runs as `nobody` and can neither signal the executor
//! nor read its `/proc` files, the file tools act with `nobody`'s rights
//! (a root-only file in the workspace stays unreadable), and what they
//! create is `nobody`'s, so the session's own processes can change it.
//!
//! Needs root (only root can change users); skipped, loudly, otherwise.

use crate::security_common;
use crate::support;
use bmx::wire::Method;
use security_common::{executor_behind_stand_in, result_text, tool};
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;

#[tokio::test]
async fn session_code_runs_as_the_run_as_user() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let msg = "SKIPPED: --run-as needs the test to run as root";
        // Under CI a skip would pass unseen: there, it fails.
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("{msg}");
        return;
    }
    let Ok(nobody) = bmx::process::run_as::resolve("nobody") else {
        let msg = "SKIPPED: no user `nobody` on this machine";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("{msg}");
        return;
    };
    let (executor, _harness, conn, work) = executor_behind_stand_in(
        &["--run-as", "nobody"],
        &[("BMX_TOKEN", support::TOKEN)],
        "info",
    )
    .await;
    let pid = executor.pid();
    let (served, mut events) = conn.serve();
    let _: Value = served
        .call(Method::SessionAssign, &support::assign_params("s1", 1))
        .await
        .unwrap();
    let ws = work.path().join("sessions").join("s1");
    assert_eq!(std::fs::metadata(&ws).unwrap().uid(), nobody.uid);

    // Who the session's code is, and what it can do to its executor.
    let r = tool(
        &served,
        &mut events,
        "who",
        "bash",
        json!({"command": format!(
            "echo uid=$(id -u) gid=$(id -g); kill -0 {pid} && echo signalled; cat /proc/{pid}/environ >/dev/null && echo read-environ; echo end"
        )}),
    )
    .await;
    let text = result_text(&r);
    let who = format!("uid={} gid={}", nobody.uid, nobody.gid);
    assert!(text.contains(&who), "want {who}: {text}");
    assert!(
        !text.contains("signalled"),
        "the session signalled its executor: {text}"
    );
    assert!(
        !text.contains("read-environ"),
        "the session read the executor's environ: {text}"
    );
    assert!(text.contains("end"), "{text}");

    // A process and a file written by the `write` tool: both nobody's.
    let r = tool(
        &served,
        &mut events,
        "w",
        "write",
        json!({"path": "notes/a.txt", "content": "one\n"}),
    )
    .await;
    assert_eq!(r["outcome"], "succeeded", "{r}");
    assert_eq!(
        std::fs::metadata(ws.join("notes/a.txt")).unwrap().uid(),
        nobody.uid
    );
    assert_eq!(
        std::fs::metadata(ws.join("notes")).unwrap().uid(),
        nobody.uid
    );
    let r = tool(
        &served,
        &mut events,
        "append",
        "bash",
        json!({"command": "echo two >> notes/a.txt && cat notes/a.txt"}),
    )
    .await;
    assert!(result_text(&r).contains("one\ntwo"), "{r}");

    // A root-only file in the workspace: the file tools act as nobody.
    std::fs::write(ws.join("root-only.txt"), "secret-7f3c\n").unwrap();
    std::fs::set_permissions(
        ws.join("root-only.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let r = tool(
        &served,
        &mut events,
        "peek",
        "read",
        json!({"path": "root-only.txt"}),
    )
    .await;
    assert_eq!(r["isError"], true, "{r}");
    assert!(!result_text(&r).contains("secret-7f3c"), "{r}");
    let r = tool(
        &served,
        &mut events,
        "grep",
        "grep",
        json!({"pattern": "secret-7f3c"}),
    )
    .await;
    assert!(!result_text(&r).contains("root-only.txt:1"), "{r}");

    // The executor's journal is its own even though its work root is
    // traversable now.
    let journal = work.path().join(bmx::executor::journal::FILE);
    assert_eq!(
        std::fs::metadata(&journal).unwrap().mode() & 0o077,
        0,
        "journal readable by others"
    );
    executor.stop();
}

#[tokio::test]
async fn run_as_refuses_root_and_unknown_users() {
    for (user, says) in [
        ("root", "unprivileged"),
        ("no-such-user-bmx", "no such user"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
            .args(["executor", "--url", "ws://127.0.0.1:9/x", "--run-as", user])
            .env("BMX_TOKEN", support::TOKEN)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{user}: {err}");
    }
}
