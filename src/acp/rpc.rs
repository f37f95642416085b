//! One ACP connection as its client keeps it, sans IO: the ids of the
//! requests it sent and what each answer means, and what each line from
//! the agent is. The agent's own requests are typed here too: bmx offers
//! agents no file system or terminal (`clientCapabilities` all false), so
//! the only one it serves is `session/request_permission`; others get
//! -32601.

use super::schema;
use serde_json::{json, Value};
use std::collections::HashMap;

pub const PROTOCOL_VERSION: u16 = 1;

/// What a request of ours was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Initialize,
    NewSession,
    LoadSession,
    Prompt,
}

/// One line from the agent.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// The answer to one of our requests.
    Answer {
        call: Call,
        result: Result<Value, String>,
    },
    /// `session/update` (checked against the schema): its `update`.
    Update { session_id: String, update: Value },
    /// `session/request_permission`: answer with [`Client::permission`].
    Permission {
        id: Value,
        request: Box<schema::RequestPermissionRequest>,
    },
    /// A request bmx does not serve: send `reply` back.
    Refused { reply: String },
    /// Not JSON-RPC, or an answer to nothing: logged, dropped.
    Garbage(&'static str),
}

#[derive(Default)]
pub struct Client {
    next: u64,
    pending: HashMap<u64, Call>,
}

impl Client {
    pub fn new() -> Self {
        Client::default()
    }

    fn request(&mut self, call: Call, method: &str, params: Value) -> String {
        self.next += 1;
        self.pending.insert(self.next, call);
        json!({"jsonrpc": "2.0", "id": self.next, "method": method, "params": params}).to_string()
    }

    pub fn initialize(&mut self) -> String {
        self.request(
            Call::Initialize,
            "initialize",
            json!({
                "protocolVersion": PROTOCOL_VERSION,
                "clientCapabilities": {"fs": {"readTextFile": false, "writeTextFile": false}, "terminal": false},
                "clientInfo": {"name": "bmx", "version": env!("CARGO_PKG_VERSION")},
            }),
        )
    }

    pub fn new_session(&mut self, cwd: &str) -> String {
        self.request(
            Call::NewSession,
            "session/new",
            json!({"cwd": cwd, "mcpServers": []}),
        )
    }

    pub fn load_session(&mut self, session_id: &str, cwd: &str) -> String {
        self.request(
            Call::LoadSession,
            "session/load",
            json!({"sessionId": session_id, "cwd": cwd, "mcpServers": []}),
        )
    }

    pub fn prompt(&mut self, session_id: &str, text: &str) -> String {
        self.request(
            Call::Prompt,
            "session/prompt",
            json!({"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}),
        )
    }

    pub fn cancel(session_id: &str) -> String {
        json!({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": session_id}})
            .to_string()
    }

    /// The answer to a permission request: the option picked, or
    /// `cancelled` when none is (the turn was canceled).
    pub fn permission(id: &Value, option_id: Option<&str>) -> String {
        let outcome = match option_id {
            Some(o) => json!({"outcome": "selected", "optionId": o}),
            None => json!({"outcome": "cancelled"}),
        };
        json!({"jsonrpc": "2.0", "id": id, "result": {"outcome": outcome}}).to_string()
    }

    /// The connection is gone: the requests it will never answer.
    pub fn closed(&mut self) -> Vec<Call> {
        self.pending.drain().map(|(_, c)| c).collect()
    }

    pub fn on_line(&mut self, line: &str) -> Incoming {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            return Incoming::Garbage("not JSON");
        };
        if v["jsonrpc"] != "2.0" {
            return Incoming::Garbage("not JSON-RPC 2.0");
        }
        match (v.get("method").and_then(Value::as_str), v.get("id")) {
            (None, Some(id)) => {
                let Some(call) = id.as_u64().and_then(|n| self.pending.remove(&n)) else {
                    return Incoming::Garbage("an answer to no request");
                };
                let result = match (v.get("result"), v.get("error")) {
                    (_, Some(e)) => Err(e["message"].as_str().unwrap_or("error").to_owned()),
                    (Some(r), None) => Ok(r.clone()),
                    (None, None) => Ok(Value::Null),
                };
                Incoming::Answer { call, result }
            }
            (Some("session/update"), None) => {
                match serde_json::from_value::<schema::SessionNotification>(v["params"].clone()) {
                    Ok(n) => Incoming::Update {
                        session_id: n.session_id.0.to_string(),
                        update: v["params"]["update"].clone(),
                    },
                    Err(_) => Incoming::Garbage("session/update that does not fit the schema"),
                }
            }
            (Some("session/request_permission"), Some(id)) => {
                match serde_json::from_value::<schema::RequestPermissionRequest>(v["params"].clone()) {
                    Ok(r) => Incoming::Permission {
                        id: id.clone(),
                        request: Box::new(r),
                    },
                    Err(e) => Incoming::Refused {
                        reply: json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32602, "message": e.to_string()}}).to_string(),
                    },
                }
            }
            (Some(method), Some(id)) => Incoming::Refused {
                reply: json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601,
                    "message": format!("bmx does not offer {method} to agents")}})
                .to_string(),
            },
            (Some(_), None) => Incoming::Garbage("a notification bmx does not use"),
            (None, None) => Incoming::Garbage("neither request nor answer"),
        }
    }
}

