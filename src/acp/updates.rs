//! From ACP `session/update` notifications to bmx session events.
//!
//! Text arrives in chunks. Each run of chunks of one kind (the agent's
//! message, its thinking) is one event: every chunk goes out at once as a
//! delta (`session.event_delta`, best effort) and the whole text as the
//! final event (`agent.message` / `agent.thinking`, delivered until
//! acknowledged) when the run ends: another kind of update comes, a
//! message grows past [`MAX_TEXT`], or the turn ends. Tool calls become
//! `agent.tool_use`, their completion `agent.tool_result`.
//!
//! Chunks that arrive together (one read of the agent's pipe, see
//! [`TurnEvents::updates`]) go out as **one** delta with their texts
//! joined, up to [`MAX_DELTA`]: when the agent writes faster than the
//! platform reads, per-delta costs (an actor hop, a WebSocket frame, an SSE
//! event) would otherwise cap the rate; when it writes slowly, every batch
//! is one chunk and nothing waits. `index` counts the deltas of an event
//! (0, 1, 2, …), so a gap in it is a lost delta.

use serde_json::{json, Value};

/// Text kept for one event before it is cut into the next.
pub const MAX_TEXT: usize = 256 << 10;

/// Text joined into one delta at most (chunks of one batch merge up to it).
pub const MAX_DELTA: usize = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Message,
    Thinking,
}

impl Kind {
    fn event_type(self) -> &'static str {
        match self {
            Kind::Message => "agent.message",
            Kind::Thinking => "agent.thinking",
        }
    }
}

struct Open {
    kind: Kind,
    event_id: String,
    text: String,
    /// The next delta's index.
    index: u64,
    /// Text of this batch not yet sent as a delta.
    pending: String,
}

impl Open {
    /// Send what is pending as one delta.
    fn flush(&mut self, out: &mut Vec<Emit>) {
        if self.pending.is_empty() {
            return;
        }
        out.push(Emit::Delta {
            event_id: self.event_id.clone(),
            event_type: self.kind.event_type(),
            index: self.index,
            text: std::mem::take(&mut self.pending),
        });
        self.index += 1;
    }
}

/// What to send.
#[derive(Debug, Clone, PartialEq)]
pub enum Emit {
    /// A final event (`session.event`), with its id.
    Event { event_id: String, event: Value },
    /// Streamed text of the event `event_id` (`session.event_delta`).
    Delta {
        event_id: String,
        event_type: &'static str,
        index: u64,
        text: String,
    },
}

/// The events of one turn.
pub struct TurnEvents {
    turn_id: String,
    next: u64,
    open: Option<Open>,
}

impl TurnEvents {
    pub fn new(turn_id: &str) -> Self {
        TurnEvents {
            turn_id: turn_id.to_owned(),
            next: 0,
            open: None,
        }
    }

    fn event_id(&mut self) -> String {
        self.next += 1;
        format!("{}.{}", self.turn_id, self.next)
    }

    fn event(&mut self, event: Value) -> Emit {
        Emit::Event {
            event_id: self.event_id(),
            event,
        }
    }

    /// End the open event: its pending delta, then the final event.
    fn close(&mut self) -> Vec<Emit> {
        let mut out = Vec::new();
        if let Some(mut open) = self.open.take() {
            open.flush(&mut out);
            out.push(Emit::Event {
                event_id: open.event_id,
                event: json!({"type": open.kind.event_type(), "text": open.text}),
            });
        }
        out
    }

    fn text(&mut self, kind: Kind, text: &str) -> Vec<Emit> {
        let mut out = Vec::new();
        let fits = self
            .open
            .as_ref()
            .is_some_and(|o| o.kind == kind && o.text.len() + text.len() <= MAX_TEXT);
        if !fits {
            out.extend(self.close());
            let event_id = self.event_id();
            self.open = Some(Open {
                kind,
                event_id,
                text: String::new(),
                index: 0,
                pending: String::new(),
            });
        }
        if let Some(open) = self.open.as_mut() {
            if open.pending.len() + text.len() > MAX_DELTA {
                open.flush(&mut out);
            }
            open.text.push_str(text);
            open.pending.push_str(text);
        }
        out
    }

    /// The turn started.
    pub fn running(&mut self) -> Vec<Emit> {
        vec![self.event(json!({"type": "session.status_running"}))]
    }

    /// One `session/update` (its `update` member, already checked against
    /// the ACP schema by the caller).
    pub fn update(&mut self, update: &Value) -> Vec<Emit> {
        self.updates(std::slice::from_ref(update))
    }

