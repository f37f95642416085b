//! The harness against a fake executor (a real WebSocket client): auth,
//! registration, the 4004 and 4008 rules, leases and fencing, the API's
//! session flow, exactly-once tool results, lost executors.

use crate::harness_common;
use bmx::harness::{HarnessEvent, SessionState};
use bmx::wire::transport::DialError;
use bmx::wire::types::{
    Accepted, Cursors, EndedParams, ProcState, ProcessReadParams, ProcessReadResult,
    ProcessStartParams, ProcessState, ReadyParams, Resume, StopParams, StopResult, Stream,
    ToolCallParams,
};
use bmx::wire::{Blob, CloseCode, Endpoint, Method, Responder};
use harness_common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[tokio::test]
async fn bad_token_is_401_and_no_common_subprotocol_is_400() {
    let h = harness().await;
    match dial(&h, "wrong").await {
        Err(DialError::Unauthorized) => {}
        Err(e) => panic!("expected 401, got {e}"),
        Ok(_) => panic!("expected 401, got an upgrade"),
    }
    let endpoint = Endpoint::parse(&h.executor_url()).unwrap();
    let only_v2 = bmx::wire::transport::dial(&endpoint, "secret-a", &[], 1 << 20, WAIT).await;
    assert!(
        matches!(only_v2, Err(DialError::NoCommonProtocol)),
        "{:?}",
        only_v2.err()
    );
    h.shutdown().await;
}

#[tokio::test]
async fn requests_before_register_are_32600() {
    let h = harness().await;
    let f = dial(&h, "secret-a").await.unwrap();
    let e = f.heartbeat().await.unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32600), "{e}");
    assert_eq!(rpc_reason(&e).as_deref(), Some("not_registered"));
    h.shutdown().await;
}

#[tokio::test]
async fn register_result_has_configured_heartbeat_and_ttl() {
    let h = harness().await;
    let mut f = dial(&h, "secret-a").await.unwrap();
    let r = f.register(None).await.unwrap();
    assert_eq!(r.executor_id, "exec-a");
    assert_eq!(r.heartbeat_interval_ms, HEARTBEAT_MS);
    assert_eq!(r.lease_ttl_ms, TTL_MS);
    assert_eq!(r.protocol, "1.1");
    assert!(!r.connection_id.is_empty());
    assert_eq!(r.max_control_frame_bytes, 1 << 20);
    assert_eq!(r.max_mcp_frame_bytes, 4 << 20);
    assert!(!r.drain);
    let hb = f.heartbeat().await.unwrap();
    assert_eq!(hb.lease_ttl_ms, TTL_MS);
    // A second register on the same connection is refused.
    let again = f.register(None).await.unwrap_err();
    assert_eq!(rpc_code(&again), Some(-32600));
    let (status, v) = api(&h).get("/v1/executors").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["executors"][0]["executorId"], "exec-a");
    assert_eq!(v["executors"][0]["connectionId"], r.connection_id.as_str());
    assert_eq!(v["executors"][0]["name"], "fake");
    assert_eq!(v["executors"][0]["state"], "ready");
    h.shutdown().await;
}

#[tokio::test]
async fn newer_connection_replaces_older_with_4004() {
    let h = harness().await;
    let mut a = dial(&h, "secret-a").await.unwrap();
    a.register(None).await.unwrap();
    let mut other = dial(&h, "secret-b").await.unwrap();
    other.register(None).await.unwrap();
    let mut b = dial(&h, "secret-a").await.unwrap();
    let rb = b.register(None).await.unwrap();
    let closed = a.closed_within(WAIT).await.expect("older closed");
    assert_eq!(closed.code, Some(CloseCode::Replaced));
    b.heartbeat().await.expect("newer lives");
    other.heartbeat().await.expect("other executor untouched");
    let execs = h.executors();
    assert_eq!(execs.len(), 2);
    let a_view = execs.iter().find(|e| e.executor_id == "exec-a").unwrap();
    assert_eq!(a_view.connection_id, rb.connection_id);
    h.shutdown().await;
}

