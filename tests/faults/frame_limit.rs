//! Issue 19, "must fix" 3: an API request whose frame would pass the
//! executor's frame limit is refused by the harness with 413, never sent,
//! so it cannot make the executor close the connection (1009) and knock
//! every other call on it offline.
//!
//! The real `bmx executor` binary against the harness (in process, real
//! sockets): the executor advertises `maxFrameBytes` (1 MiB) when it
//! registers; a write just over it but well under the API's 2 MB body
//! limit gets 413, and the executor stays on the same connection.

use crate::faults_common;
use bmx::client::ApiClient;
use faults_common::{harness, ExecutorProc};
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_request_gets_413_and_the_executor_stays_connected() {
    let h = harness("exec-l", "tok-l", 30_000).await;
    let work = tempfile::tempdir().unwrap();
    let _executor = ExecutorProc::spawn(&h.executor_url(), "tok-l", work.path());
    assert!(
        h.wait_for_executor(Some("exec-l"), Duration::from_secs(15))
            .await,
        "the executor registers"
    );
    let conn = h.executors()[0].connection_id.clone();
    // Each call has its own deadline: a hang fails the test.
    let client = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(15));
    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();
    let tools = format!("/v1/sessions/{sid}/tools");

    // Just under the limit: sent and run.
    let fits = "a".repeat((1 << 20) - 4096);
    let (status, v) = client
        .post(
            &tools,
            &json!({"tool": "write", "input": {"path": "fits.txt", "content": fits}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["outcome"], "succeeded", "{v}");

    // Just over: refused here, with the API's error shape.
    let over = "b".repeat((1 << 20) + 1024);
    let (status, v) = client
        .post(
            &tools,
            &json!({"tool": "write", "toolCallId": "too-big", "input": {"path": "over.txt", "content": over}}),
        )
        .await
        .expect("answered, not hung");
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], -32013, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "frame_too_large", "{v}");

    // The same for a process whose argv does not fit.
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            &json!({"processId": "big", "argv": ["echo", over]}),
        )
        .await
        .expect("answered, not hung");
    assert_eq!(status, 413, "{v}");

    // The executor never saw them: same connection, and the next call works.
    assert_eq!(
        h.executors()[0].connection_id,
        conn,
        "still the same connection"
    );
    let (status, v) = client
        .post(
            &tools,
            &json!({"tool": "bash", "input": {"command": "wc -c < fits.txt; test -e over.txt || echo no-over"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    let text = v["content"][0]["text"].as_str().unwrap();
    assert!(text.contains(&((1 << 20) - 4096).to_string()), "{text}");
    assert!(text.contains("no-over"), "{text}");
    // A repeated id is not poisoned by the refusal: it can be sent small.
    let (status, v) = client
        .post(
            &tools,
            &json!({"tool": "write", "toolCallId": "too-big", "input": {"path": "small.txt", "content": "ok"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(h.executors()[0].connection_id, conn);
    let (_, v) = client.executors().await.unwrap();
    assert_eq!(
        v["executors"][0]["capabilities"]["maxFrameBytes"],
        1 << 20,
        "the executor advertises its frame limit: {v}"
    );
    let (status, _) = client.delete(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200);
    h.shutdown().await;
}
