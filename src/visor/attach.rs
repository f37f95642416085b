//! `GET /v1/sessions/{id}/attach` (VISOR.md §4): a terminal view of a PTY
//! session, or the chat view of a wire session, with the writer lease.
//!
//! Output goes out as binary frames (byte 0 op, bytes 1–8 seq big-endian,
//! then data; op 1 output, op 3 snapshot). A client that attaches with no
//! `after`, or one older than the scrollback holds, first gets a snapshot:
//! a redraw of the screen model at the seq it stands for. A client that
//! falls behind the scrollback gets a fresh snapshot. The PTY waits (up to
//! `pty::PACE_WAIT`) for an attached client that keeps taking output, so
//! that one misses nothing; beyond that it does not wait:
//! this task reads the shared scrollback at its own pace.

use super::http::{close, query, query_u64, upgrade, WsStream, MAX_KEYS, MAX_TEXT, SEND_TIMEOUT};
use super::lease::Lease;
use super::session::{SessionData, SessionMsg, Writer};
use super::types::Kind;
use super::{Visor, VisorError};
use crate::terminal::frame::{frame, parse, OP_INPUT, OP_OUTPUT, OP_SNAPSHOT};
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;

pub async fn attach(State(v): State<Arc<Visor>>, Path(id): Path<String>, req: Request) -> Response {
    match prepare(&v, &id, &req) {
        Ok((d, after, view)) => {
            let visor = v.clone();
            upgrade(req, move |ws| async move {
                Attached::new(visor, d).run(ws, after, view).await
            })
        }
        Err(e) => e.into_response(),
    }
}

fn prepare(
    v: &Visor,
    id: &str,
    req: &Request,
) -> Result<(Arc<SessionData>, Option<u64>, String), VisorError> {
    let d = v.session(id)?;
    let q = query(req.uri())?;
    let after = query_u64(&q, "after")?;
    let view = q
        .get("view")
        .and_then(|l| l.first().cloned())
        .unwrap_or_else(|| "terminal".into());
    match view.as_str() {
        "terminal" if d.checked.spec.kind == Kind::Pty => {}
        "terminal" => {
            return Err(VisorError::Invalid(
                "only pty sessions have a terminal view".into(),
            ))
        }
        "chat" if d.checked.spec.kind == Kind::Wire => {}
        "chat" => {
            return Err(VisorError::Invalid(
                "only wire sessions have a chat view".into(),
            ))
        }
        other => return Err(VisorError::Invalid(format!("unknown view {other:?}"))),
    }
    Ok((d, after, view))
}

type Sink = SplitSink<WsStream, Message>;

struct Attached {
    visor: Arc<Visor>,
    data: Arc<SessionData>,
    client: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("the client went away")]
struct Gone;

async fn put(sink: &mut Sink, m: Message) -> Result<(), Gone> {
    match tokio::time::timeout(SEND_TIMEOUT, sink.send(m)).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(Gone),
    }
}

fn text(v: Value) -> Message {
    Message::Text(v.to_string().into())
}

