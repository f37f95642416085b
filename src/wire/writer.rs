//! The sending half of a connection: frames go into the socket from the
//! task that sends them whenever nothing is ahead of them, and a writer
//! task takes over only when the transport cannot take a frame at once.
//!
//! Why not always a writer task behind a channel (as before): on a
//! multi-threaded runtime every hand-off from a sender to the writer task is
//! one more task wake-up on the frame's path. tokio runs at most three
//! woken tasks in a row from its LIFO slot; past that, each wake-up queues
//! the task and unparks an idle worker, which on a VM costs tens of µs of
//! latency per frame (docs/benchmarks.md, "MCP"). Writing directly keeps a
//! request's path at one task hop per side.
//!
//! Only small frames are written directly ([`DIRECT_MAX_BYTES`]): a bulk
//! stream (process output at hundreds of MB/s) is faster when its sender
//! goes on producing while the writer task writes on another thread, and a
//! wake-up is nothing beside a large frame's write.
//!
//! Order is kept: a frame is written directly only when the queue is empty
//! and nothing written earlier is still unflushed; otherwise it joins the
//! queue, which the writer task drains in order.

use super::transport::WsStream;
use futures_util::stream::SplitSink;
use futures_util::Sink;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;

/// How long the writer waits, after sending a close frame, for the peer's
/// answer (or the reader's end) before dropping the transport; also the
/// deadline for writing what is queued once the connection is closing.
const LINGER: Duration = Duration::from_secs(2);

/// The largest frame its sender writes itself; larger ones go to the
/// writer task. An MCP message, a tool call or result, a heartbeat or a
/// line of output is far below it; a chunk of a fast output stream is
/// above it.
pub(crate) const DIRECT_MAX_BYTES: usize = 16 * 1024;

/// Why a frame was not accepted: the connection is closing or gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused;

/// The shared sending half; [`Link`](super::link::Link) holds one.
pub(crate) struct Writer {
    state: Mutex<State>,
    /// Wakes the writer task: frames queued, a flush left pending, a close.
    wake: Notify,
}

struct State {
    sink: SplitSink<WsStream, Message>,
    /// Frames not yet handed to the sink, oldest first.
    queue: VecDeque<Message>,
    /// The sink took frames it has not flushed yet.
    unflushed: bool,
    /// A close frame was accepted: nothing is accepted after it.
    closing: bool,
    /// The transport failed or the writer task ended: nothing is accepted.
    done: bool,
}

