//! Issue 6 (harness side): executor-scoped terminals through the HTTP API
//! and the relay, with the real executor (real PTYs) in process; the relay
//! tickets against a scripted executor; and `bmx attach` (the real binary)
//! driven in a real terminal by tmux.

use crate::harness_common;
use harness_common::harness_with_executor_tweaked;

use bmx::client::{ApiClient, AttachOptions, ClientError, TerminalSocket};
use bmx::executor::ExecutorHandle;
use bmx::harness::HarnessHandle;
use bmx::terminal::frame::{self, OP_INPUT, OP_OUTPUT, OP_SNAPSHOT};
use bmx::wire::types::{
    Capabilities, TerminalAttachParams, TerminalAttachResult, TerminalCapability,
    TerminalExitedParams, TerminalOpenParams, TerminalOpenResult,
};
use bmx::wire::Method;
use futures_util::{SinkExt, StreamExt};
use harness_common::{dial, register_params};
use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

/// Generous: the machine may be busy building.
const DEADLINE: Duration = Duration::from_secs(30);

struct Rig {
    h: HarnessHandle,
    executor: ExecutorHandle,
    client: ApiClient,
    _work: tempfile::TempDir,
}

async fn rig(executor_id: &str) -> Rig {
    rig_with(executor_id, None).await
}

async fn rig_with(executor_id: &str, api_token: Option<&str>) -> Rig {
    let (h, executor, work) = harness_with_executor_tweaked(
        executor_id,
        |b| b.api_token(api_token.map(str::to_owned)),
        |c| c.terminal_close_grace = Duration::from_millis(500),
    )
    .await;
    let client = ApiClient::new(&h.api_url())
        .unwrap()
        .token(api_token.map(str::to_owned))
        .timeout(Duration::from_secs(60));
    Rig {
        h,
        executor,
        client,
        _work: work,
    }
}

impl Rig {
    async fn stop(self) {
        self.executor.shutdown().await;
        self.h.shutdown().await;
    }

    async fn open(&self, exec: &str, body: Value) -> Value {
        let (status, v) = self.client.open_terminal(exec, &body).await.unwrap();
        assert_eq!(status, 200, "{v}");
        v
    }

    async fn viewer(&self, exec: &str, tid: &str, write: bool) -> Viewer {
        let opts = AttachOptions {
            write,
            ..Default::default()
        };
        let ws = self.client.attach_terminal(exec, tid, &opts).await.unwrap();
        let mut v = Viewer {
            ws,
            out: Vec::new(),
            notices: Vec::new(),
            close: None,
            gaps: 0,
        };
        v.wait_for("the attached notice", |v| {
            v.notices.iter().any(|n| n["type"] == "attached")
        })
        .await;
        v
    }
}

/// A viewer on the attach WebSocket, recording what it receives.
struct Viewer {
    ws: TerminalSocket,
    out: Vec<u8>,
    notices: Vec<Value>,
    close: Option<(u16, String)>,
    gaps: usize,
}

