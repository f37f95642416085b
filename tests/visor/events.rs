//! The visor's event stream over a real WebSocket: replay from `after`
//! joined to the live stream with no hole or duplicate, and filters.

use crate::visor_support;
use serde_json::{json, Value};
use visor_support::*;

async fn collect_until(ws: &mut Ws, n: usize) -> Vec<Value> {
    let mut out = Vec::new();
    while out.len() < n {
        out.push(next_json(ws).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_then_live_without_gap_or_duplicate_and_filtered() {
    let v = Visor::start();
    // History: two sessions that start and end.
    let a = v
        .start_pty(&["sh", "-c", "echo a"], json!({"labels": {"team": "a"}}))
        .await;
    let b = v
        .start_pty(&["sh", "-c", "echo b"], json!({"labels": {"team": "b"}}))
        .await;
    for id in [&a, &b] {
        v.until(&format!("/v1/sessions/{id}"), "exited", |s| {
            s["state"] == "exited"
        })
        .await;
    }
    let latest = v.ok("GET", "/v1/info", None).await["seq"].as_u64().unwrap();
    assert!(
        latest >= 8,
        "init, running, exit, exited for each: {latest}"
    );

    // Everything from the start, then live.
    let mut all = v.ws("/v1/events?after=0").await;
    let replayed = collect_until(&mut all, latest as usize).await;
    let seqs: Vec<u64> = replayed
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=latest).collect::<Vec<_>>());
    for e in &replayed {
        assert!(
            e["at"].as_str().is_some()
                && e["session"].as_str().is_some()
                && e["type"].as_str().is_some(),
            "{e}"
        );
    }

    // A subscriber from the middle, one filtered to session b, one to types.
    let mid = latest / 2;
    let mut from_mid = v.ws(&format!("/v1/events?after={mid}")).await;
    let mut only_b = v.ws(&format!("/v1/events?session={b}")).await;
    let mut only_state = v.ws("/v1/events?types=session_state&label=team%3Dc").await;

    // Live: a third session while everyone listens.
    let c = v
        .start_pty(&["sh", "-c", "echo c"], json!({"labels": {"team": "c"}}))
        .await;
    v.until(&format!("/v1/sessions/{c}"), "exited", |s| {
        s["state"] == "exited"
    })
    .await;
    let now = v.ok("GET", "/v1/info", None).await["seq"].as_u64().unwrap();
    assert!(now >= latest + 4);

    let live = collect_until(&mut all, (now - latest) as usize).await;
    let seqs: Vec<u64> = live.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (latest + 1..=now).collect::<Vec<_>>(),
        "no hole, no duplicate across replay and live"
    );

    let m = collect_until(&mut from_mid, (now - mid) as usize).await;
    let seqs: Vec<u64> = m.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (mid + 1..=now).collect::<Vec<_>>());

    let everything: Vec<Value> = replayed.into_iter().chain(live).collect();
    let want_b: Vec<u64> = everything
        .iter()
        .filter(|e| e["session"] == b.as_str())
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    let got_b: Vec<u64> = collect_until(&mut only_b, want_b.len())
        .await
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(got_b, want_b);

    let want_state: Vec<u64> = everything
        .iter()
        .filter(|e| e["session"] == c.as_str() && e["type"] == "session_state")
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(want_state.len(), 2, "running, exited");
    let got: Vec<u64> = collect_until(&mut only_state, 2)
        .await
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(got, want_state);

    // Nothing more arrives on the filtered streams: the next event of
    // session b's filter would be a bug. A new event of another session
    // comes on the unfiltered stream only.
    let d = v.start_pty(&["sh", "-c", "true"], json!({})).await;
    let next = next_json(&mut all).await;
    assert_eq!(next["session"], d.as_str());
    let quiet = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        next_json_opt(&mut only_b),
    )
    .await;
    assert!(
        quiet.is_err(),
        "a filtered stream got another session's event: {quiet:?}"
    );

    // Bad filters are refused before the upgrade.
    let (st, e) = v.req("GET", "/v1/events?after=x", None).await;
    assert_eq!((st, e["error"]["code"].as_str()), (400, Some("invalid")));
}

async fn next_json_opt(ws: &mut Ws) -> Option<Value> {
    use futures_util::StreamExt;
    loop {
        match ws.next().await? {
            Ok(tokio_tungstenite::tungstenite::Message::Text(t)) => {
                return serde_json::from_str(&t).ok()
            }
            Ok(_) => {}
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_does_not_block_sessions() {
    let v = Visor::start();
    // Subscribe and never read.
    let _stuck = v.ws("/v1/events?after=0").await;
    // A flood of output and many events meanwhile.
    let id = v
        .start_pty(
            &["sh", "-c", "yes visor | head -c 5000000; echo done"],
            json!({}),
        )
        .await;
    v.until(&format!("/v1/sessions/{id}"), "exited", |s| {
        s["state"] == "exited"
    })
    .await;
    for _ in 0..20 {
        let s = v.start_pty(&["true"], json!({})).await;
        v.until(&format!("/v1/sessions/{s}"), "exited", |s| {
            s["state"] == "exited"
        })
        .await;
    }
    // A client that keeps up still gets everything.
    let latest = v.ok("GET", "/v1/info", None).await["seq"].as_u64().unwrap();
    let mut ws = v.ws("/v1/events?after=0").await;
    let got = collect_until(&mut ws, latest as usize).await;
    assert_eq!(got.last().unwrap()["seq"].as_u64(), Some(latest));
    assert!(v.output(&id).await.contains("done"));
}
