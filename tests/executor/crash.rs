//! Supervision, seen from the harness: a panic injected into each kind of
//! executor actor (session, process, tool call, terminal) ends only that
//! actor, and the peer is told: `process.status` failed, an error
//! `tool.result`, `session.ended {reason: internal_error}`, a terminal gone
//! with its process tree. Everything else keeps working.

use crate::support;
use bmx::executor::PanicTarget;
use bmx::wire::types::*;
use bmx::wire::Method;
use serde_json::json;
use std::collections::BTreeMap;
use support::*;

fn tool_call(session: &str, id: &str, command: &str) -> ToolCallParams {
    ToolCallParams {
        session_id: session.into(),
        tool_call_id: id.into(),
        tool: "bash".into(),
        input: json!({ "command": command }),
        deadline_ms: None,
        permission: None,
    }
}

fn inject(rig: &Rig, target: PanicTarget) {
    assert!(
        rig.executor.as_ref().unwrap().inject_panic(target),
        "target is running"
    );
}

#[tokio::test]
async fn a_crashed_process_actor_is_reported_failed_and_its_tree_killed() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let mark = "7311";
    for (id, secs) in [("doomed", mark), ("other", "7312")] {
        let _: ProcessState = rig
            .conn
            .call(
                Method::ProcessStart,
                &start_params("s", id, &["sleep", secs]),
            )
            .await
            .unwrap();
    }
    eventually("sleep started", || !pids_with_arg("sleep 7311").is_empty()).await;
    inject(
        &rig,
        PanicTarget::Process {
            session: "s".into(),
            process: "doomed".into(),
        },
    );
    let status = rig
        .event("process.status", |v| {
            v["processId"] == "doomed" && v["state"] != "running"
        })
        .await;
    assert_eq!(status["state"], "failed");
    assert_eq!(status["reason"], "internal_error");
    eventually("the crashed process's tree is gone", || {
        pids_with_arg("sleep 7311").is_empty()
    })
    .await;
    // A request for the crashed process is answered, with an error.
    let err = rig
        .conn
        .call::<_, ProcessReadResult>(
            Method::ProcessRead,
            &read_params("s", "doomed", Stream::Stdout, 0, 0),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, bmx::wire::ErrorCode::InternalError.code());
    // The session and its other process live on.
    assert!(!pids_with_arg("sleep 7312").is_empty());
    let list: ProcessListResult = rig
        .conn
        .call(Method::ProcessList, &json!({"sessionId": "s"}))
        .await
        .unwrap();
    assert!(list.processes.iter().any(|p| p.process_id == "other"));
    let _: ProcessState = rig
        .conn
        .call(Method::ProcessStart, &start_params("s", "after", &["true"]))
        .await
        .unwrap();
    rig.shutdown().await;
    assert!(
        pids_with_arg("sleep 7312").is_empty(),
        "no orphan after shutdown"
    );
}

#[tokio::test]
async fn a_crashed_tool_actor_gets_an_error_result_and_the_session_lives() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let a: Accepted = rig
        .conn
        .call(Method::ToolCall, &tool_call("s", "long", "sleep 7321"))
        .await
        .unwrap();
    assert!(a.accepted);
    eventually("tool running", || !pids_with_arg("sleep 7321").is_empty()).await;
    inject(
        &rig,
        PanicTarget::Tool {
            session: "s".into(),
            tool_call: "long".into(),
        },
    );
    let r: ToolResultParams = serde_json::from_value(
        rig.event("tool.result", |v| v["toolCallId"] == "long")
            .await,
    )
    .unwrap();
    assert!(r.is_error);
    assert_eq!(r.outcome, Outcome::Failed);
    assert_eq!(r.reason.as_deref(), Some("internal_error"));
    // The work the crashed actor started is stopped.
    eventually("tool process stopped", || {
        pids_with_arg("sleep 7321").is_empty()
    })
    .await;
    // A repeat of the same id does not run it again: the result comes back.
    let _: Accepted = rig
        .conn
        .call(Method::ToolCall, &tool_call("s", "long", "sleep 7321"))
        .await
        .unwrap();
    let again = rig
        .event("tool.result", |v| v["toolCallId"] == "long")
        .await;
    assert_eq!(again["reason"], "internal_error");
    // Another call in the same session works.
    let _: Accepted = rig
        .conn
        .call(Method::ToolCall, &tool_call("s", "next", "echo fine"))
        .await
        .unwrap();
    let next = rig
        .event("tool.result", |v| v["toolCallId"] == "next")
        .await;
    assert_eq!(next["outcome"], "succeeded");
    rig.shutdown().await;
}

