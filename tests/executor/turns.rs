//! Issue 12, executor side: agent turns over ACP with the offline test
//! agent (tests/peers/agent/test-agent.mjs, on the official ACP SDK), driven
//! over a real WebSocket by a stand-in harness.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::{Method, RpcError};
use serde_json::{json, Value};
use std::time::Duration;
use support::*;

fn agent() -> Vec<String> {
    vec![
        "node".into(),
        format!(
            "{}/tests/peers/agent/test-agent.mjs",
            env!("CARGO_MANIFEST_DIR")
        ),
    ]
}

async fn rig(interaction_timeout: Duration) -> Rig {
    let rig = Rig::start_with(Options::default(), |c| {
        c.agents = vec![("test".into(), agent())];
        c.interaction_timeout = interaction_timeout;
    })
    .await;
    rig.assign("s").await;
    rig
}

async fn start(rig: &Rig, turn: &str, text: &str) -> Result<TurnStartResult, RpcError> {
    rig.conn
        .call(
            Method::TurnStart,
            &TurnStartParams {
                session_id: "s".into(),
                turn_id: turn.into(),
                input_id: format!("{turn}-in"),
                input: vec![TurnInputItem {
                    kind: TurnInputType::Text,
                    text: Some(text.into()),
                    file_id: None,
                    name: None,
                    mime_type: None,
                    size_bytes: None,
                }],
                config: None,
                deadline_ms: None,
                executor_session_ref: None,
                metadata: None,
            },
        )
        .await
}

/// Everything the executor sends until `turn` is idle: (method, params).
async fn until_idle(rig: &mut Rig, turn: &str) -> Vec<(String, Value)> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (m, v) = tokio::time::timeout_at(deadline, rig.events.recv())
            .await
            .expect("the turn ends within 30 s")
            .unwrap();
        let idle = m == "session.event"
            && v["turnId"] == turn
            && v["event"]["type"] == "session.status_idle";
        seen.push((m, v));
        if idle {
            return seen;
        }
    }
}

fn finals(seen: &[(String, Value)]) -> Vec<Value> {
    seen.iter()
        .filter(|(m, _)| m == "session.event")
        .map(|(_, v)| v.clone())
        .collect()
}

fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["event"]["type"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_turn_streams_deltas_then_final_events_in_sequence() {
    let mut rig = rig(Duration::from_secs(60)).await;
    let r = start(&rig, "t1", "hi there").await.unwrap();
    assert!(r.accepted && !r.resumed);
    assert!(r.executor_session_ref.is_some());
    let seen = until_idle(&mut rig, "t1").await;
    let events = finals(&seen);
    assert_eq!(
        types(&events),
        [
            "session.status_running",
            "agent.thinking",
            "agent.message",
            "agent.tool_use",
            "agent.tool_result",
            "session.status_idle"
        ]
    );
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "no hole, no duplicate"
    );
    let message = &events[2];
    assert_eq!(message["event"]["text"], "Hello, you said: hi there");
    // Its deltas came first, with its event id, numbered 0, 1, …; their
    // texts join into its text (the agent's 3 chunks: as 1 to 3 deltas,
    // depending on how many one read of its pipe found).
    let deltas: Vec<&Value> = seen
        .iter()
        .filter(|(m, v)| m == "session.event_delta" && v["eventId"] == message["eventId"])
        .map(|(_, v)| v)
        .collect();
    assert!((1..=3).contains(&deltas.len()), "{deltas:?}");
    for (i, d) in deltas.iter().enumerate() {
        assert_eq!(d["index"], i as u64);
    }
    let joined: String = deltas.iter().map(|d| d["text"].as_str().unwrap()).collect();
    assert_eq!(joined, "Hello, you said: hi there");
    let at = |pred: &dyn Fn(&(String, Value)) -> bool| seen.iter().position(pred).unwrap();
    assert!(
        at(&|(m, _)| m == "session.event_delta")
            < at(&|(_, v)| v["eventId"] == message["eventId"] && v.get("sequence").is_some())
    );
    assert_eq!(events[5]["event"]["turnOutcome"], "completed");
    assert_eq!(events[3]["event"]["input"]["path"], "note.txt");

    // The agent is kept: the next turn continues its session.
    let r2 = start(&rig, "t2", "history").await.unwrap();
    assert_eq!(r2.executor_session_ref, r.executor_session_ref);
    let events = finals(&until_idle(&mut rig, "t2").await);
    assert!(
        events
            .iter()
            .any(|e| e["event"]["text"] == "prompts so far: 2"),
        "{events:?}"
    );
    assert_eq!(events[0]["sequence"], 7, "sequence goes on across turns");
    // Idempotent by turnId; unknown turn: -32004; input to a finished one: -32009.
    assert!(start(&rig, "t2", "history").await.unwrap().accepted);
    let e = rig
        .conn
        .call::<_, Value>(
            Method::TurnCancel,
            &json!({"sessionId": "s", "turnId": "nope"}),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32004);
    let e = rig
        .conn
        .call::<_, Value>(
            Method::TurnInput,
            &json!({"sessionId": "s", "turnId": "t1", "inputId": "x", "input": [{"type": "text", "text": "more"}]}),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32009);
    rig.shutdown().await;
}