impl State {
    /// Hand every queued frame to the sink, then flush it. `Pending` when
    /// the transport cannot take more now: `cx` is woken when it can.
    fn drive(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), WsError>> {
        while !self.queue.is_empty() {
            match Pin::new(&mut self.sink).poll_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
            let Some(msg) = self.queue.pop_front() else {
                break;
            };
            Pin::new(&mut self.sink).start_send(msg)?;
            self.unflushed = true;
        }
        if self.unflushed {
            match Pin::new(&mut self.sink).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Writer {
    /// The writer for `sink`, and its task (spawned by the caller), which
    /// cancels `closed` when it ends.
    pub(crate) fn start(
        sink: SplitSink<WsStream, Message>,
        closed: CancellationToken,
    ) -> (
        Arc<Writer>,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let writer = Arc::new(Writer {
            state: Mutex::new(State {
                sink,
                queue: VecDeque::new(),
                unflushed: false,
                closing: false,
                done: false,
            }),
            wake: Notify::new(),
        });
        let task = run(writer.clone(), closed);
        (writer, task)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change under the lock leaves the state whole (a queue push
        // or pop, a flag): a panic elsewhere cannot tear it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Send `msg`: written now when nothing is ahead of it and the
    /// transport takes it, else queued for the writer task, in order.
    pub(crate) fn send(&self, msg: Message) -> Result<(), Refused> {
        let is_close = matches!(msg, Message::Close(_));
        let mut st = self.lock();
        if st.done || st.closing {
            return Err(Refused);
        }
        st.closing = is_close;
        let direct = st.queue.is_empty() && !st.unflushed && frame_len(&msg) <= DIRECT_MAX_BYTES;
        st.queue.push_back(msg);
        if direct {
            // A waker that does nothing: when the transport is not ready,
            // the writer task (woken below) polls again with its own.
            let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
            match st.drive(&mut cx) {
                Poll::Ready(Ok(())) if !is_close => return Ok(()),
                Poll::Ready(Err(e)) => {
                    tracing::debug!(error = %e, "write failed");
                    st.done = true;
                    drop(st);
                    self.wake.notify_one();
                    return Err(Refused);
                }
                _ => {}
            }
        }
        drop(st);
        self.wake.notify_one();
        Ok(())
    }

    /// Frames waiting for the writer task (tests).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.lock().queue.len()
    }
}

/// A frame's payload size: what the peer's reader measures against its
/// limit.
pub(crate) fn frame_len(msg: &Message) -> usize {
    match msg {
        Message::Text(t) => t.len(),
        Message::Binary(b) => b.len(),
        _ => 0,
    }
}

/// Poll [`State::drive`] with the task's own waker until it is done.
async fn drive(writer: &Writer) -> Result<(), WsError> {
    std::future::poll_fn(|cx| writer.lock().drive(cx)).await
}

/// The writer task: drains what senders could not write, sends the close
/// frame's linger, and ends the connection's write side.
async fn run(writer: Arc<Writer>, closed: CancellationToken) {
    loop {
        let notified = writer.wake.notified();
        let drove = tokio::select! {
            biased;
            r = drive(&writer) => r,
            // A peer that stopped reading cannot hold the write side open
            // past the connection's end (the rest gets the linger below).
            _ = closed.cancelled() => break,
        };
        if drove.is_err() {
            break;
        }
        let (done, closing) = {
            let st = writer.lock();
            (st.done, st.closing && st.queue.is_empty() && !st.unflushed)
        };
        if done {
            break;
        }
        if closing {
            // Give the peer a moment to answer the close, then drop the
            // transport.
            tokio::select! {
                _ = closed.cancelled() => {}
                _ = tokio::time::sleep(LINGER) => {}
            }
            break;
        }
        tokio::select! {
            biased;
            _ = notified => {}
            _ = closed.cancelled() => break,
        }
    }
    if closed.is_cancelled() {
        // What was queued before the connection closed still goes out,
        // within the linger.
        let _ = tokio::time::timeout(LINGER, drive(&writer)).await;
    }
    writer.lock().done = true;
    let close = std::future::poll_fn(|cx| Pin::new(&mut writer.lock().sink).poll_close(cx));
    let _ = tokio::time::timeout(LINGER, close).await;
    closed.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::WebSocketStream;

    /// Both ends of a WebSocket over an in-memory pipe of `bytes` each way.
    async fn pair(bytes: usize) -> (WsStream, WsStream) {
        let (a, b) = tokio::io::duplex(bytes);
        let a: super::super::transport::BoxIo = Box::new(a);
        let b: super::super::transport::BoxIo = Box::new(b);
        (
            WebSocketStream::from_raw_socket(a, Role::Client, None).await,
            WebSocketStream::from_raw_socket(b, Role::Server, None).await,
        )
    }

    #[tokio::test]
    async fn frames_keep_their_order_when_the_transport_is_full() {
        // 1 KiB of pipe against 200 frames of 512 bytes: most cannot be
        // written when sent and wait in the queue.
        let (near, mut far) = pair(1024).await;
        let (sink, _stream) = near.split();
        let closed = CancellationToken::new();
        let (writer, task) = Writer::start(sink, closed.clone());
        tokio::spawn(task);
        let mut most_queued = 0;
        for i in 0..200u32 {
            let body = format!("{i:05}{}", "x".repeat(507));
            writer.send(Message::Text(body.into())).unwrap();
            most_queued = most_queued.max(writer.queued());
        }
        assert!(most_queued > 0, "the queue was used");
        for i in 0..200u32 {
            let m = tokio::time::timeout(Duration::from_secs(10), far.next())
                .await
                .expect("a frame in time")
                .expect("open")
                .unwrap();
            let text = m.into_text().unwrap();
            assert_eq!(&text[..5], format!("{i:05}"), "frame {i} in order");
        }
        closed.cancel();
    }

    #[tokio::test]
    async fn nothing_is_accepted_after_a_close_and_the_close_goes_out() {
        let (near, mut far) = pair(1 << 16).await;
        let (sink, _stream) = near.split();
        let closed = CancellationToken::new();
        let (writer, task) = Writer::start(sink, closed.clone());
        let task = tokio::spawn(task);
        writer.send(Message::Text("last".into())).unwrap();
        writer.send(Message::Close(None)).unwrap();
        assert_eq!(
            writer.send(Message::Text("late".into())),
            Err(Refused),
            "nothing after the close"
        );
        let first = far.next().await.unwrap().unwrap();
        assert_eq!(first.into_text().unwrap(), "last");
        assert!(matches!(far.next().await, Some(Ok(Message::Close(_)))));
        // The peer's answer to the close is never read here (the stream
        // half is idle): the task ends when the connection is closed.
        closed.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the writer task ends")
            .unwrap();
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_cannot_hold_the_writer_past_the_close() {
        // Nobody reads `far`: 64 KiB of frames fill the 1 KiB pipe.
        let (near, _far) = pair(1024).await;
        let (sink, _stream) = near.split();
        let closed = CancellationToken::new();
        let (writer, task) = Writer::start(sink, closed.clone());
        let task = tokio::spawn(task);
        for _ in 0..64 {
            writer.send(Message::Binary(vec![0; 1024].into())).unwrap();
        }
        tokio::task::yield_now().await;
        assert!(writer.lock().unflushed, "the transport is full");
        closed.cancel();
        tokio::time::timeout(LINGER * 3, task)
            .await
            .expect("the writer task ends within the linger")
            .unwrap();
    }

    #[tokio::test]
    async fn what_is_queued_when_the_connection_closes_still_goes_out() {
        let (near, mut far) = pair(1024).await;
        let (sink, _stream) = near.split();
        let closed = CancellationToken::new();
        let (writer, task) = Writer::start(sink, closed.clone());
        for i in 0..8u32 {
            writer
                .send(Message::Binary(vec![i as u8; 600].into()))
                .unwrap();
        }
        // Closed before the writer task ever ran: it drains, then ends.
        closed.cancel();
        let task = tokio::spawn(task);
        for i in 0..8u32 {
            let m = far.next().await.unwrap().unwrap();
            assert_eq!(m.into_data()[0], i as u8);
        }
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the writer task ends")
            .unwrap();
        assert_eq!(writer.send(Message::Text("after".into())), Err(Refused));
    }
}
