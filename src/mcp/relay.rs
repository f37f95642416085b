//! One MCP server connection as the executor relays it, sans IO.
//!
//! The executor is the server's one MCP client: it sends `initialize`
//! itself when the server starts (so `session.ready` can wait for it and a
//! restarted server is ready before anyone asks), then relays the
//! harness's messages. Any number of harness clients share the server:
//! their `initialize` is answered from the cached result and their
//! `notifications/initialized` is not repeated; their request ids are
//! forwarded unchanged (the harness keeps them unique per server), except
//! ids starting with [`OWN_PREFIX`], which are the executor's.
//!
//! Every client request is kept in flight until its answer passes through,
//! so nothing is ever left unanswered: a crash answers each with -32603
//! "server restarted" (a request's deadline is the transport's or the
//! harness's, not the relay's). The relay answers the
//! server's own requests (`ping`; anything else is refused: bmx offers
//! servers no sampling, roots or elicitation).

use super::message::{self, code, Envelope, Kind};
use std::collections::HashSet;

/// Ids the executor uses for its own requests to the server.
pub const OWN_PREFIX: &str = "bmx:";
/// The id of the executor's own `initialize`, as JSON text.
pub const INIT_ID: &str = "\"bmx:init\"";

#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Requests in flight at once; more are refused (not queued).
    pub max_in_flight: usize,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            max_in_flight: 1024,
        }
    }
}

/// What the relay wants done, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    /// Write this message to the server.
    ToServer(String),
    /// Write this client request (now in flight, id as JSON text) to the
    /// server; a transport that cannot take it hands the id back to
    /// [`Relay::undeliverable`].
    Request { id: String, message: String },
    /// Send this answer to the harness (`mcp.frame`).
    ToClient(String),
    /// Send this server notification to the harness, if its channel is open.
    Notify(String),
    /// The server answered `initialize`: it is ready.
    Initialized,
    /// The server refused `initialize` (or answered nonsense).
    InitFailed(String),
    /// Nothing to send; worth a log line (never the payload).
    Dropped(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Initializing,
    Ready,
    Closed,
}

pub struct Relay {
    config: RelayConfig,
    phase: Phase,
    /// The server's `initialize` result, as JSON text.
    init: Option<String>,
    /// Ids (JSON text) of the client requests the server has not answered.
    in_flight: HashSet<String>,
}

impl Relay {
    pub fn new(config: RelayConfig) -> Self {
        Relay {
            config,
            phase: Phase::Initializing,
            init: None,
            in_flight: HashSet::new(),
        }
    }

    /// The `initialize` request to send first.
    pub fn initialize(&self) -> String {
        let mut params = rmcp::model::InitializeRequestParams::new(
            rmcp::model::ClientCapabilities::default(),
            rmcp::model::Implementation::new("bmx", env!("CARGO_PKG_VERSION")),
        );
        params.protocol_version = rmcp::model::ProtocolVersion::LATEST_WITH_INITIALIZE;
        serde_json::json!({
            "jsonrpc": "2.0",
            "id": "bmx:init",
            "method": "initialize",
            "params": params,
        })
        .to_string()
    }

    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Ready
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The server's `initialize` result (JSON text), once ready.
    pub fn init_result(&self) -> Option<&str> {
        self.init.as_deref()
    }

