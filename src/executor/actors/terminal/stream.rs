//! A viewer stream that flows over the control connection as
//! `terminal.output` notifications, with `ackSeq` flow control.
//!
//! The stream is a cursor into the scrollback, not a queue: `next` is the
//! next seq to send, `acked` the highest seq the viewer acknowledged. At
//! most `window` bytes may be sent and unacknowledged; past that the stream
//! just stops sending. If the viewer comes back after the scrollback moved
//! past `next`, the stream sends a gap marker and continues with the oldest
//! retained chunk. So memory per stream is bounded by the window, whatever
//! the program writes and however slow the viewer is.

use super::pty::Output;
use crate::terminal::scrollback::strip_terminal_replies;
use crate::wire::{Blob, CallError, Link, Method};
use bytes::Bytes;
use std::collections::VecDeque;

/// `terminal.output` with the gap extension (see docs/terminals.md): the
/// typed `TerminalOutputParams` plus an optional `gap`.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OutputNotice<'a> {
    pub terminal_id: &'a str,
    pub stream_id: &'a str,
    pub seq: u64,
    pub data: Blob,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap: Option<Gap>,
}

/// Seqs `from_seq..=to_seq` were dropped before this stream got them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Gap {
    pub from_seq: u64,
    pub to_seq: u64,
}

#[derive(Debug)]
pub struct NotifyStream {
    /// Next seq to send (>= 1).
    pub next: u64,
    /// Highest seq the viewer acknowledged.
    pub acked: u64,
    /// Chunks below this seq are history (replay): query sequences are
    /// stripped from them. Reset on resume: what is re-sent is history too.
    live_from: u64,
    /// Sent and not acknowledged: (seq, bytes).
    inflight: VecDeque<(u64, usize)>,
    inflight_bytes: usize,
}

impl NotifyStream {
    /// A stream replaying from `from` (clamped to 1..=latest+1).
    pub fn new(from: u64, latest: u64) -> Self {
        let next = from.clamp(1, latest + 1);
        NotifyStream {
            next,
            acked: next - 1,
            live_from: latest + 1,
            inflight: VecDeque::new(),
            inflight_bytes: 0,
        }
    }

    /// A re-attach of this stream: never rewinds (the viewer de-duplicates
    /// by seq, and a rewind would re-send what is in flight); `from` may
    /// skip ahead.
    pub fn reattach(&mut self, from: u64, latest: u64) {
        let from = from.min(latest + 1);
        if from > self.next {
            self.next = from;
            // Skipped seqs count as seen: a resume must not send them.
            self.ack(from - 1);
        }
    }

    /// The viewer saw everything up to `seq` (clamped to what was sent).
    pub fn ack(&mut self, seq: u64) {
        let seq = seq.min(self.next.saturating_sub(1));
        if seq <= self.acked {
            return;
        }
        self.acked = seq;
        while let Some(&(s, n)) = self.inflight.front() {
            if s > seq {
                break;
            }
            self.inflight.pop_front();
            self.inflight_bytes -= n;
        }
    }

    /// The connection was replaced: whatever was not acknowledged may be
    /// lost, so send again from `acked + 1` (as history).
    pub fn resume(&mut self, latest: u64) {
        self.next = self.acked + 1;
        self.live_from = latest + 1;
        self.inflight.clear();
        self.inflight_bytes = 0;
    }

    pub fn inflight_bytes(&self) -> usize {
        self.inflight_bytes
    }

    /// Send what the window allows.
    pub fn deliver(
        &mut self,
        link: &Link,
        output: &Output,
        terminal_id: &str,
        stream_id: &str,
        window: usize,
    ) -> Result<(), CallError> {
        if self.inflight_bytes >= window {
            return Ok(());
        }
        let replay = output.with(|sb| sb.replay(self.next));
        let send = |seq: u64, data: Bytes, gap: Option<Gap>| {
            link.notify(
                Method::TerminalOutput,
                &OutputNotice {
                    terminal_id,
                    stream_id,
                    seq,
                    data: Blob(data),
                    gap,
                },
            )
        };
        if let Some((_, earliest)) = replay.gap {
            let gap = Gap {
                from_seq: self.next,
                to_seq: earliest - 1,
            };
            send(earliest - 1, Bytes::new(), Some(gap))?;
            self.inflight.push_back((earliest - 1, 0));
            self.next = earliest;
        }
        for (seq, data) in replay.chunks {
            if self.inflight_bytes >= window {
                break;
            }
            let data = if seq < self.live_from {
                match strip_terminal_replies(&data) {
                    std::borrow::Cow::Borrowed(_) => data,
                    std::borrow::Cow::Owned(v) => Bytes::from(v),
                }
            } else {
                data
            };
            let n = data.len();
            send(seq, data, None)?;
            self.inflight.push_back((seq, n));
            self.inflight_bytes += n;
            self.next = seq + 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_releases_the_window_and_never_goes_back() {
        let mut s = NotifyStream::new(0, 5);
        assert_eq!((s.next, s.acked), (1, 0));
        s.inflight.extend([(1, 10), (2, 20), (3, 30)]);
        s.inflight_bytes = 60;
        s.next = 4;
        s.ack(2);
        assert_eq!((s.acked, s.inflight_bytes()), (2, 30));
        s.ack(1);
        assert_eq!(s.acked, 2);
        // Acks beyond what was sent are clamped.
        s.ack(99);
        assert_eq!((s.acked, s.inflight_bytes()), (3, 0));
        s.reattach(1, 10);
        assert_eq!(s.next, 4, "a re-attach does not rewind");
        s.reattach(8, 10);
        assert_eq!(s.next, 8, "but may skip ahead");
        s.resume(10);
        assert_eq!((s.next, s.live_from), (8, 11));
    }

    #[test]
    fn from_seq_is_clamped() {
        assert_eq!(NotifyStream::new(50, 5).next, 6);
        assert_eq!(NotifyStream::new(3, 5).next, 3);
    }
}