#[tokio::test]
async fn racing_registers_leave_exactly_one_connection() {
    let h = harness().await;
    for round in 0..25 {
        let token = format!("id:race-{round}");
        let mut a = dial(&h, &token).await.unwrap();
        let mut b = dial(&h, &token).await.unwrap();
        let (ra, rb) = tokio::join!(a.register(None), b.register(None));
        // Exactly one is closed with 4004 ...
        let (loser, survivor, survivor_reg) = tokio::select! {
            c = &mut a.closed => (c.unwrap(), b, rb),
            c = &mut b.closed => (c.unwrap(), a, ra),
            _ = tokio::time::sleep(WAIT) => panic!("round {round}: nobody was replaced"),
        };
        assert_eq!(loser.code, Some(CloseCode::Replaced), "round {round}");
        // ... and the other registered and stays.
        let reg = survivor_reg.unwrap_or_else(|e| panic!("round {round}: survivor: {e}"));
        let mut survivor = survivor;
        survivor.connection_id = reg.connection_id.clone();
        survivor.heartbeat().await.expect("survivor lives");
        assert!(survivor
            .closed_within(Duration::from_millis(50))
            .await
            .is_none());
        let live: Vec<_> = h
            .executors()
            .into_iter()
            .filter(|e| e.executor_id == format!("race-{round}"))
            .collect();
        assert_eq!(live.len(), 1, "round {round}");
        assert_eq!(live[0].connection_id, reg.connection_id, "round {round}");
        survivor.link.close(CloseCode::Normal, "done");
    }
    h.shutdown().await;
}

#[tokio::test]
async fn silent_connection_gets_4008_while_heartbeating_one_survives() {
    let h = harness().await;
    let mut alive = dial(&h, "secret-a").await.unwrap();
    alive.register(None).await.unwrap();
    alive.keep_alive();
    let mut silent = dial(&h, "secret-b").await.unwrap();
    silent.register(None).await.unwrap();
    let started = Instant::now();
    let closed = silent
        .closed_within(Duration::from_millis(TTL_MS + 1_500))
        .await
        .expect("silent connection closed within TTL + slack");
    assert_eq!(closed.code, Some(CloseCode::LeaseExpired));
    assert!(started.elapsed() >= Duration::from_millis(TTL_MS / 2));
    tokio::time::sleep(Duration::from_millis(300)).await;
    alive
        .heartbeat()
        .await
        .expect("heartbeating connection survives");
    assert!(alive
        .closed_within(Duration::from_millis(10))
        .await
        .is_none());
    let ids: Vec<String> = h.executors().into_iter().map(|e| e.executor_id).collect();
    assert_eq!(ids, vec!["exec-a".to_string()]);
    h.shutdown().await;
}

