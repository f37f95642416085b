//! Issue 20, RFB: a session's display as VNC through the harness's relay,
//! with a real harness, a real executor, a real Xvfb and a real x11vnc.
//! A WebSocket client (what noVNC is) gets a one-time URL from
//! `POST /v1/sessions/{id}/display/rfb`, reads `RFB 003.008\n`, and goes
//! through the RFB handshake up to the server's init (the screen's size);
//! the URL works once; x11vnc listens on no TCP port and dies with the
//! session.
//!
//! Needs `Xvfb` and `x11vnc` (scripts/test.sh installs them); without them
//! the test says so loudly and passes, except under CI, where it fails.

use crate::harness_common;
use futures_util::{SinkExt, StreamExt};
use harness_common::harness_with_executor_tweaked;
use serde_json::json;
use std::time::Duration;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

/// Generous: the machine may be busy building.
const DEADLINE: Duration = Duration::from_secs(30);

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

fn tools_present() -> bool {
    let ok = on_path("Xvfb") && on_path("x11vnc");
    if !ok {
        let msg = "Xvfb or x11vnc is not installed (scripts/test.sh installs them)";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED: {msg}");
    }
    ok
}

/// Open a viewer URL; the HTTP status when refused.
async fn open(url: &str) -> Result<Ws, u16> {
    let req = url.into_client_request().unwrap();
    let hostport = url
        .trim_start_matches("ws://")
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let tcp = tokio::net::TcpStream::connect(hostport).await.unwrap();
    match tokio_tungstenite::client_async(req, tcp).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("viewer dial: {e}"),
    }
}

/// An RFB client over the WebSocket: binary frames are a byte stream.
struct Rfb {
    ws: Ws,
    buf: Vec<u8>,
}

impl Rfb {
    async fn read(&mut self, n: usize) -> Vec<u8> {
        let deadline = Instant::now() + DEADLINE;
        while self.buf.len() < n {
            let m = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("no {n} bytes within the deadline: {:?}", self.buf));
            match m {
                Some(Ok(Message::Binary(b))) => self.buf.extend_from_slice(&b),
                Some(Ok(Message::Text(t))) => panic!("a text frame: {t}"),
                Some(Ok(Message::Close(c))) => panic!("closed: {c:?} after {:?}", self.buf),
                Some(Ok(_)) => {}
                other => panic!("the stream ended: {other:?}"),
            }
        }
        self.buf.drain(..n).collect()
    }

    async fn write(&mut self, b: &[u8]) {
        self.ws
            .send(Message::Binary(b.to_vec().into()))
            .await
            .unwrap();
    }

    /// Version, security (None), init: the screen's size.
    async fn handshake(&mut self) -> (u16, u16) {
        assert_eq!(self.read(12).await, b"RFB 003.008\n");
        self.write(b"RFB 003.008\n").await;
        let n = self.read(1).await[0] as usize;
        assert!(n > 0, "the server refused the version");
        let types = self.read(n).await;
        // x11vnc runs with -nopw: the relay's ticket is the credential.
        assert!(types.contains(&1), "security types {types:?} lack None");
        self.write(&[1]).await;
        assert_eq!(self.read(4).await, [0, 0, 0, 0], "SecurityResult OK");
        // ClientInit: shared.
        self.write(&[1]).await;
        let init = self.read(24).await;
        let w = u16::from_be_bytes([init[0], init[1]]);
        let h = u16::from_be_bytes([init[2], init[3]]);
        let name_len = u32::from_be_bytes([init[20], init[21], init[22], init[23]]) as usize;
        self.read(name_len).await;
        (w, h)
    }

    /// Wait (bounded) for the harness to end the stream.
    async fn ended(&mut self) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => panic!("the viewer stayed open after the session ended"),
                Ok(Some(Ok(Message::Binary(_)))) | Ok(Some(Ok(Message::Ping(_)))) => {}
                Ok(_) => return,
            }
        }
    }
}

/// x11vnc processes carrying the session's scope tag.
fn x11vnc_of(session_id: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        if !argv0.ends_with(b"x11vnc") {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let tagged = environ.split(|b| *b == 0).any(|v| {
            let v = String::from_utf8_lossy(v);
            v.starts_with("BMX_SCOPE=") && v.contains(&format!("/{session_id}/"))
        });
        if tagged {
            found.push(pid);
        }
    }
    found
}

