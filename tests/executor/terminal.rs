//! Issue 6 (executor side): terminals through the real executor, driven over
//! a real WebSocket by the harness stand-in; real PTYs and programs.
//!
//! JSON is negotiated so notifications (`terminal.output`) can be read as
//! `serde_json::Value` by the stand-in. No timing assertions except
//! generous upper bounds.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::{Blob, CloseCode, Method, RpcError, Subprotocol};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;
use support::*;

fn json_only() -> Options {
    Options {
        supported: vec![Subprotocol::ALL[1]],
        ..Default::default()
    }
}

const BASH: &[&str] = &["bash", "--norc", "--noprofile"];

fn open_params(id: &str, argv: &[&str], cols: u16, rows: u16) -> TerminalOpenParams {
    TerminalOpenParams {
        terminal_id: id.into(),
        kind: None,
        argv: Some(argv.iter().map(|s| s.to_string()).collect()),
        shell: None,
        cwd: None,
        env: Some(BTreeMap::from([("PS1".to_string(), "$ ".to_string())])),
        cols,
        rows,
    }
}

async fn open(rig: &Rig, p: &TerminalOpenParams) -> TerminalOpenResult {
    rig.conn
        .call(Method::TerminalOpen, p)
        .await
        .expect("terminal.open")
}

fn attach_params(
    id: &str,
    stream: &str,
    from_seq: u64,
    ack_seq: Option<u64>,
    can_write: bool,
    epoch: u64,
) -> TerminalAttachParams {
    TerminalAttachParams {
        terminal_id: id.into(),
        stream_id: stream.into(),
        from_seq,
        ack_seq,
        can_write,
        epoch,
        host: None,
    }
}

async fn attach(rig: &Rig, p: &TerminalAttachParams) -> TerminalAttachResult {
    rig.conn
        .call(Method::TerminalAttach, p)
        .await
        .expect("terminal.attach")
}

async fn input(rig: &Rig, id: &str, stream: &str, epoch: u64, data: &str) -> Result<(), RpcError> {
    rig.conn
        .call::<_, Accepted>(
            Method::TerminalInput,
            &TerminalInputParams {
                terminal_id: id.into(),
                stream_id: stream.into(),
                epoch,
                data: Blob::from(data.as_bytes().to_vec()),
            },
        )
        .await
        .map(|_| ())
}

async fn resize(
    rig: &Rig,
    id: &str,
    stream: Option<(&str, u64)>,
    cols: u16,
    rows: u16,
) -> Result<(), RpcError> {
    rig.conn
        .call::<_, Accepted>(
            Method::TerminalResize,
            &TerminalResizeParams {
                terminal_id: id.into(),
                cols,
                rows,
                stream_id: stream.map(|s| s.0.to_string()),
                epoch: stream.map(|s| s.1),
            },
        )
        .await
        .map(|_| ())
}

async fn close(rig: &Rig, id: &str) -> TerminalCloseResult {
    rig.conn
        .call(
            Method::TerminalClose,
            &TerminalCloseParams {
                terminal_id: id.into(),
                reason: "test".into(),
            },
        )
        .await
        .expect("terminal.close")
}

/// One `terminal.output` as the stand-in saw it.
#[derive(Debug)]
struct Out {
    seq: u64,
    data: Vec<u8>,
    gap: Option<Value>,
}

fn decode(v: &Value) -> Out {
    let data = match &v["data"] {
        Value::String(s) => bmx::wire::blob::base64_decode(s).expect("base64"),
        Value::Array(a) => a.iter().map(|b| b.as_u64().unwrap() as u8).collect(),
        other => panic!("data: {other}"),
    };
    Out {
        seq: v["seq"].as_u64().unwrap(),
        data,
        gap: v.get("gap").cloned(),
    }
}

async fn next_output(rig: &mut Rig, id: &str, stream: &str) -> Out {
    let v = rig
        .event("terminal.output", |v| {
            v["terminalId"] == id && v["streamId"] == stream
        })
        .await;
    decode(&v)
}