#[tokio::test]
async fn api_session_flow_with_a_fake_executor() {
    let h = harness().await;
    let mut events = h.events();
    let mut f = dial(&h, "secret-a").await.unwrap();
    f.register(None).await.unwrap();
    f.keep_alive();
    let client = api(&h);

    // No such session yet: 404 in the error format.
    let (status, v) = client.get("/v1/sessions/nope").await.unwrap();
    assert_eq!(status, 404);
    assert_eq!(v["error"]["code"], -32011);

    let s = create_session(
        &h,
        &mut f,
        json!({"sessionId": "s1", "metadata": {"k": "v"}}),
    )
    .await;
    assert_eq!(s["executorId"], "exec-a");
    assert_eq!(s["fencingToken"], 1);
    let accepted: Accepted = f
        .call(
            Method::SessionReady,
            &ReadyParams {
                session_id: "s1".into(),
                work_id: "s1".into(),
                lease_token: s["leaseToken"].as_str().unwrap().into(),
            },
        )
        .await
        .unwrap();
    assert!(accepted.accepted);
    // Same id again while it lives: 409.
    let (status, _) = client
        .post("/v1/sessions", &json!({"sessionId": "s1"}))
        .await
        .unwrap();
    assert_eq!(status, 409);

    // Process start.
    let c = client.clone();
    let task = tokio::spawn(async move {
        c.post(
            "/v1/sessions/s1/processes",
            &json!({"processId": "p1", "argv": ["echo", "hi"]}),
        )
        .await
        .unwrap()
    });
    let (p, r): (ProcessStartParams, Responder) = f.expect(Method::ProcessStart).await;
    assert_eq!((p.session_id.as_str(), p.process_id.as_str()), ("s1", "p1"));
    assert_eq!(p.argv, vec!["echo", "hi"]);
    r.ok(&ProcessState {
        accepted: true,
        process_id: "p1".into(),
        pid: Some(42),
        state: ProcState::Running,
        started_at: "2025-01-01T00:00:00Z".into(),
        ended_at: None,
        exit_code: None,
        exit_signal: None,
        reason: None,
        message: None,
        cursors: Cursors::default(),
    });
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["pid"], 42);

    // Output: a long poll forwarded as process.read with waitMs.
    let c = client.clone();
    let task = tokio::spawn(async move {
        c.get("/v1/sessions/s1/processes/p1/output?stream=stdout&cursor=0&waitMs=1000")
            .await
            .unwrap()
    });
    let (p, r): (ProcessReadParams, Responder) = f.expect(Method::ProcessRead).await;
    assert_eq!(p.wait_ms, Some(1000));
    assert_eq!(p.stream, Stream::Stdout);
    r.ok(&ProcessReadResult {
        process_id: "p1".into(),
        stream: Stream::Stdout,
        data: Blob::from(b"hi\n".to_vec()),
        from_cursor: 0,
        next_cursor: 3,
        earliest_cursor: 0,
        gap: false,
        truncated: false,
        eof: true,
        state: ProcState::Exited,
        exit_code: Some(0),
        exit_signal: None,
        ended_at: None,
        reason: None,
        file_transfer: None,
    });
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["data"], "aGkK");
    assert_eq!(v["nextCursor"], 3);
    assert_eq!(v["exitCode"], 0);

    // Tool call: the result, sent twice, is delivered once.
    let c = client.clone();
    let task = tokio::spawn(async move {
        c.post(
            "/v1/sessions/s1/tools",
            &json!({"tool": "bash", "input": {"command": "echo hi"}, "toolCallId": "t1"}),
        )
        .await
        .unwrap()
    });
    let (p, r): (ToolCallParams, Responder) = f.expect(Method::ToolCall).await;
    assert_eq!(p.tool_call_id, "t1");
    r.ok(&Accepted::YES);
    for _ in 0..2 {
        let a: Accepted = f
            .call(Method::ToolResult, &tool_result("s1", "t1", "hi\n"))
            .await
            .unwrap();
        assert!(a.accepted, "duplicates are acknowledged too");
    }
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["toolCallId"], "t1");
    assert_eq!(v["content"][0]["text"], "hi\n");
    // The same id again: the stored result, no second tool.call.
    let (status, v2) = client
        .post(
            "/v1/sessions/s1/tools",
            &json!({"tool": "bash", "input": {}, "toolCallId": "t1"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(v2, v);

    // Stop: session.stop, then session.ended answers the DELETE.
    let c = client.clone();
    let task = tokio::spawn(async move { c.delete("/v1/sessions/s1").await.unwrap() });
    let (p, r): (StopParams, Responder) = f.expect(Method::SessionStop).await;
    assert_eq!(p.session_id, "s1");
    r.ok(&StopResult { stopped: true });
    let a: Accepted = f
        .call(
            Method::SessionEnded,
            &EndedParams {
                session_id: "s1".into(),
                reason: "stopped".into(),
            },
        )
        .await
        .unwrap();
    assert!(a.accepted);
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "ended");
    // A repeated session.ended is acknowledged again.
    let again: Accepted = f
        .call(
            Method::SessionEnded,
            &EndedParams {
                session_id: "s1".into(),
                reason: "stopped".into(),
            },
        )
        .await
        .unwrap();
    assert!(again.accepted);
    // Calls on the ended session: 410.
    let (status, v) = client
        .post(
            "/v1/sessions/s1/tools",
            &json!({"tool": "bash", "input": {}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 410, "{v}");

    // Exactly one ToolResult event for t1.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut results = 0;
    while let Ok(e) = events.try_recv() {
        if matches!(&e, HarnessEvent::ToolResult(r) if r.tool_call_id == "t1") {
            results += 1;
        }
    }
    assert_eq!(results, 1);
    h.shutdown().await;
}

#[tokio::test]
async fn frames_from_a_replaced_holder_are_fenced_with_32010() {
    let h = harness().await;
    let mut a = dial(&h, "secret-a").await.unwrap();
    a.register(None).await.unwrap();
    a.keep_alive();
    create_session(
        &h,
        &mut a,
        json!({"sessionId": "s1", "executorId": "exec-a"}),
    )
    .await;
    // The executor comes back on a new connection without listing s1.
    let mut a2 = dial(&h, "secret-a").await.unwrap();
    a2.register(None).await.unwrap();
    a2.keep_alive();
    assert_eq!(
        a.closed_within(WAIT).await.and_then(|c| c.code),
        Some(CloseCode::Replaced)
    );
    let info = h.sessions().get("s1").unwrap();
    assert_eq!(info.state, SessionState::Ended);
    let e = a2
        .call::<_, Accepted>(Method::ToolResult, &tool_result("s1", "t1", "x"))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32010), "{e}");
    // The session id is granted again elsewhere, with a higher fencing token.
    let mut b = dial(&h, "secret-b").await.unwrap();
    b.register(None).await.unwrap();
    b.keep_alive();
    let s = create_session(
        &h,
        &mut b,
        json!({"sessionId": "s1", "executorId": "exec-b"}),
    )
    .await;
    assert_eq!(s["fencingToken"], 2);
    let e = a2
        .call::<_, Accepted>(Method::ToolResult, &tool_result("s1", "t1", "x"))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32010), "{e}");
    assert_eq!(rpc_reason(&e).as_deref(), Some("not_holder"));
    let ok: Accepted = b
        .call(Method::ToolResult, &tool_result("s1", "t1", "x"))
        .await
        .unwrap();
    assert!(ok.accepted);
    h.shutdown().await;
}

