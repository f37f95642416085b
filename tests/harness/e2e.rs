//! End to end: the real executor (in process) against the harness, driven
//! through the HTTP API: session.assign → process → output → tool → stop.

use crate::harness_common;
use bmx::client::ApiClient;
use harness_common::harness_with_executor;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_to_real_executor_and_back() {
    let (h, executor, _work) = harness_with_executor("exec-e2e", 2_000).await;
    let client = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(30));

    let (status, v) = client.get("/v1/executors").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["executors"][0]["executorId"], "exec-e2e");

    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();
    assert_eq!(s["executorId"], "exec-e2e");
    assert_eq!(s["fencingToken"], 1);

    // A process and its output, by long poll.
    let (status, p) = client
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            &json!({"processId": "p1", "argv": ["echo", "hi"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{p}");
    assert_eq!(p["processId"], "p1");
    let mut out = Vec::new();
    let mut cursor = 0u64;
    let exit_code = loop {
        let (status, r) = client
            .get(&format!(
                "/v1/sessions/{sid}/processes/p1/output?stream=stdout&cursor={cursor}&waitMs=2000"
            ))
            .await
            .unwrap();
        assert_eq!(status, 200, "{r}");
        out.extend(bmx::wire::blob::base64_decode(r["data"].as_str().unwrap()).unwrap());
        cursor = r["nextCursor"].as_u64().unwrap();
        if r["eof"] == true {
            break r["exitCode"].clone();
        }
    };
    assert_eq!(String::from_utf8_lossy(&out), "hi\n");
    assert_eq!(exit_code, 0);
    let (status, list) = client
        .get(&format!("/v1/sessions/{sid}/processes"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(list["processes"][0]["processId"], "p1");

    // A tool call, answered with its tool.result.
    let (status, t) = client
        .post(
            &format!("/v1/sessions/{sid}/tools"),
            &json!({"tool": "bash", "input": {"command": "echo hi"}, "toolCallId": "tc1"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["toolCallId"], "tc1");
    assert_eq!(t["outcome"], "succeeded");
    assert_eq!(t["isError"], false);
    let text = t["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("hi"), "{text}");

    // The platform's view saw session.ready and the process status.
    let (status, info) = client.get(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(info["ready"], true, "{info}");

    // Stop: answered once session.ended arrived.
    let (status, ended) = client.delete(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200, "{ended}");
    assert_eq!(ended["state"], "ended");
    let (status, _) = client
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            &json!({"argv": ["true"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 410);

    let exit = executor.shutdown().await;
    assert_eq!(exit.exit_code(), 0, "{exit:?}");
    h.shutdown().await;
}
