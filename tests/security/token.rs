//! Issue 18, finding 2: code in a session cannot read its executor's
//! credential. The real executor binary, started with its token on the
//! command line (`--token`) and another in its environment (`BMX_TOKEN`),
//! behind an in-process stand-in harness; a session's `bash` tool call and
//! the test itself (same uid) read `/proc/<executor>/environ` and
//! `cmdline`: neither secret is there. Run as root, a second test starts
//! the executor as `nobody` and checks that it is non-dumpable: its
//! `/proc` files are root's and another `nobody` process cannot read them.
//!
//! On the code before the scrub both tests fail (the token was in both
//! files, and the process was dumpable).

use crate::security_common;
use crate::support;
use bmx::wire::types::Accepted;
use bmx::wire::Method;
use security_common::{event, executor_behind_stand_in, result_text};
use serde_json::json;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;

const ENV_SECRET: &str = "env-secret-3b8f0d2a";

fn proc_file(pid: i32, name: &str) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/{name}")).unwrap()).into_owned()
}

#[tokio::test]
async fn the_token_is_in_neither_environ_nor_cmdline() {
    let (executor, _harness, conn, _work) = executor_behind_stand_in(
        &["--token", support::TOKEN],
        &[("BMX_TOKEN", ENV_SECRET)],
        "info",
    )
    .await;
    let pid = executor.pid();

    // The test, a process of the same uid.
    let environ = proc_file(pid, "environ");
    let cmdline = proc_file(pid, "cmdline");
    assert!(
        cmdline.contains("--work-root"),
        "read the real file: {cmdline:?}"
    );
    for secret in [support::TOKEN, ENV_SECRET] {
        assert!(!environ.contains(secret), "{secret} in environ");
        assert!(
            !cmdline.contains(secret),
            "{secret} in cmdline: {cmdline:?}"
        );
    }
    // The entry stays in the area the kernel shows, its value starred.
    let entry = environ
        .split('\0')
        .find(|e| e.starts_with("BMX_TOKEN="))
        .expect("the original entry");
    assert!(
        entry["BMX_TOKEN=".len()..].bytes().all(|b| b == b'*'),
        "{entry}"
    );

    // Code in a session: its bash tool call reads its parent's files.
    let (served, mut events) = conn.serve();
    let _: serde_json::Value = served
        .call(Method::SessionAssign, &support::assign_params("s1", 1))
        .await
        .unwrap();
    let a: Accepted = served
        .call(
            Method::ToolCall,
            &json!({
                "sessionId": "s1",
                "toolCallId": "peek",
                "tool": "bash",
                "input": {"command": format!(
                    "echo pid=$PPID; tr '\\0' '\\n' < /proc/{pid}/cmdline; tr '\\0' '\\n' < /proc/{pid}/environ; echo end"
                )},
            }),
        )
        .await
        .unwrap();
    assert!(a.accepted);
    let result = event(&mut events, "tool.result", |v| v["toolCallId"] == "peek").await;
    let text = result_text(&result);
    assert!(
        text.contains("--work-root") && text.contains("end"),
        "{text}"
    );
    for secret in [support::TOKEN, ENV_SECRET] {
        assert!(
            !text.contains(secret),
            "{secret} read by the session: {text}"
        );
    }

    let log = executor.stop();
    assert!(
        log.contains("visible to every local user") && log.contains("--token"),
        "a warning for --token on the command line: {log}"
    );
}

#[tokio::test]
async fn the_executor_is_not_dumpable() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let msg = "needs root to start the executor as nobody; skipped";
        // Under CI a skip would pass unseen: there, it fails.
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("{msg}");
        return;
    }
    const NOBODY: u32 = 65534;
    let mut harness = support::stand_in(support::Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    // Its work root is its own (an executor refuses one another user
    // owns or may write: docs/security.md).
    std::os::unix::fs::chown(work.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["executor", "--url", &harness.url, "--work-root"])
        .arg(work.path())
        .env("BMX_TOKEN", support::TOKEN)
        .env("RUST_LOG", "warn")
        .env("HOME", work.path())
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut conn = harness.next_conn().await;
    conn.register(10_000, 30_000).await;
    let pid = child.id();
    // A dumpable process's /proc files belong to its own uid.
    let owner = std::fs::metadata(format!("/proc/{pid}/environ"))
        .unwrap()
        .uid();
    assert_eq!(owner, 0, "non-dumpable: /proc/{pid} is root's");
    // Another process of the same uid cannot read them.
    let peek = std::process::Command::new("cat")
        .arg(format!("/proc/{pid}/environ"))
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    assert!(!peek.status.success(), "nobody read the environ of nobody");
    assert!(!String::from_utf8_lossy(&peek.stdout).contains(support::TOKEN));
    let _ = child.kill();
    let _ = child.wait();
}