#[tokio::test]
async fn resume_keeps_a_lease_and_stops_the_rest() {
    let h = harness().await;
    let mut a = dial(&h, "secret-a").await.unwrap();
    let ra = a.register(None).await.unwrap();
    a.keep_alive();
    create_session(&h, &mut a, json!({"sessionId": "keep"})).await;
    // The socket is lost; the lease waits for a resume.
    a.link.close(CloseCode::Normal, "gone");
    a.closed_within(WAIT).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        h.sessions().get("keep").unwrap().state,
        SessionState::Disconnected
    );
    let (status, v) = api(&h)
        .post(
            "/v1/sessions/keep/tools",
            &json!({"tool": "bash", "input": {}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "executor_disconnected");
    let mut b = dial(&h, "secret-a").await.unwrap();
    let rb = b
        .register(Some(Resume {
            executor_id: "exec-a".into(),
            last_connection_id: ra.connection_id.clone(),
            active_sessions: vec!["keep".into(), "unknown".into()],
            fencing_tokens: Default::default(),
        }))
        .await
        .unwrap();
    b.keep_alive();
    // The one it may not run is stopped with lease_expired.
    let (p, r): (StopParams, Responder) = b.expect(Method::SessionStop).await;
    assert_eq!(
        (p.session_id.as_str(), p.reason.as_str()),
        ("unknown", "lease_expired")
    );
    r.ok(&StopResult { stopped: true });
    // The kept one: same grant, now on the new connection.
    let info = h.sessions().get("keep").unwrap();
    assert_eq!(info.state, SessionState::Active);
    assert_eq!(info.fencing_token, 1);
    assert_eq!(
        info.connection_id.as_deref(),
        Some(rb.connection_id.as_str())
    );
    let ok: Accepted = b
        .call(Method::ToolResult, &tool_result("keep", "t9", "x"))
        .await
        .unwrap();
    assert!(ok.accepted);
    assert!(
        !b.sees(Method::SessionStop, Duration::from_millis(200))
            .await
    );
    // Past the TTL the lease is still held: the connection heartbeats.
    tokio::time::sleep(Duration::from_millis(TTL_MS + 200)).await;
    assert_eq!(
        h.sessions().get("keep").unwrap().state,
        SessionState::Active
    );
    h.shutdown().await;
}

#[tokio::test]
async fn lost_executor_fails_the_inflight_tool_call_with_tool_outcome_unknown() {
    let h = harness().await;
    let mut a = dial(&h, "secret-a").await.unwrap();
    a.register(None).await.unwrap();
    a.keep_alive();
    create_session(&h, &mut a, json!({"sessionId": "s1"})).await;
    let client = api(&h);
    let task = tokio::spawn(async move {
        let started = Instant::now();
        let r = client
            .post(
                "/v1/sessions/s1/tools",
                &json!({"tool": "bash", "input": {"command": "sleep 100"}}),
            )
            .await
            .unwrap();
        (r, started.elapsed())
    });
    let (_p, r): (ToolCallParams, Responder) = a.expect(Method::ToolCall).await;
    r.ok(&Accepted::YES);
    // The executor vanishes and does not come back.
    a.link.close(CloseCode::Normal, "crash");
    let ((status, v), elapsed) = task.await.unwrap();
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "tool_outcome_unknown");
    assert!(
        elapsed < Duration::from_millis(TTL_MS + 3_000),
        "{elapsed:?}"
    );
    let info = h.sessions().get("s1").unwrap();
    assert_eq!(info.state, SessionState::Ended);
    assert_eq!(info.ended_reason.as_deref(), Some("lease_expired"));
    h.shutdown().await;
}

