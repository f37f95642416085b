//! Attach with the writer lease over real WebSockets: snapshot on attach,
//! `control` hands the lease over, input refused to the other client,
//! resize by the writer only, release on disconnect.

use crate::visor_support;
use futures_util::SinkExt;
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;
use visor_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_and_the_lease_handover() {
    let v = Visor::start();
    let id = v
        .start_pty(
            &["bash", "--norc", "--noprofile", "-i"],
            json!({"cols": 90, "rows": 20}),
        )
        .await;
    v.keys(&id, "echo before$((20+1))\r").await;
    v.until(&format!("/v1/sessions/{id}/output"), "before21", |o| {
        o["text"].as_str().unwrap_or("").contains("before21")
    })
    .await;

    let path = format!("/v1/sessions/{id}/attach");
    let mut a = v.ws(&path).await;
    let mut a_out = Vec::new();
    let hello = until_json(&mut a, &mut a_out, "attached", |f| f["type"] == "attached").await;
    assert_eq!(hello["holder"], "none");
    assert_eq!(hello["writable"], false);
    assert_eq!(
        (hello["cols"].as_u64(), hello["rows"].as_u64()),
        (Some(90), Some(20))
    );
    // The snapshot redraws the screen, which shows the earlier output.
    until_output(&mut a, &mut a_out, "before21").await;

    let mut b = v.ws(&path).await;
    let mut b_out = Vec::new();
    until_json(&mut b, &mut b_out, "attached", |f| f["type"] == "attached").await;

    // A takes the lease: A sees "you", B sees "other".
    send_json(&mut a, json!({"type": "control"})).await;
    until_json(&mut a, &mut a_out, "lease you", |f| {
        f["type"] == "lease" && f["holder"] == "you"
    })
    .await;
    until_json(&mut b, &mut b_out, "lease other", |f| {
        f["type"] == "lease" && f["holder"] == "other"
    })
    .await;

    // B may not type or resize; HTTP keys are refused while A holds it.
    send_json(&mut b, json!({"type": "input", "data": "echo nope\r"})).await;
    until_json(&mut b, &mut b_out, "not_writer", |f| {
        f["type"] == "error" && f["code"] == "not_writer"
    })
    .await;
    b.send(Message::Binary(bmx::terminal::frame::frame(
        2,
        0,
        b"echo nope\r",
    )))
    .await
    .unwrap();
    until_json(&mut b, &mut b_out, "not_writer (binary)", |f| {
        f["type"] == "error" && f["code"] == "not_writer"
    })
    .await;
    send_json(&mut b, json!({"type": "resize", "cols": 50, "rows": 10})).await;
    until_json(&mut b, &mut b_out, "not_writer (resize)", |f| {
        f["type"] == "error" && f["code"] == "not_writer"
    })
    .await;
    let data = base64_simd::STANDARD.encode_to_string(b"echo nope\r");
    let (st, _) = v
        .req(
            "POST",
            &format!("/v1/sessions/{id}/keys"),
            Some(json!({"data": data})),
        )
        .await;
    assert_eq!(st, 409);

    // A types; both see the output.
    send_json(
        &mut a,
        json!({"type": "input", "data": "echo from$((40+2))a\r"}),
    )
    .await;
    until_output(&mut a, &mut a_out, "from42a").await;
    until_output(&mut b, &mut b_out, "from42a").await;
    // A resizes; both are told.
    send_json(&mut a, json!({"type": "resize", "cols": 100, "rows": 30})).await;
    until_json(&mut b, &mut b_out, "resized", |f| {
        f["type"] == "resized" && f["cols"] == 100
    })
    .await;

    // Handover: B takes control.
    send_json(&mut b, json!({"type": "control"})).await;
    until_json(&mut b, &mut b_out, "lease you (b)", |f| {
        f["type"] == "lease" && f["holder"] == "you"
    })
    .await;
    until_json(&mut a, &mut a_out, "lease other (a)", |f| {
        f["type"] == "lease" && f["holder"] == "other"
    })
    .await;
    send_json(&mut a, json!({"type": "input", "data": "echo nope\r"})).await;
    until_json(&mut a, &mut a_out, "not_writer (a)", |f| {
        f["type"] == "error" && f["code"] == "not_writer"
    })
    .await;
    send_json(
        &mut b,
        json!({"type": "input", "data": "echo from$((40+3))b\r"}),
    )
    .await;
    until_output(&mut a, &mut a_out, "from43b").await;

    // B disconnects: the lease is released.
    drop(b);
    until_json(&mut a, &mut a_out, "lease none", |f| {
        f["type"] == "lease" && f["holder"] == "none"
    })
    .await;
    // The nope lines never ran.
    assert!(!v.output(&id).await.lines().any(|l| l.trim() == "nope"));

    // The program ends: the attached client is told.
    send_json(&mut a, json!({"type": "control"})).await;
    send_json(&mut a, json!({"type": "input", "data": "exit 7\r"})).await;
    let ended = until_json(&mut a, &mut a_out, "ended", |f| f["type"] == "ended").await;
    assert_eq!(
        (ended["reason"].as_str(), ended["exitCode"].as_i64()),
        (Some("exited"), Some(7))
    );

    // Attach to an unknown session: a typed error, no upgrade.
    let (st, e) = v.req("GET", "/v1/sessions/nope/attach", None).await;
    assert_eq!((st, e["error"]["code"].as_str()), (404, Some("not_found")));
}

/// A flood of output (64 MiB, far more than the 1 MiB scrollback) with
/// one client that reads and one that never does: the reading client gets
/// every byte in order with no resync (the PTY waits for it), and the
/// stalled one does not hold the session up (it is left behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_keeps_up_gets_every_byte_of_a_flood() {
    use futures_util::StreamExt;
    const BYTES: usize = 64 << 20;
    let v = Visor::start();
    let cmd = format!("read go; head -c {BYTES} /dev/zero | tr '\\0' a; echo; echo flood-done");
    let id = v.start_pty(&["sh", "-c", &cmd], json!({})).await;
    let path = format!("/v1/sessions/{id}/attach");
    let mut reader = v.ws(&path).await;
    let mut first = Vec::new();
    until_json(&mut reader, &mut first, "attached", |f| {
        f["type"] == "attached"
    })
    .await;
    // Never read: its socket fills and it stops taking output.
    let stalled = v.ws(&path).await;
    v.keys(&id, "\n").await;
    let (mut a_bytes, mut snapshots, mut tail) = (0usize, 0usize, Vec::new());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, reader.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) if b[0] == 1 => {
                let data = &b[9..];
                a_bytes += data.iter().filter(|&&c| c == b'a').count();
                tail.extend_from_slice(data);
                let keep = tail.len().saturating_sub(64);
                tail.drain(..keep);
            }
            // The attach's first snapshot comes before any output.
            Ok(Some(Ok(Message::Binary(b)))) if b[0] == 3 && a_bytes > 0 => snapshots += 1,
            Ok(Some(Ok(Message::Text(t)))) if t.contains("\"ended\"") => break,
            Ok(Some(Ok(_))) => {}
            other => panic!("the flood did not end ({other:?}) after {a_bytes} bytes"),
        }
    }
    assert_eq!(snapshots, 0, "the reading client was resynchronised");
    assert_eq!(a_bytes, BYTES, "the reading client missed output");
    assert!(String::from_utf8_lossy(&tail).contains("flood-done"));
    drop(stalled);
}
