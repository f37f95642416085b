//! Agent turns on the harness side (docs/agents.md), against a real
//! WebSocket fake executor: the sequence rules of `session.event`, the
//! event stream over SSE and WebSocket (replay with `after` and with
//! `Last-Event-ID`, deltas live, no gap, nothing twice), the turn routes,
//! interactions (answer, cancel, expiry), bad input and auth.
//!
//! Run: `cargo test --profile tests --test harness turns::`.

use crate::harness_common;
use bmx::wire::types::{
    InteractionResponseParams, TurnCancelParams, TurnInputParams, TurnStartParams,
};
use bmx::wire::{Method, Responder, RpcError};
use futures_util::StreamExt;
use harness_common::*;
use serde_json::{json, Value};
use std::time::Duration;

fn msg(text: &str) -> Value {
    json!({"type": "agent.message", "text": text})
}

fn rpc_data(e: &bmx::wire::CallError) -> Value {
    match e {
        bmx::wire::CallError::Rpc(r) => serde_json::to_value(r).unwrap()["data"].clone(),
        other => panic!("not an RPC error: {other}"),
    }
}

fn seq_of(m: &SseMsg) -> u64 {
    m.data["sequence"].as_u64().expect("a final event")
}

#[tokio::test]
async fn sequence_rules_and_lease_fencing() {
    let h = harness().await;
    let (fake, sid) = fake_with_session(&h).await;
    let mut stream = sse(&h, &format!("/v1/sessions/{sid}/events"), None, None).await;
    assert_eq!(stream.status, 200);

    // The first event is sequence 1: 2 is a hole.
    let e = send_event(&fake, &sid, "t1", 2, msg("b"))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32009), "{e}");
    assert_eq!(rpc_data(&e)["expectedSequence"], 1);
    let r = send_event(&fake, &sid, "t1", 1, msg("a")).await.unwrap();
    assert_eq!(
        r,
        json!({"accepted": true, "ackedSequence": 1, "eventId": "ev-1"})
    );
    // A resend is acknowledged again with the last accepted sequence.
    let r = send_event(&fake, &sid, "t1", 1, msg("a")).await.unwrap();
    assert_eq!(r["accepted"], true);
    assert_eq!(r["ackedSequence"], 1);
    let r = send_event(&fake, &sid, "t1", 2, msg("b")).await.unwrap();
    assert_eq!(r["ackedSequence"], 2);
    let r = send_event(&fake, &sid, "t1", 1, msg("a")).await.unwrap();
    assert_eq!(r["ackedSequence"], 2);
    let e = send_event(&fake, &sid, "t1", 5, msg("e"))
        .await
        .unwrap_err();
    assert_eq!(rpc_data(&e)["expectedSequence"], 3);
    assert_eq!(rpc_data(&e)["reason"], "unexpected_sequence");
    // Untrusted input: no type, sequence 0.
    let e = send_event(&fake, &sid, "t1", 3, json!({"text": "x"}))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32602), "{e}");
    let e = send_event(&fake, &sid, "t1", 0, msg("z"))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32602), "{e}");
    send_event(&fake, &sid, "t1", 3, msg("c")).await.unwrap();

    // The subscriber saw 1, 2, 3 once each, in order.
    let got: Vec<u64> = [
        stream.next().await,
        stream.next().await,
        stream.next().await,
    ]
    .iter()
    .map(seq_of)
    .collect();
    assert_eq!(got, vec![1, 2, 3]);
    assert!(stream
        .next_within(Duration::from_millis(300))
        .await
        .is_none());

    // Another executor does not hold the lease: -32010.
    let mut other = dial(&h, "secret-b").await.unwrap();
    other.register(None).await.unwrap();
    let e = send_event(&other, &sid, "t1", 4, msg("d"))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32010), "{e}");
    // An unknown session: -32011.
    let e = send_event(&fake, "nope", "t1", 1, msg("d"))
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32011), "{e}");
    h.shutdown().await;
}