async fn answer(
    rig: &Rig,
    interaction: &str,
    outcome: &str,
    scope: Option<&str>,
) -> Result<Value, RpcError> {
    let mut p = json!({"sessionId": "s", "interactionId": interaction, "outcome": outcome});
    if let Some(s) = scope {
        p["scope"] = json!(s);
    }
    rig.conn.call(Method::InteractionResponse, &p).await
}

async fn interaction(rig: &mut Rig) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (m, v) = tokio::time::timeout_at(deadline, rig.events.recv())
            .await
            .unwrap()
            .unwrap();
        if m == "interaction.request" {
            return v;
        }
    }
}

#[tokio::test]
async fn permissions_allow_deny_session_scope_and_expiry() {
    let mut rig = rig(Duration::from_millis(1500)).await;
    // Deny.
    start(&rig, "p1", "permission").await.unwrap();
    let q = interaction(&mut rig).await;
    assert_eq!(q["kind"], "permission");
    assert_eq!(q["toolName"], "write a file");
    assert_eq!(q["toolInput"]["path"], "out.txt");
    assert_eq!(q["toolUseId"], "tc-perm");
    let id = q["interactionId"].as_str().unwrap().to_owned();
    answer(&rig, &id, "deny", None).await.unwrap();
    let events = finals(&until_idle(&mut rig, "p1").await);
    assert!(
        events
            .iter()
            .any(|e| e["event"]["type"] == "agent.tool_result" && e["event"]["status"] == "failed"),
        "{events:?}"
    );
    // Answered twice, or unknown: -32004.
    assert_eq!(
        answer(&rig, &id, "allow", None).await.unwrap_err().code,
        -32004
    );

    // Allow for the session: asked once, not again.
    start(&rig, "p2", "permission").await.unwrap();
    let q = interaction(&mut rig).await;
    answer(
        &rig,
        q["interactionId"].as_str().unwrap(),
        "allow",
        Some("session"),
    )
    .await
    .unwrap();
    let events = finals(&until_idle(&mut rig, "p2").await);
    assert!(
        events.iter().any(|e| e["event"]["status"] == "completed"),
        "{events:?}"
    );
    start(&rig, "p3", "permission").await.unwrap();
    let seen = until_idle(&mut rig, "p3").await;
    assert!(
        !seen.iter().any(|(m, _)| m == "interaction.request"),
        "asked again"
    );
    assert!(finals(&seen)
        .iter()
        .any(|e| e["event"]["status"] == "completed"));
    rig.shutdown().await;

    // Expiry: nobody answers; the agent is told no, the harness is told why.
    let mut rig = rig_named(Duration::from_millis(800)).await;
    start(&rig, "p4", "permission").await.unwrap();
    let q = interaction(&mut rig).await;
    let seen = until_idle(&mut rig, "p4").await;
    let cancel = seen
        .iter()
        .find(|(m, _)| m == "interaction.cancel")
        .expect("interaction.cancel");
    assert_eq!(cancel.1["interactionId"], q["interactionId"]);
    assert_eq!(cancel.1["reason"], "expired");
    assert!(finals(&seen)
        .iter()
        .any(|e| e["event"]["status"] == "failed"));
    rig.shutdown().await;
}

async fn rig_named(t: Duration) -> Rig {
    rig(t).await
}

#[tokio::test]
async fn cancel_crash_and_one_turn_at_a_time() {
    let mut rig = rig(Duration::from_secs(60)).await;
    start(&rig, "slow", "slow").await.unwrap();
    // One at a time.
    let e = start(&rig, "other", "hi").await.unwrap_err();
    assert_eq!((e.code, e.reason()), (-32009, Some("turn_running")));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c: TurnCancelResult = rig
        .conn
        .call(
            Method::TurnCancel,
            &json!({"sessionId": "s", "turnId": "slow", "reason": "user"}),
        )
        .await
        .unwrap();
    assert!(c.canceled);
    let events = finals(&until_idle(&mut rig, "slow").await);
    let idle = events.last().unwrap();
    assert_eq!(idle["event"]["turnOutcome"], "canceled");

    // A crash mid-turn: session.error, failed; the next turn gets a fresh agent.
    start(&rig, "boom", "crash").await.unwrap();
    let events = finals(&until_idle(&mut rig, "boom").await);
    assert!(
        types(&events).contains(&"session.error".to_owned()),
        "{events:?}"
    );
    assert_eq!(events.last().unwrap()["event"]["turnOutcome"], "failed");
    start(&rig, "after", "hello again").await.unwrap();
    let events = finals(&until_idle(&mut rig, "after").await);
    assert_eq!(events.last().unwrap()["event"]["turnOutcome"], "completed");
    assert!(events
        .iter()
        .any(|e| e["event"]["text"] == "Hello, you said: hello again"));
    // Garbage on the agent's stdout does not break the session.
    start(&rig, "g", "garbage").await.unwrap();
    let events = finals(&until_idle(&mut rig, "g").await);
    assert_eq!(events.last().unwrap()["event"]["turnOutcome"], "completed");
    rig.shutdown().await;
}

