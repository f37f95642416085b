//! Issue 5: tool calls through the real executor over a real WebSocket:
//! at-most-once execution, results retried until acknowledged (also across a
//! reconnect), cancel, the workspace boundary, truncation, custom tools.

use crate::support;
use bmx::executor::Executor;
use bmx::tools::{Tool, ToolContext, ToolOutput, ToolRegistry};
use bmx::wire::types::*;
use bmx::wire::{Method, RpcError};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use support::*;

fn call(session: &str, id: &str, tool: &str, input: Value) -> ToolCallParams {
    ToolCallParams {
        session_id: session.into(),
        tool_call_id: id.into(),
        tool: tool.into(),
        input,
        deadline_ms: None,
        permission: None,
    }
}

async fn run(rig: &mut Rig, id: &str, tool: &str, input: Value) -> ToolResultParams {
    let a: Accepted = rig
        .conn
        .call(Method::ToolCall, &call("s", id, tool, input))
        .await
        .unwrap();
    assert!(a.accepted);
    let v = rig.event("tool.result", |v| v["toolCallId"] == id).await;
    serde_json::from_value(v).unwrap()
}

fn text(r: &ToolResultParams) -> &str {
    r.content[0].text.as_deref().unwrap_or("")
}

#[tokio::test]
async fn every_builtin_tool_round_trips() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let r = run(
        &mut rig,
        "t1",
        "bash",
        json!({"command": "echo hello; echo oops >&2; exit 3"}),
    )
    .await;
    assert_eq!(r.outcome, Outcome::Failed);
    assert!(r.is_error);
    assert!(
        text(&r).contains("hello")
            && text(&r).contains("oops")
            && text(&r).contains("exit code: 3"),
        "{}",
        text(&r)
    );
    let r = run(
        &mut rig,
        "t2",
        "write",
        json!({"path": "dir/a.txt", "content": "one\ntwo\nthree\n"}),
    )
    .await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{}", text(&r));
    let r = run(
        &mut rig,
        "t3",
        "read",
        json!({"path": "dir/a.txt", "offset": 2, "limit": 1}),
    )
    .await;
    assert!(
        text(&r).contains("two") && !text(&r).contains("three"),
        "{}",
        text(&r)
    );
    let r = run(
        &mut rig,
        "t4",
        "edit",
        json!({"path": "dir/a.txt", "oldString": "two", "newString": "2"}),
    )
    .await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{}", text(&r));
    let r = run(
        &mut rig,
        "t5",
        "edit",
        json!({"path": "dir/a.txt", "oldString": "zzz", "newString": "2"}),
    )
    .await;
    assert!(r.is_error && text(&r).contains('0'), "{}", text(&r));
    let r = run(&mut rig, "t6", "grep", json!({"pattern": "^2$"})).await;
    assert!(text(&r).contains("dir/a.txt:2:2"), "{}", text(&r));
    let r = run(&mut rig, "t7", "glob", json!({"pattern": "**/*.txt"})).await;
    assert!(text(&r).contains("dir/a.txt"), "{}", text(&r));
    let r = run(&mut rig, "t8", "list_files", json!({})).await;
    assert!(text(&r).contains("dir/"), "{}", text(&r));
    let r = run(&mut rig, "t9", "read", json!({"path": "missing.txt"})).await;
    assert!(r.is_error);
    let r = run(&mut rig, "t10", "read", json!({"nope": 1})).await;
    assert_eq!(r.reason.as_deref(), Some("invalid_input"));
    rig.shutdown().await;
}

#[tokio::test]
async fn unknown_and_display_tools_are_rpc_errors() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    // A computer tool this executor does not have: -32012, display or
    // not (`computer_action` itself is tests/executor/computer.rs's).
    let e: RpcError = rig
        .conn
        .call::<_, Accepted>(
            Method::ToolCall,
            &call("s", "c", "computer_frobnicate", json!({})),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32012);
    if rig.registered.capabilities.display.is_none() {
        let e: RpcError = rig
            .conn
            .call::<_, Accepted>(
                Method::ToolCall,
                &call("s", "d", "computer_action", json!({})),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code, -32012);
    }
    let e: RpcError = rig
        .conn
        .call::<_, Accepted>(Method::ToolCall, &call("s", "u", "no_such_tool", json!({})))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32602);
    rig.shutdown().await;
}

