//! `bmx bench rfb`: the time from "I want to see the display" to the VNC
//! server's init (the screen's size) through the harness's relay, against
//! the same RFB handshake straight on x11vnc's Unix socket, in the same
//! run, on the same display.
//!
//! A relay connect is: `POST /v1/sessions/{id}/display/rfb`, the viewer's
//! WebSocket to the one-time URL, the harness's `display.rfb` to the
//! executor, the executor's dial back, then the RFB version, security
//! (None) and init exchange through both sockets. The direct connect is
//! the RFB exchange alone. The first connect (which starts Xvfb and
//! x11vnc) is not measured.

use super::local::Local;
use futures_util::{SinkExt, StreamExt};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;

pub struct RfbOptions {
    pub connects: usize,
}

#[derive(Debug, Serialize)]
pub struct RfbReport {
    pub connects: usize,
    pub relay_p50_us: f64,
    pub relay_p99_us: f64,
    pub direct_p50_us: f64,
    pub direct_p99_us: f64,
    pub p50_ratio: f64,
    pub screen: (u16, u16),
}

impl RfbReport {
    pub fn table(&self) -> String {
        format!(
            "RFB connect to ServerInit ({}x{}), {} connects per row\n\
             {:<28} {:>10} {:>10}\n\
             {:<28} {:>8.0}us {:>8.0}us\n\
             {:<28} {:>8.0}us {:>8.0}us\n\
             relay / direct (p50): {:.1}\n",
            self.screen.0,
            self.screen.1,
            self.connects,
            "path",
            "p50",
            "p99",
            "relay (POST + ws + dial-back)",
            self.relay_p50_us,
            self.relay_p99_us,
            "direct (x11vnc Unix socket)",
            self.direct_p50_us,
            self.direct_p99_us,
            self.p50_ratio
        )
    }
}

const DEADLINE: Duration = Duration::from_secs(30);

/// The client's half of RFB 3.8 up to ServerInit, over any byte pipe given
/// as `read(n)` / `write(bytes)`; the screen's size.
macro_rules! handshake {
    ($read:expr, $write:expr) => {{
        let version = $read(12).await?;
        if version != b"RFB 003.008\n" {
            return Err(format!("not RFB 3.8: {version:?}"));
        }
        $write(b"RFB 003.008\n".to_vec()).await?;
        let n = $read(1).await?[0] as usize;
        let types = $read(n).await?;
        if !types.contains(&1) {
            return Err(format!("no security type None in {types:?}"));
        }
        $write(vec![1]).await?;
        if $read(4).await? != [0, 0, 0, 0] {
            return Err("security failed".into());
        }
        $write(vec![1]).await?;
        let init = $read(24).await?;
        let name = u32::from_be_bytes([init[20], init[21], init[22], init[23]]) as usize;
        $read(name).await?;
        Ok::<_, String>((
            u16::from_be_bytes([init[0], init[1]]),
            u16::from_be_bytes([init[2], init[3]]),
        ))
    }};
}

async fn via_relay(local: &Local, session: &str) -> Result<(u16, u16), String> {
    let offer = local
        .post(
            &format!("/v1/sessions/{session}/display/rfb"),
            &serde_json::json!({}),
        )
        .await?;
    let url = offer["url"].as_str().ok_or("no url")?.to_owned();
    let (ws, _) = tokio_tungstenite::connect_async(url.as_str())
        .await
        .map_err(|e| format!("viewer: {e}"))?;
    let ws = tokio::sync::Mutex::new((ws, Vec::<u8>::new()));
    let read = |n: usize| {
        let ws = &ws;
        async move {
            let mut g = ws.lock().await;
            let (ws, buf) = &mut *g;
            while buf.len() < n {
                match tokio::time::timeout(DEADLINE, ws.next()).await {
                    Ok(Some(Ok(Message::Binary(b)))) => buf.extend_from_slice(&b),
                    Ok(Some(Ok(_))) => {}
                    other => return Err(format!("relay ended: {other:?}")),
                }
            }
            Ok::<Vec<u8>, String>(buf.drain(..n).collect())
        }
    };
    let write = |b: Vec<u8>| {
        let ws = &ws;
        async move {
            let mut g = ws.lock().await;
            g.0.send(Message::Binary(b.into()))
                .await
                .map_err(|e| e.to_string())
        }
    };
    let size = handshake!(read, write)?;
    let _ = ws.lock().await.0.close(None).await;
    Ok(size)
}

async fn direct(socket: &PathBuf) -> Result<(u16, u16), String> {
    let s = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| e.to_string())?;
    let s = tokio::sync::Mutex::new(s);
    let read = |n: usize| {
        let s = &s;
        async move {
            let mut buf = vec![0; n];
            tokio::time::timeout(DEADLINE, s.lock().await.read_exact(&mut buf))
                .await
                .map_err(|_| "direct: timeout".to_owned())?
                .map_err(|e| e.to_string())?;
            Ok::<Vec<u8>, String>(buf)
        }
    };
    let write = |b: Vec<u8>| {
        let s = &s;
        async move {
            s.lock()
                .await
                .write_all(&b)
                .await
                .map_err(|e| e.to_string())
        }
    };
    handshake!(read, write)
}

/// The `-unixsock` of the x11vnc carrying `session`'s scope tag.
fn x11vnc_socket(session: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = e.file_name();
        let cmdline =
            std::fs::read(format!("/proc/{}/cmdline", pid.to_string_lossy())).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if !args.first().is_some_and(|a| a.ends_with(b"x11vnc")) {
            continue;
        }
        let environ =
            std::fs::read(format!("/proc/{}/environ", pid.to_string_lossy())).unwrap_or_default();
        let tag = format!("/{session}/");
        let ours = environ.split(|b| *b == 0).any(|v| {
            let v = String::from_utf8_lossy(v);
            v.starts_with("BMX_SCOPE=") && v.contains(&tag)
        });
        if ours {
            let i = args.iter().position(|a| *a == b"-unixsock")?;
            return Some(PathBuf::from(
                String::from_utf8_lossy(args.get(i + 1)?).into_owned(),
            ));
        }
    }
    None
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted
        .get(i.min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0.0)
}

/// Run the benchmark: an in-process harness and executor, one session.
///
/// # Errors
/// No Xvfb or x11vnc, or any connect failing.
pub async fn run(opts: &RfbOptions) -> Result<RfbReport, String> {
    let local = Local::start(|_| {}).await?;
    let result = measure(&local, opts).await;
    local.shutdown().await;
    result
}

async fn measure(local: &Local, opts: &RfbOptions) -> Result<RfbReport, String> {
    let session = local.session(&serde_json::json!({})).await?;
    // Warm-up: starts Xvfb and x11vnc.
    let screen = via_relay(local, &session).await?;
    let socket = x11vnc_socket(&session).ok_or("x11vnc's socket not found")?;
    let (mut relay, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..opts.connects {
        let t = Instant::now();
        via_relay(local, &session).await?;
        relay.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        direct(&socket).await?;
        plain.push(t.elapsed().as_secs_f64() * 1e6);
    }
    relay.sort_by(f64::total_cmp);
    plain.sort_by(f64::total_cmp);
    let (r50, d50) = (percentile(&relay, 0.5), percentile(&plain, 0.5));
    Ok(RfbReport {
        connects: opts.connects,
        relay_p50_us: r50,
        relay_p99_us: percentile(&relay, 0.99),
        direct_p50_us: d50,
        direct_p99_us: percentile(&plain, 0.99),
        p50_ratio: if d50 > 0.0 { r50 / d50 } else { 0.0 },
        screen,
    })
}