#[tokio::test]
async fn sse_replays_after_and_last_event_id_with_no_gap_or_duplicate() {
    let h = harness().await;
    let (fake, sid) = fake_with_session(&h).await;
    for n in 1..=5 {
        send_event(&fake, &sid, "t1", n, msg(&format!("m{n}")))
            .await
            .unwrap();
    }
    let path = format!("/v1/sessions/{sid}/events");
    // ?after=2: 3, 4, 5 then live.
    let mut s = sse(&h, &format!("{path}?after=2"), None, None).await;
    for want in 3..=5 {
        let m = s.next().await;
        assert_eq!(m.event, None);
        assert_eq!(m.id.as_deref(), Some(want.to_string().as_str()));
        assert_eq!(seq_of(&m), want);
        assert_eq!(m.data["kind"], "event");
        assert_eq!(m.data["event"]["text"], format!("m{want}"));
        assert_eq!(m.data["turnId"], "t1");
    }
    // Live: a delta (no id) then its final event.
    fake.link
        .notify(
            Method::SessionEventDelta,
            &json!({"sessionId": sid, "turnId": "t1", "eventId": "ev-6", "eventType": "agent.message", "index": 0, "text": "Hel"}),
        )
        .unwrap();
    send_event(&fake, &sid, "t1", 6, msg("Hello"))
        .await
        .unwrap();
    let d = s.next().await;
    assert_eq!(d.event.as_deref(), Some("delta"));
    assert_eq!(d.id, None);
    assert_eq!(d.data["text"], "Hel");
    assert_eq!(d.data["eventId"], "ev-6");
    assert_eq!(seq_of(&s.next().await), 6);
    drop(s);

    // A client that got up to 4 reconnects with Last-Event-ID: 4 (it wins
    // over ?after): 5, 6, then live 7; nothing twice.
    let mut s = sse(&h, &format!("{path}?after=1"), Some(4), None).await;
    assert_eq!(seq_of(&s.next().await), 5);
    assert_eq!(seq_of(&s.next().await), 6);
    send_event(&fake, &sid, "t1", 7, msg("seven"))
        .await
        .unwrap();
    assert_eq!(seq_of(&s.next().await), 7);
    assert!(s.next_within(Duration::from_millis(300)).await.is_none());

    // From the start: everything kept.
    let mut all = sse(&h, &path, None, None).await;
    for want in 1..=7 {
        assert_eq!(seq_of(&all.next().await), want);
    }
    // Bad cursors.
    let bad = sse(&h, &format!("{path}?after=99"), None, None).await;
    assert_eq!(bad.status, 400);
    assert_eq!(
        bad.body.unwrap()["error"]["data"]["reason"],
        "after_beyond_last"
    );
    let bad = sse(&h, &format!("{path}?after=x"), None, None).await;
    assert_eq!(bad.status, 400);
    let bad = sse(&h, "/v1/sessions/nope/events", None, None).await;
    assert_eq!(bad.status, 404);

    // The session ends: followers get `end`, the stream closes; a later
    // client replays the tail and gets `end` too.
    let api = api(&h);
    let stop = tokio::spawn({
        let path = format!("/v1/sessions/{sid}");
        async move { api.delete(&path).await.unwrap() }
    });
    let mut fake = fake;
    fake.end_as_stopped(&sid).await;
    assert_eq!(stop.await.unwrap().0, 200);
    let end = s.next().await;
    assert_eq!(end.event.as_deref(), Some("end"));
    assert_eq!(end.data["reason"], "stopped");
    assert!(s.next_within(Duration::from_millis(300)).await.is_none());
    let mut late = sse(&h, &format!("{path}?after=6"), None, None).await;
    assert_eq!(seq_of(&late.next().await), 7);
    assert_eq!(late.next().await.event.as_deref(), Some("end"));
    // Nothing more is accepted for an ended session.
    let e = send_event(&fake, &sid, "t1", 8, msg("late"))
        .await
        .unwrap_err();
    assert!(matches!(rpc_code(&e), Some(-32010) | Some(-32011)), "{e}");
    h.shutdown().await;
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn next_frame(ws: &mut Ws) -> Value {
    loop {
        let m = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("a frame")
            .expect("open")
            .expect("ok");
        if let tokio_tungstenite::tungstenite::Message::Text(t) = m {
            return serde_json::from_str(&t).unwrap();
        }
    }
}

#[tokio::test]
async fn websocket_stream_replays_then_follows() {
    let h = harness().await;
    let (fake, sid) = fake_with_session(&h).await;
    for n in 1..=3 {
        send_event(&fake, &sid, "t1", n, msg("x")).await.unwrap();
    }
    let url = format!(
        "ws://{}/v1/sessions/{sid}/events/ws?after=1",
        h.local_addr()
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    assert_eq!(next_frame(&mut ws).await["sequence"], 2);
    assert_eq!(next_frame(&mut ws).await["sequence"], 3);
    fake.link
        .notify(
            Method::SessionEventDelta,
            &json!({"sessionId": sid, "turnId": "t1", "eventId": "ev-4", "eventType": "agent.thinking", "index": 0, "text": "hm"}),
        )
        .unwrap();
    send_event(
        &fake,
        &sid,
        "t1",
        4,
        json!({"type": "agent.thinking", "text": "hm"}),
    )
    .await
    .unwrap();
    let d = next_frame(&mut ws).await;
    assert_eq!(d["kind"], "delta");
    assert_eq!(d["eventType"], "agent.thinking");
    let f = next_frame(&mut ws).await;
    assert_eq!(f["kind"], "event");
    assert_eq!(f["sequence"], 4);
    let _ = ws.close(None).await;
    // Not an upgrade: 400.
    let (status, _) = api(&h)
        .get(&format!("/v1/sessions/{sid}/events/ws"))
        .await
        .unwrap();
    assert_eq!(status, 400);
    h.shutdown().await;
}

#[tokio::test]
async fn turn_routes_reach_the_executor_and_pass_its_answers_back() {
    let h = harness().await;
    let (mut fake, sid) = fake_with_session(&h).await;
    let client = api(&h);
    let base = format!("/v1/sessions/{sid}/turns");
    let task = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move {
            client
                .post(
                    &base,
                    &json!({"input": "hello", "config": {"agent": "test", "model": "m1"}}),
                )
                .await
                .unwrap()
        }
    });
    let (p, r): (TurnStartParams, Responder) = fake.expect(Method::TurnStart).await;
    assert_eq!(p.session_id, sid);
    assert!(p.turn_id.starts_with("turn-"));
    assert!(p.input_id.starts_with("in-"));
    assert_eq!(p.input.len(), 1);
    assert_eq!(p.input[0].text.as_deref(), Some("hello"));
    assert_eq!(p.config.as_ref().unwrap().agent.as_deref(), Some("test"));
    r.ok(&json!({"accepted": true, "turnId": p.turn_id, "effective": {"agent": "test"}, "executorSessionRef": "acp-1", "resumed": false}));
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["turnId"], p.turn_id.as_str());
    assert_eq!(v["inputId"], p.input_id.as_str());
    assert_eq!(v["executorSessionRef"], "acp-1");
    assert_eq!(v["effective"]["agent"], "test");
    let turn = p.turn_id;

    // A second turn while one runs: the executor's -32009 comes back as 409.
    let task = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move {
            client
                .post(
                    &base,
                    &json!({"input": [{"type": "text", "text": "again"}], "turnId": "mine"}),
                )
                .await
                .unwrap()
        }
    });
    let (p, r): (TurnStartParams, Responder) = fake.expect(Method::TurnStart).await;
    assert_eq!(p.turn_id, "mine");
    r.err(RpcError::conflict("turn_running", "a turn is running"));
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "turn_running");

    // Input to the running turn.
    let task = tokio::spawn({
        let (client, base, turn) = (client.clone(), base.clone(), turn.clone());
        async move {
            client
                .post(&format!("{base}/{turn}/input"), &json!({"input": "more"}))
                .await
                .unwrap()
        }
    });
    let (p, r): (TurnInputParams, Responder) = fake.expect(Method::TurnInput).await;
    assert_eq!(p.turn_id, turn);
    assert_eq!(p.input[0].text.as_deref(), Some("more"));
    r.ok(&json!({"accepted": true}));
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["inputId"], p.input_id.as_str());

    // Cancel: the executor's answer; an unknown turn: its -32004 as 404.
    let task = tokio::spawn({
        let (client, base, turn) = (client.clone(), base.clone(), turn.clone());
        async move {
            client
                .post(&format!("{base}/{turn}/cancel"), &json!({}))
                .await
                .unwrap()
        }
    });
    let (p, r): (TurnCancelParams, Responder) = fake.expect(Method::TurnCancel).await;
    assert_eq!(p.turn_id, turn);
    r.ok(&json!({"canceled": true}));
    assert_eq!(task.await.unwrap(), (200, json!({"canceled": true})));
    let task = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move {
            client
                .post(&format!("{base}/nope/cancel"), &json!({"reason": "user"}))
                .await
                .unwrap()
        }
    });
    let (p, r): (TurnCancelParams, Responder) = fake.expect(Method::TurnCancel).await;
    assert_eq!(p.reason, "user");
    r.err(RpcError::not_found("no turn nope"));
    assert_eq!(task.await.unwrap().0, 404);

    // Bad input never reaches the executor.
    for body in [
        json!({}),
        json!({"input": ""}),
        json!({"input": []}),
        json!({"input": [{"type": "file"}]}),
        json!({"input": "x", "bogus": 1}),
        json!({"input": "x", "turnId": ""}),
    ] {
        let (status, v) = client.post(&base, &body).await.unwrap();
        assert_eq!(status, 400, "{body} -> {v}");
        assert_eq!(v["error"]["code"], -32602);
    }
    // Oversized: 413 before parsing.
    let big = "x".repeat(2 << 20);
    let (status, v) = client.post(&base, &json!({"input": big})).await.unwrap();
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], -32013);
    // Unknown session.
    let (status, v) = client
        .post("/v1/sessions/nope/turns", &json!({"input": "x"}))
        .await
        .unwrap();
    assert_eq!(status, 404, "{v}");
    assert!(
        !fake
            .sees(Method::TurnStart, Duration::from_millis(200))
            .await
    );
    h.shutdown().await;
}

