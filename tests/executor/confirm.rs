//! Issue 20, part 1: tool calls held for a person at the executor's machine
//! (`permission.mode: always_ask`, `--confirm always`), answered through the
//! local socket and the real `bmx confirm` binary.
//!
//! Every call here is a `bash` that appends a line to `ran.txt` in the
//! workspace: the file's lines count how often the tool really ran.

use crate::support;
use bmx::executor::confirm::{client, socket_path, LocalRequest, LocalResponse, PendingView};
use bmx::wire::types::*;
use bmx::wire::{Method, RpcError};
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use support::*;

fn call(id: &str, mode: Option<&str>, deadline_ms: Option<u64>) -> ToolCallParams {
    ToolCallParams {
        session_id: "s".into(),
        tool_call_id: id.into(),
        tool: "bash".into(),
        input: json!({"command": format!("echo {id} >> ran.txt")}),
        deadline_ms,
        permission: mode.map(|m| Permission { mode: m.into() }),
    }
}

async fn send(conn: &Served, p: &ToolCallParams) {
    let a: Accepted = conn.call(Method::ToolCall, p).await.unwrap();
    assert!(a.accepted);
}

async fn list(sock: &Path) -> Vec<PendingView> {
    let r = client::request(sock, &LocalRequest::List, WAIT)
        .await
        .unwrap();
    assert!(r.ok, "{r:?}");
    r.pending.unwrap()
}

/// Wait until the call `id` is listed as pending; its confirmation id.
async fn pending(sock: &Path, id: &str) -> String {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if let Some(p) = list(sock).await.into_iter().find(|p| p.tool_call_id == id) {
            return p.id;
        }
        assert!(std::time::Instant::now() < deadline, "{id} never pending");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `bmx confirm ARGS --socket SOCK`, the real binary.
async fn bmx_confirm(sock: &Path, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .arg("confirm")
        .args(args)
        .arg("--socket")
        .arg(sock)
        .output()
        .await
        .unwrap()
}

fn ran(workspace: &Path) -> Vec<String> {
    std::fs::read_to_string(workspace.join("ran.txt"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn result(rig: &mut Rig, id: &str) -> ToolResultParams {
    let v = rig.event("tool.result", |v| v["toolCallId"] == id).await;
    serde_json::from_value(v).unwrap()
}

fn setup(rig: &Rig) -> (PathBuf, PathBuf) {
    (
        socket_path(rig.work.path()),
        rig.work.path().join("sessions").join("s"),
    )
}

#[tokio::test]
async fn allowed_through_bmx_confirm_runs_once() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let (sock, ws) = setup(&rig);
    // Only the executor's user: the directory 0700, the socket 0600.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&sock), 0o600);
    assert_eq!(mode(sock.parent().unwrap()), 0o700);
    send(&rig.conn, &call("a", Some("always_ask"), None)).await;
    let id = pending(&sock, "a").await;
    // `ls` shows what the person is asked about.
    let out = bmx_confirm(&sock, &["ls", "--json"]).await;
    assert!(out.status.success(), "{out:?}");
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entry = &listed["pending"][0];
    assert_eq!(entry["id"], id.as_str());
    assert_eq!(entry["tool"], "bash");
    assert!(
        entry["input"].as_str().unwrap().contains("ran.txt"),
        "{entry}"
    );
    assert!(entry["expiresInMs"].as_u64().unwrap() > 0);
    assert!(ran(&ws).is_empty(), "the tool ran before anyone allowed it");
    let out = bmx_confirm(&sock, &["allow", &id]).await;
    assert!(out.status.success(), "{out:?}");
    let r = result(&mut rig, "a").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert_eq!(ran(&ws), vec!["a"]);
    // Answered: gone from the list, and a second answer is refused.
    assert!(list(&sock).await.is_empty());
    let out = bmx_confirm(&sock, &["deny", &id]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_id"));
    rig.shutdown().await;
}

#[tokio::test]
async fn denied_never_runs() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let (sock, ws) = setup(&rig);
    send(&rig.conn, &call("d", Some("always_ask"), None)).await;
    let id = pending(&sock, "d").await;
    let out = bmx_confirm(&sock, &["deny", &id]).await;
    assert!(out.status.success(), "{out:?}");
    let r = result(&mut rig, "d").await;
    assert!(r.is_error);
    assert_eq!(r.outcome, Outcome::Failed);
    assert_eq!(r.reason.as_deref(), Some("local_confirmation_denied"));
    assert!(ran(&ws).is_empty());
    rig.shutdown().await;
}

#[tokio::test]
async fn unanswered_expires_at_the_call_deadline() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let (sock, ws) = setup(&rig);
    send(&rig.conn, &call("e", Some("always_ask"), Some(300))).await;
    let r = result(&mut rig, "e").await;
    assert!(r.is_error);
    assert_eq!(r.reason.as_deref(), Some("local_confirmation_expired"));
    assert!(list(&sock).await.is_empty());
    assert!(ran(&ws).is_empty());
    rig.shutdown().await;
}

#[tokio::test]
async fn a_repeated_call_while_pending_asks_once_and_runs_once() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let (sock, ws) = setup(&rig);
    send(&rig.conn, &call("r", Some("always_ask"), None)).await;
    let id = pending(&sock, "r").await;
    send(&rig.conn, &call("r", Some("always_ask"), None)).await;
    send(&rig.conn, &call("r", Some("always_ask"), None)).await;
    let all = list(&sock).await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0].id, id);
    let r = client::request(
        &sock,
        &LocalRequest::Answer {
            id: id.clone(),
            decision: bmx::executor::confirm::LocalDecision::Allow,
        },
        WAIT,
    )
    .await
    .unwrap();
    assert_eq!(r, LocalResponse::answered(id));
    let first = result(&mut rig, "r").await;
    assert_eq!(first.outcome, Outcome::Succeeded);
    // After the result a repeat re-sends it; nothing asks or runs again.
    send(&rig.conn, &call("r", Some("always_ask"), None)).await;
    let again = result(&mut rig, "r").await;
    assert_eq!(again.outcome, Outcome::Succeeded);
    assert!(list(&sock).await.is_empty());
    assert_eq!(ran(&ws), vec!["r"]);
    rig.shutdown().await;
}

