//! Issue 19, "must fix" 4: no orphans on daemon exit. SIGTERM (or SIGINT)
//! to `bmx executor` ends every session like `session.stop` does — every
//! process tree and every tagged descendant, double-forked escapees
//! included — and the executor's terminals, then the daemon exits.
//!
//! Black box: the real binary against the stand-in harness of
//! `tests/support`; escapees are found by their unique command lines.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::Method;
use nix::sys::signal::Signal;
use std::time::Duration;
use support::*;

/// On the way out (a failed assertion included), SIGKILL whatever the
/// test's command lines still name: a failing test leaves nothing behind.
struct Sweep(String);

impl Drop for Sweep {
    fn drop(&mut self) {
        for pid in pids_with_arg(&self.0) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// The daemon with a session running a process tree, a bash tool call and
/// a terminal, each leaving a double-forked `setsid` escapee behind; then
/// `signal`; nothing of the scope may survive.
async fn nothing_survives(signal: Signal, tag_base: u32) {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut child = executor_command(&s.url, work.path()).spawn().unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let (served, _events) = conn.serve();
    let _: AssignResult = served
        .call(Method::SessionAssign, &assign_params("d", 1))
        .await
        .unwrap();
    let tag = format!("{tag_base}{}", std::process::id() % 10_000);
    let sleeps = format!("sleep {tag}.");
    let _sweep = Sweep(sleeps.clone());
    // A process whose tree double-forks an escapee and keeps running.
    let script = format!("setsid sh -c 'sleep {tag}.1 &'; sleep {tag}.2");
    let _: ProcessState = served
        .call(
            Method::ProcessStart,
            &start_params("d", "p", &["sh", "-c", &script]),
        )
        .await
        .unwrap();
    // One that also dropped its tag on the way (`env -i`): found by
    // being below the daemon, not by its tag.
    let script = format!("setsid sh -c 'env -i sleep {tag}.3 &'; sleep {tag}.7");
    let _: ProcessState = served
        .call(
            Method::ProcessStart,
            &start_params("d", "untagged", &["sh", "-c", &script]),
        )
        .await
        .unwrap();
    // A bash tool call that leaves one behind and finishes.
    let _: serde_json::Value = served
        .call(
            Method::ToolCall,
            &ToolCallParams {
                session_id: "d".into(),
                tool_call_id: "t1".into(),
                tool: "bash".into(),
                input: serde_json::json!({"command": format!("setsid sh -c 'sleep {tag}.4 &'; echo ok")}),
                deadline_ms: None,
                permission: None,
            },
        )
        .await
        .unwrap();
    // A terminal running a tree with its own escapee.
    let script = format!("setsid sh -c 'sleep {tag}.5 &'; sleep {tag}.6");
    let _: TerminalOpenResult = served
        .call(
            Method::TerminalOpen,
            &TerminalOpenParams {
                terminal_id: "term".into(),
                kind: None,
                argv: Some(vec!["sh".into(), "-c".into(), script]),
                shell: None,
                cwd: None,
                env: None,
                cols: 80,
                rows: 24,
            },
        )
        .await
        .unwrap();
    for n in [1, 2, 3, 4, 5, 6, 7] {
        let one = format!("{sleeps}{n}");
        eventually(&format!("{one} running"), || pids_with_arg(&one).len() == 1).await;
    }

    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, signal).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the daemon exits within 30 s")
        .unwrap();
    assert_eq!(status.code(), Some(0), "exit status 0 after {signal}");
    let left = pids_with_arg(&sleeps);
    assert!(left.is_empty(), "orphans after {signal}: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_kills_every_tagged_descendant() {
    nothing_survives(Signal::SIGTERM, 51).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_kills_every_tagged_descendant() {
    nothing_survives(Signal::SIGINT, 52).await;
}
