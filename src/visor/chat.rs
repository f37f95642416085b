//! A wire session's conversation, sans IO: the chat view's turns, the
//! pending requests, the messages held for the next idle, the vendor id.
//!
//! It outlives one run of the agent (it sits in the session's record), so
//! held messages and the vendor id survive a restart. Every part is
//! bounded: [`MAX_TURNS`] turns and [`MAX_CHAT_BYTES`] of their text (the
//! oldest go first), [`MAX_PENDING`] open requests, [`MAX_HELD`] held
//! messages.
//!
//! [`events`] maps what [`crate::acp::updates::TurnEvents`] makes of the
//! agent's updates (the executor's mapping, reused) to the visor's event
//! types (VISOR.md §3).

use crate::acp::updates::Emit;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};

/// Turns kept for the chat view.
pub const MAX_TURNS: usize = 512;
/// Text of the kept turns.
pub const MAX_CHAT_BYTES: usize = 1 << 20;
/// Requests open at once.
pub const MAX_PENDING: usize = 64;
/// Messages held for the next idle.
pub const MAX_HELD: usize = 64;
/// Answered request ids remembered (to tell 409 from 404).
const ANSWERED: usize = 256;

/// One entry of the chat view (VISOR.md §4 `turns`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTurn {
    pub seq: u64,
    /// `user`, `assistant`, `tool` or `result`.
    pub role: &'static str,
    pub text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool: Option<Value>,
}

/// A request of the agent waiting for `answer`.
#[derive(Debug, Clone)]
pub struct Pending {
    /// `Request` as clients see it (`{id, kind, tool?, input?, options?}`).
    pub view: Value,
    pub id: String,
    /// The JSON-RPC id of the agent's request.
    pub rpc_id: Value,
    /// optionId by option kind (`allow_once`, `reject_once`, …).
    pub options: HashMap<String, String>,
}

/// Why `answer` was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerError {
    Unknown,
    Answered,
}

#[derive(Debug, Default)]
pub struct Conversation {
    turns: VecDeque<ChatTurn>,
    bytes: usize,
    pending: Vec<Pending>,
    answered: VecDeque<String>,
    held: VecDeque<String>,
    pub vendor_id: Option<String>,
    /// Prompts sent to the agent.
    pub prompts: u64,
    next_request: u64,
}

impl Conversation {
    pub fn push(&mut self, turn: ChatTurn) {
        self.bytes += turn.text.len();
        self.turns.push_back(turn);
        while self.turns.len() > MAX_TURNS || (self.bytes > MAX_CHAT_BYTES && self.turns.len() > 1)
        {
            if let Some(t) = self.turns.pop_front() {
                self.bytes -= t.text.len();
            }
        }
    }

    /// A tool's later status and output: on its turn, and as the tool
    /// object to publish (with the name and kind its first event gave).
    pub fn tool_update(&mut self, id: &Value, status: &Value, output: Option<&Value>) -> Value {
        let mut tool = json!({"id": id, "status": status});
        if let Some(t) = self
            .turns
            .iter_mut()
            .rev()
            .filter_map(|t| t.tool.as_mut())
            .find(|t| &t["id"] == id)
        {
            t["status"] = status.clone();
            tool["name"] = t["name"].clone();
            tool["kind"] = t["kind"].clone();
        }
        if let Some(o) = output {
            tool["output"] = o.clone();
        }
        tool
    }

    /// Turns with `seq > after`, oldest first.
    pub fn turns_after(&self, after: u64) -> Vec<ChatTurn> {
        self.turns
            .iter()
            .filter(|t| t.seq > after)
            .cloned()
            .collect()
    }

    pub fn last_seq(&self) -> u64 {
        self.turns.back().map_or(0, |t| t.seq)
    }

    pub fn pending_views(&self) -> Vec<Value> {
        self.pending.iter().map(|p| p.view.clone()).collect()
    }

    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Open a request; `None` when [`MAX_PENDING`] are open.
    pub fn open(&mut self, rpc_id: Value, request: &Value) -> Option<Pending> {
        if self.pending.len() >= MAX_PENDING {
            return None;
        }
        self.next_request += 1;
        let id = format!("r-{}", self.next_request);
        let call = &request["toolCall"];
        let mut view = json!({
            "id": id,
            "kind": "permission",
            "tool": {"id": call["toolCallId"], "name": call["title"], "kind": call["kind"]},
            "options": request["options"].as_array().map(|a| a.iter().map(|o| json!({
                "id": o["optionId"], "name": o["name"], "kind": o["kind"]})).collect::<Vec<_>>()),
        });
        if let Some(input) = call.get("rawInput") {
            view["input"] = input.clone();
        }
        let p = Pending {
            view,
            id,
            rpc_id,
            options: crate::acp::rpc::option_kinds(request),
        };
        self.pending.push(p.clone());
        Some(p)
    }