#[tokio::test]
async fn cancel_and_session_stop_end_a_pending_call() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let (sock, ws) = setup(&rig);
    // tool.cancel
    send(&rig.conn, &call("c", Some("always_ask"), None)).await;
    pending(&sock, "c").await;
    let c: ToolCancelResult = rig
        .conn
        .call(
            Method::ToolCancel,
            &ToolCancelParams {
                session_id: "s".into(),
                tool_call_id: "c".into(),
                reason: "test".into(),
            },
        )
        .await
        .unwrap();
    assert!(c.canceled);
    let r = result(&mut rig, "c").await;
    assert_eq!(r.outcome, Outcome::Canceled);
    assert!(list(&sock).await.is_empty());
    // session.stop: answered within the wait, the call withdrawn.
    send(&rig.conn, &call("x", Some("always_ask"), None)).await;
    let id = pending(&sock, "x").await;
    let stopped: StopResult = tokio::time::timeout(
        WAIT,
        rig.conn.call(
            Method::SessionStop,
            &StopParams {
                session_id: "s".into(),
                reason: "test".into(),
                deadline_ms: Some(1000),
                keep_workspace: true,
            },
        ),
    )
    .await
    .expect("session.stop does not hang on a pending confirmation")
    .unwrap();
    assert!(stopped.stopped);
    // The call withdraws its entry as it ends (after the stop's answer).
    let deadline = std::time::Instant::now() + WAIT;
    while !list(&sock).await.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "still pending after session.stop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Too late to allow: the call is gone and never runs.
    let out = bmx_confirm(&sock, &["allow", &id]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(ran(&ws).is_empty());
    rig.shutdown().await;
}