#[tokio::test]
async fn the_workspace_boundary_holds_including_symlinks() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let ws = rig.work.path().join("sessions").join("s");
    std::os::unix::fs::symlink("/etc", ws.join("etc-link")).unwrap();
    for (i, input) in [
        json!({"path": "../outside.txt"}),
        json!({"path": "/etc/passwd"}),
        json!({"path": "etc-link/passwd"}),
    ]
    .into_iter()
    .enumerate()
    {
        let r = run(&mut rig, &format!("b{i}"), "read", input).await;
        assert!(r.is_error);
        assert_eq!(
            r.reason.as_deref(),
            Some("workspace_boundary"),
            "{}",
            text(&r)
        );
        assert!(!text(&r).contains("root:"), "nothing outside was read");
    }
    let r = run(
        &mut rig,
        "w",
        "write",
        json!({"path": "etc-link/bmx-test-file", "content": "x"}),
    )
    .await;
    assert_eq!(r.reason.as_deref(), Some("workspace_boundary"));
    assert!(!std::path::Path::new("/etc/bmx-test-file").exists());
    rig.shutdown().await;
}

#[tokio::test]
async fn inline_limit_keeps_head_and_tail() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let r = run(
        &mut rig,
        "big",
        "bash",
        json!({"command": "echo HEAD; head -c 300000 /dev/zero | tr '\\0' a; echo; echo TAIL"}),
    )
    .await;
    let t = text(&r);
    assert!(t.len() < 80 * 1024, "{}", t.len());
    assert!(t.contains("HEAD") && t.contains("TAIL"));
    assert!(t.contains("omitted"), "an explicit marker");
    rig.shutdown().await;
}

#[tokio::test]
async fn a_repeated_call_runs_once_and_resends_the_result() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let first = run(
        &mut rig,
        "once",
        "bash",
        json!({"command": "echo run >> count.txt; cat count.txt"}),
    )
    .await;
    let a: Accepted = rig
        .conn
        .call(
            Method::ToolCall,
            &call(
                "s",
                "once",
                "bash",
                json!({"command": "echo run >> count.txt; cat count.txt"}),
            ),
        )
        .await
        .unwrap();
    assert!(a.accepted);
    let again: ToolResultParams = serde_json::from_value(
        rig.event("tool.result", |v| v["toolCallId"] == "once")
            .await,
    )
    .unwrap();
    assert_eq!(again.content, first.content, "the kept result, sent again");
    let count = std::fs::read_to_string(rig.work.path().join("sessions/s/count.txt")).unwrap();
    assert_eq!(count, "run\n", "executed at most once");
    rig.shutdown().await;
}

#[tokio::test]
async fn cancel_kills_a_running_command() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let tag = format!("sleep 40{}.5", std::process::id() % 10_000);
    let _: Accepted = rig
        .conn
        .call(
            Method::ToolCall,
            &call("s", "long", "bash", json!({"command": tag.clone()})),
        )
        .await
        .unwrap();
    eventually("sleep running", || !pids_with_arg(&tag).is_empty()).await;
    let c: ToolCancelResult = rig
        .conn
        .call(
            Method::ToolCancel,
            &ToolCancelParams {
                session_id: "s".into(),
                tool_call_id: "long".into(),
                reason: "user".into(),
            },
        )
        .await
        .unwrap();
    assert!(c.canceled);
    let r: ToolResultParams = serde_json::from_value(
        rig.event("tool.result", |v| v["toolCallId"] == "long")
            .await,
    )
    .unwrap();
    assert_eq!(r.outcome, Outcome::Canceled);
    assert!(pids_with_arg(&tag).is_empty());
    rig.shutdown().await;
}