impl Viewer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out).into_owned()
    }

    fn attached(&self) -> &Value {
        self.notices
            .iter()
            .find(|n| n["type"] == "attached")
            .expect("attached")
    }

    async fn send_input(&mut self, s: &str) {
        self.ws
            .send(Message::Binary(frame::frame(OP_INPUT, 0, s.as_bytes())))
            .await
            .unwrap();
    }

    async fn resize(&mut self, cols: u16, rows: u16) {
        let m = json!({"type": "resize", "cols": cols, "rows": rows}).to_string();
        self.ws.send(Message::text(m)).await.unwrap();
    }

    /// Read messages until `pred` holds (panics after DEADLINE).
    async fn wait_for(&mut self, what: &str, pred: impl Fn(&Viewer) -> bool) {
        let deadline = Instant::now() + DEADLINE;
        while !pred(self) {
            if self.close.is_some() {
                panic!(
                    "waiting for {what}: closed {:?}; output {:?}",
                    self.close,
                    self.text()
                );
            }
            let m = match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Ok(m) => m,
                Err(_) => panic!(
                    "no {what} within {DEADLINE:?}; output {:?}; notices {:?}",
                    self.text(),
                    self.notices
                ),
            };
            match m {
                Some(Ok(Message::Binary(b))) => match frame::parse(&b) {
                    Some((OP_SNAPSHOT, _, d)) if d.is_empty() => self.gaps += 1,
                    Some((OP_OUTPUT | OP_SNAPSHOT, _, d)) => self.out.extend_from_slice(&d),
                    other => panic!("unexpected frame {other:?}"),
                },
                Some(Ok(Message::Text(t))) => self.notices.push(serde_json::from_str(&t).unwrap()),
                Some(Ok(Message::Close(f))) => {
                    self.close = Some(
                        f.map(|f| (u16::from(f.code), f.reason.to_string()))
                            .unwrap_or((0, String::new())),
                    );
                }
                None | Some(Err(_)) => self.close = Some((0, "gone".into())),
                Some(Ok(_)) => {}
            }
        }
    }

    async fn wait_output(&mut self, needle: &str) {
        self.wait_for(&format!("{needle:?}"), |v| v.text().contains(needle))
            .await;
    }

    async fn wait_close(&mut self) -> (u16, String) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(c) = &self.close {
                return c.clone();
            }
            let m = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("not closed; output {:?}", self.text()));
            match m {
                Some(Ok(Message::Binary(b))) => {
                    if let Some((_, _, d)) = frame::parse(&b) {
                        self.out.extend_from_slice(&d);
                    }
                }
                Some(Ok(Message::Text(t))) => self.notices.push(serde_json::from_str(&t).unwrap()),
                Some(Ok(Message::Close(f))) => {
                    self.close = Some(
                        f.map(|f| (u16::from(f.code), f.reason.to_string()))
                            .unwrap_or((0, String::new())),
                    )
                }
                None | Some(Err(_)) => self.close = Some((0, "gone".into())),
                Some(Ok(_)) => {}
            }
        }
    }
}