#[tokio::test]
async fn modes_are_checked_and_advertised() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let e: RpcError = rig
        .conn
        .call::<_, Accepted>(Method::ToolCall, &call("u", Some("sometimes"), None))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32602);
    // always_allow and no permission run at once.
    let mut rig = rig;
    send(&rig.conn, &call("y", Some("always_allow"), None)).await;
    assert_eq!(result(&mut rig, "y").await.outcome, Outcome::Succeeded);
    send(&rig.conn, &call("n", None, None)).await;
    assert_eq!(result(&mut rig, "n").await.outcome, Outcome::Succeeded);
    rig.shutdown().await;
}

#[tokio::test]
async fn the_socket_refuses_oversized_and_malformed_lines() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let rig = Rig::start(Options::default()).await;
    let (sock, _) = setup(&rig);
    let s = tokio::net::UnixStream::connect(&sock).await.unwrap();
    let (r, mut w) = s.into_split();
    let mut r = BufReader::new(r);
    w.write_all(b"{\"op\":\"rm\"}\n").await.unwrap();
    let mut line = String::new();
    r.read_line(&mut line).await.unwrap();
    let a: LocalResponse = serde_json::from_str(&line).unwrap();
    assert_eq!(a.error.unwrap().code, "bad_request");
    // The same connection goes on after a bad line...
    w.write_all(b"{\"op\":\"list\"}\n").await.unwrap();
    line.clear();
    r.read_line(&mut line).await.unwrap();
    assert!(serde_json::from_str::<LocalResponse>(&line).unwrap().ok);
    // ...but not after one past the limit.
    let big = vec![b'x'; bmx::executor::confirm::MAX_LINE + 10];
    let _ = w.write_all(&big).await;
    line.clear();
    r.read_line(&mut line).await.unwrap();
    let a: LocalResponse = serde_json::from_str(&line).unwrap();
    assert_eq!(a.error.unwrap().code, "too_large");
    line.clear();
    assert_eq!(r.read_line(&mut line).await.unwrap(), 0, "closed");
    rig.shutdown().await;
}