/// Collect a stream's output (de-duplicated by seq) until it contains
/// `needle`; returns the bytes and the last seq.
async fn read_until(
    rig: &mut Rig,
    id: &str,
    stream: &str,
    seen: &mut Vec<u8>,
    needle: &str,
) -> u64 {
    let mut last = 0;
    while !contains(seen, needle) {
        let o = next_output(rig, id, stream).await;
        if o.seq > last || last == 0 {
            seen.extend_from_slice(&o.data);
            last = o.seq;
        }
    }
    last
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn code(e: &RpcError) -> (i32, Option<String>) {
    (
        e.code,
        e.data.as_ref().and_then(|d| d.terminal_code.clone()),
    )
}

#[tokio::test]
async fn bash_computes_42() {
    let mut rig = Rig::start(json_only()).await;
    let t = open(&rig, &open_params("t1", BASH, 80, 24)).await;
    assert!(t.pid > 0);
    assert_eq!((t.cols, t.rows, t.epoch), (80, 24, 0));
    let a = attach(&rig, &attach_params("t1", "s1", 1, None, true, 1)).await;
    assert_eq!((a.accepted, a.writer_epoch), (true, 1));
    input(&rig, "t1", "s1", 1, "echo $((6*7))\n").await.unwrap();
    let mut seen = Vec::new();
    read_until(&mut rig, "t1", "s1", &mut seen, "42\r\n").await;
    rig.shutdown().await;
}

#[tokio::test]
async fn stty_size_follows_open_and_resize() {
    let mut rig = Rig::start(json_only()).await;
    open(&rig, &open_params("t", BASH, 100, 30)).await;
    attach(&rig, &attach_params("t", "w", 1, None, true, 1)).await;
    input(&rig, "t", "w", 1, "stty size\n").await.unwrap();
    let mut seen = Vec::new();
    read_until(&mut rig, "t", "w", &mut seen, "30 100").await;
    // Only the writer resizes.
    let e = resize(&rig, "t", Some(("other", 1)), 120, 40)
        .await
        .unwrap_err();
    assert_eq!(code(&e), (-32009, Some("not_writer".into())));
    let e = resize(&rig, "t", None, 120, 40).await.unwrap_err();
    assert_eq!(code(&e), (-32009, Some("not_writer".into())));
    resize(&rig, "t", Some(("w", 1)), 120, 40).await.unwrap();
    input(&rig, "t", "w", 1, "stty size\n").await.unwrap();
    read_until(&mut rig, "t", "w", &mut seen, "40 120").await;
    let t = open(&rig, &open_params("t", BASH, 100, 30)).await;
    assert_eq!((t.cols, t.rows), (120, 40), "open answers the current size");

    // The program sees SIGWINCH (no writer: a stream-less resize is allowed).
    let script = "trap 'echo winch $(stty size)' WINCH; echo ready; while :; do sleep 0.05; done";
    open(&rig, &open_params("w", &["sh", "-c", script], 80, 24)).await;
    attach(&rig, &attach_params("w", "v", 1, None, false, 0)).await;
    let mut seen = Vec::new();
    read_until(&mut rig, "w", "v", &mut seen, "ready").await;
    resize(&rig, "w", None, 90, 33).await.unwrap();
    read_until(&mut rig, "w", "v", &mut seen, "winch 33 90").await;
    rig.shutdown().await;
}

#[tokio::test]
async fn replay_from_seq_1_is_identical_minus_queries() {
    let mut rig = Rig::start(json_only()).await;
    // A cursor-position query in the output: live viewers get it, replays
    // must not (the viewer's emulator would answer it as typed input).
    // The program waits for a line, so all it prints is live for the first
    // stream (attached before).
    let script = "read go; printf 'before\\033[6nafter\\n'; \
                  for i in $(seq 1 300); do echo line-$i; done; sleep 100";
    open(&rig, &open_params("r", &["sh", "-c", script], 80, 24)).await;
    attach(&rig, &attach_params("r", "live", 1, None, true, 1)).await;
    input(&rig, "r", "live", 1, "go\n").await.unwrap();
    let mut live = Vec::new();
    let last = read_until(&mut rig, "r", "live", &mut live, "line-300\r\n").await;
    assert!(contains(&live, "before\x1b[6nafter"));
    // Detach (a new stream: the protocol has no detach) and replay.
    attach(&rig, &attach_params("r", "replay", 1, None, false, 0)).await;
    let mut replay = Vec::new();
    loop {
        let o = next_output(&mut rig, "r", "replay").await;
        assert!(o.gap.is_none());
        replay.extend_from_slice(&o.data);
        if o.seq >= last {
            break;
        }
    }
    let expected: Vec<u8> = String::from_utf8(live)
        .unwrap()
        .replace("\x1b[6n", "")
        .into_bytes();
    assert_eq!(
        String::from_utf8_lossy(&replay),
        String::from_utf8_lossy(&expected)
    );
    rig.shutdown().await;
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test]
async fn flood_with_a_slow_viewer_is_bounded_and_reports_a_gap() {
    let mut rig = Rig::start(json_only()).await;
    let before = rss_kib();
    let script = "yes | head -c 50000000; echo FLOOD-END";
    open(&rig, &open_params("f", &["sh", "-c", script], 80, 24)).await;
    attach(&rig, &attach_params("f", "slow", 1, None, false, 0)).await;
    // The viewer does not ack: the program still runs to the end.
    let mut last_seen = 0;
    let mut received = 0;
    let exited = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let (m, v) = rig.events.recv().await.expect("events");
            if m == "terminal.exited" {
                return v;
            }
            if m == "terminal.output" {
                let o = decode(&v);
                received += o.data.len();
                last_seen = o.seq;
            }
        }
    })
    .await
    .expect("the flood ends within 120 s");
    assert_eq!(exited["exitCode"], 0);
    // The window stopped the stream: about 256 KiB went out, unacknowledged.
    assert!(
        received <= (256 << 10) + (64 << 10),
        "{received} bytes sent"
    );
    let grown = rss_kib().saturating_sub(before);
    eprintln!("flood: RSS grew by {grown} KiB");
    assert!(grown < 64 * 1024, "RSS grew by {grown} KiB");
    let t = open(&rig, &open_params("f", &["sh", "-c", script], 80, 24)).await;
    assert!(t.earliest_seq > 1, "the scrollback dropped old chunks");
    // Now the viewer acks as it reads: a gap first, then the retained tail.
    attach(
        &rig,
        &attach_params("f", "slow", last_seen + 1, Some(last_seen), false, 0),
    )
    .await;
    let mut gap = None;
    let mut tail = Vec::new();
    while !contains(&tail, "FLOOD-END") {
        let o = next_output(&mut rig, "f", "slow").await;
        if o.seq <= last_seen {
            continue;
        }
        if o.gap.is_some() {
            gap = o.gap.clone();
        } else if gap.is_some() {
            tail.extend_from_slice(&o.data);
        }
        last_seen = o.seq;
        attach(
            &rig,
            &attach_params("f", "slow", last_seen + 1, Some(last_seen), false, 0),
        )
        .await;
    }
    let gap = gap.expect("a gap marker");
    assert_eq!(gap["toSeq"].as_u64().unwrap() + 1, t.earliest_seq);
    assert!(tail.len() <= 1 << 20);
    rig.shutdown().await;
}

