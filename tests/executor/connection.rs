//! Issue 2: the executor's connection against a harness stand-in (real
//! WebSocket server on 127.0.0.1), plus the bmx binary's exit statuses.

use crate::support;
use bmx::executor::Executor;
use bmx::wire::types::*;
use bmx::wire::{CloseCode, Codec, Method, Subprotocol};
use std::time::{Duration, Instant};
use support::*;
use tokio_tungstenite::tungstenite::Message;

#[tokio::test]
async fn first_frame_is_register_with_info_and_real_capabilities() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    assert_eq!(
        conn.subprotocol.name(),
        "bmaexecutor.v1.1+msgpack",
        "best offer wins"
    );
    let p = conn.register(10_000, 30_000).await;
    assert_eq!(p.protocol, "1.1");
    assert_eq!(p.executor.name, "test-executor");
    assert_eq!(p.executor.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(p.executor.os, std::env::consts::OS);
    assert!(p.resume.is_none(), "no resume on the first connection");
    let process = p.capabilities.process.expect("process capability");
    assert!(process.enabled && process.pty);
    let terminal = p.capabilities.terminal.expect("terminal capability");
    assert!(terminal.enabled && terminal.kinds == ["pty"]);
    assert_eq!(terminal.max_sessions, Some(32));
    // What it runs, and only that: MCP servers yes; agent turns only with
    // an agent configured (`--agent`), and this executor has none.
    let mcp = p.capabilities.mcp.expect("mcp advertised");
    assert!(mcp.stdio && mcp.http && mcp.secret_env);
    assert!(p.capabilities.agent.is_none());
    exec.shutdown().await;
}

#[tokio::test]
async fn heartbeats_follow_the_register_result() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register_as("exec-1", "conn-77", 100, 30_000).await;
    let started = Instant::now();
    let mut beats = 0;
    while beats < 5 {
        let g = conn.next().await;
        if g.method() == "executor.heartbeat" {
            let p: HeartbeatParams = g.params();
            assert_eq!(p.connection_id, "conn-77");
            g.ok(&HeartbeatResult {
                lease_ttl_ms: 30_000,
                server_time: now_rfc3339(),
                drain: false,
            });
            beats += 1;
        }
    }
    let took = started.elapsed();
    // 5 beats at 100 ms: well under the 10 s default interval.
    assert!(
        took >= Duration::from_millis(350) && took < Duration::from_secs(3),
        "{took:?}"
    );
    exec.shutdown().await;
}

#[tokio::test]
async fn reconnects_after_a_drop_and_resumes_its_sessions() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register_as("exec-9", "conn-a", 10_000, 30_000).await;
    let (served, _events) = conn.serve();
    let r: AssignResult = served
        .call(Method::SessionAssign, &assign_params("s1", 1))
        .await
        .unwrap();
    assert!(r.accepted);
    // The harness drops the connection (no close code that forbids reconnecting).
    served.link.close(CloseCode::GoingAway, "restarting");
    let mut conn = s.next_conn().await;
    let p = conn.register_as("exec-9", "conn-b", 10_000, 30_000).await;
    let resume = p.resume.expect("resume on reconnect");
    assert_eq!(resume.executor_id, "exec-9");
    assert_eq!(resume.last_connection_id, "conn-a");
    assert_eq!(resume.active_sessions, vec!["s1".to_owned()]);
    exec.shutdown().await;
}

#[tokio::test]
async fn backoff_grows_and_is_jittered() {
    let s = stand_in(Options {
        refuse_handshake: true,
        ..Default::default()
    })
    .await;
    let work = tempfile::tempdir().unwrap();
    let mut config = s.config(work.path());
    config.reconnect_backoff = bmx::supervisor::Backoff {
        min: Duration::from_millis(40),
        max: Duration::from_secs(5),
    };
    config.reconnect_max_attempts = Some(6);
    let exec = Executor::start(config).await.unwrap();
    let started = Instant::now();
    let exit = tokio::time::timeout(Duration::from_secs(20), exec.wait())
        .await
        .unwrap();
    assert_eq!(exit.exit_code(), 5, "{exit:?}");
    // 1 first try + 6 retries.
    assert_eq!(s.attempts.load(std::sync::atomic::Ordering::SeqCst), 7);
    // Delays are at least half of 40·2^k: 20+40+80+160+320+640 ms.
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(1260), "{took:?}");
    // And at most the full 40·(2^6−1) ms plus connect overhead.
    assert!(took < Duration::from_millis(2520 + 3000), "{took:?}");
}