#[tokio::test]
async fn executors_connect_over_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sock");
    let h = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .listen_unix(&path)
        .token("exec-u", "secret-u")
        .build()
        .await
        .unwrap();
    let endpoint = Endpoint::Unix { socket: path };
    assert!(matches!(
        dial_endpoint(&endpoint, "nope").await,
        Err(DialError::Unauthorized)
    ));
    let mut f = dial_endpoint(&endpoint, "secret-u").await.unwrap();
    let r = f.register(None).await.unwrap();
    assert_eq!(r.executor_id, "exec-u");
    assert!(h.wait_for_executor(Some("exec-u"), WAIT).await);
    h.shutdown().await;
}

/// One HTTP/1.1 request over a Unix socket: (status, body).
async fn unix_request(path: &std::path::Path, uri: &str, bearer: Option<&str>) -> (u16, Value) {
    use http_body_util::{BodyExt, Empty};
    let io = tokio::net::UnixStream::connect(path).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::get(uri).header(http::header::HOST, "localhost");
    if let Some(t) = bearer {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let resp = send
        .send_request(req.body(Empty::<bytes::Bytes>::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn the_api_and_executors_are_served_on_the_api_unix_socket() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    // A stale socket file of an earlier run is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let h = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .api_unix(&path)
        .token("exec-u", "secret-u")
        .api_token(Some("api-secret-0123456789".into()))
        .build()
        .await
        .unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "owner only");
    // The token applies as on TCP.
    let (status, v) = unix_request(&path, "/v1/sessions", None).await;
    assert_eq!(status, 401, "{v}");
    let (status, v) = unix_request(&path, "/v1/sessions", Some("wrong")).await;
    assert_eq!(status, 401, "{v}");
    let (status, v) = unix_request(&path, "/v1/sessions", Some("api-secret-0123456789")).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["sessions"].is_array(), "{v}");
    // The executors' upgrade route is one of the routes.
    let endpoint = Endpoint::Unix {
        socket: path.clone(),
    };
    let mut f = dial_endpoint(&endpoint, "secret-u").await.unwrap();
    assert_eq!(f.register(None).await.unwrap().executor_id, "exec-u");
    assert!(h.wait_for_executor(Some("exec-u"), WAIT).await);
    let (status, v) = unix_request(&path, "/v1/executors", Some("api-secret-0123456789")).await;
    assert_eq!(status, 200, "{v}");
    assert!(v.to_string().contains("exec-u"), "{v}");
    drop(f);
    h.shutdown().await;
    assert!(!path.exists(), "the socket file is removed at shutdown");
}

/// The build failed to listen on `path` because something holds it.
fn refused_in_use<T>(
    built: Result<T, bmx::harness::HarnessError>,
    path: &std::path::Path,
    if_built: &str,
) {
    match built {
        Err(bmx::harness::HarnessError::Listen { addr, source }) => {
            assert_eq!(addr, path.display().to_string());
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("{if_built}"),
    }
}

#[tokio::test]
async fn a_second_harness_does_not_take_over_a_live_api_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    let build = || {
        bmx::harness::Harness::builder()
            .listen("127.0.0.1:0".parse().unwrap())
            .api_unix(&path)
            .token("exec-u", "secret-u")
            .api_token(Some("api-secret-0123456789".into()))
            .build()
    };
    let first = build().await.unwrap();
    refused_in_use(build().await, &path, "the live socket was taken over");
    let (status, _) = unix_request(&path, "/v1/sessions", Some("api-secret-0123456789")).await;
    assert_eq!(status, 200, "the first harness still serves it");
    first.shutdown().await;
}

#[tokio::test]
async fn a_second_harness_does_not_take_over_a_live_executor_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sock");
    let build = || {
        bmx::harness::Harness::builder()
            .listen("127.0.0.1:0".parse().unwrap())
            .listen_unix(&path)
            .token("exec-u", "secret-u")
            .build()
    };
    let first = build().await.unwrap();
    refused_in_use(build().await, &path, "the live socket was taken over");
    let mut f = dial_endpoint(&Endpoint::Unix { socket: path }, "secret-u")
        .await
        .unwrap();
    assert_eq!(f.register(None).await.unwrap().executor_id, "exec-u");
    assert!(first.wait_for_executor(Some("exec-u"), WAIT).await);
    drop(f);
    first.shutdown().await;
}