#[tokio::test]
async fn a_higher_epoch_takes_the_writer_role() {
    let mut rig = Rig::start(json_only()).await;
    open(&rig, &open_params("w", BASH, 80, 24)).await;
    let a = attach(&rig, &attach_params("w", "a", 1, None, true, 1)).await;
    assert_eq!(a.writer_epoch, 1);
    input(&rig, "w", "a", 1, "echo from-a\n").await.unwrap();
    let b = attach(&rig, &attach_params("w", "b", 1, None, true, 2)).await;
    assert_eq!(b.writer_epoch, 2);
    let e = input(&rig, "w", "a", 1, "echo late\n").await.unwrap_err();
    assert_eq!(code(&e), (-32009, Some("not_writer".into())));
    // Not the same epoch, not another stream claiming the same epoch.
    let e = input(&rig, "w", "b", 1, "x").await.unwrap_err();
    assert_eq!(code(&e), (-32009, Some("not_writer".into())));
    let c = attach(&rig, &attach_params("w", "c", 1, None, true, 2)).await;
    assert_eq!(c.writer_epoch, 2);
    let e = input(&rig, "w", "c", 2, "x").await.unwrap_err();
    assert_eq!(code(&e), (-32009, Some("not_writer".into())));
    input(&rig, "w", "b", 2, "echo $((6*7))\n").await.unwrap();
    let mut seen = Vec::new();
    read_until(&mut rig, "w", "b", &mut seen, "42\r\n").await;
    assert!(!contains(&seen, "late"));
    let t = open(&rig, &open_params("w", BASH, 80, 24)).await;
    assert_eq!(t.epoch, 2);
    rig.shutdown().await;
}

