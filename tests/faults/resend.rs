//! Issue 19, "must fix" 1: requests lost in a dropped connection are sent
//! again on the resumed one, so no API call hangs.
//!
//! Real pieces: the harness (in process, real sockets), the real `bmx
//! executor` binary, and a TCP proxy between them. The proxy swallows what
//! the harness sends while tool calls, a process start and a terminal open
//! are in flight, then cuts the connection (RST). The executor reconnects
//! and resumes; every HTTP call must get its answer (each within a
//! client-side deadline), every tool must have run exactly once, and each
//! result must reach the platform once.

use crate::faults_common;
use bmx::client::ApiClient;
use bmx::harness::HarnessEvent;
use faults_common::{harness, ws_addr, ExecutorProc, Proxy};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

const CALLS: usize = 12;
/// Each HTTP call's own deadline: well past a reconnect (sub-second) and
/// below the lease TTL, so an answer can only come from a re-send.
const CALL_DEADLINE: Duration = Duration::from_secs(12);

async fn wait_until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not reached within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_lost_in_a_drop_are_sent_again_on_the_resumed_connection() {
    // Lease TTL 30 s: the executor comes back long before it runs out.
    let h = harness("exec-f", "tok-f", 30_000).await;
    let proxy = Proxy::start(ws_addr(&h.executor_url())).await;
    let work = tempfile::tempdir().unwrap();
    let _executor = ExecutorProc::spawn(&proxy.url(), "tok-f", work.path());
    assert!(
        h.wait_for_executor(Some("exec-f"), Duration::from_secs(15))
            .await,
        "the executor registers through the proxy"
    );
    let first_conn = h.executors()[0].connection_id.clone();
    let mut events = h.events();
    let client = ApiClient::new(&h.api_url()).unwrap().timeout(CALL_DEADLINE);
    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();

    // From here the harness's frames to the executor are lost.
    proxy.black_hole(true);
    let mut calls = Vec::new();
    for i in 0..CALLS {
        let client = client.clone();
        let path = format!("/v1/sessions/{sid}/tools");
        let id = format!("lost-call-{i:02}");
        calls.push(tokio::spawn(async move {
            let body = json!({
                "tool": "bash",
                "toolCallId": id,
                "input": {"command": format!("echo {id} >> ran.txt; echo out-{id}")},
            });
            (id, client.post(&path, &body).await)
        }));
    }
    let start = {
        let client = client.clone();
        let path = format!("/v1/sessions/{sid}/processes");
        tokio::spawn(async move {
            let body = json!({"processId": "lost-proc",
                "argv": ["sh", "-c", "echo started >> started.txt"], "waitMs": 5000});
            client.post(&path, &body).await
        })
    };
    let terminal = {
        let client = client.clone();
        tokio::spawn(async move {
            let body = json!({"terminalId": "lost-term", "argv": ["cat"]});
            client.post("/v1/executors/exec-f/terminals", &body).await
        })
    };
    // Every request reached the wire (and was swallowed) ...
    wait_until("all requests swallowed", Duration::from_secs(10), || {
        (0..CALLS).all(|i| proxy.swallowed_contains(&format!("lost-call-{i:02}")))
            && proxy.swallowed_contains("lost-proc")
            && proxy.swallowed_contains("lost-term")
    })
    .await;
    // ... then the connection is cut.
    proxy.sever();
    proxy.black_hole(false);

    let mut answered = 0;
    for c in calls {
        let (id, r) = c.await.unwrap();
        let (status, v) =
            r.unwrap_or_else(|e| panic!("{id}: no answer within {CALL_DEADLINE:?}: {e}"));
        assert_eq!(status, 200, "{id}: {v}");
        assert_eq!(v["toolCallId"], id.as_str());
        assert_eq!(v["outcome"], "succeeded", "{id}: {v}");
        let text = v["content"][0]["text"].as_str().unwrap_or_default();
        assert!(text.contains(&format!("out-{id}")), "{id}: {text}");
        answered += 1;
    }
    assert_eq!(answered, CALLS);
    let (status, p) = start
        .await
        .unwrap()
        .expect("process.start answered within its deadline");
    assert_eq!(status, 200, "{p}");
    assert_eq!(p["processId"], "lost-proc");
    let (status, t) = terminal
        .await
        .unwrap()
        .expect("terminal.open answered within its deadline");
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["terminalId"], "lost-term");

    // The executor really reconnected (the answers did not come over the
    // connection that was cut).
    let now_conn = h.executors()[0].connection_id.clone();
    assert_ne!(now_conn, first_conn, "a new connection");

    // Each tool ran exactly once, the process started once.
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{sid}/tools"),
            &json!({"tool": "bash", "input": {"command": "cat ran.txt; echo ---; cat started.txt"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    let text = v["content"][0]["text"].as_str().unwrap().to_owned();
    for i in 0..CALLS {
        let id = format!("lost-call-{i:02}");
        let n = text.lines().filter(|l| l.trim() == id).count();
        assert_eq!(n, 1, "{id} ran {n} times:\n{text}");
    }
    let n = text.lines().filter(|l| l.trim() == "started").count();
    assert_eq!(n, 1, "the process started {n} times:\n{text}");

    // And each result reached the platform's event stream once.
    let mut seen: HashMap<String, usize> = HashMap::new();
    while let Ok(e) = events.try_recv() {
        if let HarnessEvent::ToolResult(r) = e {
            *seen.entry(r.tool_call_id).or_default() += 1;
        }
    }
    for i in 0..CALLS {
        let id = format!("lost-call-{i:02}");
        assert_eq!(
            seen.get(&id).copied(),
            Some(1),
            "{id} delivered {:?} times",
            seen.get(&id)
        );
    }

    let (status, _) = client
        .delete("/v1/executors/exec-f/terminals/lost-term")
        .await
        .unwrap();
    assert_eq!(status, 200);
    let (status, _) = client.delete(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200);
    drop(_executor);
    h.shutdown().await;
}

/// The other side of the rule: when the executor does not come back
/// within the lease TTL, a tool call lost with the connection is answered
/// 502 `tool_outcome_unknown` (not left hanging, not re-sent forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_call_whose_lease_expires_answers_tool_outcome_unknown() {
    let h = harness("exec-g", "tok-g", 2_000).await;
    let proxy = Proxy::start(ws_addr(&h.executor_url())).await;
    let work = tempfile::tempdir().unwrap();
    let mut executor = ExecutorProc::spawn(&proxy.url(), "tok-g", work.path());
    assert!(
        h.wait_for_executor(Some("exec-g"), Duration::from_secs(15))
            .await
    );
    let client = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(15));
    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();
    proxy.black_hole(true);
    let call = {
        let client = client.clone();
        let path = format!("/v1/sessions/{sid}/tools");
        tokio::spawn(async move {
            client
                .post(
                    &path,
                    &json!({"tool": "bash", "toolCallId": "doomed", "input": {"command": "echo x"}}),
                )
                .await
        })
    };
    wait_until("the call swallowed", Duration::from_secs(10), || {
        proxy.swallowed_contains("doomed")
    })
    .await;
    // The executor is gone for good: it cannot resume.
    drop(executor.child.take().map(|mut c| {
        let _ = c.kill();
        c.wait()
    }));
    proxy.sever();
    let (status, v): (u16, Value) = call.await.unwrap().expect("answered within the deadline");
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "tool_outcome_unknown", "{v}");
    h.shutdown().await;
}
