//! Issue 19, "must build": the executor journal. A tool result the harness
//! has not acknowledged survives `kill -9` of the executor: the executor
//! started again on the same work root delivers it, and the API caller gets
//! it exactly once.
//!
//! Real pieces: the harness (in process), the real `bmx executor` binary
//! (killed with SIGKILL, then started again), and a TCP proxy that
//! swallows what the executor sends once the tool is running, so its
//! `tool.result` never reaches the harness before the kill.

use crate::faults_common;
use bmx::client::ApiClient;
use bmx::harness::HarnessEvent;
use faults_common::{free_port, harness, scrape, ws_addr, ExecutorProc, Proxy};
use serde_json::json;
use std::time::Duration;

async fn wait_until(what: &str, within: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not reached within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn metric(url: &str, name: &str) -> Option<f64> {
    let r = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    if r.status() != 200 {
        return None;
    }
    scrape(url).await.get(name).copied()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_unacknowledged_at_kill_9_is_delivered_once_after_restart() {
    let h = harness("exec-j", "tok-j", 30_000).await;
    let proxy = Proxy::start(ws_addr(&h.executor_url())).await;
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let listen = format!("127.0.0.1:{port}");
    let mut first = ExecutorProc::spawn_with(
        &proxy.url(),
        "tok-j",
        work.path(),
        &["--metrics-listen", &listen],
    );
    assert!(
        h.wait_for_executor(Some("exec-j"), Duration::from_secs(15))
            .await
    );
    let mut events = h.events();
    let client = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(60));
    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();

    // The marks are in the session's workspace: its sandbox writes
    // nowhere else (issue 48).
    let marks = work.path().join("sessions").join(&sid);
    let ran = marks.join("ran");
    let go = marks.join("go");
    let command = format!(
        "echo once >> {ran}; while [ ! -e {go} ]; do sleep 0.05; done; echo journaled-result",
        ran = ran.display(),
        go = go.display()
    );
    let call = {
        let client = client.clone();
        let path = format!("/v1/sessions/{sid}/tools");
        tokio::spawn(async move {
            client
                .post(
                    &path,
                    &json!({"tool": "bash", "toolCallId": "kept", "input": {"command": command}}),
                )
                .await
        })
    };
    // The tool runs; from now on nothing the executor sends arrives.
    wait_until("the tool runs", Duration::from_secs(15), async || {
        ran.exists()
    })
    .await;
    proxy.black_hole_up(true);
    std::fs::write(&go, b"").unwrap();
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "once\n");
    // The executor has the result, journaled, unacknowledged.
    wait_until(
        "the result journaled",
        Duration::from_secs(15),
        async || {
            metric(&metrics, "bmx_executor_journal_entries").await == Some(1.0)
                && metric(
                    &metrics,
                    "bmx_executor_tool_calls_total{outcome=\"succeeded\"}",
                )
                .await
                    == Some(1.0)
        },
    )
    .await;
    // kill -9: no shutdown, no sweep, nothing flushed on the way out.
    let mut child = first.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    proxy.sever();
    proxy.black_hole_up(false);
    assert!(!call.is_finished(), "the caller is still waiting");

    // The same work root, a new process.
    let _second = ExecutorProc::spawn(&proxy.url(), "tok-j", work.path());
    let (status, v) = call
        .await
        .unwrap()
        .expect("the call is answered within its deadline");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["toolCallId"], "kept");
    assert_eq!(v["outcome"], "succeeded", "{v}");
    let text = v["content"][0]["text"].as_str().unwrap_or_default();
    assert!(text.contains("journaled-result"), "{text}");
    // The restarted executor ends the session and removes its workspace
    // (the marks with it): a second run would have left two lines.
    let runs = std::fs::read_to_string(&ran).unwrap_or_default();
    assert!(runs.lines().count() <= 1, "the tool ran once: {runs:?}");

    // The restarted executor no longer runs the session: it ends it, after
    // the result.
    let path = format!("/v1/sessions/{sid}");
    wait_until("the session ended", Duration::from_secs(20), async || {
        let (_, s) = client.get(&path).await.unwrap();
        s["state"] == "ended"
    })
    .await;
    let (_, s) = client.get(&path).await.unwrap();
    assert_eq!(s["endedReason"], "executor_restarted", "{s}");

    // Delivered exactly once on the event stream too.
    let mut results = 0;
    while let Ok(e) = events.try_recv() {
        if let HarnessEvent::ToolResult(r) = e {
            assert_eq!(r.tool_call_id, "kept");
            results += 1;
        }
    }
    assert_eq!(results, 1, "one tool.result delivered");
    drop(_second);
    h.shutdown().await;
}