#[tokio::test]
async fn close_kills_the_program_and_its_children() {
    let rig = Rig::start_with(json_only(), |c| {
        c.terminal_close_grace = Duration::from_millis(500)
    })
    .await;
    let t = open(&rig, &open_params("c", BASH, 80, 24)).await;
    attach(&rig, &attach_params("c", "s", 1, None, true, 1)).await;
    // A background job that ignores SIGHUP, and a foreground one.
    input(
        &rig,
        "c",
        "s",
        1,
        "(trap '' HUP; exec sleep 1234567) & sleep 7654321\n",
    )
    .await
    .unwrap();
    eventually("both sleeps run", || {
        !pids_with_arg("sleep 1234567").is_empty() && !pids_with_arg("sleep 7654321").is_empty()
    })
    .await;
    let r = close(&rig, "c").await;
    assert!(r.closed);
    assert!(r.exit_code.is_some());
    eventually("the tree is gone", || {
        !alive(t.pid as i32)
            && pids_with_arg("sleep 1234567").is_empty()
            && pids_with_arg("sleep 7654321").is_empty()
    })
    .await;
    let e = rig
        .conn
        .call::<_, TerminalAttachResult>(
            Method::TerminalAttach,
            &attach_params("c", "s", 1, None, false, 0),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32004);
    // The id is free again.
    let again = open(&rig, &open_params("c", &["sleep", "30"], 80, 24)).await;
    assert_ne!(again.pid, t.pid);
    rig.shutdown().await;
}

#[tokio::test]
async fn a_program_that_ends_reports_exited_and_keeps_its_output() {
    let mut rig = Rig::start(json_only()).await;
    open(
        &rig,
        &open_params("e", &["sh", "-c", "echo bye; exit 3"], 80, 24),
    )
    .await;
    let v = rig
        .event("terminal.exited", |v| v["terminalId"] == "e")
        .await;
    assert_eq!(v["exitCode"], 3);
    attach(&rig, &attach_params("e", "late", 1, None, true, 1)).await;
    let mut seen = Vec::new();
    read_until(&mut rig, "e", "late", &mut seen, "bye").await;
    let e = input(&rig, "e", "late", 1, "x").await.unwrap_err();
    assert_eq!(e.reason(), Some("terminal_exited"));
    let r = close(&rig, "e").await;
    assert_eq!((r.closed, r.exit_code), (true, Some(3)));
    rig.shutdown().await;
}

#[tokio::test]
async fn terminals_survive_a_connection_drop_and_resume_without_loss() {
    let mut rig = Rig::start(json_only()).await;
    let script = "for i in $(seq 0 39); do echo line-$i; sleep 0.05; done; sleep 100";
    let t = open(&rig, &open_params("d", &["sh", "-c", script], 80, 24)).await;
    attach(&rig, &attach_params("d", "v", 1, None, false, 0)).await;
    let mut seen = Vec::new();
    let mut last = 0;
    // Read and ack until line-5.
    while !contains(&seen, "line-5\r\n") {
        let o = next_output(&mut rig, "d", "v").await;
        assert_eq!(o.seq, last + 1, "consecutive seqs");
        seen.extend_from_slice(&o.data);
        last = o.seq;
        attach(
            &rig,
            &attach_params("d", "v", last + 1, Some(last), false, 0),
        )
        .await;
    }
    // The harness drops the connection; output keeps coming meanwhile.
    rig.conn.link.close(CloseCode::GoingAway, "restarting");
    let mut conn = rig.stand_in.next_conn().await;
    conn.register(10_000, 30_000).await;
    let (served, events) = conn.serve();
    rig.conn = served;
    rig.events = events;
    let again = open(&rig, &open_params("d", &["sh", "-c", script], 80, 24)).await;
    assert_eq!(again.pid, t.pid, "the same terminal");
    // The stream resumes from its last ack; the viewer drops duplicates.
    while !contains(&seen, "line-39\r\n") {
        let o = next_output(&mut rig, "d", "v").await;
        if o.seq <= last {
            continue;
        }
        assert_eq!(o.seq, last + 1, "no seq lost");
        assert!(o.gap.is_none());
        seen.extend_from_slice(&o.data);
        last = o.seq;
        attach(
            &rig,
            &attach_params("d", "v", last + 1, Some(last), false, 0),
        )
        .await;
    }
    let expected: String = (0..40).map(|i| format!("line-{i}\r\n")).collect();
    assert_eq!(String::from_utf8_lossy(&seen), expected);
    rig.shutdown().await;
}

