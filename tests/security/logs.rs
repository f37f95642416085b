//! Issue 18, finding 7: no secret reaches a log, even at `RUST_LOG=trace`.
//! The real harness and executor binaries, both at trace, through a run
//! that uses every secret they hold: the executor's bearer token (the
//! WebSocket handshake), the API token (every API request), a relay
//! ticket (a terminal attached through the harness: the executor dials the
//! ticket URL). Everything both wrote is then searched for each secret.
//!
//! On the code before the fix the harness's request span logged the relay
//! path, ticket included, at info; tungstenite's frame traces carried
//! payloads.

use crate::security_common;
use bmx::client::AttachOptions;
use futures_util::StreamExt;
use serde_json::json;
use std::time::Duration;

const EXEC_SECRET: &str = "exec-secret-5d1c7e9a";
const API_SECRET: &str = "api-secret-81f2b6c4";
const RELAY_PATH: &str = "/v1/relay/terminals/";

/// Every relay path in `log` whose ticket is not starred out.
fn relay_tickets(log: &str) -> Vec<&str> {
    log.match_indices(RELAY_PATH)
        .map(|(i, _)| &log[i..(i + RELAY_PATH.len() + 8).min(log.len())])
        .filter(|s| !s[RELAY_PATH.len()..].starts_with('*'))
        .collect()
}

#[tokio::test]
async fn a_whole_run_at_trace_logs_no_secret() {
    let security_common::Pair {
        harness,
        executor,
        client,
        work: _work,
        ..
    } = security_common::pair(API_SECRET, EXEC_SECRET, "trace").await;
    // The executor registered (its token in the handshake).
    // A session and a process (API token on every request).
    let (status, v) = client
        .post("/v1/sessions", &json!({"sessionId": "logs-1"}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{v}");
    let (status, v) = client
        .post(
            "/v1/sessions/logs-1/processes",
            &json!({"argv": ["sh", "-c", "echo hello"], "waitMs": 5000}),
        )
        .await
        .unwrap();
    assert!(status < 300, "{status}: {v}");
    // A terminal attached through the relay (a ticket).
    let (status, v) = client
        .open_terminal(
            "exec-1",
            &json!({"terminalId": "logs-t", "argv": ["sh", "-c", "echo relayed; sleep 30"]}),
        )
        .await
        .unwrap();
    assert!(status < 300, "{status}: {v}");
    let mut socket = client
        .attach_terminal("exec-1", "logs-t", &AttachOptions::default())
        .await
        .expect("attached");
    let got = tokio::time::timeout(Duration::from_secs(20), socket.next())
        .await
        .expect("the relay carries output");
    assert!(got.is_some());
    drop(socket);
    let (status, _) = client.delete("/v1/sessions/logs-1").await.unwrap();
    assert_eq!(status, 200);

    let executor_log = executor.stop();
    let harness_log = harness.stop();
    for (who, log) in [("executor", &executor_log), ("harness", &harness_log)] {
        assert!(log.lines().count() > 10, "{who} logged at trace: {log}");
        for secret in [EXEC_SECRET, API_SECRET] {
            let hits = log.matches(secret).count();
            assert_eq!(hits, 0, "{secret} in the {who}'s log");
        }
        let tickets = relay_tickets(log);
        assert!(
            tickets.is_empty(),
            "relay tickets in the {who}'s log: {tickets:?}"
        );
    }
}