#[test]
fn backoff_delays_are_jittered() {
    let b = bmx::supervisor::Backoff {
        min: Duration::from_millis(250),
        max: Duration::from_secs(30),
    };
    let delays: std::collections::HashSet<Duration> =
        (0..50).map(|_| b.delay(3, rand::random())).collect();
    assert!(
        delays.len() > 40,
        "jitter spreads the delays: {}",
        delays.len()
    );
    assert!(delays
        .iter()
        .all(|d| *d >= Duration::from_millis(1000) && *d <= Duration::from_millis(2000)));
}

async fn run_binary_against(close: CloseCode) -> (std::process::ExitStatus, usize) {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut child = executor_command(&s.url, work.path()).spawn().unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    conn.link.close(close, "test");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .unwrap()
        .unwrap();
    // Nothing dials again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    (status, s.attempts.load(std::sync::atomic::Ordering::SeqCst))
}

#[tokio::test]
async fn close_4004_exits_3_and_never_reconnects() {
    let (status, attempts) = run_binary_against(CloseCode::Replaced).await;
    assert_eq!(status.code(), Some(3));
    assert_eq!(attempts, 1);
}

#[tokio::test]
async fn close_4001_exits_4_and_never_reconnects() {
    let (status, attempts) = run_binary_against(CloseCode::CredentialRejected).await;
    assert_eq!(status.code(), Some(4));
    assert_eq!(attempts, 1);
}

#[tokio::test]
async fn http_401_exits_4() {
    let s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args([
            "executor",
            "--url",
            &s.url,
            "--token",
            "wrong",
            "--work-root",
        ])
        .arg(work.path())
        .env("RUST_LOG", "warn")
        .status()
        .await
        .unwrap();
    assert_eq!(status.code(), Some(4));
    assert_eq!(s.attempts.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn sigterm_closes_1000_and_exits_0() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut child = executor_command(&s.url, work.path()).spawn().unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let pid = child.id().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let close = conn.expect(Method::ExecutorClose).await;
    let p: CloseParams = close.params();
    assert_eq!(p.reason, "shutdown");
    let closed = tokio::time::timeout(WAIT, conn.closed)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(closed.code, Some(CloseCode::Normal));
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn drain_refuses_assign_then_closes_1001() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let (served, mut events) = conn.serve();
    let _: AssignResult = served
        .call(Method::SessionAssign, &assign_params("busy", 1))
        .await
        .unwrap();
    let d: DrainResult = served
        .call(
            Method::ExecutorDrain,
            &DrainParams {
                reason: "maintenance".into(),
                deadline_ms: Some(5_000),
            },
        )
        .await
        .unwrap();
    assert!(d.accepted);
    assert_eq!(d.active_sessions, vec!["busy".to_owned()]);
    let e = served
        .call::<_, AssignResult>(Method::SessionAssign, &assign_params("new", 1))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32029);
    assert_eq!(e.reason(), Some("draining"));
    assert_eq!(e.data.as_ref().and_then(|d| d.retryable), Some(true));
    // The running session finishes; then the executor closes with 1001.
    let _: StopResult = served
        .call(
            Method::SessionStop,
            &StopParams {
                session_id: "busy".into(),
                reason: "done".into(),
                deadline_ms: None,
                keep_workspace: false,
            },
        )
        .await
        .unwrap();
    let closed = tokio::time::timeout(WAIT, served.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(closed.code, Some(CloseCode::GoingAway));
    let mut saw_ended = false;
    while let Ok((m, _)) = events.try_recv() {
        saw_ended |= m == "session.ended";
    }
    assert!(saw_ended, "session.ended was delivered before the close");
    let exit = tokio::time::timeout(WAIT, exec.wait()).await.unwrap();
    assert_eq!(exit.exit_code(), 0);
}

#[tokio::test]
async fn oversized_frame_closes_1009() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut config = s.config(work.path());
    config.reconnect_max_attempts = Some(0);
    let exec = Executor::start(config).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    // 2 MiB: above maxControlFrameBytes, and not an mcp.frame.
    let params =
        serde_json::json!({ "sessionId": "x", "processId": "y", "argv": ["a".repeat(2 << 20)] });
    let frame = serde_json::json!({"jsonrpc": "2.0", "id": "big", "method": "process.start", "params": params});
    let msg = match conn.subprotocol.codec {
        Codec::Json => Message::Text(serde_json::to_string(&frame).unwrap().into()),
        Codec::MsgPack => Message::Binary(rmp_serde::to_vec_named(&frame).unwrap().into()),
    };
    conn.link.send_raw(msg).unwrap();
    let closed = tokio::time::timeout(WAIT, conn.closed)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(closed.code, Some(CloseCode::TooLarge));
    exec.shutdown().await;
}