/// The real daemon with `--confirm always`: an `always_allow` call waits
/// too, the capability says so, and `bmx confirm` (found through
/// `--work-root`) answers it.
#[tokio::test]
async fn the_daemon_with_confirm_always_asks_for_every_call() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let _child = executor_command(&s.url, work.path())
        .args(["--confirm", "always"])
        .spawn()
        .unwrap();
    let mut conn = s.next_conn().await;
    let reg = conn.register(10_000, 30_000).await;
    let tools = reg.capabilities.tools.expect("tools advertised");
    assert_eq!(tools.permission_modes, vec!["always_ask".to_owned()]);
    assert!(tools.local_confirmation);
    let (conn, mut events) = conn.serve();
    let _: AssignResult = conn
        .call(Method::SessionAssign, &assign_params("s", 1))
        .await
        .unwrap();
    send(&conn, &call("k", Some("always_allow"), None)).await;
    let ws = work.path().join("sessions").join("s");
    let root = work.path().to_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + WAIT;
    let id = loop {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
            .args(["confirm", "ls", "--json", "--work-root", &root])
            .output()
            .await
            .unwrap();
        if out.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            if let Some(id) = v["pending"][0]["id"].as_str() {
                break id.to_owned();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never pending: {out:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(ran(&ws).is_empty());
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["confirm", "allow", &id, "--work-root", &root])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let deadline = tokio::time::Instant::now() + WAIT;
    let r: ToolResultParams = loop {
        let (m, v) = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("a tool.result")
            .unwrap();
        if m == "tool.result" && v["toolCallId"] == "k" {
            break serde_json::from_value(v).unwrap();
        }
    };
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert_eq!(ran(&ws), vec!["k"]);
}

/// A `request` event of the visor's stream whose tool call is `call`.
async fn visor_request(events: &mut crate::visor_support::Ws, call: &str) -> (String, String) {
    let seen = crate::visor_support::events_until(events, call, |e| {
        e["type"] == "request" && e["request"]["tool"]["id"] == call
    })
    .await;
    let e = seen.last().unwrap();
    (
        e["session"].as_str().unwrap().to_owned(),
        e["request"]["id"].as_str().unwrap().to_owned(),
    )
}

/// `bmx visor` on the same machine shows held calls as `request` events of
/// an observed session and answers them with its own `answer`; answers
/// given elsewhere (`bmx confirm`) close the request in the visor too.
#[tokio::test]
async fn answered_through_the_visor() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let (sock, ws) = setup(&rig);
    let visor =
        crate::visor_support::Visor::start_with(&["--confirm-socket", sock.to_str().unwrap()]);
    let mut events = visor.ws("/v1/events?types=request,request_closed").await;

    // Allowed in the visor: runs once, the request closes.
    send(&rig.conn, &call("v1", Some("always_ask"), None)).await;
    let (session, req) = visor_request(&mut events, "v1").await;
    let view = visor.session(&session).await;
    assert_eq!(view["kind"], "observed");
    assert_eq!(view["agent"], "bmx-executor");
    assert_eq!(view["state"], "waiting", "{view}");
    assert_eq!(view["pending"][0]["id"], req.as_str());
    assert!(view["pending"][0]["input"]["command"]
        .as_str()
        .unwrap()
        .contains("ran.txt"));
    assert!(ran(&ws).is_empty(), "ran before anyone allowed it");
    let path = format!("/v1/sessions/{session}/answer");
    // Bad answers first: an unknown id, a changed input.
    let (status, _) = visor
        .req(
            "POST",
            &path,
            Some(json!({"requestId": "c999", "allow": true})),
        )
        .await;
    assert_eq!(status, 404);
    let (status, _) = visor
        .req(
            "POST",
            &path,
            Some(json!({"requestId": req, "allow": true, "updatedInput": {"command": "rm -rf /"}})),
        )
        .await;
    assert_eq!(status, 400);
    visor
        .ok(
            "POST",
            &path,
            Some(json!({"requestId": req, "allow": true})),
        )
        .await;
    let r = result(&mut rig, "v1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert_eq!(ran(&ws), vec!["v1"]);
    crate::visor_support::events_until(&mut events, "closed", |e| {
        e["type"] == "request_closed" && e["requestId"] == req.as_str()
    })
    .await;
    let (status, _) = visor
        .req(
            "POST",
            &path,
            Some(json!({"requestId": req, "allow": false})),
        )
        .await;
    assert_eq!(status, 409, "a second answer");
    visor
        .until(&format!("/v1/sessions/{session}"), "idle", |v| {
            v["state"] == "idle"
        })
        .await;

    // Denied in the visor: never runs.
    send(&rig.conn, &call("v2", Some("always_ask"), None)).await;
    let (same, req) = visor_request(&mut events, "v2").await;
    assert_eq!(same, session, "one observed session per executor");
    visor
        .ok(
            "POST",
            &path,
            Some(json!({"requestId": req, "allow": false})),
        )
        .await;
    let r = result(&mut rig, "v2").await;
    assert_eq!(r.reason.as_deref(), Some("local_confirmation_denied"));
    assert_eq!(ran(&ws), vec!["v1"]);

    // Answered with `bmx confirm` instead: the visor's request closes.
    send(&rig.conn, &call("v3", Some("always_ask"), None)).await;
    let (_, req) = visor_request(&mut events, "v3").await;
    let out = bmx_confirm(&sock, &["allow", &req]).await;
    assert!(out.status.success(), "{out:?}");
    let closed = crate::visor_support::events_until(&mut events, "closed elsewhere", |e| {
        e["type"] == "request_closed" && e["requestId"] == req.as_str()
    })
    .await;
    assert_eq!(closed.last().unwrap()["reason"], "resolved");
    let r = result(&mut rig, "v3").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");

    // The executor goes away with a call pending: the request closes.
    send(&rig.conn, &call("v4", Some("always_ask"), None)).await;
    let (_, req) = visor_request(&mut events, "v4").await;
    assert_eq!(ran(&ws), vec!["v1", "v3"]);
    rig.shutdown().await;
    let closed = crate::visor_support::events_until(&mut events, "executor gone", |e| {
        e["type"] == "request_closed" && e["requestId"] == req.as_str()
    })
    .await;
    assert!(
        ["executor_gone", "resolved"].contains(&closed.last().unwrap()["reason"].as_str().unwrap()),
        "{closed:?}"
    );
}