    /// Updates that arrived together, in order: the text chunks among them
    /// that follow one another in one event go out as one delta.
    pub fn updates(&mut self, updates: &[Value]) -> Vec<Emit> {
        let mut out = Vec::new();
        for u in updates {
            out.extend(self.apply(u));
        }
        if let Some(open) = self.open.as_mut() {
            open.flush(&mut out);
        }
        out
    }

    fn apply(&mut self, update: &Value) -> Vec<Emit> {
        let text = || update["content"]["text"].as_str().unwrap_or("");
        match update["sessionUpdate"].as_str().unwrap_or("") {
            "agent_message_chunk" => self.text(Kind::Message, text()),
            "agent_thought_chunk" => self.text(Kind::Thinking, text()),
            "tool_call" => {
                let mut out = self.close();
                let mut event = json!({
                    "type": "agent.tool_use",
                    "toolUseId": update["toolCallId"],
                    "name": update["title"],
                });
                if let Some(kind) = update.get("kind") {
                    event["kind"] = kind.clone();
                }
                if let Some(input) = update.get("rawInput") {
                    event["input"] = input.clone();
                }
                out.push(self.event(event));
                out
            }
            "tool_call_update" => match update["status"].as_str() {
                Some(status @ ("completed" | "failed")) => {
                    let mut out = self.close();
                    let mut event = json!({
                        "type": "agent.tool_result",
                        "toolUseId": update["toolCallId"],
                        "status": status,
                    });
                    if let Some(content) = update.get("content") {
                        event["content"] = content.clone();
                    }
                    out.push(self.event(event));
                    out
                }
                _ => Vec::new(),
            },
            // Plans, modes, commands, usage: not session events.
            _ => Vec::new(),
        }
    }

    /// The turn failed (the agent crashed, refused, garbled).
    pub fn error(&mut self, kind: &str, message: &str) -> Vec<Emit> {
        let mut out = self.close();
        out.push(
            self.event(
                json!({"type": "session.error", "error": {"type": kind, "message": message}}),
            ),
        );
        out
    }

    /// The turn ended: what is open, then `session.status_idle`.
    pub fn idle(&mut self, stop_reason: &str, outcome: &str) -> Vec<Emit> {
        let mut out = self.close();
        out.push(self.event(json!({
            "type": "session.status_idle",
            "stopReason": {"type": stop_reason},
            "turnOutcome": outcome,
        })));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(kind: &str, text: &str) -> Value {
        json!({"sessionUpdate": kind, "content": {"type": "text", "text": text}})
    }

    #[test]
    fn chunks_stream_as_deltas_and_end_as_one_event() {
        let mut t = TurnEvents::new("t1");
        let mut out = t.running();
        out.extend(t.update(&chunk("agent_thought_chunk", "hmm")));
        out.extend(t.update(&chunk("agent_message_chunk", "Hel")));
        out.extend(t.update(&chunk("agent_message_chunk", "lo")));
        out.extend(
            t.update(&json!({"sessionUpdate": "tool_call", "toolCallId": "c1",
            "title": "read", "kind": "read", "status": "pending", "rawInput": {"path": "a"}})),
        );
        out.extend(t.update(&json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "in_progress"})));
        out.extend(t.update(&json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed"})));
        out.extend(t.update(&chunk("agent_message_chunk", "done")));
        out.extend(t.idle("end_turn", "completed"));
        let finals: Vec<Value> = out
            .iter()
            .filter_map(|e| match e {
                Emit::Event { event, .. } => Some(event.clone()),
                _ => None,
            })
            .collect();
        let types: Vec<&str> = finals.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            [
                "session.status_running",
                "agent.thinking",
                "agent.message",
                "agent.tool_use",
                "agent.tool_result",
                "agent.message",
                "session.status_idle"
            ]
        );
        assert_eq!(finals[2]["text"], "Hello");
        assert_eq!(finals[3]["input"]["path"], "a");
        let deltas: Vec<(String, u64)> = out
            .iter()
            .filter_map(|e| match e {
                Emit::Delta {
                    event_id, index, ..
                } => Some((event_id.clone(), *index)),
                _ => None,
            })
            .collect();
        // The deltas of "Hello" carry the id of its final event, in order.
        let hello = out
            .iter()
            .find_map(|e| match e {
                Emit::Event { event_id, event } if event["text"] == "Hello" => {
                    Some(event_id.clone())
                }
                _ => None,
            })
            .unwrap();
        assert_eq!(deltas[1], (hello.clone(), 0));
        assert_eq!(deltas[2], (hello, 1));
    }

    #[test]
    fn a_long_message_is_cut() {
        let mut t = TurnEvents::new("t");
        let big = "x".repeat(MAX_TEXT / 2 + 1);
        let mut out = t.update(&chunk("agent_message_chunk", &big));
        out.extend(t.update(&chunk("agent_message_chunk", &big)));
        out.extend(t.idle("end_turn", "completed"));
        let texts = out
            .iter()
            .filter(|e| matches!(e, Emit::Event { event, .. } if event["type"] == "agent.message"))
            .count();
        assert_eq!(texts, 2);
    }