    /// A message from the harness.
    pub fn from_client(&mut self, payload: &str) -> Vec<Out> {
        let env = match message::parse(payload) {
            Ok(env) => env,
            Err(e) => return vec![Out::ToClient(e.response())],
        };
        let error = |id: &str, code: i64, msg: &str, reason: &str| {
            vec![Out::ToClient(message::error_response(
                id, code, msg, reason,
            ))]
        };
        match env.kind {
            Kind::Request { id, method } => {
                if id.starts_with(&format!("\"{OWN_PREFIX}")) {
                    return error(
                        &id,
                        code::INVALID_REQUEST,
                        "ids starting with \"bmx:\" are the executor's",
                        "reserved_id",
                    );
                }
                match self.phase {
                    Phase::Ready => {}
                    Phase::Initializing => {
                        return error(
                            &id,
                            code::INTERNAL_ERROR,
                            "server starting",
                            "server_starting",
                        )
                    }
                    Phase::Closed => {
                        return error(
                            &id,
                            code::INTERNAL_ERROR,
                            "server restarted",
                            "server_crashed",
                        )
                    }
                }
                if method == "initialize" {
                    let result = self.init.as_deref().unwrap_or("{}");
                    return vec![Out::ToClient(message::result_response(&id, result))];
                }
                if self.in_flight.contains(&id) {
                    return error(
                        &id,
                        code::INVALID_REQUEST,
                        "a request with this id is already in flight",
                        "duplicate_id",
                    );
                }
                if self.in_flight.len() >= self.config.max_in_flight {
                    return error(
                        &id,
                        code::INTERNAL_ERROR,
                        "too many requests in flight to this server",
                        "busy",
                    );
                }
                self.in_flight.insert(id.clone());
                vec![Out::Request {
                    id,
                    message: payload.to_owned(),
                }]
            }
            Kind::Notification { method } => {
                if method == "notifications/initialized" {
                    return vec![Out::Dropped("initialized: the executor already sent it")];
                }
                if self.phase != Phase::Ready {
                    return vec![Out::Dropped("notification while the server is not ready")];
                }
                // `notifications/cancelled` too: the server may still answer,
                // and the request stays in flight until it does.
                vec![Out::ToServer(payload.to_owned())]
            }
            Kind::Response { .. } => {
                // The executor answers the server's requests itself.
                vec![Out::Dropped("response from the client to no request")]
            }
        }
    }

    /// A message from the server.
    pub fn from_server(&mut self, payload: &str) -> Vec<Out> {
        let env: Envelope = match message::parse(payload) {
            Ok(env) => env,
            Err(_) => return vec![Out::Dropped("server wrote something that is not JSON-RPC")],
        };
        match env.kind {
            Kind::Response { id } if id == INIT_ID => self.initialized(payload, env.is_error),
            Kind::Response { id } => {
                if self.in_flight.remove(&id) {
                    vec![Out::ToClient(payload.to_owned())]
                } else if id.starts_with(&format!("\"{OWN_PREFIX}")) {
                    vec![Out::Dropped("answer to an own request")]
                } else {
                    // Late (after a timeout) or unknown: the harness knows
                    // what to do with it better than silence would.
                    vec![Out::ToClient(payload.to_owned())]
                }
            }
            Kind::Notification { .. } => {
                if self.phase == Phase::Ready {
                    vec![Out::Notify(payload.to_owned())]
                } else {
                    // server-everything sends tools/list_changed before it
                    // answers initialize: fine, nobody has listed yet.
                    vec![Out::Dropped("notification before initialize")]
                }
            }
            Kind::Request { id, method } => {
                if method == "ping" {
                    vec![Out::ToServer(message::result_response(&id, "{}"))]
                } else {
                    vec![Out::ToServer(message::error_response(
                        &id,
                        code::METHOD_NOT_FOUND,
                        &format!("bmx does not offer {method} to MCP servers"),
                        "not_offered",
                    ))]
                }
            }
        }
    }

    fn initialized(&mut self, payload: &str, is_error: bool) -> Vec<Out> {
        if self.phase != Phase::Initializing {
            return vec![Out::Dropped("second initialize answer")];
        }
        #[derive(serde::Deserialize)]
        struct Answer<'a> {
            #[serde(borrow)]
            result: Option<&'a serde_json::value::RawValue>,
        }
        let result = serde_json::from_str::<Answer>(payload)
            .ok()
            .and_then(|a| a.result)
            .filter(|_| !is_error);
        let Some(result) = result else {
            self.phase = Phase::Closed;
            return vec![Out::InitFailed("the server refused initialize".into())];
        };
        if let Err(e) = serde_json::from_str::<rmcp::model::InitializeResult>(result.get()) {
            self.phase = Phase::Closed;
            return vec![Out::InitFailed(format!("bad initialize result: {e}"))];
        }
        self.init = Some(result.get().to_owned());
        self.phase = Phase::Ready;
        vec![
            Out::ToServer(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#.into()),
            Out::Initialized,
        ]
    }

    /// The server is gone: answer everything in flight.
    pub fn crashed(&mut self, message: &str, reason: &str) -> Vec<Out> {
        self.phase = Phase::Closed;
        let mut ids: Vec<String> = self.in_flight.drain().collect();
        ids.sort();
        ids.into_iter()
            .map(|id| {
                Out::ToClient(message::error_response(
                    &id,
                    code::INTERNAL_ERROR,
                    message,
                    reason,
                ))
            })
            .collect()
    }