/// `ended` once the session has exited (`true`: the view is over).
async fn ended(
    sink: &mut Sink,
    ended_rx: &mut tokio::sync::watch::Receiver<Option<Option<i32>>>,
) -> Result<bool, Gone> {
    let ended = *ended_rx.borrow_and_update();
    match ended {
        Some(code) => {
            put(
                sink,
                text(json!({"type": "ended", "reason": "exited", "exitCode": code})),
            )
            .await?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// The visor shuts down: `ended {reason: closed}` and a 1001 close.
async fn closing(sink: &mut Sink) -> Result<(), Gone> {
    let _ = put(sink, text(json!({"type": "ended", "reason": "closed"}))).await;
    let _ = put(sink, close(CloseCode::Away, "closed")).await;
    Err(Gone)
}

fn error_frame(code: &str, message: impl Into<String>) -> Message {
    text(json!({"type": "error", "code": code, "message": message.into()}))
}

impl Attached {
    fn new(visor: Arc<Visor>, data: Arc<SessionData>) -> Attached {
        let client = visor.client_id();
        Attached {
            visor,
            data,
            client,
        }
    }

    fn lease_frame(&self, l: &Lease) -> Message {
        text(json!({"type": "lease", "holder": l.seen_by(self.client).as_str()}))
    }

    async fn run(self, ws: WsStream, after: Option<u64>, view: String) {
        let (mut sink, mut stream) = ws.split();
        let r = if view == "chat" {
            self.pump_chat(&mut sink, &mut stream, after.unwrap_or(0))
                .await
        } else {
            self.pump(&mut sink, &mut stream, after, &view).await
        };
        self.data.with_lease(|l| l.disconnect(self.client));
        if r.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
        }
    }

    async fn snapshot(&self, sink: &mut Sink) -> Result<u64, Gone> {
        let (seq, redraw) = self.data.snapshot();
        put(sink, Message::Binary(frame(OP_SNAPSHOT, seq, &redraw))).await?;
        Ok(seq + 1)
    }

    async fn pump(
        &self,
        sink: &mut Sink,
        stream: &mut futures_util::stream::SplitStream<WsStream>,
        after: Option<u64>,
        view: &str,
    ) -> Result<(), Gone> {
        let d = &self.data;
        let (cols, rows) = *d.size_tx.borrow();
        let lease = d.lease();
        put(
            sink,
            text(json!({"type": "attached", "view": view, "writable": lease.may_write(self.client),
                "holder": lease.seen_by(self.client).as_str(), "cols": cols, "rows": rows, "resizable": true})),
        )
        .await?;
        let mut out_rx = d.output.subscribe();
        let mut lease_rx = d.lease_tx.subscribe();
        let mut size_rx = d.size_tx.subscribe();
        let mut ended_rx = d.ended_tx.subscribe();
        let earliest = d.output.with(|sb| sb.earliest_seq());
        let latest = d.output.with(|sb| sb.latest_seq());
        let mut next = match after {
            Some(a) if a + 1 >= earliest && a <= latest => a + 1,
            _ => self.snapshot(sink).await?,
        };
        // A client that keeps up misses nothing: the PTY reader waits for
        // it (see `pty::Output::pace`).
        let pace = d.output.pace(next);
        loop {
            out_rx.borrow_and_update();
            let replay = d.output.with(|sb| sb.replay(next));
            if replay.gap.is_some() {
                next = self.snapshot(sink).await?;
                pace.resync(next);
                continue;
            }
            for (seq, chunk) in replay.chunks {
                sink.feed(Message::Binary(frame(OP_OUTPUT, seq, &chunk)))
                    .await
                    .map_err(|_| Gone)?;
                next = seq + 1;
            }
            tokio::time::timeout(SEND_TIMEOUT, sink.flush())
                .await
                .map_err(|_| Gone)?
                .map_err(|_| Gone)?;
            pace.advance(next);
            if ended(sink, &mut ended_rx).await? {
                return Ok(());
            }
            tokio::select! {
                _ = out_rx.changed() => {}
                _ = lease_rx.changed() => {
                    let l = *lease_rx.borrow_and_update();
                    put(sink, self.lease_frame(&l)).await?;
                }
                _ = size_rx.changed() => {
                    let (c, r) = *size_rx.borrow_and_update();
                    put(sink, text(json!({"type": "resized", "cols": c, "rows": r}))).await?;
                }
                _ = ended_rx.changed() => {}
                msg = stream.next() => match msg {
                    Some(Ok(Message::Text(t))) => {
                        if let Some(reply) = self.on_text(t.as_str()).await {
                            put(sink, reply).await?;
                        }
                    }
                    Some(Ok(Message::Binary(b))) => {
                        let reply = match parse(&b) {
                            Some((OP_INPUT, _, data)) => self.input(data).await,
                            _ => Some(error_frame("invalid", "binary frames from a client are op 2 input")),
                        };
                        if let Some(reply) = reply {
                            put(sink, reply).await?;
                        }
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return Err(Gone),
                    Some(Ok(_)) => {}
                },
                _ = self.visor.shutdown.cancelled() => return closing(sink).await,
            }
        }
    }

    /// The chat view of a wire session: `turns` frames (first every
    /// retained turn after `after`, then each new one), the lease, `ended`;
    /// from the client `control`, `release`, `send`, `interrupt`, `ack`.
    async fn pump_chat(
        &self,
        sink: &mut Sink,
        stream: &mut futures_util::stream::SplitStream<WsStream>,
        mut after: u64,
    ) -> Result<(), Gone> {
        let d = &self.data;
        let lease = d.lease();
        put(
            sink,
            text(
                json!({"type": "attached", "view": "chat", "writable": lease.may_write(self.client),
                "holder": lease.seen_by(self.client).as_str(), "resizable": false}),
            ),
        )
        .await?;
        let mut chat_rx = d.chat_tx.subscribe();
        let mut lease_rx = d.lease_tx.subscribe();
        let mut ended_rx = d.ended_tx.subscribe();
        let mut first = true;
        loop {
            chat_rx.borrow_and_update();
            let (turns, pending) = {
                let c = d.chat();
                (c.turns_after(after), c.pending_views())
            };
            if first || !turns.is_empty() {
                first = false;
                after = turns.last().map_or(after, |t| t.seq);
                put(
                    sink,
                    text(json!({"type": "turns", "turns": turns, "pending": pending})),
                )
                .await?;
            }
            if ended(sink, &mut ended_rx).await? {
                return Ok(());
            }
            tokio::select! {
                _ = chat_rx.changed() => {}
                _ = lease_rx.changed() => {
                    let l = *lease_rx.borrow_and_update();
                    put(sink, self.lease_frame(&l)).await?;
                }
                _ = ended_rx.changed() => {}
                msg = stream.next() => match msg {
                    Some(Ok(Message::Text(t))) => {
                        if let Some(reply) = self.on_chat_text(t.as_str()).await {
                            put(sink, reply).await?;
                        }
                    }
                    Some(Ok(Message::Binary(_))) => {
                        put(sink, error_frame("invalid", "the chat view takes send frames, not terminal input")).await?;
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return Err(Gone),
                    Some(Ok(_)) => {}
                },
                _ = self.visor.shutdown.cancelled() => return closing(sink).await,
            }
        }
    }

    async fn on_chat_text(&self, t: &str) -> Option<Message> {
        let Ok(v) = serde_json::from_str::<Value>(t) else {
            return Some(error_frame("invalid", "frames are JSON objects"));
        };
        let w = Writer::Client(self.client);
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "control" | "release" | "ack" | "interrupt" => self.on_text(t).await,
            "send" => match v.get("text").and_then(Value::as_str) {
                Some(s) if s.len() <= MAX_TEXT => {
                    if !self.data.lease().may_write(self.client) {
                        return Some(error_frame(
                            "not_writer",
                            "this client does not hold the writer lease",
                        ));
                    }
                    let text_ = s.to_owned();
                    let Some(actor) = self.data.actor() else {
                        return Some(error_frame("state", "the session is not running"));
                    };
                    match actor
                        .call(
                            |r| SessionMsg::Send(text_, w, r),
                            Some(Duration::from_secs(20)),
                        )
                        .await
                    {
                        Ok(ractor::rpc::CallResult::Success(Ok(delivery))) => {
                            Some(text(json!({"type": "sent", "delivery": delivery})))
                        }
                        Ok(ractor::rpc::CallResult::Success(Err(e))) => {
                            Some(error_frame(e.code(), e.to_string()))
                        }
                        _ => Some(error_frame("state", "the session's program has ended")),
                    }
                }
                Some(_) => Some(error_frame(
                    "invalid",
                    format!("text is limited to {MAX_TEXT} bytes"),
                )),
                None => Some(error_frame("invalid", "send needs text")),
            },
            other => Some(error_frame(
                "invalid",
                format!("the chat view does not take {other:?} frames"),
            )),
        }
    }

    /// Ask the session's current run; map refusals to error frames.
    async fn call(
        &self,
        f: impl FnOnce(ractor::RpcReplyPort<Result<(), VisorError>>) -> SessionMsg,
    ) -> Option<Message> {
        let Some(actor) = self.data.actor() else {
            return Some(error_frame("state", "the session is not running"));
        };
        match actor.call(f, Some(Duration::from_secs(20))).await {
            Ok(ractor::rpc::CallResult::Success(Ok(()))) => None,
            Ok(ractor::rpc::CallResult::Success(Err(VisorError::State(m))))
                if m == "not_writer" =>
            {
                Some(error_frame(
                    "not_writer",
                    "this client does not hold the writer lease",
                ))
            }
            Ok(ractor::rpc::CallResult::Success(Err(e))) => {
                Some(error_frame(e.code(), e.to_string()))
            }
            _ => Some(error_frame("state", "the session's program has ended")),
        }
    }

    async fn input(&self, data: Bytes) -> Option<Message> {
        if data.len() > MAX_KEYS {
            return Some(error_frame(
                "invalid",
                format!("input is limited to {MAX_KEYS} bytes"),
            ));
        }
        if !self.data.lease().may_write(self.client) {
            return Some(error_frame(
                "not_writer",
                "this client does not hold the writer lease",
            ));
        }
        let w = Writer::Client(self.client);
        self.call(|r| SessionMsg::Write(data, w, Some(r))).await
    }

    async fn on_text(&self, t: &str) -> Option<Message> {
        let Ok(v) = serde_json::from_str::<Value>(t) else {
            return Some(error_frame("invalid", "frames are JSON objects"));
        };
        let w = Writer::Client(self.client);
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "control" => {
                self.data.with_lease(|l| l.control(self.client));
                None
            }
            "release" => {
                self.data.with_lease(|l| l.release(self.client));
                None
            }
            "input" => match v.get("data").and_then(Value::as_str) {
                Some(s) => self.input(Bytes::copy_from_slice(s.as_bytes())).await,
                None => Some(error_frame("invalid", "input needs data (a string)")),
            },
            "resize" => {
                let dim = |k| {
                    v.get(k)
                        .and_then(Value::as_u64)
                        .filter(|n| (1..=u64::from(super::types::MAX_DIM)).contains(n))
                        .map(|n| n as u16)
                };
                match (dim("cols"), dim("rows")) {
                    (Some(c), Some(r)) => {
                        self.call(|reply| SessionMsg::Resize(c, r, w, reply)).await
                    }
                    _ => Some(error_frame(
                        "invalid",
                        "resize needs cols and rows in 1..=1000",
                    )),
                }
            }
            "ack" => None,
            "interrupt" => self.call(|r| SessionMsg::Interrupt(w, r)).await,
            "send" => match v.get("text").and_then(Value::as_str) {
                Some(s) if s.len() <= MAX_TEXT => {
                    let mut b = s.as_bytes().to_vec();
                    b.push(b'\r');
                    self.call(|r| SessionMsg::Write(Bytes::from(b), w, Some(r)))
                        .await
                }
                Some(_) => Some(error_frame(
                    "invalid",
                    format!("text is limited to {MAX_TEXT} bytes"),
                )),
                None => Some(error_frame("invalid", "send needs text")),
            },
            other => Some(error_frame(
                "invalid",
                format!("unknown frame type {other:?}"),
            )),
        }
    }
}