    #[test]
    fn chunks_that_arrive_together_are_one_delta() {
        let mut t = TurnEvents::new("t");
        let batch: Vec<Value> = ["a", "b", "c"]
            .iter()
            .map(|x| chunk("agent_message_chunk", x))
            .collect();
        let out = t.updates(&batch);
        assert_eq!(
            out,
            [Emit::Delta {
                event_id: "t.1".into(),
                event_type: "agent.message",
                index: 0,
                text: "abc".into()
            }]
        );
        // The next batch's delta is the event's second.
        let out = t.update(&chunk("agent_message_chunk", "d"));
        assert!(matches!(&out[..], [Emit::Delta { index: 1, text, .. }] if text == "d"));
        // A tool call in the middle of a batch ends the run before it.
        let out = t.updates(&[
            chunk("agent_message_chunk", "e"),
            json!({"sessionUpdate": "tool_call", "toolCallId": "c", "title": "x"}),
            chunk("agent_message_chunk", "f"),
        ]);
        let kinds: Vec<String> = out
            .iter()
            .map(|e| match e {
                Emit::Delta { text, .. } => format!("delta {text}"),
                Emit::Event { event, .. } => format!("{} {}", event["type"], event["text"]),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "delta e",
                "\"agent.message\" \"abcde\"",
                "\"agent.tool_use\" null",
                "delta f"
            ]
        );
    }

    #[test]
    fn a_big_batch_is_cut_into_deltas_of_at_most_max_delta() {
        let mut t = TurnEvents::new("t");
        let piece = "y".repeat(1000);
        let batch: Vec<Value> = (0..200)
            .map(|_| chunk("agent_message_chunk", &piece))
            .collect();
        let out = t.updates(&batch);
        assert!(out.len() > 1);
        for e in &out {
            match e {
                Emit::Delta { text, .. } => assert!(text.len() <= MAX_DELTA),
                Emit::Event { .. } => panic!("no final event yet"),
            }
        }
    }

    mod batching {
        use super::*;
        use proptest::prelude::*;

        fn update() -> impl Strategy<Value = Value> {
            prop_oneof![
                4 => "[a-z]{0,5}".prop_map(|t| chunk("agent_message_chunk", &t)),
                2 => "[a-z]{0,5}".prop_map(|t| chunk("agent_thought_chunk", &t)),
                1 => Just(json!({"sessionUpdate": "tool_call", "toolCallId": "c", "title": "x"})),
                1 => Just(json!({"sessionUpdate": "plan"})),
            ]
        }

        proptest! {
            /// However the updates are batched, the final events are the
            /// same; each event's deltas come before it, with indexes 0, 1,
            /// 2, … and texts that join into its text.
            #[test]
            fn batching_changes_only_how_many_deltas(
                updates in prop::collection::vec(update(), 0..40),
                cuts in prop::collection::vec(1usize..6, 0..40),
            ) {
                let mut one = TurnEvents::new("t");
                let mut singles = Vec::new();
                for u in &updates {
                    singles.extend(one.update(u));
                }
                singles.extend(one.idle("end_turn", "completed"));
                let mut many = TurnEvents::new("t");
                let mut batched = Vec::new();
                let mut rest = &updates[..];
                let mut cuts = cuts.iter().cycle();
                while !rest.is_empty() {
                    let n = (*cuts.next().unwrap_or(&1)).min(rest.len());
                    batched.extend(many.updates(&rest[..n]));
                    rest = &rest[n..];
                }
                batched.extend(many.idle("end_turn", "completed"));
                let finals = |v: &[Emit]| -> Vec<Emit> {
                    v.iter().filter(|e| matches!(e, Emit::Event { .. })).cloned().collect()
                };
                prop_assert_eq!(finals(&singles), finals(&batched));
                let mut streamed: std::collections::HashMap<String, (u64, String)> = Default::default();
                for e in &batched {
                    match e {
                        Emit::Delta { event_id, index, text, .. } => {
                            let s = streamed.entry(event_id.clone()).or_default();
                            prop_assert_eq!(*index, s.0);
                            s.0 += 1;
                            s.1.push_str(text);
                        }
                        Emit::Event { event_id, event } => {
                            if let Some(text) = event["text"].as_str() {
                                let s = streamed.remove(event_id).unwrap_or_default();
                                prop_assert_eq!(s.1.as_str(), text);
                            }
                        }
                    }
                }
                prop_assert!(streamed.is_empty(), "deltas after their event: {:?}", streamed);
            }
        }
    }
}