/// Whether `pid` has a TCP socket in the LISTEN state (IPv4 or IPv6).
fn listens_on_tcp(pid: i32) -> bool {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")
                .and_then(|r| r.strip_suffix(']'))
                .map(str::to_owned)
        })
        .collect();
    assert!(!inodes.is_empty(), "x11vnc has no socket at all");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|row| {
                let cols: Vec<&str> = row.split_whitespace().collect();
                // st 0A = LISTEN; column 9 is the inode.
                cols.get(3) == Some(&"0A")
                    && cols.get(9).is_some_and(|i| inodes.iter().any(|x| x == i))
            })
    })
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfb_handshake_through_the_relay() {
    if !tools_present() {
        return;
    }
    let (h, executor, _work) = harness_with_executor_tweaked("exec-rfb", |b| b, |_| {}).await;
    let client = harness_common::api(&h);
    let (status, list) = client.executors().await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        list["executors"][0]["capabilities"]["display"],
        json!({"desktop": true, "rfb": true}),
        "{list}"
    );
    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();

    // A one-time URL under the relay base.
    let (status, offer) = client
        .post(&format!("/v1/sessions/{sid}/display/rfb"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{offer}");
    let url = offer["url"].as_str().unwrap().to_owned();
    assert!(
        url.starts_with(&format!("{}/v1/relay/rfb/", h.relay_url())),
        "{url}"
    );

    // The viewer: RFB 003.008, the security types, the server's init.
    let mut viewer = Rfb {
        ws: open(&url).await.expect("the ticket works"),
        buf: Vec::new(),
    };
    assert_eq!(
        viewer.handshake().await,
        (1280, 800),
        "the session's screen"
    );

    // The URL is good once, and a wrong secret never.
    assert_eq!(open(&url).await.err(), Some(401), "single use");
    let (id, _) = url.rsplit('/').next().unwrap().split_once('.').unwrap();
    let forged = format!("{}/v1/relay/rfb/{id}.{}", h.relay_url(), "0".repeat(64));
    assert_eq!(open(&forged).await.err(), Some(401));

    // A second viewer at the same time (x11vnc -shared).
    let (status, offer) = client
        .post(&format!("/v1/sessions/{sid}/display/rfb"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{offer}");
    let mut second = Rfb {
        ws: open(offer["url"].as_str().unwrap()).await.unwrap(),
        buf: Vec::new(),
    };
    assert_eq!(second.handshake().await, (1280, 800));

    // One x11vnc for the session, on a Unix socket only.
    let vnc = x11vnc_of(&sid);
    assert_eq!(vnc.len(), 1, "x11vnc processes of the session: {vnc:?}");
    let pid = vnc[0];
    assert!(!listens_on_tcp(pid), "x11vnc listens on a TCP port");

    // The session's end takes x11vnc and the viewers' streams with it.
    let (status, ended) = client.delete(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200, "{ended}");
    let deadline = Instant::now() + DEADLINE;
    while alive(pid) {
        assert!(Instant::now() < deadline, "x11vnc outlived its session");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    viewer.ended().await;
    second.ended().await;
    // No viewer URL for an ended session.
    let (status, _) = client
        .post(&format!("/v1/sessions/{sid}/display/rfb"), &json!({}))
        .await
        .unwrap();
    assert!(status == 404 || status == 410, "{status}");
    executor.shutdown().await;
    h.shutdown().await;
}

/// Dial the display relay as an executor would; the HTTP status when
/// refused.
async fn dial_display(base: &str, url: &str, bearer: &str) -> Result<Ws, u16> {
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        http::header::AUTHORIZATION,
        format!("Bearer {bearer}").parse().unwrap(),
    );
    let tcp = tokio::net::TcpStream::connect(base.trim_start_matches("ws://"))
        .await
        .unwrap();
    match tokio_tungstenite::client_async(req, tcp).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("relay dial: {e}"),
    }
}

/// The relay with scripted executors: the executor's ticket is
/// single-use and its secret stays out of the URL, bytes pass both ways
/// untouched, the executor's refusal is an HTTP error before the
/// upgrade, and an executor without `rfb` gets no viewer URL (501).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_executor_tickets_bytes_and_refusals() {
    use bmx::wire::types::{
        Capabilities, DisplayCapability, DisplayRfbParams, DisplayRfbResult, RegisterResult,
    };
    use bmx::wire::{Method, RpcError};
    use harness_common::{create_session, dial, register_params, WAIT};
    let h = harness_common::harness().await;
    let client = harness_common::api(&h);
    let mut fakes = Vec::new();
    for (token, rfb) in [("secret-a", true), ("secret-b", false)] {
        let fake = dial(&h, token).await.unwrap();
        let mut params = register_params(None);
        params.capabilities = Capabilities {
            display: Some(DisplayCapability { desktop: true, rfb }),
            ..Default::default()
        };
        let _: RegisterResult = fake
            .link
            .request(Method::ExecutorRegister, &params, WAIT)
            .await
            .unwrap();
        fake.keep_alive();
        fakes.push(fake);
    }
    let mut b = fakes.pop().unwrap();
    let mut a = fakes.pop().unwrap();
    let sa = create_session(&h, &mut a, json!({"executorId": "exec-a"})).await;
    let sa = sa["sessionId"].as_str().unwrap().to_owned();
    let sb = create_session(&h, &mut b, json!({"executorId": "exec-b"})).await;
    let sb = sb["sessionId"].as_str().unwrap().to_owned();

    // No rfb: no viewer URL.
    let (status, e) = client
        .post(&format!("/v1/sessions/{sb}/display/rfb"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 501, "{e}");

    let offer = |sid: String| {
        let client = client.clone();
        async move {
            let (status, o) = client
                .post(&format!("/v1/sessions/{sid}/display/rfb"), &json!({}))
                .await
                .unwrap();
            assert_eq!(status, 200, "{o}");
            o["url"].as_str().unwrap().to_owned()
        }
    };
    let url = offer(sa.clone()).await;
    let viewer = tokio::spawn(async move { open(&url).await });
    let (p, reply): (DisplayRfbParams, _) = a.expect(Method::DisplayRfb).await;
    assert_eq!(p.session_id, sa);
    let base = h.relay_url();
    assert!(
        p.host.url.starts_with(&format!("{base}/v1/relay/display/")),
        "{}",
        p.host.url
    );
    let (id, secret) = p.host.ticket.split_once('.').unwrap();
    assert!(p.host.url.ends_with(id) && !p.host.url.contains(secret));
    let wrong = format!("{id}.{}", "0".repeat(64));
    assert_eq!(
        dial_display(&base, &p.host.url, &wrong).await.err(),
        Some(401)
    );
    let mut exec = dial_display(&base, &p.host.url, &p.host.ticket)
        .await
        .expect("the ticket works");
    assert_eq!(
        dial_display(&base, &p.host.url, &p.host.ticket).await.err(),
        Some(401),
        "single use"
    );
    reply.ok(&DisplayRfbResult {
        accepted: true,
        display: ":9".into(),
    });
    let mut v = Rfb {
        ws: viewer.await.unwrap().expect("the viewer is upgraded"),
        buf: Vec::new(),
    };
    // Bytes pass as they are, both ways.
    exec.send(Message::Binary(b"RFB 003.008\n".to_vec().into()))
        .await
        .unwrap();
    assert_eq!(v.read(12).await, b"RFB 003.008\n");
    v.write(b"RFB 003.008\n").await;
    let got = tokio::time::timeout(DEADLINE, exec.next()).await.unwrap();
    assert!(
        matches!(&got, Some(Ok(Message::Binary(b))) if &b[..] == b"RFB 003.008\n"),
        "{got:?}"
    );
    // The executor's end ends the viewer.
    exec.close(None).await.unwrap();
    v.ended().await;

    // The executor cannot serve the display: 502 before any upgrade.
    let url = offer(sa.clone()).await;
    let viewer = tokio::spawn(async move { open(&url).await });
    let (_, reply): (DisplayRfbParams, _) = a.expect(Method::DisplayRfb).await;
    reply.err(RpcError::resource_unavailable("no Xvfb").with_reason("display_error"));
    assert_eq!(viewer.await.unwrap().err(), Some(502));
    h.shutdown().await;
}