#[tokio::test]
async fn host_attach_streams_binary_frames_both_ways() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let rig = Rig::start(json_only()).await;
    let script = "echo hello-host; exec bash --norc --noprofile";
    open(&rig, &open_params("h", &["sh", "-c", script], 80, 24)).await;
    eventually_async(&rig, "first output", |t| t.latest_seq > 0, "h", script).await;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}/relay/h", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut auth = None;
        #[allow(clippy::result_large_err)]
        let ws = tokio_tungstenite::accept_hdr_async(tcp, |req: &http::Request<()>, resp| {
            auth = req
                .headers()
                .get("authorization")
                .map(|v| v.to_str().unwrap().to_owned());
            Ok(resp)
        })
        .await
        .unwrap();
        (ws, auth)
    });
    let mut p = attach_params("h", "relay", 1, None, true, 1);
    p.host = Some(AttachHost {
        url,
        ticket: "tick-1".into(),
    });
    let a = attach(&rig, &p).await;
    assert_eq!((a.accepted, a.writer_epoch), (true, 1));
    let (mut ws, auth) = server.await.unwrap();
    assert_eq!(auth.as_deref(), Some("Bearer tick-1"));

    let mut history = Vec::new();
    let mut live = Vec::new();
    let mut typed = false;
    let deadline = tokio::time::Instant::now() + WAIT;
    while !contains(&live, "42\r\n") {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "frames within 10 s: history {:?} live {:?}",
                    String::from_utf8_lossy(&history),
                    String::from_utf8_lossy(&live)
                )
            })
            .expect("socket open")
            .unwrap();
        let Message::Binary(b) = msg else { continue };
        assert!(b.len() >= 9);
        match b[0] {
            3 => history.extend_from_slice(&b[9..]),
            1 => live.extend_from_slice(&b[9..]),
            op => panic!("unexpected op {op}"),
        }
        if !typed && contains(&history, "hello-host") {
            let mut f = vec![2u8];
            f.extend_from_slice(&0u64.to_be_bytes());
            f.extend_from_slice(b"echo $((6*7))\n");
            ws.send(Message::Binary(f.into())).await.unwrap();
            typed = true;
        }
    }
    assert!(
        contains(&history, "hello-host"),
        "replay arrives as snapshots"
    );
    ws.close(None).await.ok();
    rig.shutdown().await;
}

/// Poll `terminal.open` (idempotent) until `cond` holds.
async fn eventually_async(
    rig: &Rig,
    what: &str,
    cond: impl Fn(&TerminalOpenResult) -> bool,
    id: &str,
    script: &str,
) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let t = open(rig, &open_params(id, &["sh", "-c", script], 80, 24)).await;
        if cond(&t) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: not in 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn limits_idempotency_and_unknown_terminals() {
    let rig = Rig::start_with(json_only(), |c| c.terminal_max_sessions = 2).await;
    let a = open(&rig, &open_params("a", &["sleep", "30"], 80, 24)).await;
    let a2 = open(&rig, &open_params("a", &["sleep", "30"], 100, 50)).await;
    assert_eq!((a.pid, &a.created_at), (a2.pid, &a2.created_at));
    let e = rig
        .conn
        .call::<_, TerminalOpenResult>(
            Method::TerminalOpen,
            &open_params("a", &["sleep", "31"], 80, 24),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32009);
    assert_eq!(e.reason(), Some("terminal_id_spec_mismatch"));
    open(&rig, &open_params("b", &["sleep", "30"], 80, 24)).await;
    let e = rig
        .conn
        .call::<_, TerminalOpenResult>(
            Method::TerminalOpen,
            &open_params("c", &["sleep", "30"], 80, 24),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32015);
    close(&rig, "a").await;
    open(&rig, &open_params("c", &["sleep", "30"], 80, 24)).await;
    let e = input(&rig, "nope", "s", 1, "x").await.unwrap_err();
    assert_eq!(e.code, -32004);
    close(&rig, "b").await;
    let e = rig
        .conn
        .call::<_, TerminalOpenResult>(
            Method::TerminalOpen,
            &open_params("x", &["/definitely/not/a/program"], 80, 24),
        )
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Some("spawn_failed"), "{e:?}");
    rig.shutdown().await;
}

#[tokio::test]
async fn shutdown_kills_every_terminal() {
    let rig = Rig::start(json_only()).await;
    let t = open(
        &rig,
        &open_params("s", &["sh", "-c", "sleep 2345678 & sleep 2345679"], 80, 24),
    )
    .await;
    eventually("sleeps run", || {
        !pids_with_arg("sleep 2345678").is_empty() && !pids_with_arg("sleep 2345679").is_empty()
    })
    .await;
    rig.shutdown().await;
    eventually("all gone", || {
        !alive(t.pid as i32)
            && pids_with_arg("sleep 2345678").is_empty()
            && pids_with_arg("sleep 2345679").is_empty()
    })
    .await;
}
