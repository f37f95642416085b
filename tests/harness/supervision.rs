//! The harness's supervision, seen from outside: a panic is injected into
//! the leases actor or into a connection actor (through `#[doc(hidden)]`
//! hooks that neither the wire nor the HTTP API reach), and the tests check
//! what the executor (the fake one, or the real one) and the API see.

use crate::harness_common;
use bmx::harness::{HarnessHandle, SessionState};
use bmx::wire::types::{Accepted, Resume, ToolCallParams};
use bmx::wire::{CloseCode, Method, Responder};
use harness_common::*;
use serde_json::json;
use std::time::Duration;

/// A tool call through the API, answered by the fake: proves the session's
/// route and lease (the fake's result is fenced by it).
async fn tool_round_trip(h: &HarnessHandle, fake: &mut Fake, session: &str, call: &str) {
    let client = api(h);
    let path = format!("/v1/sessions/{session}/tools");
    let body = json!({"tool": "bash", "input": {"command": "true"}, "toolCallId": call});
    let task = tokio::spawn(async move { client.post(&path, &body).await.unwrap() });
    let (p, r): (ToolCallParams, Responder) = fake.expect(Method::ToolCall).await;
    assert_eq!(p.tool_call_id, call);
    r.ok(&Accepted::YES);
    let a: Accepted = fake
        .call(Method::ToolResult, &tool_result(session, call, "done"))
        .await
        .unwrap();
    assert!(a.accepted);
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"][0]["text"], "done");
}

/// DELETE a session; the fake acknowledges the stop and reports the end.
async fn stop_session(h: &HarnessHandle, fake: &mut Fake, session: &str) {
    let client = api(h);
    let path = format!("/v1/sessions/{session}");
    let task = tokio::spawn(async move { client.delete(&path).await.unwrap() });
    fake.end_as_stopped(session).await;
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "ended");
}

/// Poll `cond` every 20 ms for at most `WAIT` (a bound, not a timing claim).
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

#[tokio::test]
async fn leases_crash_keeps_sessions_tokens_and_the_api() {
    let h = harness().await;
    let mut f = dial(&h, "secret-a").await.unwrap();
    f.register(None).await.unwrap();
    f.keep_alive();
    let keep = create_session(&h, &mut f, json!({"sessionId": "keep"})).await;
    assert_eq!(keep["fencingToken"], 1);
    let again = create_session(&h, &mut f, json!({"sessionId": "again"})).await;
    assert_eq!(again["fencingToken"], 1);
    stop_session(&h, &mut f, "again").await;

    assert!(h.inject_leases_panic().await, "a new leases actor started");

    // The platform's view and the registry are intact.
    let (status, v) = api(&h).get("/v1/sessions/keep").await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "active");
    assert_eq!(v["fencingToken"], 1);
    assert_eq!(v["connectionId"], f.connection_id.as_str());
    let (_, v) = api(&h).get("/v1/sessions/again").await.unwrap();
    assert_eq!(v["state"], "ended");
    let (_, execs) = api(&h).get("/v1/executors").await.unwrap();
    assert_eq!(execs["executors"][0]["executorId"], "exec-a");
    assert_eq!(execs["executors"][0]["activeSessions"], json!(["keep"]));

    // The lease is held: the API routes to the fake, whose frames pass the fence.
    tool_round_trip(&h, &mut f, "keep", "t1").await;
    // A frame for a session the fake does not hold is still fenced.
    let e = f
        .call::<_, Accepted>(Method::ToolResult, &tool_result("again", "t2", "x"))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32010), "{e}");
    f.heartbeat().await.expect("the connection lives on");

    // The fencing counter survived: the id granted anew gets a higher token.
    let again = create_session(&h, &mut f, json!({"sessionId": "again"})).await;
    assert_eq!(again["fencingToken"], 2);
    // A session created after the crash starts as any other.
    let fresh = create_session(&h, &mut f, json!({"sessionId": "fresh"})).await;
    assert_eq!(fresh["fencingToken"], 1);
    stop_session(&h, &mut f, "keep").await;
    h.shutdown().await;
}

#[tokio::test]
async fn leases_crash_while_the_executor_is_away_keeps_its_lease_for_the_resume() {
    let h = harness().await;
    let mut a = dial(&h, "secret-a").await.unwrap();
    let ra = a.register(None).await.unwrap();
    a.keep_alive();
    create_session(&h, &mut a, json!({"sessionId": "keep"})).await;
    a.link.close(CloseCode::Normal, "gone");
    a.closed_within(WAIT).await;
    let sessions = h.sessions();
    assert!(
        eventually(|| sessions
            .get("keep")
            .is_some_and(|s| s.state == SessionState::Disconnected))
        .await
    );

    assert!(h.inject_leases_panic().await, "a new leases actor started");
    assert_eq!(
        h.sessions().get("keep").map(|s| (s.state, s.fencing_token)),
        Some((SessionState::Disconnected, 1))
    );

    // The executor comes back within the TTL and keeps the same grant.
    let mut b = dial(&h, "secret-a").await.unwrap();
    b.register(Some(Resume {
        executor_id: "exec-a".into(),
        last_connection_id: ra.connection_id.clone(),
        active_sessions: vec!["keep".into()],
        fencing_tokens: Default::default(),
    }))
    .await
    .unwrap();
    b.keep_alive();
    let info = h.sessions().get("keep").unwrap();
    assert_eq!(info.state, SessionState::Active);
    assert_eq!(info.fencing_token, 1);
    assert_eq!(
        info.connection_id.as_deref(),
        Some(b.connection_id.as_str())
    );
    tool_round_trip(&h, &mut b, "keep", "t1").await;
    h.shutdown().await;
}

