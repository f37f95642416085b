//! The display's RFB side (`display.rfb`, issue 20): a real VNC server,
//! `x11vnc` from Debian, serving the session's Xvfb display on a **Unix
//! socket** in a private (0700) directory, and one task per viewer that
//! dials out to the harness's relay with the one-time ticket and carries
//! the RFB bytes both ways.
//!
//! Why a Unix socket and no TCP port at all: the issue asks that nothing
//! listens on the executor's machine for the outside. `-rfbport 0` turns
//! the IPv4 listener off and `-rfbportv6 -1` libvncserver's IPv6 one
//! (Debian's build listens on `[::]:5900` with `-rfbport 0` alone, and
//! even with `-no6 -noipv6`, which are kept for x11vnc's own IPv6 mode).
//! Not `-localhost`: it is `-allow 127.0.0.1`, and a Unix-socket client
//! (named `localhost`) is then denied after the version greeting. The
//! socket's directory is the executor user's alone, so only that user
//! (who can reach the X display anyway) can connect past the relay;
//! `tests/harness/rfb.rs` checks in /proc that x11vnc listens on no TCP
//! port.
//! `-shared -forever` let several viewers watch (and one take over) and
//! keep the server up between them; `-nopw` because the relay's ticket,
//! not a VNC password, is the credential.
//!
//! The server is started on the first `display.rfb` of a display (most
//! displays are never watched), again if it died, and killed when the
//! display actor stops (it also carries the session's scope tag, so the
//! session's final sweep would find it).

use crate::executor::actors::terminal::host::{dial, DialError, Ws};
use crate::wire::types::{AttachHost, DisplayRfbResult};
use crate::wire::{Responder, RpcError};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::Message;

/// Viewers one display serves at once (each is a socket to x11vnc and one
/// to the harness, with a 64 KiB read buffer).
pub const MAX_STREAMS: usize = 8;
/// Time x11vnc has to listen on its socket.
const START: Duration = Duration::from_secs(10);
/// Bytes read from x11vnc per frame sent to the harness.
const CHUNK: usize = 64 << 10;

/// Why an RFB stream could not start.
#[derive(Debug, thiserror::Error)]
pub enum RfbError {
    #[error("cannot start x11vnc: {0}")]
    Start(String),
    #[error("x11vnc does not answer on its socket: {0}")]
    Socket(std::io::Error),
    #[error("cannot reach the relay: {0}")]
    Dial(#[from] DialError),
    #[error("{MAX_STREAMS} RFB viewers are already attached to this display")]
    Full,
}

impl RfbError {
    /// The JSON-RPC error `display.rfb` answers with: all of them are
    /// -32015 (the display or the relay is not available now), told apart
    /// by `data.reason`.
    pub fn rpc(&self) -> RpcError {
        let reason = match self {
            RfbError::Start(_) | RfbError::Socket(_) => "display_error",
            RfbError::Dial(_) => "relay_unreachable",
            RfbError::Full => "rfb_streams_full",
        };
        RpcError::resource_unavailable(self.to_string()).with_reason(reason)
    }
}

/// The x11vnc command line: display `display`, listening on `socket` only.
pub fn x11vnc_command(display: &str, socket: &Path) -> tokio::process::Command {
    let mut c = tokio::process::Command::new("x11vnc");
    c.arg("-display")
        .arg(display)
        .arg("-unixsock")
        .arg(socket)
        .args([
            "-rfbport",
            "0",
            "-rfbportv6",
            "-1",
            "-no6",
            "-noipv6",
            "-nolookup",
            "-shared",
            "-forever",
            "-nopw",
            "-norc",
            "-noremote",
            "-nocmds",
            "-quiet",
        ]);
    c
}

/// A running x11vnc and the private directory of its socket.
pub struct Vnc {
    child: tokio::process::Child,
    dir: tempfile::TempDir,
}

impl Vnc {
    /// Start x11vnc on `display` with the child environment `env` and wait
    /// (at most [`START`]) until its socket accepts a connection.
    ///
    /// # Errors
    /// x11vnc is missing or ends, or its socket does not answer in time.
    pub async fn start(display: &str, env: Vec<(String, String)>) -> Result<Vnc, RfbError> {
        // `tempdir` makes the directory 0700.
        let dir = tempfile::Builder::new()
            .prefix("bmx-rfb-")
            .tempdir()
            .map_err(|e| RfbError::Start(e.to_string()))?;
        let socket = dir.path().join("vnc.sock");
        let mut child = x11vnc_command(display, &socket)
            .env_clear()
            .envs(env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .process_group(0)
            .spawn()
            .map_err(|e| RfbError::Start(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + START;
        loop {
            match UnixStream::connect(&socket).await {
                // A probe: x11vnc sees a client that leaves at once.
                Ok(_) => break,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    let _ = child.start_kill();
                    return Err(RfbError::Socket(e));
                }
                Err(_) => {}
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(RfbError::Start(format!("x11vnc ended: {status}")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let name = display;
        tracing::info!(display = %name, pid = ?child.id(), "x11vnc started");
        Ok(Vnc { child, dir })
    }

    /// The socket viewers are relayed to.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("vnc.sock")
    }

    /// x11vnc's process id (while it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Whether x11vnc still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kill x11vnc's group and reap it (at most 2 s); the directory goes
    /// with `self`.
    pub async fn stop(&mut self) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.child.wait()).await;
    }
}

/// One viewer: connect to x11vnc, dial the relay, answer `display.rfb`
/// (after the dial, so an unreachable harness is an error and not a silent
/// stream), then carry bytes until either side ends.
pub async fn serve(socket: PathBuf, host: AttachHost, display: String, reply: Responder) {
    let started = async {
        let vnc = tokio::time::timeout(START, UnixStream::connect(&socket))
            .await
            .map_err(|_| {
                RfbError::Socket(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connect timed out",
                ))
            })?
            .map_err(RfbError::Socket)?;
        let ws = dial(&host.url, &host.ticket).await?;
        Ok::<_, RfbError>((vnc, ws))
    };
    let (vnc, ws) = match started.await {
        Ok(v) => v,
        Err(e) => {
            tracing::info!(error = %e, "RFB stream did not start");
            return reply.err(e.rpc());
        }
    };
    reply.ok(&DisplayRfbResult {
        accepted: true,
        display,
    });
    tracing::info!("RFB viewer relayed");
    match pump(ws, vnc).await {
        Ok(()) => tracing::info!("RFB viewer left"),
        Err(e) => tracing::info!(error = %e, "RFB stream ended"),
    }
}

/// Both directions at once, each with its own bounded buffer, so neither
/// side's writes can wait on the other side's reads (x11vnc writing a
/// frame update while the viewer types). The first direction to end ends
/// the stream; dropping the other closes its sockets.
async fn pump(ws: Ws, vnc: UnixStream) -> std::io::Result<()> {
    let (mut sink, mut stream) = ws.split();
    let (mut rd, mut wr) = vnc.into_split();
    let down = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = rd.read(&mut buf).await?;
            if n == 0 {
                let _ = sink.close().await;
                return Ok(());
            }
            sink.send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
                .await
                .map_err(std::io::Error::other)?;
        }
    };
    let up = async {
        while let Some(m) = stream.next().await {
            match m.map_err(std::io::Error::other)? {
                Message::Binary(b) => wr.write_all(&b).await?,
                Message::Close(_) => break,
                // Text frames have no meaning in RFB; pings are answered
                // by tungstenite.
                _ => {}
            }
        }
        Ok(())
    };
    tokio::select! {
        r = down => r,
        r = up => r,
    }
}