#[tokio::test]
async fn a_crashed_session_is_ended_internal_error_and_never_recreated() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    rig.assign("t").await;
    let _: ProcessState = rig
        .conn
        .call(
            Method::ProcessStart,
            &start_params("s", "p", &["sleep", "7331"]),
        )
        .await
        .unwrap();
    eventually("sleep started", || !pids_with_arg("sleep 7331").is_empty()).await;
    inject(&rig, PanicTarget::Session("s".into()));
    let ended = rig.event("session.ended", |v| v["sessionId"] == "s").await;
    assert_eq!(ended["reason"], "internal_error");
    eventually("the session's processes are killed", || {
        pids_with_arg("sleep 7331").is_empty()
    })
    .await;
    // The other session is untouched.
    let _: ProcessState = rig
        .conn
        .call(Method::ProcessStart, &start_params("t", "p", &["true"]))
        .await
        .unwrap();
    // The crashed one is gone, not silently recreated.
    let err = rig
        .conn
        .call::<_, ProcessState>(Method::ProcessStart, &start_params("s", "q", &["true"]))
        .await
        .unwrap_err();
    assert_eq!(err.code, bmx::wire::ErrorCode::SessionNotActive.code());
    rig.shutdown().await;
}

#[tokio::test]
async fn a_crashed_terminal_actor_takes_its_tree_and_nothing_else() {
    let rig = Rig::start(Options::default()).await;
    let open = |id: &str, argv: &[&str]| TerminalOpenParams {
        terminal_id: id.into(),
        kind: None,
        argv: Some(argv.iter().map(|s| s.to_string()).collect()),
        shell: None,
        cwd: None,
        env: Some(BTreeMap::new()),
        cols: 80,
        rows: 24,
    };
    let _: TerminalOpenResult = rig
        .conn
        .call(Method::TerminalOpen, &open("t1", &["sleep", "7341"]))
        .await
        .unwrap();
    let _: TerminalOpenResult = rig
        .conn
        .call(Method::TerminalOpen, &open("t2", &["sleep", "7342"]))
        .await
        .unwrap();
    eventually("terminals started", || {
        !pids_with_arg("sleep 7341").is_empty() && !pids_with_arg("sleep 7342").is_empty()
    })
    .await;
    inject(&rig, PanicTarget::Terminal("t1".into()));
    eventually("the crashed terminal's program is killed", || {
        pids_with_arg("sleep 7341").is_empty()
    })
    .await;
    assert!(!pids_with_arg("sleep 7342").is_empty(), "t2 untouched");
    // The id is free again and the terminals supervisor still opens.
    let mut reopened = false;
    for _ in 0..100 {
        if rig
            .conn
            .call::<_, TerminalOpenResult>(Method::TerminalOpen, &open("t1", &["sleep", "7343"]))
            .await
            .is_ok()
        {
            reopened = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(reopened, "t1 can be opened again");
    rig.shutdown().await;
    assert!(
        pids_with_arg("sleep 7342").is_empty(),
        "no orphan after shutdown"
    );
    assert!(
        pids_with_arg("sleep 7343").is_empty(),
        "no orphan after shutdown"
    );
}

#[tokio::test]
async fn a_crashed_sessions_actor_is_restarted_and_ends_every_session_it_held() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    rig.assign("t").await;
    for (session, mark) in [("s", "7351"), ("t", "7352")] {
        let _: ProcessState = rig
            .conn
            .call(
                Method::ProcessStart,
                &start_params(session, "p", &["sleep", mark]),
            )
            .await
            .unwrap();
    }
    eventually("sleeps started", || {
        !pids_with_arg("sleep 7351").is_empty() && !pids_with_arg("sleep 7352").is_empty()
    })
    .await;
    inject(&rig, PanicTarget::Sessions);
    for session in ["s", "t"] {
        let ended = rig
            .event("session.ended", |v| v["sessionId"] == session)
            .await;
        assert_eq!(ended["reason"], "internal_error");
    }
    eventually("every session's processes are killed", || {
        pids_with_arg("sleep 7351").is_empty() && pids_with_arg("sleep 7352").is_empty()
    })
    .await;
    // The restarted sessions actor takes new sessions.
    let mut assigned = false;
    for _ in 0..100 {
        if rig
            .conn
            .call::<_, AssignResult>(Method::SessionAssign, &assign_params("u", 1))
            .await
            .is_ok()
        {
            assigned = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(assigned, "a new session after the restart");
    let _: ProcessState = rig
        .conn
        .call(Method::ProcessStart, &start_params("u", "p", &["true"]))
        .await
        .unwrap();
    rig.shutdown().await;
}