#[tokio::test]
async fn a_build_that_fails_after_binding_the_api_socket_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    let built = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .api_unix(&path)
        .token("exec-u", "secret-u")
        .public_url(Some("ftp://example.test".into()))
        .build()
        .await;
    assert!(
        matches!(built, Err(bmx::harness::HarnessError::PublicUrl(_))),
        "the public URL is checked after the bind"
    );
    assert!(!path.exists(), "the socket file went with its listener");
}

#[tokio::test]
async fn a_path_that_is_not_a_socket_is_not_replaced_by_the_api_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    std::fs::write(&path, "not a socket").unwrap();
    let built = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .api_unix(&path)
        .token("exec-u", "secret-u")
        .build()
        .await;
    refused_in_use(built, &path, "bound over a regular file");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "not a socket");
}

#[tokio::test]
async fn api_errors_openapi_and_token() {
    let h = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("exec-a", "secret-a")
        .api_token(Some("api-secret-0123456789".into()))
        .build()
        .await
        .unwrap();
    let anon = api(&h);
    let (status, v) = anon.get("/v1/sessions").await.unwrap();
    assert_eq!(status, 401);
    assert_eq!(v["error"]["code"], -32001);
    let client = anon.token(Some("api-secret-0123456789".into()));
    let (status, doc) = client.get("/v1/openapi.json").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(doc["openapi"], "3.0.3");
    assert!(doc["paths"]["/v1/sessions/{id}/tools"]["post"].is_object());
    let (status, v) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], -32029);
    let (status, v) = client
        .post("/v1/sessions", &json!({"bogus": 1}))
        .await
        .unwrap();
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], -32602);
    let (status, _) = client.get("/v1/nope").await.unwrap();
    assert_eq!(status, 404);
    // The executor route keeps its own credential.
    let mut f = dial(&h, "secret-a").await.unwrap();
    f.register(None).await.unwrap();
    h.shutdown().await;
}

#[tokio::test]
async fn json_v1_connection_refuses_newer_methods() {
    let h = harness().await;
    let endpoint = Endpoint::parse(&h.executor_url()).unwrap();
    let json_v1 = [bmx::wire::Subprotocol::ALL[3]];
    let t = bmx::wire::transport::dial(&endpoint, "secret-a", &json_v1, 1 << 20, WAIT)
        .await
        .unwrap();
    assert_eq!(t.subprotocol.name(), "bmaexecutor.v1");
    let (link, reader) = bmx::wire::Link::start(t, "e", Default::default());
    struct Nop;
    impl bmx::wire::Dispatch for Nop {
        fn dispatch(&self, _: bmx::wire::Inbound, _: Option<Responder>) {}
    }
    tokio::spawn(reader.run(std::sync::Arc::new(Nop)));
    let r: bmx::wire::types::RegisterResult = link
        .request(Method::ExecutorRegister, &register_params(None), WAIT)
        .await
        .unwrap();
    assert_eq!(r.protocol, "1");
    let e = link
        .request::<_, Value>(
            Method::SessionEvent,
            &json!({"sessionId": "s", "turnId": "t", "eventId": "e", "sequence": 0, "event": {}}),
            WAIT,
        )
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32601), "{e}");
    // Bad params are -32602, never a dropped frame.
    let e = link
        .request::<_, Value>(Method::ExecutorHeartbeat, &json!({"connectionId": 5}), WAIT)
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32602), "{e}");
    h.shutdown().await;
}
