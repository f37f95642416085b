//! From ACP `session/update` notifications to bmx session events.
//!
//! Text arrives in chunks. Each run of chunks of one kind (the agent's
//! message, its thinking) is one event: every chunk goes out at once as a
//! delta (`session.event_delta`, best effort) and the whole text as the
//! final event (`agent.message` / `agent.thinking`, delivered until
//! acknowledged) when the run ends: another kind of update comes, a
//! message grows past [`MAX_TEXT`], or the turn ends. Tool calls become
//! `agent.tool_use`, their completion `agent.tool_result`.

use serde_json::{json, Value};

/// Text kept for one event before it is cut into the next.
pub const MAX_TEXT: usize = 256 << 10;

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
    index: u64,
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

    fn close(&mut self) -> Option<Emit> {
        let open = self.open.take()?;
        Some(Emit::Event {
            event_id: open.event_id,
            event: json!({"type": open.kind.event_type(), "text": open.text}),
        })
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
            });
        }
        if let Some(open) = self.open.as_mut() {
            open.text.push_str(text);
            out.push(Emit::Delta {
                event_id: open.event_id.clone(),
                event_type: kind.event_type(),
                index: open.index,
                text: text.to_owned(),
            });
            open.index += 1;
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
        let text = || update["content"]["text"].as_str().unwrap_or("");
        match update["sessionUpdate"].as_str().unwrap_or("") {
            "agent_message_chunk" => self.text(Kind::Message, text()),
            "agent_thought_chunk" => self.text(Kind::Thinking, text()),
            "tool_call" => {
                let mut out: Vec<Emit> = self.close().into_iter().collect();
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
                    let mut out: Vec<Emit> = self.close().into_iter().collect();
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
        let mut out: Vec<Emit> = self.close().into_iter().collect();
        out.push(
            self.event(
                json!({"type": "session.error", "error": {"type": kind, "message": message}}),
            ),
        );
        out
    }

    /// The turn ended: what is open, then `session.status_idle`.
    pub fn idle(&mut self, stop_reason: &str, outcome: &str) -> Vec<Emit> {
        let mut out: Vec<Emit> = self.close().into_iter().collect();
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
}