#[tokio::test]
async fn denied_env_never_reaches_a_tool() {
    std::env::set_var("BMX_TEST_SECRET_ENV", "hunter2");
    let mut rig = Rig::start_with(Options::default(), |c| {
        c.deny_env.push("BMX_TEST_SECRET_ENV".into())
    })
    .await;
    rig.assign("s").await;
    let r = run(
        &mut rig,
        "env",
        "bash",
        json!({"command": "echo [$BMX_TEST_SECRET_ENV]"}),
    )
    .await;
    assert!(text(&r).contains("[]"), "{}", text(&r));
    let r = run(
        &mut rig,
        "env2",
        "bash",
        json!({"command": "true", "env": {"BMX_TEST_SECRET_ENV": "x"}}),
    )
    .await;
    assert_eq!(r.reason.as_deref(), Some("denied_env"));
    rig.shutdown().await;
}

#[tokio::test]
async fn a_result_refused_twice_is_delivered_on_the_third_try() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let link = conn.link.clone();
    let assign = tokio::spawn(async move {
        let _: AssignResult = link
            .request(Method::SessionAssign, &assign_params("s", 1), WAIT)
            .await
            .unwrap();
        let _: Accepted = link
            .request(
                Method::ToolCall,
                &call("s", "r3", "bash", json!({"command": "echo ok"})),
                WAIT,
            )
            .await
            .unwrap();
    });
    for attempt in 1..=3 {
        let g = conn.expect(Method::ToolResult).await;
        let p: ToolResultParams = g.params();
        assert_eq!(p.tool_call_id, "r3");
        if attempt < 3 {
            g.err(RpcError::internal("try again"));
        } else {
            g.ok(&Accepted::YES);
        }
    }
    assign.await.unwrap();
    exec.shutdown().await;
}

#[tokio::test]
async fn a_pending_result_is_delivered_after_the_resumed_register() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let link = conn.link.clone();
    tokio::spawn(async move {
        let _: Result<AssignResult, _> = link
            .request(Method::SessionAssign, &assign_params("s", 1), WAIT)
            .await;
        let _: Result<Accepted, _> = link
            .request(
                Method::ToolCall,
                &call("s", "x", "bash", json!({"command": "echo across"})),
                WAIT,
            )
            .await;
    });
    let g = conn.expect(Method::ToolResult).await;
    // The connection dies before the harness acknowledges.
    drop(g);
    conn.link.close(bmx::wire::CloseCode::GoingAway, "gone");
    let mut conn = s.next_conn().await;
    let p = conn.register(10_000, 30_000).await;
    assert!(p.resume.is_some());
    let g = conn.expect(Method::ToolResult).await;
    let r: ToolResultParams = g.params();
    assert_eq!(r.tool_call_id, "x");
    assert!(text(&r).contains("across"));
    g.ok(&Accepted::YES);
    exec.shutdown().await;
}

/// A platform's own tool, registered by name.
struct Upper;

#[async_trait::async_trait]
impl Tool for Upper {
    fn name(&self) -> &str {
        "upper"
    }
    async fn run(&self, _ctx: ToolContext, input: Value) -> ToolOutput {
        match input.get("text").and_then(Value::as_str) {
            Some(t) => ToolOutput::success(t.to_uppercase()),
            None => ToolOutput::invalid_input("text is required"),
        }
    }
}

#[tokio::test]
async fn a_platform_can_register_its_own_tool() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut tools = ToolRegistry::builtin();
    tools.register(Arc::new(Upper));
    let exec = Executor::start_with_tools(s.config(work.path()), tools)
        .await
        .unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let (served, mut events) = conn.serve();
    let _: AssignResult = served
        .call(Method::SessionAssign, &assign_params("s", 1))
        .await
        .unwrap();
    let _: Accepted = served
        .call(
            Method::ToolCall,
            &call("s", "u", "upper", json!({"text": "shout"})),
        )
        .await
        .unwrap();
    let r = loop {
        let (m, v) = tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .unwrap()
            .unwrap();
        if m == "tool.result" {
            break serde_json::from_value::<ToolResultParams>(v).unwrap();
        }
    };
    assert_eq!(r.content[0].text.as_deref(), Some("SHOUT"));
    exec.shutdown().await;
}
