//! Issue 18, finding 8: ids obey one rule (docs/protocol.md, "Ids")
//! wherever they enter, and a hostile one cannot forge a log line. The
//! real executor binary behind an in-process stand-in harness, and the real
//! harness binary behind its HTTP API, both at `RUST_LOG=trace`.
//!
//! Before the rule, the executor accepted a `sessionId` with a `\n` (its
//! log then carried a line of the attacker's) and the harness answered
//! such ids 404 or 503 instead of 400: both tests failed.

use crate::security_common;
use crate::support;
use bmx::client::ApiClient;
use bmx::wire::Method;
use security_common::{executor_behind_stand_in, forged_lines, Bmx};
use serde_json::json;

const FORGED: &str = "FORGED";
const HOSTILE: &str = "s\nFORGED ERROR bmx: the attacker wrote this line";

#[tokio::test]
async fn the_executor_refuses_hostile_ids_and_logs_no_forged_line() {
    let (executor, _harness, conn, _work) =
        executor_behind_stand_in(&[], &[("BMX_TOKEN", support::TOKEN)], "trace").await;

    let mut assign = serde_json::to_value(support::assign_params("ok-1", 1)).unwrap();
    assign["sessionId"] = json!(HOSTILE);
    let e = conn
        .call::<_, serde_json::Value>(Method::SessionAssign, &assign)
        .await
        .expect_err("a hostile session id is refused");
    assert_eq!(e.code, -32602, "{e:?}");
    assert_eq!(e.reason(), Some("invalid_id"), "{e:?}");
    assert!(!e.message.contains(FORGED), "the id is not echoed: {e:?}");

    // A good session, then a hostile process id and tool call id in it.
    let _: serde_json::Value = conn
        .call(Method::SessionAssign, &support::assign_params("ok-1", 1))
        .await
        .expect("a plain id is taken");
    let mut start = serde_json::to_value(support::start_params("ok-1", "p1", &["true"])).unwrap();
    start["processId"] = json!("p\r\nFORGED");
    let e = conn
        .call::<_, serde_json::Value>(Method::ProcessStart, &start)
        .await
        .expect_err("a hostile process id is refused");
    assert_eq!(e.reason(), Some("invalid_id"), "{e:?}");
    let e = conn
        .call::<_, serde_json::Value>(
            Method::ToolCall,
            &json!({"sessionId": "ok-1", "toolCallId": "t\nFORGED", "tool": "read", "input": {"path": "x"}}),
        )
        .await
        .expect_err("a hostile tool call id is refused");
    assert_eq!(e.reason(), Some("invalid_id"), "{e:?}");
    let e = conn
        .call::<_, serde_json::Value>(
            Method::SessionAssign,
            &json!({"sessionId": "x".repeat(129), "workId": "w", "lease": {"token": "l", "fencingToken": 2}}),
        )
        .await
        .expect_err("an id over 128 bytes is refused");
    assert_eq!(e.code, -32602, "{e:?}");

    let log = executor.stop();
    assert!(!log.is_empty(), "the executor logged at trace");
    let forged = forged_lines(&log, FORGED);
    assert!(forged.is_empty(), "forged log lines: {forged:?}");
}

#[tokio::test]
async fn the_harness_refuses_hostile_ids_with_400_and_logs_no_forged_line() {
    let (harness, api) = Bmx::harness(&["--token", "exec-1=exec-secret"], &[], "trace");
    let client = ApiClient::new(&api).unwrap();

    let (status, v) = client
        .post("/v1/sessions", &json!({"sessionId": HOSTILE}))
        .await
        .unwrap();
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], -32602, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "invalid_id", "{v}");
    assert!(!v.to_string().contains(FORGED), "the id is not echoed: {v}");

    for path in [
        "/v1/sessions/s%0AFORGED%20ERROR%20x",
        "/v1/sessions/s%0D%0AFORGED/processes",
        "/v1/sessions/ok/processes/p%0AFORGED/output",
        "/v1/executors/exec-1/terminals/t%0AFORGED",
    ] {
        let (status, v) = client.get(path).await.unwrap();
        assert_eq!(status, 400, "{path}: {v}");
        assert_eq!(v["error"]["data"]["reason"], "invalid_id", "{path}: {v}");
    }
    let (status, v) = client.delete("/v1/sessions/..").await.unwrap();
    assert!(status == 400 || status == 404, "{v}");
    let (status, v) = client
        .post(
            "/v1/sessions/ok/processes",
            &json!({"processId": "p\nFORGED", "argv": ["true"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 400, "{v}");

    let log = harness.stop();
    assert!(log.contains("shutting down"), "{log}");
    let forged = forged_lines(&log, FORGED);
    assert!(forged.is_empty(), "forged log lines: {forged:?}");
}
