//! The `host` variant of `terminal.attach`: the executor dials the URL the
//! harness gave (bearer = the one-time ticket) and streams the terminal as
//! binary WebSocket frames, so bulk output never rides the control
//! connection.
//!
//! Frame: byte 0 op, bytes 1-8 seq (u64 big-endian), then data.
//!
//! | op | direction | meaning |
//! | --- | --- | --- |
//! | 1 output | executor → host | a live chunk `seq` |
//! | 2 input | host → executor | bytes to type (seq ignored); only if this stream is the writer |
//! | 3 snapshot | executor → host | a replayed chunk `seq` (query sequences stripped); empty data = gap marker, `seq` = the last lost seq |
//!
//! Flow control is the socket's: a slow host makes sends wait, this task
//! falls behind in the scrollback, and when the chunks it needs are gone it
//! sends a gap marker and continues from the oldest retained one. The PTY
//! reader never waits.

use super::pty::Output;
use super::TerminalMsg;
use crate::terminal::scrollback::strip_terminal_replies;
use crate::wire::types::TerminalAttachResult;
use crate::wire::{Responder, RpcError};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{header, HeaderValue};
use ractor::ActorRef;
use std::sync::Arc;
use std::time::Duration;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

pub use crate::terminal::frame::{frame, parse, OP_INPUT, OP_OUTPUT, OP_SNAPSHOT};

/// Largest frame accepted from the host.
const MAX_FRAME: usize = 1 << 20;
pub(crate) const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// One host stream's task.
pub struct HostStream {
    pub url: String,
    pub ticket: String,
    pub terminal_id: String,
    pub stream_id: String,
    /// Tells this stream apart from a later one with the same id.
    pub token: u64,
    pub from_seq: u64,
    /// Chunks below this seq are history: sent as snapshots, stripped.
    pub live_from: u64,
    pub output: Arc<Output>,
    pub terminal: ActorRef<TerminalMsg>,
    pub cancel: CancellationToken,
}

/// Why dialing a relay failed.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("host url must be ws://host:port/path: {0}")]
    BadUrl(String),
    #[error("cannot reach the host: {0}")]
    Io(#[from] std::io::Error),
    #[error("handshake failed: {0}")]
    Handshake(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

pub(crate) type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Dial a harness relay URL (`ws://` only) with the one-time ticket as the
/// bearer token, within [`DIAL_TIMEOUT`]; frames up to 1 MiB are read.
/// Shared by the terminal host streams and the display's RFB streams.
pub(crate) async fn dial(url: &str, ticket: &str) -> Result<Ws, DialError> {
    let hostport = url
        .strip_prefix("ws://")
        .and_then(|r| r.split('/').next())
        .filter(|h| !h.is_empty())
        .ok_or_else(|| DialError::BadUrl(url.to_owned()))?;
    let mut request = url
        .into_client_request()
        .map_err(|e| DialError::BadUrl(e.to_string()))?;
    request.headers_mut().insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {ticket}"))
            .map_err(|_| DialError::BadUrl("ticket is not a valid header value".into()))?,
    );
    let connect = async {
        let tcp = tokio::net::TcpStream::connect(hostport).await?;
        tcp.set_nodelay(true)?;
        let config = crate::wire::transport::ws_config(MAX_FRAME);
        tokio_tungstenite::client_async_with_config(request, tcp, Some(config))
            .await
            .map(|(ws, _)| ws)
            .map_err(|e| DialError::Handshake(e.to_string()))
    };
    tokio::time::timeout(DIAL_TIMEOUT, connect)
        .await
        .map_err(|_| DialError::Timeout(DIAL_TIMEOUT))?
}

impl HostStream {
    /// Dial, answer the attach (the answer waits for the dial so an
    /// unreachable host is an error, not a silent stream), then stream until
    /// the socket closes or the terminal cancels.
    pub async fn run(self, reply: Responder, answer: TerminalAttachResult) {
        let ws = match dial(&self.url, &self.ticket).await {
            Ok(ws) => {
                reply.ok(&answer);
                ws
            }
            Err(e) => {
                tracing::info!(terminal = %self.terminal_id, stream = %self.stream_id, error = %e, "host attach failed");
                reply.err(RpcError::resource_unavailable(e.to_string()));
                return self.gone();
            }
        };
        if let Err(e) = self.pump(ws).await {
            tracing::debug!(terminal = %self.terminal_id, stream = %self.stream_id, error = %e, "host stream ended");
        }
        self.gone();
    }

    fn gone(&self) {
        let _ = self.terminal.send_message(TerminalMsg::HostGone {
            stream_id: self.stream_id.clone(),
            token: self.token,
        });
    }

    async fn pump(&self, ws: Ws) -> Result<(), tokio_tungstenite::tungstenite::Error> {
        let (mut sink, mut stream) = ws.split();
        let mut latest = self.output.subscribe();
        let mut next = self.from_seq.max(1);
        loop {
            latest.borrow_and_update();
            let replay = self.output.with(|sb| sb.replay(next));
            if let Some((_, earliest)) = replay.gap {
                sink.feed(Message::Binary(frame(OP_SNAPSHOT, earliest - 1, &[])))
                    .await?;
                next = earliest;
            }
            for (seq, data) in replay.chunks {
                let msg = if seq < self.live_from {
                    frame(OP_SNAPSHOT, seq, &strip_terminal_replies(&data))
                } else {
                    frame(OP_OUTPUT, seq, &data)
                };
                sink.feed(Message::Binary(msg)).await?;
                next = seq + 1;
            }
            sink.flush().await?;
            tokio::select! {
                changed = latest.changed() => if changed.is_err() { break },
                msg = stream.next() => match msg {
                    Some(Ok(Message::Binary(b))) => self.input(&b),
                    Some(Ok(Message::Close(_))) | None => break,
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e),
                },
                _ = self.cancel.cancelled() => break,
            }
        }
        let _ = sink.close().await;
        Ok(())
    }

    fn input(&self, b: &Bytes) {
        match parse(b) {
            Some((OP_INPUT, _, data)) if !data.is_empty() => {
                let _ = self.terminal.send_message(TerminalMsg::HostInput {
                    stream_id: self.stream_id.clone(),
                    token: self.token,
                    data,
                });
            }
            Some((OP_INPUT, ..)) => {}
            _ => tracing::debug!(stream = %self.stream_id, "ignored a frame from the host"),
        }
    }
}
