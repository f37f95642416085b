//! `POST /v1/executors/{id}/drain` against a real executor: the executor
//! accepts and reports its running sessions, the harness shows it
//! `draining` and places no new session there, its running session goes
//! on, and once that session is stopped the executor ends by itself
//! (`ExecutorExit::Stopped`). Bad bodies and unknown executors are refused
//! before anything is sent.

use crate::harness_common::*;
use bmx::client::ApiClient;
use bmx::executor::ExecutorExit;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_executor_takes_no_new_session_and_ends_after_its_last() {
    let (h, executor, _work) = harness_with_executor("drain-a", 30_000).await;
    let client = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(30));

    let (status, s) = client
        .post("/v1/sessions", &json!({"sessionId": "s-drain-1"}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{s}");

    // Refused before anything is sent.
    for bad in [
        json!({"reason": "a\nb"}),
        json!({"reason": ""}),
        json!({"deadlineMs": 86_400_001u64}),
        json!({"reason": null}),
        json!({"nope": 1}),
    ] {
        let (status, v) = client
            .post("/v1/executors/drain-a/drain", &bad)
            .await
            .unwrap();
        assert_eq!(status, 400, "{bad} -> {v}");
    }
    let (status, v) = client
        .post("/v1/executors/nobody/drain", &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "unknown_executor");
    let (_, v) = client.get("/v1/executors").await.unwrap();
    assert_eq!(v["executors"][0]["state"], "ready", "{v}");

    let (status, r) = client
        .post(
            "/v1/executors/drain-a/drain",
            &json!({"reason": "maintenance", "deadlineMs": 60_000}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["accepted"], true, "{r}");
    assert_eq!(r["activeSessions"], json!(["s-drain-1"]), "{r}");

    let (_, v) = client.get("/v1/executors").await.unwrap();
    assert_eq!(v["executors"][0]["state"], "draining", "{v}");
    // Placement skips it: no other executor, so no executor.
    let (status, v) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "no_executor", "{v}");
    // Named, it refuses itself.
    let (status, v) = client
        .post("/v1/sessions", &json!({"executorId": "drain-a"}))
        .await
        .unwrap();
    assert_eq!(status, 503, "{v}");

    // The running session still runs tools.
    let (status, v) = client
        .post(
            "/v1/sessions/s-drain-1/tools",
            &json!({"tool": "bash", "input": {"command": "echo still-here"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    assert!(v.to_string().contains("still-here"), "{v}");

    // Its last session stopped, the executor ends by itself.
    let (status, v) = client.delete("/v1/sessions/s-drain-1").await.unwrap();
    assert_eq!(status, 200, "{v}");
    let exit = tokio::time::timeout(Duration::from_secs(30), executor.wait())
        .await
        .expect("the drained executor ends within 30 s");
    assert!(matches!(exit, ExecutorExit::Stopped), "{exit:?}");
    h.shutdown().await;
}