    /// Open a request whose id and view someone else chose (an executor's
    /// held tool call, `visor::confirm`); `false` when [`MAX_PENDING`] are
    /// open or the id is open already.
    pub fn open_as(&mut self, id: String, view: Value) -> bool {
        if self.pending.len() >= MAX_PENDING || self.pending.iter().any(|p| p.id == id) {
            return false;
        }
        self.pending.push(Pending {
            view,
            id,
            rpc_id: Value::Null,
            options: HashMap::new(),
        });
        true
    }

    /// Whether `id` was closed lately (the last 256 closed).
    pub fn was_closed(&self, id: &str) -> bool {
        self.answered.iter().any(|a| a == id)
    }

    /// Close a request (answered, expired, withdrawn).
    ///
    /// # Errors
    /// [`AnswerError::Answered`] for one closed before (as far as the last
    /// 256 go), else [`AnswerError::Unknown`].
    pub fn close(&mut self, id: &str) -> Result<Pending, AnswerError> {
        match self.pending.iter().position(|p| p.id == id) {
            Some(i) => {
                let p = self.pending.remove(i);
                self.answered.push_back(p.id.clone());
                if self.answered.len() > ANSWERED {
                    self.answered.pop_front();
                }
                Ok(p)
            }
            None if self.answered.iter().any(|a| a == id) => Err(AnswerError::Answered),
            None => Err(AnswerError::Unknown),
        }
    }

    /// Every open request, closed.
    pub fn close_all(&mut self) -> Vec<Pending> {
        let ids: Vec<String> = self.pending.iter().map(|p| p.id.clone()).collect();
        ids.iter().filter_map(|id| self.close(id).ok()).collect()
    }

    /// Hold a message for the next idle; `false` when [`MAX_HELD`] are.
    pub fn hold(&mut self, text: String) -> bool {
        if self.held.len() >= MAX_HELD {
            return false;
        }
        self.held.push_back(text);
        true
    }

    pub fn next_held(&mut self) -> Option<String> {
        self.held.pop_front()
    }

    pub fn held(&self) -> usize {
        self.held.len()
    }
}

/// A visor event (`type`, fields) and, for a final one, its chat turn
/// (its `seq` is filled in once the event is numbered).
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    pub kind: &'static str,
    pub fields: Value,
    pub turn: Option<ChatTurn>,
    /// A tool's later status: `(id, status, output)` to fold into its turn.
    pub tool_update: Option<(Value, Value, Option<Value>)>,
}

fn mapped(kind: &'static str, fields: Value) -> Mapped {
    Mapped {
        kind,
        fields,
        turn: None,
        tool_update: None,
    }
}

fn chat(role: &'static str, text: String, tool: Option<Value>) -> Option<ChatTurn> {
    Some(ChatTurn {
        seq: 0,
        role,
        text,
        tool,
    })
}