#[tokio::test]
async fn malformed_frames_get_errors_and_the_connection_lives() {
    let mut s = stand_in(Options {
        supported: vec![Subprotocol::ALL[1]],
        ..Default::default()
    })
    .await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    assert_eq!(conn.subprotocol.codec, Codec::Json);
    conn.register(10_000, 30_000).await;
    conn.link
        .send_raw(Message::Text("{not json".into()))
        .unwrap();
    let err = conn.next().await;
    assert!(
        matches!(&err.frame.kind, bmx::wire::FrameKind::Error { id: None, error } if error.code == -32700)
    );
    let (served, _events) = conn.serve();
    let e = served
        .call::<_, serde_json::Value>(Method::ProcessStart, &serde_json::json!({"sessionId": 5}))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32602);
    let e = served
        .link
        .request::<_, serde_json::Value>(Method::TerminalOutput, &serde_json::json!({}), WAIT)
        .await;
    assert!(
        matches!(e, Err(bmx::wire::CallError::Rpc(ref e)) if e.code == -32601),
        "{e:?}"
    );
    // A built capability with bad params: -32602; one not built: -32012.
    let e = served
        .call::<_, serde_json::Value>(Method::McpOpen, &serde_json::json!({}))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32602);
    let e = served
        .call::<_, serde_json::Value>(Method::TurnStart, &serde_json::json!({}))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32012);
    assert_eq!(e.data.and_then(|d| d.capability).as_deref(), Some("agent"));
    let e = served
        .call::<_, serde_json::Value>(
            Method::ProcessList,
            &SessionRefParams {
                session_id: "nope".into(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32011);
    // Still alive and working.
    let r: AssignResult = served
        .call(Method::SessionAssign, &assign_params("alive", 1))
        .await
        .unwrap();
    assert!(r.accepted);
    exec.shutdown().await;
}

#[tokio::test]
async fn v1_connection_refuses_v1_1_methods() {
    let mut s = stand_in(Options {
        supported: vec![Subprotocol::ALL[3]],
        ..Default::default()
    })
    .await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    let p = conn.register(10_000, 30_000).await;
    assert_eq!(p.protocol, "1");
    let (served, _e) = conn.serve();
    let e = served
        .call::<_, serde_json::Value>(
            Method::TerminalOpen,
            &serde_json::json!({"terminalId": "t", "cols": 1, "rows": 1}),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32601);
    exec.shutdown().await;
}

#[tokio::test]
async fn unix_socket_transport_end_to_end() {
    let rig = Rig::start(Options {
        unix: true,
        ..Default::default()
    })
    .await;
    rig.assign("u1").await;
    let st: ProcessState = rig
        .conn
        .call(
            Method::ProcessStart,
            &ProcessStartParams {
                wait_ms: Some(5_000),
                ..start_params("u1", "p", &["echo", "over unix"])
            },
        )
        .await
        .unwrap();
    assert_eq!(st.exit_code, Some(0));
    let r: ProcessReadResult = rig
        .conn
        .call(
            Method::ProcessRead,
            &read_params("u1", "p", Stream::Stdout, 0, 1000),
        )
        .await
        .unwrap();
    assert_eq!(r.data.as_slice(), b"over unix\n");
    rig.shutdown().await;
}

/// A SIGTERM while the executor is still starting (connected, its
/// register not answered) is a clean shutdown too: the handlers are
/// installed before anything starts, so the daemon never dies of the
/// signal's default action (which skips the end of every session). The
/// unanswered register is cut short (`Shared::stopping`); before that it
/// was waited out (its 10 s request timeout), so a generous bound here.
#[tokio::test]
async fn sigterm_during_start_is_a_clean_exit() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut child = executor_command(&s.url, work.path()).spawn().unwrap();
    let _conn = s.next_conn().await;
    let pid = child.id().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(40), child.wait())
        .await
        .expect("the executor exits")
        .unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}");
}