fn permission(sid: &str, id: &str, expires_in: Duration) -> Value {
    let at = time::OffsetDateTime::now_utc() + expires_in;
    json!({
        "sessionId": sid, "turnId": "t1", "interactionId": id, "kind": "permission",
        "toolName": "write a file", "toolInput": {"path": "out.txt"}, "toolUseId": "tc-perm",
        "scopes": ["once", "session"],
        "expiresAt": at.format(&time::format_description::well_known::Rfc3339).unwrap(),
    })
}

#[tokio::test]
async fn interactions_answer_cancel_and_expiry() {
    let h = harness().await;
    let (mut fake, sid) = fake_with_session(&h).await;
    let client = api(&h);
    let mut s = sse(&h, &format!("/v1/sessions/{sid}/events"), None, None).await;
    let base = format!("/v1/sessions/{sid}/interactions");

    let r: Value = fake
        .call(
            Method::InteractionRequest,
            &permission(&sid, "i-1", Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert_eq!(r["accepted"], true);
    let pid = r["platformInteractionId"].as_str().unwrap().to_owned();
    // A resend: the same answer.
    let again: Value = fake
        .call(
            Method::InteractionRequest,
            &permission(&sid, "i-1", Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert_eq!(again["platformInteractionId"], pid.as_str());
    let note = s.next().await;
    assert_eq!(note.event.as_deref(), Some("interaction"));
    assert_eq!(note.data["turnId"], "t1");
    assert_eq!(note.data["interaction"]["state"], "pending");
    assert_eq!(note.data["interaction"]["kind"], "permission");
    assert_eq!(note.data["interaction"]["interactionId"], "i-1");
    assert_eq!(note.data["interaction"]["toolInput"]["path"], "out.txt");
    let (status, v) = client.get(&base).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["interactions"].as_array().unwrap().len(), 1);
    assert_eq!(v["interactions"][0]["platformInteractionId"], pid.as_str());

    // A scope it does not offer, an outcome that does not fit: 400.
    let (status, _) = client
        .post(&format!("{base}/i-1"), &json!({"outcome": "answered"}))
        .await
        .unwrap();
    assert_eq!(status, 400);
    let (status, _) = client
        .post(
            &format!("{base}/i-1"),
            &json!({"outcome": "allow", "scope": "forever"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 400);
    // Unknown: 404.
    let (status, v) = client
        .post(&format!("{base}/nope"), &json!({"outcome": "allow"}))
        .await
        .unwrap();
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "unknown_interaction");

    // Allow for the session: the executor gets interaction.response.
    let task = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move {
            client
                .post(
                    &format!("{base}/i-1"),
                    &json!({"outcome": "allow", "scope": "session"}),
                )
                .await
                .unwrap()
        }
    });
    let (p, r): (InteractionResponseParams, Responder) =
        fake.expect(Method::InteractionResponse).await;
    assert_eq!(p.interaction_id, "i-1");
    assert_eq!(serde_json::to_value(p.outcome).unwrap(), "allow");
    assert_eq!(serde_json::to_value(p.scope).unwrap(), "session");
    r.ok(&json!({"accepted": true}));
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "answered");
    assert_eq!(v["outcome"], "allow");
    let states: Vec<Value> = [s.next().await, s.next().await]
        .iter()
        .map(|m| m.data["interaction"]["state"].clone())
        .collect();
    assert_eq!(states, vec![json!("responding"), json!("answered")]);
    // Answered already: 409; still readable.
    let (status, v) = client
        .post(&format!("{base}/i-1"), &json!({"outcome": "deny"}))
        .await
        .unwrap();
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "interaction_resolved");
    let (status, v) = client.get(&format!("{base}/i-1")).await.unwrap();
    assert_eq!((status, v["state"].clone()), (200, json!("answered")));

    // The executor cancels one (the turn was canceled).
    let _: Value = fake
        .call(
            Method::InteractionRequest,
            &permission(&sid, "i-2", Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert_eq!(s.next().await.data["interaction"]["state"], "pending");
    let r: Value = fake
        .call(
            Method::InteractionCancel,
            &json!({"sessionId": sid, "interactionId": "i-2", "reason": "turn_canceled"}),
        )
        .await
        .unwrap();
    assert_eq!(r["accepted"], true);
    let n = s.next().await;
    assert_eq!(
        (
            n.data["interaction"]["state"].clone(),
            n.data["interaction"]["reason"].clone()
        ),
        (json!("canceled"), json!("turn_canceled"))
    );
    let (status, _) = client
        .post(&format!("{base}/i-2"), &json!({"outcome": "allow"}))
        .await
        .unwrap();
    assert_eq!(status, 409);

    // The executor no longer knows it: 409 interaction_gone.
    let _: Value = fake
        .call(
            Method::InteractionRequest,
            &permission(&sid, "i-3", Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let task = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move {
            client
                .post(
                    &format!("{base}/i-3"),
                    &json!({"outcome": "deny", "denyMessage": "no"}),
                )
                .await
                .unwrap()
        }
    });
    let (p, r): (InteractionResponseParams, Responder) =
        fake.expect(Method::InteractionResponse).await;
    assert_eq!(p.deny_message.as_deref(), Some("no"));
    r.err(RpcError::not_found("no interaction i-3"));
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "interaction_gone");

    // Expiry on the harness's clock.
    let _: Value = fake
        .call(
            Method::InteractionRequest,
            &permission(&sid, "i-4", Duration::from_millis(300)),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (_, v) = client.get(&base).await.unwrap();
    assert!(v["interactions"].as_array().unwrap().is_empty(), "{v}");
    let (_, v) = client.get(&format!("{base}/i-4")).await.unwrap();
    assert_eq!(v["state"], "expired");
    let (status, _) = client
        .post(&format!("{base}/i-4"), &json!({"outcome": "allow"}))
        .await
        .unwrap();
    assert_eq!(status, 409);
    // Bad expiresAt: -32602.
    let mut bad = permission(&sid, "i-5", Duration::from_secs(1));
    bad["expiresAt"] = json!("tomorrow");
    let e = fake
        .call::<_, Value>(Method::InteractionRequest, &bad)
        .await
        .unwrap_err();
    assert_eq!(rpc_code(&e), Some(-32602), "{e}");
    h.shutdown().await;
}

#[tokio::test]
async fn a_slow_subscriber_is_dropped_and_resumes_without_loss() {
    let mut config = bmx::harness::HarnessConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    config.event_subscriber_queue = 4;
    let h = bmx::harness::Harness::builder()
        .config(config)
        .token("exec-a", "secret-a")
        .build()
        .await
        .unwrap();
    let (fake, sid) = fake_with_session(&h).await;
    let session = h.sessions().session(&sid);
    // Subscribed, never read: the queue of 4 fills, the 5th kicks it.
    let mut slow = session.events(0).await.unwrap();
    for n in 1..=10 {
        send_event(&fake, &sid, "t1", n, msg("x")).await.unwrap();
    }
    let mut seen = Vec::new();
    let last = loop {
        match tokio::time::timeout(WAIT, slow.next()).await.unwrap() {
            Some(bmx::harness::StreamItem::Event { sequence, .. }) => seen.push(sequence),
            other => break other,
        }
    };
    assert_eq!(seen, vec![1, 2, 3, 4]);
    assert_eq!(
        last,
        Some(bmx::harness::StreamItem::Error {
            reason: "slow_subscriber"
        })
    );
    assert_eq!(slow.next().await, None);
    // Resuming from what it had: the rest, once.
    let mut again = session.events(4).await.unwrap();
    for want in 5..=10 {
        match again.next().await {
            Some(bmx::harness::StreamItem::Event { sequence, .. }) => assert_eq!(sequence, want),
            other => panic!("{other:?}"),
        }
    }
    h.shutdown().await;
}

#[tokio::test]
async fn routes_need_the_api_token() {
    let h = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("exec-a", "secret-a")
        .api_token(Some("api-secret-0123456789".into()))
        .build()
        .await
        .unwrap();
    let anon = api(&h);
    for path in [
        "/v1/sessions/s/events",
        "/v1/sessions/s/interactions",
        "/v1/sessions/s/interactions/i",
    ] {
        let (status, v) = anon.get(path).await.unwrap();
        assert_eq!(status, 401, "{path}: {v}");
    }
    for path in [
        "/v1/sessions/s/turns",
        "/v1/sessions/s/turns/t/input",
        "/v1/sessions/s/turns/t/cancel",
        "/v1/sessions/s/interactions/i",
    ] {
        let (status, _) = anon.post(path, &json!({})).await.unwrap();
        assert_eq!(status, 401, "{path}");
    }
    let s = sse(&h, "/v1/sessions/s/events", None, None).await;
    assert_eq!(s.status, 401);
    let s = sse(
        &h,
        "/v1/sessions/s/events",
        None,
        Some("api-secret-0123456789"),
    )
    .await;
    assert_eq!(s.status, 404);
    let client = anon.token(Some("api-secret-0123456789".into()));
    let (_, doc) = client.get("/v1/openapi.json").await.unwrap();
    for p in [
        "/v1/sessions/{id}/turns",
        "/v1/sessions/{id}/turns/{turnId}/input",
        "/v1/sessions/{id}/turns/{turnId}/cancel",
        "/v1/sessions/{id}/events",
        "/v1/sessions/{id}/events/ws",
        "/v1/sessions/{id}/interactions",
        "/v1/sessions/{id}/interactions/{interactionId}",
    ] {
        assert!(doc["paths"][p].is_object(), "{p} not documented");
    }
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// End to end: the real executor, its ACP driver and the offline test agent
// (tests/peers/agent/test-agent.mjs on the official ACP SDK).
// ---------------------------------------------------------------------------

fn agent_argv() -> Vec<String> {
    vec![
        "node".into(),
        format!(
            "{}/tests/peers/agent/test-agent.mjs",
            env!("CARGO_MANIFEST_DIR")
        ),
    ]
}

struct E2e {
    h: bmx::harness::HarnessHandle,
    exec: bmx::executor::ExecutorHandle,
    _work: tempfile::TempDir,
    _data: tempfile::TempDir,
    sid: String,
}

/// A harness over the embedded store (as `bmx up` and `bmx harness` run:
/// events are acknowledged once durable) and a real executor with the
/// test agent.
async fn e2e(executor_id: &str) -> E2e {
    use bmx::harness::store::{DurableState, SqliteStore};
    let data = tempfile::tempdir().unwrap();
    let db = SqliteStore::open_dir(data.path()).unwrap();
    let durable = DurableState::open(std::sync::Arc::new(db)).unwrap();
    let (h, exec, work) = harness_with_executor_tweaked(
        executor_id,
        |b| {
            b.heartbeat_ms(200)
                .lease_ttl_ms(5_000)
                .durable_state(durable)
        },
        |c| {
            c.agents = vec![("test".into(), agent_argv())];
            c.interaction_timeout = Duration::from_secs(60);
        },
    )
    .await;
    let (status, v) = api(&h).post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();
    E2e {
        h,
        exec,
        _work: work,
        _data: data,
        sid,
    }
}

impl E2e {
    async fn start(&self, text: &str) -> (u16, Value) {
        api(&self.h)
            .post(
                &format!("/v1/sessions/{}/turns", self.sid),
                &json!({"input": text}),
            )
            .await
            .unwrap()
    }

    async fn events(&self, last_event_id: Option<u64>) -> Sse {
        let s = sse(
            &self.h,
            &format!("/v1/sessions/{}/events", self.sid),
            last_event_id,
            None,
        )
        .await;
        assert_eq!(s.status, 200, "{:?}", s.body);
        s
    }

    async fn stop(self) {
        self.exec.shutdown().await;
        self.h.shutdown().await;
    }
}

/// Stream items until `turn` is idle (30 s at most).
async fn until_idle(s: &mut Sse, turn: &str) -> Vec<SseMsg> {
    let mut seen = Vec::new();
    loop {
        let m = s
            .next_within(Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("turn {turn} idle within 30 s; saw {seen:#?}"));
        let idle = m.data["turnId"] == turn && m.data["event"]["type"] == "session.status_idle";
        seen.push(m);
        if idle {
            return seen;
        }
    }
}

fn finals(seen: &[SseMsg]) -> Vec<&SseMsg> {
    seen.iter().filter(|m| m.event.is_none()).collect()
}

fn types(seen: &[SseMsg]) -> Vec<String> {
    finals(seen)
        .iter()
        .map(|m| m.data["event"]["type"].as_str().unwrap().to_owned())
        .collect()
}

fn said(seen: &[SseMsg]) -> Vec<String> {
    finals(seen)
        .iter()
        .filter(|m| m.data["event"]["type"] == "agent.message")
        .map(|m| m.data["event"]["text"].as_str().unwrap().to_owned())
        .collect()
}

fn outcome(seen: &[SseMsg]) -> Value {
    seen.last().unwrap().data["event"]["turnOutcome"].clone()
}

#[tokio::test]
async fn e2e_a_turn_streams_deltas_then_final_events_and_sse_resumes() {
    let t = e2e("exec-e2e-1").await;
    let mut s = t.events(None).await;
    let (status, v) = t.start("hi there").await;
    assert_eq!(status, 201, "{v}");
    let turn = v["turnId"].as_str().unwrap().to_owned();
    assert!(v["executorSessionRef"].is_string(), "{v}");
    assert_eq!(v["resumed"], false);
    let seen = until_idle(&mut s, &turn).await;
    assert_eq!(
        types(&seen),
        [
            "session.status_running",
            "agent.thinking",
            "agent.message",
            "agent.tool_use",
            "agent.tool_result",
            "session.status_idle"
        ]
    );
    // Final events: id = sequence, 1..=6, no hole, nothing twice.
    let ids: Vec<String> = finals(&seen)
        .iter()
        .map(|m| m.id.clone().unwrap())
        .collect();
    assert_eq!(ids, ["1", "2", "3", "4", "5", "6"]);
    assert_eq!(said(&seen), ["Hello, you said: hi there"]);
    // The message's deltas, without an id, came before its final event.
    let message = finals(&seen)[2].data.clone();
    let deltas: Vec<&SseMsg> = seen
        .iter()
        .filter(|m| m.event.as_deref() == Some("delta") && m.data["eventId"] == message["eventId"])
        .collect();
    let text: String = deltas
        .iter()
        .map(|d| d.data["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello, you said: hi there");
    assert!(deltas.iter().all(|d| d.id.is_none()));
    let pos = |pred: &dyn Fn(&SseMsg) -> bool| seen.iter().position(pred).unwrap();
    assert!(
        pos(&|m| m.event.as_deref() == Some("delta") && m.data["eventId"] == message["eventId"])
            < pos(&|m| m.id.as_deref() == Some("3"))
    );
    let tool_use = &finals(&seen)[3].data["event"];
    assert_eq!(tool_use["input"]["path"], "note.txt");
    assert_eq!(outcome(&seen), "completed");

    // A client that had up to 3 resumes with Last-Event-ID: 4, 5, 6, then
    // the next turn live; nothing twice.
    drop(s);
    let mut again = t.events(Some(3)).await;
    for want in 4..=6 {
        assert_eq!(seq_of(&again.next().await), want);
    }
    let (status, v) = t.start("history").await;
    assert_eq!(status, 201, "{v}");
    let turn2 = v["turnId"].as_str().unwrap().to_owned();
    let seen = until_idle(&mut again, &turn2).await;
    assert_eq!(seq_of(finals(&seen)[0]), 7, "sequence goes on across turns");
    assert_eq!(said(&seen), ["prompts so far: 2"]);
    let seqs: Vec<u64> = finals(&seen).iter().map(|m| seq_of(m)).collect();
    assert_eq!(seqs, (7..7 + seqs.len() as u64).collect::<Vec<_>>());
    t.stop().await;
}

async fn pending_interaction(s: &mut Sse) -> Value {
    loop {
        let m = s.next().await;
        if m.event.as_deref() == Some("interaction") && m.data["interaction"]["state"] == "pending"
        {
            return m.data["interaction"].clone();
        }
    }
}

#[tokio::test]
async fn e2e_permissions_allow_deny_and_session_scope() {
    let t = e2e("exec-e2e-2").await;
    let client = api(&t.h);
    let mut s = t.events(None).await;
    let answer = |id: &str, body: Value| {
        let (client, path) = (
            client.clone(),
            format!("/v1/sessions/{}/interactions/{id}", t.sid),
        );
        async move { client.post(&path, &body).await.unwrap() }
    };

    // Allow once.
    let (_, v) = t.start("permission please").await;
    let turn = v["turnId"].as_str().unwrap().to_owned();
    let i = pending_interaction(&mut s).await;
    assert_eq!(i["turnId"], turn.as_str());
    assert_eq!(i["kind"], "permission");
    assert_eq!(i["toolInput"]["path"], "out.txt");
    let (status, pending) = client
        .get(&format!("/v1/sessions/{}/interactions", t.sid))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        pending["interactions"][0]["interactionId"],
        i["interactionId"]
    );
    let id = i["interactionId"].as_str().unwrap();
    let (status, v) = answer(id, json!({"outcome": "allow", "scope": "once"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "answered");
    let seen = until_idle(&mut s, &turn).await;
    assert_eq!(said(&seen), ["allowed"]);
    let result = finals(&seen)
        .into_iter()
        .find(|m| m.data["event"]["type"] == "agent.tool_result")
        .unwrap();
    assert_eq!(result.data["event"]["status"], "completed");

    // Deny.
    let (_, v) = t.start("permission again").await;
    let turn = v["turnId"].as_str().unwrap().to_owned();
    let i = pending_interaction(&mut s).await;
    let (status, v) = answer(
        i["interactionId"].as_str().unwrap(),
        json!({"outcome": "deny", "denyMessage": "not now"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let seen = until_idle(&mut s, &turn).await;
    assert_eq!(said(&seen), ["denied"]);
    assert_eq!(outcome(&seen), "completed");

    // Allow for the session: the next turn's question is not asked.
    let (_, v) = t.start("permission three").await;
    let turn = v["turnId"].as_str().unwrap().to_owned();
    let i = pending_interaction(&mut s).await;
    let (status, v) = answer(
        i["interactionId"].as_str().unwrap(),
        json!({"outcome": "allow", "scope": "session"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(said(&until_idle(&mut s, &turn).await), ["allowed"]);
    let (_, v) = t.start("permission four").await;
    let turn = v["turnId"].as_str().unwrap().to_owned();
    let seen = until_idle(&mut s, &turn).await;
    assert_eq!(said(&seen), ["allowed"]);
    assert!(
        !seen
            .iter()
            .any(|m| m.event.as_deref() == Some("interaction")),
        "asked again: {seen:#?}"
    );
    t.stop().await;
}

#[tokio::test]
async fn e2e_cancel_one_turn_at_a_time_and_a_crash_then_the_next_turn() {
    let t = e2e("exec-e2e-3").await;
    let client = api(&t.h);
    let mut s = t.events(None).await;
    let (_, v) = t.start("slow").await;
    let turn = v["turnId"].as_str().unwrap().to_owned();
    // Ticks arrive (deltas or finals)...
    loop {
        let m = s.next().await;
        if m.data["turnId"] == turn.as_str()
            && (m.data["text"]
                .as_str()
                .is_some_and(|x| x.starts_with("tick"))
                || m.data["event"]["text"]
                    .as_str()
                    .is_some_and(|x| x.starts_with("tick")))
        {
            break;
        }
    }
    // ...a second turn is refused while it runs...
    let (status, v) = t.start("hi").await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "turn_running");
    // ...and cancel ends it.
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{}/turns/{turn}/cancel", t.sid),
            &json!({"reason": "user"}),
        )
        .await
        .unwrap();
    assert_eq!((status, v["canceled"].clone()), (200, json!(true)));
    let seen = until_idle(&mut s, &turn).await;
    assert_eq!(outcome(&seen), "canceled");
    // Input to a finished turn: the executor's 409.
    let (status, v) = client
        .post(
            &format!("/v1/sessions/{}/turns/{turn}/input", t.sid),
            &json!({"input": "more"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 409, "{v}");

    // The agent dies mid-turn: session.error, failed; the next turn works
    // on a fresh agent.
    let (_, v) = t.start("crash").await;
    let turn = v["turnId"].as_str().unwrap().to_owned();
    let seen = until_idle(&mut s, &turn).await;
    assert!(
        types(&seen).contains(&"session.error".to_owned()),
        "{seen:#?}"
    );
    assert_eq!(outcome(&seen), "failed");
    let (status, v) = t.start("after the crash").await;
    assert_eq!(status, 201, "{v}");
    let turn = v["turnId"].as_str().unwrap().to_owned();
    let seen = until_idle(&mut s, &turn).await;
    assert_eq!(outcome(&seen), "completed");
    assert_eq!(said(&seen), ["Hello, you said: after the crash"]);
    // Every final event of the session so far, once each, in order.
    drop(s);
    let mut all = t.events(None).await;
    let mut n = 0;
    while let Some(m) = all.next_within(Duration::from_millis(500)).await {
        if m.event.is_none() {
            n += 1;
            assert_eq!(seq_of(&m), n);
        }
    }
    assert!(n >= 10, "{n}");
    t.stop().await;
}

async fn bmx_run(t: &E2e, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .arg("run")
        .arg("--harness")
        .arg(t.h.api_url())
        .args(args)
        .stdin(std::process::Stdio::null())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("bmx run ends within 60 s")
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn e2e_bmx_run_streams_asks_and_exits_with_the_outcome() {
    let t = e2e("exec-e2e-4").await;
    // A new session of its own, stopped at the end.
    let (code, out, err) = bmx_run(&t, &["hello", "world"]).await;
    assert_eq!(code, 0, "stdout {out:?} stderr {err:?}");
    assert_eq!(out, "Hello, you said: hello world\n");
    assert!(err.contains("[tool] read a file"), "{err}");
    // In our session: no terminal to ask, so the permission is denied.
    let sid = t.sid.clone();
    let (code, out, err) = bmx_run(&t, &["--session", &sid, "permission"]).await;
    assert_eq!(code, 0, "stdout {out:?} stderr {err:?}");
    assert_eq!(out, "denied\n");
    assert!(err.contains("no terminal to ask: denied"), "{err}");
    let (code, out, _) = bmx_run(
        &t,
        &["--session", &sid, "--permission", "allow", "permission"],
    )
    .await;
    assert_eq!((code, out.as_str()), (0, "allowed\n"));
    // The agent crashes: exit 1.
    let (code, _, err) = bmx_run(&t, &["--session", &sid, "crash"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("agent error"), "{err}");
    // The session goes on.
    let (code, out, _) = bmx_run(&t, &["--session", &sid, "history"]).await;
    assert_eq!(code, 0);
    assert!(out.starts_with("prompts so far: "), "{out}");
    t.stop().await;
}

#[tokio::test]
async fn e2e_a_connection_cut_mid_turn_loses_no_event_and_repeats_none() {
    let t = e2e("exec-e2e-5").await;
    let client = api(&t.h);
    let mut s = t.events(None).await;
    let (_, v) = t.start("slow").await;
    let turn = v["turnId"].as_str().unwrap().to_owned();
    // Ticks flow; then the executor's connection is cut (closed with 1011:
    // the executor reconnects and resumes its session).
    let mut early = Vec::new();
    while early
        .iter()
        .filter(|m: &&SseMsg| m.event.as_deref() == Some("delta"))
        .count()
        < 2
    {
        early.push(s.next().await);
    }
    let before = t.h.executors()[0].connection_id.clone();
    assert!(t.h.inject_connection_panic("exec-e2e-5"));
    // Back on a new connection.
    let deadline = tokio::time::Instant::now() + WAIT;
    while t
        .h
        .executors()
        .first()
        .is_none_or(|e| e.connection_id == before)
    {
        assert!(tokio::time::Instant::now() < deadline, "no reconnect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Cancel (retried while the session's executor is away) and finish.
    let cancel = format!("/v1/sessions/{}/turns/{turn}/cancel", t.sid);
    loop {
        let (status, v) = client.post(&cancel, &json!({})).await.unwrap();
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{v}");
        assert!(tokio::time::Instant::now() < deadline + WAIT, "{v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut seen = early;
    seen.extend(until_idle(&mut s, &turn).await);
    assert_eq!(outcome(&seen), "canceled");
    let (_, v) = t.start("after the cut").await;
    let turn2 = v["turnId"].as_str().unwrap().to_owned();
    let seen2 = until_idle(&mut s, &turn2).await;
    assert_eq!(said(&seen2), ["Hello, you said: after the cut"]);
    // The live client saw every sequence once, in order, no hole...
    let live: Vec<u64> = finals(&seen)
        .into_iter()
        .chain(finals(&seen2))
        .map(seq_of)
        .collect();
    assert_eq!(live, (1..=live.len() as u64).collect::<Vec<_>>());
    // ...and so does a replay of everything kept.
    let mut all = t.events(None).await;
    let mut replayed = Vec::new();
    while let Some(m) = all.next_within(Duration::from_millis(500)).await {
        if m.event.is_none() {
            replayed.push(seq_of(&m));
        }
    }
    assert_eq!(replayed, live);
    t.stop().await;
}

#[tokio::test]
async fn e2e_bmx_run_ctrl_c_cancels_the_turn() {
    use tokio::io::AsyncReadExt;
    let t = e2e("exec-e2e-6").await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args([
            "run",
            "--harness",
            &t.h.api_url(),
            "--session",
            &t.sid,
            "slow",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&got).contains("tick 2") {
        let n = tokio::time::timeout(WAIT, stdout.read(&mut buf))
            .await
            .expect("ticks on stdout")
            .unwrap();
        assert!(n > 0, "stdout closed: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("bmx run ends after Ctrl-C")
        .unwrap();
    assert_eq!(status.code(), Some(130));
    // The turn was canceled, not abandoned: the session takes the next one.
    let (status, v) = t.start("hi").await;
    assert_eq!(status, 201, "{v}");
    t.stop().await;
}