#[tokio::test]
async fn leases_crash_with_the_executor_away_still_expires_the_lease() {
    let h = harness().await;
    let mut a = dial(&h, "secret-a").await.unwrap();
    a.register(None).await.unwrap();
    a.keep_alive();
    create_session(&h, &mut a, json!({"sessionId": "gone"})).await;
    a.link.close(CloseCode::Normal, "gone");
    a.closed_within(WAIT).await;
    let sessions = h.sessions();
    assert!(
        eventually(|| sessions
            .get("gone")
            .is_some_and(|s| s.state == SessionState::Disconnected))
        .await
    );
    assert!(h.inject_leases_panic().await);
    // Nobody resumes: the rebuilt timer ends the session for lease_expired.
    assert!(
        eventually(|| sessions
            .get("gone")
            .is_some_and(|s| s.state == SessionState::Ended))
        .await
    );
    let info = h.sessions().get("gone").unwrap();
    assert_eq!(info.ended_reason.as_deref(), Some("lease_expired"));
    h.shutdown().await;
}

#[tokio::test]
async fn connection_crash_closes_the_socket_and_the_fake_resumes() {
    let h = harness().await;
    let mut a = dial(&h, "secret-a").await.unwrap();
    let ra = a.register(None).await.unwrap();
    create_session(&h, &mut a, json!({"sessionId": "keep"})).await;

    assert!(h.inject_connection_panic("exec-a"));
    // The socket nobody serves is closed (at the latest on the next frame).
    let _ = a.heartbeat().await;
    let closed = a.closed_within(WAIT).await.expect("the socket closes");
    assert_eq!(closed.code, Some(CloseCode::Other(1011)), "{closed:?}");
    let sessions = h.sessions();
    assert!(
        eventually(|| sessions
            .get("keep")
            .is_some_and(|s| s.state == SessionState::Disconnected))
        .await
    );

    let mut b = dial(&h, "secret-a").await.unwrap();
    let rb = b
        .register(Some(Resume {
            executor_id: "exec-a".into(),
            last_connection_id: ra.connection_id.clone(),
            active_sessions: vec!["keep".into()],
            fencing_tokens: Default::default(),
        }))
        .await
        .unwrap();
    assert_ne!(rb.connection_id, ra.connection_id);
    b.keep_alive();
    let info = h.sessions().get("keep").unwrap();
    assert_eq!((info.state, info.fencing_token), (SessionState::Active, 1));
    tool_round_trip(&h, &mut b, "keep", "t1").await;
    // The other connections and the API were never affected.
    let execs = h.executors();
    assert_eq!(execs.len(), 1);
    assert_eq!(execs[0].connection_id, rb.connection_id);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_crash_real_executor_reconnects_and_resumes_its_session() {
    let (h, executor, _work) = harness_with_executor("exec-sup", 5_000).await;
    let client = api(&h);
    let (status, s) = client
        .post("/v1/sessions", &json!({"sessionId": "live"}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{s}");
    let first_conn = h.executors()[0].connection_id.clone();

    assert!(h.inject_connection_panic("exec-sup"));

    // The executor reconnects on a new connection and resumes the session.
    let resumed = || {
        let execs = h.executors();
        let info = h.sessions().get("live");
        execs.len() == 1
            && execs[0].connection_id != first_conn
            && info.is_some_and(|i| {
                i.state == SessionState::Active
                    && i.connection_id.as_deref() == Some(execs[0].connection_id.as_str())
            })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !resumed() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(resumed(), "the executor resumed on a new connection");
    let info = h.sessions().get("live").unwrap();
    assert_eq!(info.fencing_token, 1, "same grant");

    // The session works on the new connection.
    let (status, t) = client
        .post(
            "/v1/sessions/live/tools",
            &json!({"tool": "bash", "input": {"command": "echo resumed"}, "toolCallId": "tc1"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{t}");
    assert!(
        t["content"][0]["text"]
            .as_str()
            .is_some_and(|s| s.contains("resumed")),
        "{t}"
    );
    let (status, ended) = client.delete("/v1/sessions/live").await.unwrap();
    assert_eq!(status, 200, "{ended}");
    assert_eq!(ended["state"], "ended");
    let exit = executor.shutdown().await;
    assert_eq!(exit.exit_code(), 0, "{exit:?}");
    h.shutdown().await;
}
