//! Metrics: `GET /metrics` on the harness and `bmx executor
//! --metrics-listen` serve the Prometheus / OpenMetrics text format, and
//! the values move when things happen (a session, a tool call, output
//! read, a request refused as too large, a cut connection and the
//! reconnect). Scraped and parsed like a Prometheus server would.

use crate::faults_common;
use bmx::client::ApiClient;
use faults_common::{harness, scrape, ws_addr, ExecutorProc, Proxy};
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;

fn get(m: &HashMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

async fn until(url: &str, what: &str, cond: impl Fn(&HashMap<String, f64>) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let m = scrape(url).await;
        if cond(&m) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not reached within 15 s: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_and_executor_metrics_move_with_the_work() {
    let h = harness("exec-m", "tok-m", 30_000).await;
    let proxy = Proxy::start(ws_addr(&h.executor_url())).await;
    let work = tempfile::tempdir().unwrap();
    let port = faults_common::free_port();
    let exec_metrics = format!("http://127.0.0.1:{port}/metrics");
    let _executor = ExecutorProc::spawn_with(
        &proxy.url(),
        "tok-m",
        work.path(),
        &["--metrics-listen", &format!("127.0.0.1:{port}")],
    );
    assert!(
        h.wait_for_executor(Some("exec-m"), Duration::from_secs(15))
            .await
    );
    let hm = format!("{}/metrics", h.api_url());
    let m = scrape(&hm).await;
    assert_eq!(get(&m, "bmx_harness_executor_connections"), 1.0, "{m:?}");
    assert_eq!(get(&m, "bmx_harness_sessions{state=\"active\"}"), 0.0);
    assert_eq!(get(&m, "bmx_harness_tool_call_duration_seconds_count"), 0.0);
    until(&exec_metrics, "the executor's scrape", |m| {
        get(m, "bmx_executor_connected") == 1.0 && get(m, "bmx_executor_registrations_total") == 1.0
    })
    .await;

    let client = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(20));
    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{sid}/tools"),
            &json!({"tool": "bash", "input": {"command": "echo hi"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            &json!({"processId": "p", "argv": ["sh", "-c", "printf hello; sleep 30"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    let (status, v) = client
        .get(&format!(
            "/v1/sessions/{sid}/processes/p/output?cursor=0&waitMs=5000"
        ))
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    // Output past the 1 MiB ring, read from the start: a gap.
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            &json!({"processId": "flood", "argv": ["head", "-c", "3000000", "/dev/zero"], "waitMs": 10000}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "exited", "{v}");
    let (status, v) = client
        .get(&format!(
            "/v1/sessions/{sid}/processes/flood/output?cursor=0&maxBytes=16"
        ))
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["gap"], true, "{v}");
    let big = "x".repeat((1 << 20) + 1024);
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{sid}/tools"),
            &json!({"tool": "write", "input": {"path": "big", "content": big}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 413, "{v}");

    let m = scrape(&hm).await;
    assert_eq!(
        get(&m, "bmx_harness_sessions{state=\"active\"}"),
        1.0,
        "{m:?}"
    );
    assert_eq!(
        get(&m, "bmx_harness_tool_calls_total{outcome=\"succeeded\"}"),
        1.0
    );
    assert_eq!(
        get(
            &m,
            "bmx_harness_tool_calls_total{outcome=\"frame_too_large\"}"
        ),
        1.0
    );
    assert_eq!(get(&m, "bmx_harness_tool_call_duration_seconds_count"), 2.0);
    assert_eq!(get(&m, "bmx_harness_frames_refused_total"), 1.0);
    assert_eq!(
        get(
            &m,
            "bmx_harness_process_output_bytes_total{stream=\"stdout\"}"
        ),
        5.0 + 16.0,
        "{m:?}"
    );
    assert_eq!(get(&m, "bmx_harness_ring_gaps_total"), 1.0, "{m:?}");
    // `p` runs; `flood` has exited (as its last process.status says).
    until(&hm, "one running process", |m| {
        get(m, "bmx_harness_processes") == 1.0
    })
    .await;
    until(
        &exec_metrics,
        "the executor sees its session and process",
        // Exited processes keep their actor (their output stays readable).
        |m| get(m, "bmx_executor_sessions") == 1.0 && get(m, "bmx_executor_processes") >= 1.0,
    )
    .await;
    // The executor's own view: one tool result (the 413 never reached
    // it), the bytes it answered reads with, the gap it reported, and the
    // journal (the daemon's default) empty once everything is acknowledged.
    until(&exec_metrics, "the executor counts its work", |m| {
        get(m, "bmx_executor_tool_calls_total{outcome=\"succeeded\"}") == 1.0
            && get(m, "bmx_executor_tool_call_duration_seconds_count") == 1.0
            && get(
                m,
                "bmx_executor_process_output_bytes_total{stream=\"stdout\"}",
            ) == 5.0 + 16.0
            && get(m, "bmx_executor_ring_gaps_total") == 1.0
            && get(m, "bmx_executor_journal_entries") == 0.0
            && get(m, "bmx_executor_journal_overflows_total") == 0.0
    })
    .await;
    let m = scrape(&exec_metrics).await;
    assert!(
        m.contains_key("bmx_executor_journal_bytes"),
        "the journal is on: {m:?}"
    );
    // A histogram's buckets are cumulative and end at +Inf = count.
    assert_eq!(
        get(
            &m,
            "bmx_executor_tool_call_duration_seconds_bucket{le=\"+Inf\"}"
        ),
        1.0,
        "{m:?}"
    );

    // Cut the connection: the close is counted on both sides and the
    // executor registers again.
    proxy.sever();
    until(&hm, "the harness counts the lost connection", |m| {
        get(
            m,
            "bmx_harness_executor_connection_closes_total{code=\"none\"}",
        ) == 1.0
    })
    .await;
    until(&exec_metrics, "the executor reconnects", |m| {
        get(m, "bmx_executor_registrations_total") == 2.0
            && get(m, "bmx_executor_connected") == 1.0
            && m.iter()
                .filter(|(k, _)| k.starts_with("bmx_executor_connection_losses_total"))
                .map(|(_, v)| v)
                .sum::<f64>()
                == 1.0
    })
    .await;
    until(&hm, "the harness sees it back", |m| {
        get(m, "bmx_harness_executor_connections") == 1.0
    })
    .await;

    let (status, _) = client.delete(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200);
    let m = scrape(&hm).await;
    assert_eq!(
        get(&m, "bmx_harness_sessions{state=\"ended\"}"),
        1.0,
        "{m:?}"
    );
    assert_eq!(get(&m, "bmx_harness_processes"), 0.0, "{m:?}");
    h.shutdown().await;
}