/// A stand-in harness with the real sequence rules: accepts `last + 1`,
/// re-acknowledges a duplicate, refuses a hole with -32009
/// `expectedSequence`. `cut_at`: close the connection instead of answering
/// that sequence (the first time it comes).
struct Strict {
    last: u64,
    accepted: Vec<u64>,
    seen: Vec<u64>,
    cut_at: Option<u64>,
}

fn serve_strict(
    mut conn: Conn,
    state: std::sync::Arc<std::sync::Mutex<Strict>>,
    events: tokio::sync::mpsc::UnboundedSender<(String, Value)>,
) {
    tokio::spawn(async move {
        while let Some(g) = conn.rx.recv().await {
            let method = g.method().to_owned();
            let params: Value = g.frame.params().unwrap_or(Value::Null);
            let _ = events.send((method.clone(), params.clone()));
            let Some(reply) = g.reply else { continue };
            match method.as_str() {
                "executor.heartbeat" => reply.ok(&HeartbeatResult {
                    lease_ttl_ms: 30_000,
                    server_time: now_rfc3339(),
                    drain: false,
                }),
                "session.event" => {
                    let seq = params["sequence"].as_u64().unwrap();
                    let mut s = state.lock().unwrap();
                    s.seen.push(seq);
                    if s.cut_at == Some(seq) {
                        s.cut_at = None;
                        drop(s);
                        conn.link.close(bmx::wire::CloseCode::GoingAway, "cut");
                        continue;
                    }
                    if seq == s.last + 1 {
                        s.last = seq;
                        s.accepted.push(seq);
                    }
                    if seq <= s.last {
                        reply.ok(&json!({"accepted": true, "ackedSequence": s.last, "eventId": params["eventId"]}));
                    } else {
                        reply.err(
                            RpcError::conflict("sequence_gap", "hole")
                                .with_expected_sequence(s.last + 1),
                        );
                    }
                }
                _ => reply.ok(&Accepted::YES),
            }
        }
    });
}

#[tokio::test]
async fn a_connection_cut_mid_turn_loses_no_event_and_duplicates_none() {
    let mut stand_in = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut config = stand_in.config(work.path());
    config.agents = vec![("test".into(), agent())];
    config.interaction_timeout = Duration::from_secs(2);
    let executor = bmx::executor::Executor::start(config).await.unwrap();
    let state = std::sync::Arc::new(std::sync::Mutex::new(Strict {
        last: 0,
        accepted: Vec::new(),
        seen: Vec::new(),
        cut_at: Some(3),
    }));
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let mut conn = stand_in.next_conn().await;
    conn.register(10_000, 30_000).await;
    let link = conn.link.clone();
    serve_strict(conn, state.clone(), tx.clone());
    let _: AssignResult = link
        .request(
            Method::SessionAssign,
            &assign_params("s", 1),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    // The default prompt: six events; the third is cut before its ack.
    let _: TurnStartResult = link
        .request(
            Method::TurnStart,
            &json!({"sessionId": "s", "turnId": "t", "inputId": "i",
                "input": [{"type": "text", "text": "cut me"}]}),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    // The executor comes back and resumes.
    let mut conn = stand_in.next_conn().await;
    let p = conn.register(10_000, 30_000).await;
    assert_eq!(p.resume.unwrap().active_sessions, vec!["s".to_owned()]);
    serve_strict(conn, state.clone(), tx);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while state.lock().unwrap().last < 6 {
        let _ = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("every event within 30 s");
    }
    {
        let s = state.lock().unwrap();
        assert_eq!(s.accepted, vec![1, 2, 3, 4, 5, 6], "each once, in order");
        assert!(
            s.seen.iter().filter(|&&q| q == 3).count() >= 2,
            "the cut event was sent again: {:?}",
            s.seen
        );
    }
    executor.shutdown().await;
}