    /// A request ([`Out::Request`]) the transport could not take (a full
    /// or closed stdin): answer it now.
    pub fn undeliverable(&mut self, id: &str, why: &str) -> Vec<Out> {
        self.in_flight.remove(id);
        vec![Out::ToClient(message::error_response(
            id,
            code::INTERNAL_ERROR,
            why,
            "busy",
        ))]
    }

    /// The server sent a message too large to relay; answer its request
    /// (if it was one we know) with an error instead.
    pub fn oversized(&mut self, id: Option<&str>, limit: usize) -> Vec<Out> {
        match id {
            Some(id) if self.in_flight.remove(id) => {
                vec![Out::ToClient(message::error_response(
                    id,
                    code::INTERNAL_ERROR,
                    &format!("the server's answer is larger than {limit} bytes"),
                    "payload_too_large",
                ))]
            }
            _ => vec![Out::Dropped("oversized message from the server")],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const INIT_OK: &str = r#"{"jsonrpc":"2.0","id":"bmx:init","result":{"protocolVersion":"2025-06-18","capabilities":{"tools":{}},"serverInfo":{"name":"s","version":"1"}}}"#;

    fn ready() -> Relay {
        let mut r = Relay::new(RelayConfig::default());
        let out = r.from_server(INIT_OK);
        assert!(out.contains(&Out::Initialized), "{out:?}");
        r
    }

    fn req(id: &str) -> String {
        format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{}}}}"#)
    }

    fn answer(id: &str) -> String {
        format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{}}}}"#)
    }

    fn error_of(out: &Out) -> (String, i64, String) {
        let Out::ToClient(s) = out else {
            panic!("{out:?}")
        };
        let v: serde_json::Value = serde_json::from_str(s).unwrap();
        (
            v["id"].to_string(),
            v["error"]["code"].as_i64().unwrap(),
            v["error"]["data"]["reason"].as_str().unwrap().to_owned(),
        )
    }

    #[test]
    fn the_handshake_is_the_executors_and_clients_get_the_cached_result() {
        let mut r = Relay::new(RelayConfig::default());
        let init: serde_json::Value = serde_json::from_str(&r.initialize()).unwrap();
        assert_eq!(init["method"], "initialize");
        assert_eq!(init["params"]["clientInfo"]["name"], "bmx");
        // A notification before the answer (server-everything) is fine.
        let early = r#"{"method":"notifications/tools/list_changed","jsonrpc":"2.0"}"#;
        assert!(matches!(r.from_server(early)[..], [Out::Dropped(_)]));
        let (_, code, reason) = error_of(&r.from_client(&req("1"))[0]);
        assert_eq!(
            (code, reason.as_str()),
            (code::INTERNAL_ERROR, "server_starting")
        );
        let out = r.from_server(INIT_OK);
        assert!(matches!(&out[0], Out::ToServer(s) if s.contains("notifications/initialized")));
        let out = r.from_client(r#"{"jsonrpc":"2.0","id":7,"method":"initialize","params":{}}"#);
        let Out::ToClient(s) = &out[0] else { panic!() };
        let v: serde_json::Value = serde_json::from_str(s).unwrap();
        assert_eq!(v["id"], 7);
        assert_eq!(v["result"]["serverInfo"]["name"], "s");
        let again = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        assert!(matches!(r.from_client(again)[..], [Out::Dropped(_)]));
    }

    #[test]
    fn a_refused_initialize_fails() {
        let mut r = Relay::new(RelayConfig::default());
        let out = r.from_server(
            r#"{"jsonrpc":"2.0","id":"bmx:init","error":{"code":-32602,"message":"no"}}"#,
        );
        assert!(matches!(out[..], [Out::InitFailed(_)]));
        let out = Relay::new(RelayConfig::default())
            .from_server(r#"{"jsonrpc":"2.0","id":"bmx:init","result":{"x":1}}"#);
        assert!(matches!(out[..], [Out::InitFailed(_)]));
    }

    #[test]
    fn reserved_duplicate_and_excess_ids_are_refused() {
        let mut r = Relay::new(RelayConfig { max_in_flight: 1 });
        r.from_server(INIT_OK);
        assert_eq!(
            error_of(&r.from_client(&req("\"bmx:x\""))[0]).2,
            "reserved_id"
        );
        assert!(matches!(
            r.from_client(&req("1"))[..],
            [Out::Request { ref id, .. }] if id == "1"
        ));
        assert_eq!(error_of(&r.from_client(&req("1"))[0]).2, "duplicate_id");
        assert_eq!(error_of(&r.from_client(&req("2"))[0]).2, "busy");
        // "1" and 1 are different ids.
        assert_eq!(r.from_server(&answer("\"1\"")).len(), 1);
        assert_eq!(r.in_flight(), 1);
    }

    #[test]
    fn server_requests_are_answered_by_the_executor() {
        let mut r = ready();
        let out = r.from_server(r#"{"jsonrpc":"2.0","id":5,"method":"ping"}"#);
        assert_eq!(
            out,
            vec![Out::ToServer(
                r#"{"jsonrpc":"2.0","id":5,"result":{}}"#.into()
            )]
        );
        let out = r.from_server(r#"{"jsonrpc":"2.0","id":6,"method":"sampling/createMessage"}"#);
        assert!(matches!(&out[0], Out::ToServer(s) if s.contains("-32601")));
    }

    #[test]
    fn a_request_the_transport_cannot_take_is_answered_at_once() {
        let mut r = ready();
        let out = r.from_client(&req("1"));
        let [Out::Request { id, .. }] = &out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(
            error_of(&r.undeliverable(id, "stdin full")[0]),
            ("1".into(), code::INTERNAL_ERROR, "busy".into())
        );
        assert_eq!(r.in_flight(), 0);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Request,
        Answer(u8),
        Oversized(u8),
        Undeliverable(u8),
        Crash,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => Just(Step::Request),
            3 => (0u8..16).prop_map(Step::Answer),
            1 => (0u8..16).prop_map(Step::Oversized),
            1 => (0u8..16).prop_map(Step::Undeliverable),
            1 => Just(Step::Crash),
        ]
    }

    proptest! {
        /// Every request the relay forwards gets exactly one answer by the
        /// end (the server's, an oversize error, a transport's refusal or a
        /// crash error), and a refused one gets its refusal at once.
        #[test]
        fn every_forwarded_request_is_answered_exactly_once(steps in proptest::collection::vec(step(), 1..60)) {
            let mut r = Relay::new(RelayConfig { max_in_flight: 8 });
            r.from_server(INIT_OK);
            let mut open: std::collections::HashSet<String> = Default::default();
            let mut answers: std::collections::HashMap<String, usize> = Default::default();
            let mut seq = 0u32;
            let note = |outs: Vec<Out>, answers: &mut std::collections::HashMap<String, usize>, open: &mut std::collections::HashSet<String>| {
                for o in outs {
                    if let Out::ToClient(s) = o {
                        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
                        let id = v["id"].to_string();
                        if open.remove(&id) {
                            *answers.entry(id).or_default() += 1;
                        }
                    }
                }
            };
            for s in steps {
                match s {
                    Step::Request => {
                        seq += 1;
                        let id = format!("\"r{seq}\"");
                        let outs = r.from_client(&req(&id));
                        if matches!(outs[..], [Out::Request { .. }]) {
                            open.insert(id);
                        } else {
                            prop_assert!(matches!(outs[..], [Out::ToClient(_)]));
                        }
                    }
                    Step::Answer(k) => {
                        if let Some(id) = open.iter().nth(k as usize % open.len().max(1)).cloned() {
                            note(r.from_server(&answer(&id)), &mut answers, &mut open);
                        }
                    }
                    Step::Oversized(k) => {
                        if let Some(id) = open.iter().nth(k as usize % open.len().max(1)).cloned() {
                            note(r.oversized(Some(&id), 10), &mut answers, &mut open);
                        }
                    }
                    Step::Undeliverable(k) => {
                        if let Some(id) = open.iter().nth(k as usize % open.len().max(1)).cloned() {
                            note(r.undeliverable(&id, "stdin full"), &mut answers, &mut open);
                        }
                    }
                    Step::Crash => {
                        note(r.crashed("server restarted", "server_crashed"), &mut answers, &mut open);
                        r = { let mut n = Relay::new(RelayConfig { max_in_flight: 8 }); n.from_server(INIT_OK); n };
                    }
                }
                prop_assert_eq!(r.in_flight(), open.len());
            }
            note(r.crashed("server restarted", "server_crashed"), &mut answers, &mut open);
            prop_assert!(open.is_empty());
            prop_assert!(answers.values().all(|&n| n == 1));
        }
    }
}