/// The options of a `session/request_permission` request: optionId by
/// kind (`allow_once`, `allow_always`, `reject_once`, `reject_always`).
/// Shared by the executor's turns and the visor's wire sessions.
pub fn option_kinds(request: &Value) -> HashMap<String, String> {
    request["options"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|o| {
                    Some((
                        o["kind"].as_str()?.to_owned(),
                        o["optionId"].as_str()?.to_owned(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The option that says `allow` (for good when `always`, else once
/// first) or no, from [`option_kinds`]; `None` when the agent offered no
/// such option (answer `cancelled`).
pub fn pick_option(options: &HashMap<String, String>, allow: bool, always: bool) -> Option<String> {
    let kinds: &[&str] = match (allow, always) {
        (true, true) => &["allow_always", "allow_once"],
        (true, false) => &["allow_once", "allow_always"],
        (false, _) => &["reject_once", "reject_always"],
    };
    kinds.iter().find_map(|k| options.get(*k).cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_updates_and_requests() {
        let mut c = Client::new();
        let init: Value = serde_json::from_str(&c.initialize()).unwrap();
        assert_eq!(init["method"], "initialize");
        let a = c.on_line(&format!(
            r#"{{"jsonrpc":"2.0","id":{},"result":{{"protocolVersion":1}}}}"#,
            init["id"]
        ));
        assert!(matches!(
            a,
            Incoming::Answer {
                call: Call::Initialize,
                result: Ok(_)
            }
        ));
        assert!(matches!(
            c.on_line(r#"{"jsonrpc":"2.0","id":99,"result":{}}"#),
            Incoming::Garbage(_)
        ));
        let u = c.on_line(r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi"}}}}"#);
        assert!(
            matches!(u, Incoming::Update { ref session_id, .. } if session_id == "s"),
            "{u:?}"
        );
        assert!(matches!(
            c.on_line(r#"{"jsonrpc":"2.0","method":"session/update","params":{"nope":1}}"#),
            Incoming::Garbage(_)
        ));
        let p = c.on_line(r#"{"jsonrpc":"2.0","id":5,"method":"session/request_permission","params":{"sessionId":"s","toolCall":{"toolCallId":"t"},"options":[{"optionId":"a","name":"Allow","kind":"allow_once"}]}}"#);
        assert!(matches!(p, Incoming::Permission { .. }), "{p:?}");
        let r = c.on_line(r#"{"jsonrpc":"2.0","id":6,"method":"fs/read_text_file","params":{}}"#);
        assert!(matches!(r, Incoming::Refused { ref reply } if reply.contains("-32601")));
        assert!(matches!(c.on_line("garbage"), Incoming::Garbage(_)));
        let _ = c.prompt("s", "x");
        assert_eq!(c.closed(), vec![Call::Prompt]);
    }
}