fn sh() -> Value {
    json!(["/bin/sh"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_attach_type_resize_list_and_delete() {
    let r = rig("exec-t1").await;
    let t = r
        .open(
            "exec-t1",
            json!({"terminalId": "t1", "argv": sh(), "cols": 80, "rows": 24}),
        )
        .await;
    assert_eq!(t["terminalId"], "t1");
    assert_eq!(t["executorId"], "exec-t1");
    assert_eq!(t["state"], "running");
    assert!(t["pid"].as_u64().unwrap() > 0);

    let mut v = r.viewer("exec-t1", "t1", true).await;
    assert_eq!(v.attached()["writer"], true, "{:?}", v.notices);
    v.send_input("echo $((6*7))\n").await;
    // Not "\n42": typed before the shell prints its prompt, the line
    // comes back as "# 42" (the echo of the input holds no "42").
    v.wait_output("42\r\n").await;

    // Resize through the viewer's control message, seen by the program.
    v.resize(100, 30).await;
    v.wait_for("resized", |v| {
        v.notices.iter().any(|n| n["type"] == "resized")
    })
    .await;
    v.send_input("stty size\n").await;
    v.wait_output("30 100\r\n").await;

    // The list shows it, with the new size and one viewer.
    let (status, list) = r.client.list_terminals("exec-t1").await.unwrap();
    assert_eq!(status, 200, "{list}");
    let one = &list["terminals"][0];
    assert_eq!(one["terminalId"], "t1");
    assert_eq!(
        (one["cols"].as_u64(), one["rows"].as_u64()),
        (Some(100), Some(30))
    );
    assert_eq!(one["viewers"], 1);
    assert_eq!(one["argv"], sh());

    // Opening the same id with the same spec answers the same terminal.
    let again = r
        .open("exec-t1", json!({"terminalId": "t1", "argv": sh()}))
        .await;
    assert_eq!(again["pid"], t["pid"]);
    // With another spec: 409.
    let (status, e) = r
        .client
        .open_terminal(
            "exec-t1",
            &json!({"terminalId": "t1", "argv": ["/bin/cat"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 409, "{e}");

    // A read-only viewer replays the scrollback (with the 42) and cannot type.
    let mut ro = r.viewer("exec-t1", "t1", false).await;
    assert_eq!(ro.attached()["writer"], false);
    ro.wait_output("42\r\n").await;

    // DELETE closes it: {closed, exitCode}; the viewers are told.
    let (status, c) = r.client.close_terminal("exec-t1", "t1").await.unwrap();
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["closed"], true);
    let (code, reason) = v.wait_close().await;
    assert_eq!((code, reason.as_str()), (4100, "terminal closed"));
    assert_eq!(ro.wait_close().await.0, 4100);
    let (_, list) = r.client.list_terminals("exec-t1").await.unwrap();
    assert_eq!(list["terminals"], json!([]));
    // Closing again: unknown.
    let (status, e) = r.client.close_terminal("exec-t1", "t1").await.unwrap();
    assert_eq!(status, 404, "{e}");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_takes_over() {
    let r = rig("exec-t2").await;
    r.open("exec-t2", json!({"terminalId": "w", "argv": sh()}))
        .await;
    let mut first = r.viewer("exec-t2", "w", true).await;
    first.send_input("echo one-$((1+1))\n").await;
    first.wait_output("one-2\r\n").await;
    let e1 = first.attached()["epoch"].as_u64().unwrap();

    let mut second = r.viewer("exec-t2", "w", true).await;
    assert_eq!(second.attached()["writer"], true);
    let e2 = second.attached()["epoch"].as_u64().unwrap();
    assert!(e2 > e1, "a newer writer gets a higher epoch ({e1} → {e2})");

    // The first one's input is refused (and told so) and never written.
    first.send_input("echo first-$((2+3))\n").await;
    first
        .wait_for("not_writer", |v| {
            v.notices
                .iter()
                .any(|n| n["type"] == "error" && n["reason"] == "not_writer")
        })
        .await;
    // Its resize is refused by the executor too.
    first.resize(50, 10).await;
    first
        .wait_for("a refused resize", |v| {
            v.notices
                .iter()
                .any(|n| n["type"] == "error" && n["code"] == -32009)
        })
        .await;
    second.send_input("echo second-$((2+2))\n").await;
    second.wait_output("second-4\r\n").await;
    // Both see the second's output; neither saw the first's refused line.
    first.wait_output("second-4\r\n").await;
    assert!(!second.text().contains("first-5"), "{}", second.text());
    assert!(!first.text().contains("first-5"), "{}", first.text());
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_closes_the_viewer_with_the_status() {
    let r = rig("exec-t3").await;
    r.open(
        "exec-t3",
        json!({"terminalId": "x", "argv": ["/bin/sh", "-c", "read line; echo got-$line; exit 7"]}),
    )
    .await;
    let mut v = r.viewer("exec-t3", "x", true).await;
    v.send_input("hello\n").await;
    let (code, reason) = v.wait_close().await;
    assert_eq!((code, reason.as_str()), (1000, "exited 7"));
    assert!(v.text().contains("got-hello"), "{}", v.text());
    assert!(v
        .notices
        .iter()
        .any(|n| n["type"] == "exited" && n["exitCode"] == 7));
    let (_, t) = r.client.get_terminal("exec-t3", "x").await.unwrap();
    assert_eq!(t["state"], "exited", "{t}");
    assert_eq!(t["exitCode"], 7);
    // Attaching to an exited terminal replays it, then closes with the status.
    let mut late = r.viewer("exec-t3", "x", false).await;
    assert_eq!(late.wait_close().await, (1000, "exited 7".into()));
    assert!(late.text().contains("got-hello"), "{}", late.text());
    let (status, c) = r.client.close_terminal("exec-t3", "x").await.unwrap();
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["closed"], true);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_executors_terminals_and_bad_input_are_errors() {
    let r = rig("exec-t4").await;
    let c = &r.client;
    let reason = |v: &Value| {
        v["error"]["data"]["reason"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };

    let (status, e) = c.open_terminal("nope", &json!({})).await.unwrap();
    assert_eq!(
        (status, reason(&e).as_str()),
        (404, "unknown_executor"),
        "{e}"
    );
    let (status, e) = c.list_terminals("nope").await.unwrap();
    assert_eq!(status, 404, "{e}");
    let (status, e) = c.close_terminal("exec-t4", "nope").await.unwrap();
    assert_eq!(status, 404, "{e}");
    let (status, e) = c.get_terminal("exec-t4", "nope").await.unwrap();
    assert_eq!(
        (status, reason(&e).as_str()),
        (404, "unknown_terminal"),
        "{e}"
    );
    match c
        .attach_terminal("exec-t4", "nope", &AttachOptions::default())
        .await
    {
        Err(ClientError::Refused { status, body }) => {
            assert_eq!(
                (status, reason(&body).as_str()),
                (404, "unknown_terminal"),
                "{body}"
            )
        }
        other => panic!("expected 404, got {:?}", other.map(|_| ())),
    }
    match c
        .attach_terminal("nope", "t", &AttachOptions::default())
        .await
    {
        Err(ClientError::Refused { status, .. }) => assert_eq!(status, 404),
        other => panic!("expected 404, got {:?}", other.map(|_| ())),
    }
    // Bad bodies: unknown member, zero size, empty argv, bad id.
    for body in [
        json!({"bogus": 1}),
        json!({"cols": 0}),
        json!({"argv": []}),
        json!({"terminalId": "a/b"}),
    ] {
        let (status, e) = c.open_terminal("exec-t4", &body).await.unwrap();
        assert_eq!(status, 400, "{body}: {e}");
    }
    // A program that cannot start.
    let (status, e) = c
        .open_terminal("exec-t4", &json!({"argv": ["/nonexistent/prog"]}))
        .await
        .unwrap();
    assert_eq!(status, 400, "{e}");
    // The attach route without an upgrade, and with a bad query.
    r.open("exec-t4", json!({"terminalId": "t", "argv": sh()}))
        .await;
    let (status, e) = c
        .get("/v1/executors/exec-t4/terminals/t/attach")
        .await
        .unwrap();
    assert_eq!(status, 400, "{e}");
    let opts = AttachOptions {
        stream_id: Some("x".repeat(200)),
        ..Default::default()
    };
    match c.attach_terminal("exec-t4", "t", &opts).await {
        Err(ClientError::Refused { status, .. }) => assert_eq!(status, 400),
        other => panic!("expected 400, got {:?}", other.map(|_| ())),
    }
    // The relay never upgrades without a ticket.
    let (status, e) = c.get("/v1/relay/terminals/abc").await.unwrap();
    assert_eq!(status, 400, "not an upgrade: {e}");
    assert_eq!(
        dial_relay(&r.h.relay_url(), "abc", "abc.def").await.err(),
        Some(401)
    );
    // The OpenAPI document lists the routes.
    let (_, doc) = c.get("/v1/openapi.json").await.unwrap();
    for p in [
        "/v1/executors/{id}/terminals",
        "/v1/executors/{id}/terminals/{tid}",
        "/v1/executors/{id}/terminals/{tid}/attach",
    ] {
        assert!(doc["paths"].get(p).is_some(), "{p}");
    }
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_token_guards_attach_but_not_the_relay() {
    let r = rig_with("exec-t5", Some("api-secret-0123456789")).await;
    r.open("exec-t5", json!({"terminalId": "a", "argv": sh()}))
        .await;
    let anonymous = ApiClient::new(&r.h.api_url()).unwrap();
    match anonymous
        .attach_terminal("exec-t5", "a", &AttachOptions::default())
        .await
    {
        Err(ClientError::Refused { status, .. }) => assert_eq!(status, 401),
        other => panic!("expected 401, got {:?}", other.map(|_| ())),
    }
    let (status, _) = anonymous.list_terminals("exec-t5").await.unwrap();
    assert_eq!(status, 401);
    // With the token: the executor dials the relay with its ticket only.
    let mut v = r.viewer("exec-t5", "a", true).await;
    v.send_input("echo $((6*7))\n").await;
    // Not "\n42": typed before the shell prints its prompt, the line
    // comes back as "# 42" (the echo of the input holds no "42").
    v.wait_output("42\r\n").await;
    r.stop().await;
}

/// Dial the relay as an executor would; the HTTP status when refused.
async fn dial_relay(
    base: &str,
    ticket_id: &str,
    bearer: &str,
) -> Result<tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>, u16> {
    let url = format!("{base}/v1/relay/terminals/{ticket_id}");
    let mut req = url.as_str().into_client_request().unwrap();
    req.headers_mut().insert(
        http::header::AUTHORIZATION,
        format!("Bearer {bearer}").parse().unwrap(),
    );
    let hostport = base.trim_start_matches("ws://").to_owned();
    let tcp = tokio::net::TcpStream::connect(hostport).await.unwrap();
    match tokio_tungstenite::client_async(req, tcp).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("relay dial: {e}"),
    }
}

/// The relay with a scripted executor: the ticket it gets is single-use,
/// frames pass both ways, and the executor's end reaches the viewer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_tickets_are_single_use() {
    let h = harness_common::harness().await;
    let mut fake = dial(&h, "secret-a").await.unwrap();
    let mut params = register_params(None);
    params.capabilities = Capabilities {
        terminal: Some(TerminalCapability {
            enabled: true,
            kinds: vec![],
            max_sessions: Some(4),
        }),
        ..Default::default()
    };
    let _: bmx::wire::types::RegisterResult = fake
        .link
        .request(Method::ExecutorRegister, &params, harness_common::WAIT)
        .await
        .unwrap();
    fake.keep_alive();
    let client = harness_common::api(&h);
    let opened = |id: &str| TerminalOpenResult {
        terminal_id: id.into(),
        pid: 42,
        cols: 80,
        rows: 24,
        created_at: "2025-01-01T00:00:00Z".into(),
        epoch: 0,
        earliest_seq: 1,
        latest_seq: 0,
    };
    let c2 = client.clone();
    let open = tokio::spawn(async move {
        c2.open_terminal("exec-a", &json!({"terminalId": "f"}))
            .await
    });
    let (p, reply): (TerminalOpenParams, _) = fake.expect(Method::TerminalOpen).await;
    assert_eq!((p.cols, p.rows), (80, 24), "defaults");
    reply.ok(&opened("f"));
    assert_eq!(open.await.unwrap().unwrap().0, 200);

    let c2 = client.clone();
    let attach = tokio::spawn(async move {
        let opts = AttachOptions {
            write: true,
            ..Default::default()
        };
        c2.attach_terminal("exec-a", "f", &opts).await
    });
    // The harness asks for the current state first (the same open again).
    let (_, reply): (TerminalOpenParams, _) = fake.expect(Method::TerminalOpen).await;
    reply.ok(&opened("f"));
    let (a, reply): (TerminalAttachParams, _) = fake.expect(Method::TerminalAttach).await;
    assert!(a.can_write);
    assert_eq!(a.epoch, 1, "greater than the executor's epoch 0");
    assert_eq!(a.from_seq, 1, "from the oldest retained chunk");
    let host = a.host.expect("a host attach");
    let base = h.relay_url();
    assert!(
        host.url.starts_with(&format!("{base}/v1/relay/terminals/")),
        "{}",
        host.url
    );
    let ticket_id = host.url.rsplit('/').next().unwrap().to_owned();
    assert!(
        !host.url.contains(host.ticket.split_once('.').unwrap().1),
        "the secret stays out of the URL"
    );
    // A wrong secret and another id are refused; the real ticket works once.
    let wrong = format!("{ticket_id}.{}", "0".repeat(64));
    assert_eq!(dial_relay(&base, &ticket_id, &wrong).await.err(), Some(401));
    assert_eq!(
        dial_relay(&base, "other", &host.ticket).await.err(),
        Some(401)
    );
    let mut exec_ws = dial_relay(&base, &ticket_id, &host.ticket)
        .await
        .expect("the ticket works");
    assert_eq!(
        dial_relay(&base, &ticket_id, &host.ticket).await.err(),
        Some(401),
        "single use"
    );
    reply.ok(&TerminalAttachResult {
        accepted: true,
        writer_epoch: 1,
    });
    let ws = attach.await.unwrap().expect("the viewer is upgraded");
    let mut v = Viewer {
        ws,
        out: Vec::new(),
        notices: Vec::new(),
        close: None,
        gaps: 0,
    };
    // Executor → viewer: output, a gap marker, more output.
    exec_ws
        .send(Message::Binary(frame::frame(OP_SNAPSHOT, 1, b"old ")))
        .await
        .unwrap();
    exec_ws
        .send(Message::Binary(frame::frame(OP_SNAPSHOT, 5, b"")))
        .await
        .unwrap();
    exec_ws
        .send(Message::Binary(frame::frame(OP_OUTPUT, 6, b"live")))
        .await
        .unwrap();
    v.wait_output("old live").await;
    assert_eq!(v.gaps, 1);
    assert_eq!(v.attached()["writer"], true);
    // Viewer → executor: input frames pass as they are; others do not.
    v.ws.send(Message::Binary(frame::frame(OP_OUTPUT, 0, b"no")))
        .await
        .unwrap();
    v.send_input("typed").await;
    let got = tokio::time::timeout(DEADLINE, exec_ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(got, Message::Binary(frame::frame(OP_INPUT, 0, b"typed")));
    // terminal.exited, then the executor's stream ends: closed "exited 3".
    fake.link
        .notify(
            Method::TerminalExited,
            &TerminalExitedParams {
                terminal_id: "f".into(),
                exit_code: 3,
            },
        )
        .unwrap();
    // The relay asks for latestSeq to drain to.
    let (_, reply): (TerminalOpenParams, _) = fake.expect(Method::TerminalOpen).await;
    let mut done = opened("f");
    done.latest_seq = 7;
    reply.ok(&done);
    exec_ws
        .send(Message::Binary(frame::frame(OP_OUTPUT, 7, b" bye")))
        .await
        .unwrap();
    assert_eq!(v.wait_close().await, (1000, "exited 3".into()));
    assert!(v.text().ends_with("live bye"), "{}", v.text());
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// `bmx attach` in a real terminal (tmux).

const BMX: &str = env!("CARGO_BIN_EXE_bmx");

/// A tmux server of our own (its socket in a temporary directory); killed
/// on drop, whatever happens.
struct Tmux {
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmux {
    fn start(env: &[(&str, &str)], cols: u16, rows: u16) -> Tmux {
        let dir = tempfile::tempdir().unwrap();
        let t = Tmux {
            socket: dir.path().join("tmux.sock"),
            _dir: dir,
        };
        let mut cmd = Command::new("tmux");
        cmd.arg("-S")
            .arg(&t.socket)
            .args(["-f", "/dev/null", "new-session", "-d"])
            .args([
                "-s",
                "main",
                "-x",
                &cols.to_string(),
                "-y",
                &rows.to_string(),
            ])
            .arg("/bin/sh")
            .env_remove("TMUX");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let status = cmd
            .status()
            .expect("tmux runs (scripts/test.sh installs it)");
        assert!(status.success(), "tmux new-session failed");
        t
    }

    fn run(&self, args: &[&str]) -> String {
        let o = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux");
        assert!(
            o.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Type text literally, then Enter.
    fn line(&self, text: &str) {
        self.run(&["send-keys", "-t", "main", "-l", text]);
        self.run(&["send-keys", "-t", "main", "Enter"]);
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "main"];
        args.extend_from_slice(keys);
        self.run(&args);
    }

    fn pane(&self) -> String {
        self.run(&["capture-pane", "-p", "-J", "-t", "main"])
    }

    /// Poll the pane until `pred` holds.
    async fn wait(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let p = self.pane();
            if pred(&p) {
                return p;
            }
            if Instant::now() > deadline {
                panic!("tmux: no {what} within {DEADLINE:?}; pane:\n{p}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .status();
    }
}

fn has_line(pane: &str, line: &str) -> bool {
    pane.lines().any(|l| l.trim_end() == line)
}

/// Poll the API until `pred` holds for the one terminal of `exec`.
async fn wait_terminal(
    client: &ApiClient,
    exec: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (_, v) = client.list_terminals(exec).await.unwrap();
        if let Some(t) = v["terminals"].as_array().and_then(|a| a.first()) {
            if pred(t) {
                return t.clone();
            }
        }
        if Instant::now() > deadline {
            panic!("no {what} within {DEADLINE:?}: {v}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bmx_attach_in_tmux() {
    let r = rig("exec-tmux").await;
    let api_url = r.h.api_url();
    let tmux = Tmux::start(&[("BMX_HARNESS", &api_url)], 100, 30);
    tmux.wait("the outer prompt", |p| !p.trim().is_empty())
        .await;

    // A new terminal (the only executor is picked), sized like the pane.
    tmux.line(&format!("{BMX} attach -- /bin/sh; echo EXIT1=$?"));
    let t = wait_terminal(&r.client, "exec-tmux", "an attached terminal", |t| {
        t["viewers"] == 1
    })
    .await;
    let tid = t["terminalId"].as_str().unwrap().to_owned();
    assert_eq!(
        (t["cols"].as_u64(), t["rows"].as_u64()),
        (Some(100), Some(30)),
        "{t}"
    );
    tmux.line("echo $((6*7))");
    tmux.wait("42", |p| has_line(p, "42")).await;
    tmux.line("stty size");
    tmux.wait("30 100", |p| has_line(p, "30 100")).await;

    // The window grows: SIGWINCH → resize → the program sees it.
    tmux.run(&["resize-window", "-t", "main", "-x", "120", "-y", "40"]);
    wait_terminal(&r.client, "exec-tmux", "the new size", |t| {
        t["cols"] == 120 && t["rows"] == 40
    })
    .await;
    tmux.line("stty size");
    tmux.wait("40 120", |p| has_line(p, "40 120")).await;

    // A lone Ctrl-P followed by another key reaches the program.
    tmux.line("od -c");
    tokio::time::sleep(Duration::from_millis(300)).await;
    tmux.keys(&["C-p", "x", "Enter", "C-d"]);
    tmux.wait("od's dump of ^P x", |p| p.contains("020   x  \\n"))
        .await;

    // Detach: the terminal keeps running, bmx attach exits 0.
    tmux.keys(&["C-p", "C-q"]);
    let p = tmux.wait("the detach", |p| has_line(p, "EXIT1=0")).await;
    assert!(
        p.contains(&format!("bmx attach --executor exec-tmux {tid}")),
        "{p}"
    );
    let t = wait_terminal(&r.client, "exec-tmux", "no viewer", |t| t["viewers"] == 0).await;
    assert_eq!(t["state"], "running", "{t}");

    // Re-attach on a cleared screen: the replay brings the 42 back.
    tmux.line("clear");
    tmux.run(&["clear-history", "-t", "main"]);
    tmux.wait("a clear screen", |p| !has_line(p, "42")).await;
    tmux.line(&format!(
        "{BMX} attach --executor exec-tmux {tid}; echo EXIT2=$?"
    ));
    tmux.wait("the replayed 42", |p| has_line(p, "42")).await;
    wait_terminal(&r.client, "exec-tmux", "the re-attached viewer", |t| {
        t["viewers"] == 1
    })
    .await;

    // Ctrl-D reaches the shell: it exits with its last status, and so does bmx attach.
    tmux.line("(exit 3)");
    tokio::time::sleep(Duration::from_millis(300)).await;
    tmux.keys(&["C-d"]);
    tmux.wait("the program's exit status", |p| has_line(p, "EXIT2=3"))
        .await;
    let t = wait_terminal(&r.client, "exec-tmux", "the exit", |t| {
        t["state"] == "exited"
    })
    .await;
    assert_eq!(t["exitCode"], 3);
    let (status, _) = r.client.close_terminal("exec-tmux", &tid).await.unwrap();
    assert_eq!(status, 200);
    drop(tmux);
    r.stop().await;
}