/// The visor's events for what the executor's mapping made of a batch of
/// updates: streamed text as `assistant`/`thought` with `delta: true`, the
/// whole text as the same type with `delta: false`, tool calls as `tool`,
/// a failed turn as `error`. The turn's start and end are the wire
/// session's own (`user`, `result`), so the mapping's status events are
/// dropped.
pub fn events(emits: Vec<Emit>) -> Vec<Mapped> {
    let mut out = Vec::new();
    for e in emits {
        match e {
            Emit::Delta {
                event_type, text, ..
            } => {
                let kind = if event_type == "agent.thinking" {
                    "thought"
                } else {
                    "assistant"
                };
                out.push(mapped(kind, json!({"text": text, "delta": true})));
            }
            Emit::Event { event, .. } => match event["type"].as_str().unwrap_or("") {
                "agent.message" => {
                    let text = event["text"].as_str().unwrap_or("").to_owned();
                    let mut m = mapped("assistant", json!({"text": text, "delta": false}));
                    m.turn = chat("assistant", text, None);
                    out.push(m);
                }
                "agent.thinking" => out.push(mapped(
                    "thought",
                    json!({"text": event["text"], "delta": false}),
                )),
                "agent.tool_use" => {
                    let mut tool = json!({"id": event["toolUseId"], "name": event["name"],
                        "kind": event.get("kind").cloned().unwrap_or(Value::Null), "status": "pending"});
                    if let Some(input) = event.get("input") {
                        tool["input"] = input.clone();
                    }
                    let name = event["name"].as_str().unwrap_or("tool").to_owned();
                    let mut m = mapped("tool", json!({"tool": tool.clone()}));
                    m.turn = chat("tool", name, Some(tool));
                    out.push(m);
                }
                "agent.tool_result" => {
                    let mut m = mapped("tool", Value::Null);
                    m.tool_update = Some((
                        event["toolUseId"].clone(),
                        event["status"].clone(),
                        event.get("content").cloned(),
                    ));
                    out.push(m);
                }
                "session.error" => {
                    out.push(mapped("error", json!({"error": event["error"]["message"]})))
                }
                _ => {}
            },
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acp::updates::TurnEvents;

    fn chunk(kind: &str, text: &str) -> Value {
        json!({"sessionUpdate": kind, "content": {"type": "text", "text": text}})
    }

    #[test]
    fn updates_become_visor_events() {
        let mut t = TurnEvents::new("t1");
        let mut e = t.updates(&[
            chunk("agent_thought_chunk", "hmm"),
            chunk("agent_message_chunk", "Hel"),
            chunk("agent_message_chunk", "lo"),
        ]);
        e.extend(
            t.update(&json!({"sessionUpdate": "tool_call", "toolCallId": "c1",
            "title": "read", "kind": "read", "rawInput": {"path": "a"}})),
        );
        e.extend(t.update(&json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed"})));
        e.extend(t.idle("end_turn", "completed"));
        let m = events(e);
        let kinds: Vec<(&str, bool)> = m
            .iter()
            .map(|m| (m.kind, m.fields["delta"] == true))
            .collect();
        assert_eq!(
            kinds,
            [
                ("thought", true),
                ("thought", false),
                ("assistant", true),
                ("assistant", false),
                ("tool", false),
                ("tool", false)
            ]
        );
        assert_eq!(m[1].fields["text"], "hmm");
        assert_eq!(m[2].fields["text"], "Hello");
        assert_eq!(m[3].turn.as_ref().unwrap().text, "Hello");
        assert_eq!(m[4].fields["tool"]["input"]["path"], "a");
        assert!(m[5].tool_update.is_some());
    }

    #[test]
    fn requests_open_close_and_are_bounded() {
        let mut c = Conversation::default();
        let req = json!({"sessionId": "s", "toolCall": {"toolCallId": "t", "title": "write", "rawInput": {"p": 1}},
            "options": [{"optionId": "a", "name": "Allow", "kind": "allow_once"}]});
        let p = c.open(json!(7), &req).unwrap();
        assert_eq!(p.view["input"]["p"], 1);
        assert_eq!(p.options["allow_once"], "a");
        assert_eq!(c.close(&p.id).unwrap().rpc_id, json!(7));
        assert_eq!(c.close(&p.id).unwrap_err(), AnswerError::Answered);
        assert_eq!(c.close("r-99").unwrap_err(), AnswerError::Unknown);
        for i in 0..MAX_PENDING {
            assert!(c.open(json!(i), &req).is_some());
        }
        assert!(c.open(json!(0), &req).is_none());
        assert_eq!(c.close_all().len(), MAX_PENDING);
        assert_eq!(c.pending_count(), 0);
    }

    #[test]
    fn the_chat_is_bounded() {
        let mut c = Conversation::default();
        for seq in 1..=(MAX_TURNS as u64 + 10) {
            c.push(ChatTurn {
                seq,
                role: "user",
                text: "x".into(),
                tool: None,
            });
        }
        assert_eq!(c.turns_after(0).len(), MAX_TURNS);
        assert_eq!(c.turns_after(0)[0].seq, 11);
        c.push(ChatTurn {
            seq: 10_000,
            role: "assistant",
            text: "y".repeat(MAX_CHAT_BYTES),
            tool: None,
        });
        assert_eq!(c.turns_after(0).len(), 1);
        for _ in 0..MAX_HELD {
            assert!(c.hold("m".into()));
        }
        assert!(!c.hold("m".into()));
        assert_eq!(c.next_held().as_deref(), Some("m"));
    }
}
