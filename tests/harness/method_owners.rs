//! The owner column of the method table, checked against the real harness
//! router: a fake executor sends every method the harness receives, for a
//! session nobody leased, and only the methods whose owner is the harness's
//! session view (the leases actor) are fenced as an unknown session. The
//! executor's routing is generated from the column (compile-time checked);
//! the harness's is hand-written, so this keeps the two in step.

use crate::harness_common;
use bmx::wire::{CallError, Owner, METHODS};
use harness_common::*;
use serde_json::{json, Value};

#[tokio::test]
async fn only_harness_session_methods_reach_the_leases_actor() {
    let h = harness().await;
    let mut f = dial(&h, "secret-a").await.unwrap();
    f.register(None).await.unwrap();
    f.keep_alive();
    // Enough members for any of them to get past its own params; the
    // session is one the harness never assigned.
    let params = json!({
        "sessionId": "nobody",
        "terminalId": "nobody",
        "processId": "p",
        "toolCallId": "t",
        "connectionId": f.connection_id,
    });
    let mut checked = 0;
    for spec in METHODS.iter().filter(|s| s.method.harness_receives()) {
        // Sent as requests, so every one is answered. A notification sent
        // as a request is refused before any routing (issue 18, finding 9):
        // for those, that refusal is what is checked.
        let answer = f.call::<_, Value>(spec.method, &params).await;
        if spec.method.is_notification() {
            assert!(
                matches!(&answer, Err(e @ CallError::Rpc(_))
                    if rpc_code(e) == Some(-32600)
                        && rpc_reason(e).as_deref() == Some("notification_as_request")),
                "{} (a notification) answered {answer:?}",
                spec.name
            );
            checked += 1;
            continue;
        }
        let fenced = match &answer {
            Err(e @ CallError::Rpc(_)) => {
                rpc_code(e) == Some(-32011) && rpc_reason(e).as_deref() == Some("unknown_session")
            }
            _ => false,
        };
        assert_eq!(
            fenced,
            spec.owner == Owner::HarnessSession,
            "{} (owner {:?}) answered {answer:?}",
            spec.name,
            spec.owner
        );
        checked += 1;
    }
    assert!(checked > 15, "only {checked} methods checked");
    h.shutdown().await;
}
