//! The OpenAPI 3 document served at `GET /v1/openapi.json`, written by hand
//! (it lists every route of `harness::http`; a test checks that).

use crate::wire::Method;
use serde_json::{json, Value};

fn err(desc: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

fn ok(desc: &str, schema: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

fn body(schema: &str, required: bool) -> Value {
    json!({"required": required, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

fn sid() -> Value {
    json!({"name": "id", "in": "path", "required": true, "schema": {"type": "string"}, "description": "session id"})
}

fn pid() -> Value {
    json!({"name": "pid", "in": "path", "required": true, "schema": {"type": "string"}, "description": "process id"})
}

fn session_errors(mut responses: Value) -> Value {
    let m = responses.as_object_mut().expect("object");
    m.insert("400".into(), err("bad input (-32602)"));
    m.insert(
        "404".into(),
        err("unknown session or process (-32011, -32004)"),
    );
    m.insert("409".into(), err("conflict (-32009)"));
    m.insert(
        "410".into(),
        err("the session ended or its lease expired (-32010)"),
    );
    m.insert(
        "503".into(),
        err("the session's executor is disconnected or busy (-32029)"),
    );
    m.insert(
        "504".into(),
        err("the executor did not answer in time (-32008)"),
    );
    responses
}

/// The document.
/// The id rule (docs/protocol.md, "Ids") as a JSON schema: what the
/// router enforces on every id in a path or a request body.
pub fn id_schema() -> Value {
    json!({
        "type": "string",
        "minLength": 1,
        "maxLength": crate::wire::id::MAX_ID_LEN,
        "pattern": "^[A-Za-z0-9._:-]+$",
        "not": {"enum": [".", ".."]},
    })
}

/// Request bodies whose id fields the router checks.
const ID_BODIES: [&str; 5] = [
    "CreateSession",
    "ProcessStart",
    "ToolCall",
    "OpenTerminal",
    "StartTurn",
];

/// Put the id rule on every id path parameter and every id field of a
/// request body, so a schema-driven client (schemathesis) knows what the
/// server refuses. Descriptions stay.
fn constrain_ids(doc: &mut Value) {
    let constrain = |schema: &mut Value| {
        if let (Value::Object(s), Value::Object(rule)) = (schema, id_schema()) {
            s.extend(rule);
        }
    };
    if let Some(paths) = doc["paths"].as_object_mut() {
        for item in paths.values_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            // Parameters live on the path item (shared by its operations)
            // or on one operation.
            let mut lists: Vec<&mut Vec<Value>> = Vec::new();
            for (key, v) in item.iter_mut() {
                let list = if key == "parameters" {
                    v.as_array_mut()
                } else {
                    v.get_mut("parameters").and_then(Value::as_array_mut)
                };
                lists.extend(list);
            }
            for params in lists {
                for p in params {
                    let is_id = p["in"] == "path"
                        && p["name"]
                            .as_str()
                            .is_some_and(|n| super::PATH_IDS.iter().any(|(name, _)| *name == n));
                    if is_id {
                        constrain(&mut p["schema"]);
                    }
                }
            }
        }
    }
    for name in ID_BODIES {
        let props = &mut doc["components"]["schemas"][name]["properties"];
        if let Some(props) = props.as_object_mut() {
            for field in crate::wire::id::ID_FIELDS {
                if let Some(schema) = props.get_mut(field) {
                    constrain(schema);
                }
            }
        }
    }
    // An empty argv is refused, except with `fileTransfer` (the `anyOf`
    // of `ProcessStart`).
}

pub fn document() -> Value {
    let mut doc = base();
    if let Some(schemas) = doc["components"]["schemas"].as_object_mut() {
        if let Value::Object(more) = terminal_schemas() {
            schemas.extend(more);
        }
    }
    if let Some(paths) = doc["paths"].as_object_mut() {
        if let Value::Object(more) = terminal_paths() {
            paths.extend(more);
        }
    }
    if let Some(schemas) = doc["components"]["schemas"].as_object_mut() {
        if let Value::Object(more) = mcp_schemas() {
            schemas.extend(more);
        }
    }
    if let Some(paths) = doc["paths"].as_object_mut() {
        if let Value::Object(more) = mcp_paths() {
            paths.extend(more);
        }
    }
    if let Some(schemas) = doc["components"]["schemas"].as_object_mut() {
        if let Value::Object(more) = turn_schemas() {
            schemas.extend(more);
        }
    }
    if let Some(paths) = doc["paths"].as_object_mut() {
        if let Value::Object(more) = turn_paths() {
            paths.extend(more);
        }
    }
    constrain_ids(&mut doc);
    conform(&mut doc);
    doc
}

/// Bodies whose Rust types refuse unknown fields (`deny_unknown_fields`).
const CLOSED_BODIES: [&str; 10] = [
    "CreateSession",
    "DrainExecutor",
    "OpenTerminal",
    "StartTurn",
    "MoreInput",
    "CancelTurn",
    "InteractionAnswer",
    "McpServiceRegistration",
    "Stdin",
    "Terminate",
];

/// Query parameters that are cursors, counts or durations: never negative.
const COUNT_QUERIES: [&str; 5] = ["cursor", "maxBytes", "waitMs", "after", "fromSeq"];

/// Make the document say what the server does, where a schema-driven
/// client (schemathesis, run by `tests/security/schemathesis.rs`) would
/// otherwise find them apart:
/// - an operation with an id in its path answers 400 `invalid_id` for an id
///   outside the rule, so it documents 400;
/// - bodies that refuse unknown fields say `additionalProperties: false`;
/// - counts and cursors in the query are at least 0;
/// - a `text/event-stream` answer is described as SSE events (`data`,
///   `event`, `id`), which is what a client parses, not as the JSON its
///   `data` lines hold.
fn conform(doc: &mut Value) {
    if let Some(paths) = doc["paths"].as_object_mut() {
        for (path, item) in paths.iter_mut() {
            let has_id = super::PATH_IDS
                .iter()
                .any(|(name, _)| path.contains(&format!("{{{name}}}")));
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for (key, v) in item.iter_mut() {
                if key == "parameters" {
                    count_queries(v);
                    continue;
                }
                let has_body = v.get("requestBody").is_some();
                if let Some(params) = v.get_mut("parameters") {
                    count_queries(params);
                }
                let Some(responses) = v.get_mut("responses").and_then(Value::as_object_mut) else {
                    continue;
                };
                if has_id && !responses.contains_key("400") {
                    responses.insert(
                        "400".into(),
                        err("an id in the path breaks the id rule (-32602, reason invalid_id)"),
                    );
                }
                web_surface(responses, has_body);
                for r in responses.values_mut() {
                    if let Some(sse) = r.pointer_mut("/content/text~1event-stream") {
                        let what = sse["schema"]["$ref"]
                            .as_str()
                            .map(|r| r.rsplit('/').next().unwrap_or(r).to_owned());
                        sse["schema"] = sse_event(what.as_deref());
                    }
                }
            }
        }
    }
    for name in CLOSED_BODIES {
        if let Some(schema) = doc["components"]["schemas"][name].as_object_mut() {
            schema.insert("additionalProperties".into(), json!(false));
        }
    }
    unsigned_inputs(doc);
}

/// The answers of the web surface's guards (issue 56), which any
/// operation can give: 429 to a source that showed too many wrong
/// credentials, 403 from the browser rules, 408 for a body that missed
/// its deadline. Added to (or, for a status the operation documents for
/// another reason, appended to) each operation's responses.
fn web_surface(responses: &mut serde_json::Map<String, Value>, has_body: bool) {
    let mut also = |status: &str, why: &str| match responses.get_mut(status) {
        Some(r) => {
            if let Some(d) = r["description"].as_str() {
                r["description"] = json!(format!("{d}; or {why}"));
            }
        }
        None => {
            responses.insert(status.into(), err(why));
        }
    };
    also("429", "too many wrong credentials from this address (-32015, reason too_many_failures; Retry-After says when to try again)");
    also("403", "without an API token: a Host that is not a loopback name or a page of another origin (-32003, reason not_loopback, cross_origin); with the console's cookie: reason csrf, cross_origin, origin_required");
    if has_body {
        also("408", "the body did not arrive within the body timeout (-32008, reason body_timeout); the connection is closed");
    }
}

/// Every integer a request body can hold is read as an unsigned number by
/// the server (counts, sizes, milliseconds, cursors): say `minimum: 0`
/// wherever the schema gives no minimum of its own. Walks the schemas
/// reachable from a request body, following `$ref`s once each.
fn unsigned_inputs(doc: &mut Value) {
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                if let Some(r) = o.get("$ref").and_then(Value::as_str) {
                    if let Some(name) = r.strip_prefix("#/components/schemas/") {
                        out.push(name.to_owned());
                    }
                }
                o.values().for_each(|v| refs(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    fn floor(v: &mut Value) {
        match v {
            Value::Object(o) => {
                if o.get("type").and_then(Value::as_str) == Some("integer")
                    && !o.contains_key("minimum")
                {
                    o.insert("minimum".into(), json!(0));
                }
                o.values_mut().for_each(floor);
            }
            Value::Array(a) => a.iter_mut().for_each(floor),
            _ => {}
        }
    }
    let mut todo = Vec::new();
    if let Some(paths) = doc["paths"].as_object() {
        for item in paths.values() {
            for op in item.as_object().into_iter().flat_map(|o| o.values()) {
                if let Some(b) = op.get("requestBody") {
                    refs(b, &mut todo);
                }
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    while let Some(name) = todo.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if let Some(schema) = doc["components"]["schemas"].get_mut(&name) {
            floor(schema);
            refs(schema, &mut todo);
        }
    }
}

fn count_queries(params: &mut Value) {
    for p in params.as_array_mut().into_iter().flatten() {
        let is_count = p["in"] == "query"
            && p["name"]
                .as_str()
                .is_some_and(|n| COUNT_QUERIES.contains(&n));
        if is_count && p["schema"]["type"] == "integer" {
            p["schema"]["minimum"] = json!(0);
            // Read as u64 by the server; a larger number is a 400.
            p["schema"]["maximum"] = json!(u64::MAX);
        }
    }
}

/// One Server-Sent Event as a client parses it.
fn sse_event(data_schema: Option<&str>) -> Value {
    let data = match data_schema {
        Some(name) => format!("one JSON {name} per event"),
        None => "the event's payload".to_owned(),
    };
    json!({"type": "object", "properties": {
        "data": {"type": "string", "description": data},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"}}})
}

fn turn_schemas() -> Value {
    json!({
      "TurnInputItem": {"type": "object", "required": ["type"], "properties": {
          "type": {"type": "string", "enum": ["text", "file"]}, "text": {"type": "string", "description": "text items: required, not empty"},
          "fileId": {"type": "string", "description": "file items: required"}, "name": {"type": "string"}, "mimeType": {"type": "string"}, "sizeBytes": {"type": "integer"}}},
      "TurnInput": {"description": "a string (one text item) or 1 to 64 items", "oneOf": [
          {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "maxItems": 64, "items": {"$ref": "#/components/schemas/TurnInputItem"}}]},
      "TurnConfig": {"type": "object", "properties": {
          "agent": {"type": "string", "description": "one of the executor's agents (capabilities.agent.agents); default its first"},
          "model": {"type": "string"}, "cwd": {"type": "string"}, "permissionMode": {"type": "string"}, "system": {"type": "string"}, "thinkingLevel": {"type": "string"}}},
      "StartTurn": {"type": "object", "additionalProperties": false, "required": ["input"], "properties": {
          "input": {"$ref": "#/components/schemas/TurnInput"}, "config": {"$ref": "#/components/schemas/TurnConfig"},
          "turnId": {"type": "string", "maxLength": 128, "description": "idempotency key (default: a fresh turn-<uuid>): the same id again gets the same answer"},
          "executorSessionRef": {"type": "string", "description": "resume the agent's own session (from an earlier answer)"},
          "deadlineMs": {"type": "integer"}, "metadata": {"type": "object"}}},
      "TurnStarted": {"type": "object", "properties": {
          "turnId": {"type": "string"}, "inputId": {"type": "string"}, "accepted": {"type": "boolean"},
          "effective": {"type": "object", "description": "the configuration the executor applied (agent, model, ...)"},
          "executorSessionRef": {"type": "string"}, "resumed": {"type": "boolean"}}},
      "MoreInput": {"type": "object", "additionalProperties": false, "required": ["input"], "properties": {
          "input": {"$ref": "#/components/schemas/TurnInput"}, "inputId": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[^\\u0000-\\u001f\\u007f]*$", "description": "1 to 128 characters, no control characters"}}},
      "InputAccepted": {"type": "object", "properties": {"accepted": {"type": "boolean"}, "inputId": {"type": "string"}}},
      "CancelTurn": {"type": "object", "additionalProperties": false, "properties": {"reason": {"type": "string", "maxLength": 256}}},
      "TurnCanceled": {"type": "object", "properties": {"canceled": {"type": "boolean", "description": "false when the turn had already finished"}}},
      "StreamItem": {"type": "object", "required": ["kind"], "description": "one item of the event stream (an SSE data line, a WebSocket text frame)", "properties": {
          "kind": {"type": "string", "enum": ["event", "delta", "interaction", "gap", "end", "error"]},
          "sessionId": {"type": "string"}, "turnId": {"type": "string"}, "eventId": {"type": "string"},
          "sequence": {"type": "integer", "description": "event: 1, 2, 3... per session, no hole"},
          "event": {"type": "object", "description": "event: {type: agent.message|agent.thinking|agent.tool_use|agent.tool_result|session.status_running|session.status_idle|session.error, ...}"},
          "receivedAt": {"type": "string", "format": "date-time"},
          "eventType": {"type": "string", "description": "delta: the type of the event it streams"}, "index": {"type": "integer"}, "text": {"type": "string"},
          "interaction": {"$ref": "#/components/schemas/Interaction"},
          "from": {"type": "integer"}, "to": {"type": "integer"}, "reason": {"type": "string"}, "message": {"type": "string"}}},
      "Interaction": {"type": "object", "properties": {
          "sessionId": {"type": "string"}, "turnId": {"type": "string"}, "interactionId": {"type": "string"}, "platformInteractionId": {"type": "string"},
          "kind": {"type": "string", "enum": ["permission", "question"]}, "toolName": {"type": "string"}, "toolInput": {}, "toolUseId": {"type": "string"},
          "question": {"type": "object"}, "scopes": {"type": "array", "items": {"type": "string", "enum": ["once", "session"]}},
          "expiresAt": {"type": "string", "format": "date-time"}, "receivedAt": {"type": "string", "format": "date-time"},
          "state": {"type": "string", "enum": ["pending", "responding", "answered", "canceled", "expired"]},
          "outcome": {"type": "string", "enum": ["allow", "deny", "answered"]}, "reason": {"type": "string", "description": "why it went away (turn_canceled, expired, session_ended, unknown_to_executor, ...)"}}},
      "Interactions": {"type": "object", "properties": {"interactions": {"type": "array", "items": {"$ref": "#/components/schemas/Interaction"}}}},
      "InteractionAnswer": {"type": "object", "additionalProperties": false, "required": ["outcome"], "properties": {
          "outcome": {"type": "string", "enum": ["allow", "deny", "answered"], "description": "permission: allow or deny; question: answered or deny"},
          "scope": {"type": "string", "enum": ["once", "session"], "description": "one of the interaction's scopes; session: the executor does not ask again for this tool in this session"},
          "answers": {"description": "question answers (at most 64 KiB of JSON)"}, "denyMessage": {"type": "string", "maxLength": 4096}}}
    })
}

fn turn_paths() -> Value {
    let turn =
        json!({"name": "turnId", "in": "path", "required": true, "schema": {"type": "string"}});
    let iid = json!({"name": "interactionId", "in": "path", "required": true, "schema": {"type": "string"}, "description": "the executor's interactionId"});
    let after = json!({"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0, "default": 0},
        "description": "the last sequence the client has (0: from the oldest kept); Last-Event-ID wins when both are given"});
    let last_id = json!({"name": "Last-Event-ID", "in": "header", "schema": {"type": "string", "pattern": "^[ \t]*[0-9]{0,19}[ \t]*$"}, "description": "sent by EventSource on reconnect: resume after this sequence (empty: as if absent)"});
    let stream_errors = |mut r: Value| {
        let m = r.as_object_mut().expect("object");
        m.insert("400".into(), err("bad after / Last-Event-ID, or after beyond the last event (reason after_beyond_last)"));
        m.insert("404".into(), err("unknown session (-32011)"));
        m.insert("429".into(), err("the session has its maximum of stream clients (64; -32015, reason too_many_subscribers), or (WebSocket forwarded to another replica) this replica's max_relays are in use (reason relays_full)"));
        m.insert(
            "502".into(),
            err("the replica holding the session did not answer (reason replica_unreachable)"),
        );
        r
    };
    let turn_errors = |r: Value| {
        let mut r = session_errors(r);
        let m = r.as_object_mut().expect("object");
        m.insert("409".into(), err("the executor's conflict (-32009): turn_running (a turn is running), turn_finished (input to a finished turn)"));
        m.insert(
            "413".into(),
            err("the input does not fit in a control frame (-32013)"),
        );
        m.insert(
            "501".into(),
            err("the executor does not offer the agent capability (-32012)"),
        );
        m.insert(
            "502".into(),
            err("the executor connection closed mid-request (reason executor_lost)"),
        );
        r
    };
    json!({
      "/v1/sessions/{id}/turns": {
        "parameters": [sid()],
        "post": {"summary": "turn.start: run an agent turn in the session (one at a time); the agent's output flows on /events",
          "requestBody": body("StartTurn", true),
          "responses": turn_errors(json!({"201": ok("the executor's answer and the ids", "TurnStarted")}))}},
      "/v1/sessions/{id}/turns/{turnId}/input": {
        "parameters": [sid(), turn],
        "post": {"summary": "turn.input: more input for the running turn (the agent's next prompt in the same turn)",
          "requestBody": body("MoreInput", true),
          "responses": turn_errors(json!({"200": ok("accepted", "InputAccepted")}))}},
      "/v1/sessions/{id}/turns/{turnId}/cancel": {
        "parameters": [sid(), {"name": "turnId", "in": "path", "required": true, "schema": {"type": "string"}}],
        "post": {"summary": "turn.cancel: the turn ends with turnOutcome canceled",
          "requestBody": body("CancelTurn", false),
          "responses": turn_errors(json!({"200": ok("canceled or not (already finished)", "TurnCanceled")}))}},
      "/v1/sessions/{id}/events": {
        "parameters": [sid(), after.clone(), last_id.clone()],
        "get": {"summary": "The session's agent stream as Server-Sent Events: the events kept after the cursor, then live events, deltas and interaction notices, until the session ends",
          "description": "Final events: `id: <sequence>`, no event name (type message), data = StreamItem kind event. Deltas (`event: delta`) and interaction notices (`event: interaction`: pending, responding, answered, canceled, expired) have no id and are not replayed (after a reconnect, GET /interactions lists what is pending). `event: gap` {from, to}: those events were dropped by retention (the newest 10 000 / 16 MiB are kept per session while it lives, 1 000 / 1 MiB once it ended). `event: end` {reason}: the session ended; the stream closes. `event: error` {reason: slow_subscriber}: this client fell 4096 items behind and was let go; reconnect with Last-Event-ID: nothing is lost. Keep-alive comments every 15 s.",
          "responses": stream_errors(json!({"200": {"description": "text/event-stream of StreamItem", "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/StreamItem"}}}}}))}},
      "/v1/sessions/{id}/events/ws": {
        "parameters": [sid(), after, last_id],
        "get": {"summary": "The same stream over a WebSocket: one StreamItem JSON text frame each; closed with 1000 after end, 1013 after error; pings every 15 s. Over several replicas, made on any replica: passed on frame by frame to the one holding the session (1011 when that replica is lost)",
          "responses": stream_errors(json!({"101": {"description": "switching protocols"}}))}},
      "/v1/sessions/{id}/interactions": {
        "parameters": [sid()],
        "get": {"summary": "Interactions waiting for an answer (pending or responding), oldest deadline first",
          "responses": {"200": ok("interactions", "Interactions"), "404": err("unknown session")}}},
      "/v1/sessions/{id}/interactions/{interactionId}": {
        "parameters": [sid(), iid],
        "get": {"summary": "One interaction, pending or recently resolved (the newest 256 resolved are remembered)",
          "responses": {"200": ok("the interaction", "Interaction"), "404": err("unknown session or interaction (-32004, reason unknown_interaction)")}},
        "post": {"summary": "Answer it: interaction.response to the executor; answers the interaction, resolved",
          "requestBody": body("InteractionAnswer", true),
          "responses": {"200": ok("the interaction, answered", "Interaction"),
            "400": err("an outcome that does not fit its kind, a scope it does not offer, bad input"),
            "404": err("unknown session or interaction (reason unknown_interaction)"),
            "409": err("interaction_resolved (answered, canceled or expired: data.detail), interaction_busy (an answer is on its way), interaction_gone (the executor no longer waits for it)"),
            "413": err("the body is larger than 128 KiB"),
            "503": err("the executor is disconnected: the interaction stays pending")}}}
    })
}

fn mcp_schemas() -> Value {
    json!({
      "McpServerSpec": {"type": "object", "required": ["serverKey", "connectionOrigin", "transport"], "properties": {
          "serverKey": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
          "connectionOrigin": {"type": "string", "enum": ["environment", "service"], "description": "environment: the executor runs it (transport stdio or http). service: the platform runs it; transport is {\"type\": \"http\"} only (400 reason service_spec otherwise) and its url is registered with POST /v1/sessions/{id}/mcp-services; the session's processes reach it at $BMX_MCP_<KEY>_URL"},
          "transport": {"$ref": "#/components/schemas/McpTransport"},
          "restartBudget": {"type": "object", "description": "bmx extension: restarts of a crashed server before it is unavailable (default 3 in 60 s)", "properties": {
              "maxRestarts": {"type": "integer", "maximum": 1000}, "windowMs": {"type": "integer", "minimum": 1, "maximum": 86400000}}}}},
      "McpTransport": {"type": "object", "required": ["type"], "properties": {
          "type": {"type": "string", "enum": ["stdio", "http"]},
          "command": {"type": "string", "description": "stdio: required"}, "args": {"type": "array", "maxItems": 256, "items": {"type": "string"}},
          "cwd": {"type": "string"}, "env": {"type": "object", "additionalProperties": {"type": "string"}},
          "secretEnv": {"type": "object", "additionalProperties": {"type": "string"}, "description": "given to the server only; every value reads \"<redacted>\" wherever the harness shows the spec"},
          "commandSha256": {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"},
          "url": {"type": "string", "description": "http: required, http:// or https://"}, "timeoutMs": {"type": "integer", "minimum": 1, "maximum": 3600000}}},
      "McpTool": {"type": "object", "required": ["name"], "properties": {
          "name": {"type": "string"}, "title": {"type": "string"}, "description": {"type": "string", "description": "cut at 8 KiB"},
          "inputSchema": {"type": "object", "description": "omitted above 64 KiB"}}},
      "McpServer": {"type": "object", "properties": {
          "serverKey": {"type": "string"}, "connectionOrigin": {"type": "string", "enum": ["environment", "service"]},
          "transport": {"$ref": "#/components/schemas/McpTransport"}, "restartBudget": {"type": "object"},
          "state": {"type": "string", "enum": ["starting", "ready", "restarting", "unavailable"]},
          "restarts": {"type": "integer"}, "reason": {"type": "string"}, "lastError": {"type": "string"},
          "tools": {"type": "array", "items": {"$ref": "#/components/schemas/McpTool"}},
          "toolsTruncated": {"type": "boolean"}, "toolsUpdatedAt": {"type": "string", "format": "date-time"},
          "toolsError": {"type": "string", "description": "why the last tools/list failed (the list shown is the one before)"}}},
      "McpServers": {"type": "object", "properties": {"servers": {"type": "array", "items": {"$ref": "#/components/schemas/McpServer"}}}},
      "McpServiceRegistration": {"type": "object", "required": ["serverKey", "url"], "additionalProperties": false, "properties": {
          "serverKey": {"type": "string", "description": "a service server of the session"},
          "url": {"type": "string", "pattern": "^https?://", "description": "the service's Streamable HTTP MCP endpoint, http:// or https://; kept on the harness, never echoed, listed or logged"},
          "timeoutMs": {"type": "integer", "minimum": 1, "maximum": 3600000, "description": "one request to the service, at most (default 60000)"}}},
      "JsonRpcMessage": {"type": "object", "required": ["jsonrpc"], "description": "one MCP JSON-RPC message (request, notification or response); batches are refused", "properties": {
          "jsonrpc": {"type": "string", "enum": ["2.0"]}, "id": {"description": "a string or an integer; null in the answer to a message whose id could not be read"},
          "method": {"type": "string"}, "params": {"anyOf": [{"type": "object"}, {"type": "array"}]}, "result": {}, "error": {"type": "object"}}}
    })
}

fn mcp_error(desc: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JsonRpcMessage"}}}})
}

/// A 400 of the MCP endpoint: a JSON-RPC error from the proxy, or the
/// API's own error when an id in the path breaks the id rule (checked
/// before the proxy sees the request). `anyOf`, not `oneOf`: a JSON-RPC
/// error message (`{jsonrpc, id, error}`) also has the API error's shape
/// (`{error: {code, message}}`), so it matches both, and `oneOf` would call
/// every such answer invalid (schemathesis ST108).
fn mcp_bad_request(desc: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"anyOf": [
        {"$ref": "#/components/schemas/JsonRpcMessage"}, {"$ref": "#/components/schemas/Error"}]}}}})
}

fn mcp_paths() -> Value {
    let session_header = json!({"name": "Mcp-Session-Id", "in": "header", "schema": {"type": "string"},
        "description": "minted by the harness in the answer to initialize (128 random bits, hex); required on every later request"});
    let mut required_header = session_header.clone();
    required_header["required"] = json!(true);
    let key = json!({"name": "serverKey", "in": "path", "required": true, "schema": {"type": "string"}, "description": "the server's serverKey"});
    json!({
      "/v1/sessions/{id}/mcp": {
        "parameters": [sid()],
        "get": {"summary": "The session's MCP servers: redacted spec, state from session.status (starting, ready, restarting, unavailable), restarts, reason, lastError, and the tool list the harness fetched with tools/list (refreshed on notifications/tools/list_changed)",
          "responses": {"200": ok("servers", "McpServers"), "404": err("unknown session")}}},
      "/v1/sessions/{id}/mcp-services": {
        "parameters": [sid()],
        "post": {"summary": "Register (or replace) where a service-origin MCP server is: the harness is its MCP client (initialize once, then every message of the session's processes, which reach it at $BMX_MCP_<KEY>_URL through the executor over mcp.frame)",
          "requestBody": body("McpServiceRegistration", true),
          "responses": {"201": {"description": "registered: {serverKey, registered: true}"},
            "400": err("a bad url or timeoutMs, or not a registration (the url is never echoed)"),
            "404": err("unknown session (-32011), or the session has no service server with that key (-32014, reason unknown_server)"),
            "410": err("the session ended"),
            "413": err("the body is larger than 64 KiB")}}},
      "/v1/sessions/{id}/mcp/{serverKey}": {
        "parameters": [sid(), key],
        "post": {"summary": "Streamable HTTP MCP endpoint (MCP 2025-03-26 / 2025-06-18): one JSON-RPC message, proxied over the session's mcp.frame channel",
          "description": "Content-Type application/json; Accept application/json and/or text/event-stream. A request is answered with application/json when JSON is accepted and the request carries no params._meta.progressToken, else with text/event-stream (its progress notifications, then its response); initialize is answered with JSON when JSON is accepted and mints the Mcp-Session-Id. Server errors are JSON-RPC responses (200): -32603 with data.reason executor_disconnected, session_ended, channel_closed or client_session_ended; -32001 (reason timeout) after the harness's MCP request timeout (60 s by default); the executor's -32014 when the server cannot be opened. Transport errors carry a JSON-RPC error body.",
          "parameters": [session_header.clone(), {"name": "Accept", "in": "header", "schema": {"type": "string"}, "example": "application/json, text/event-stream"}],
          "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JsonRpcMessage"}}}},
          "responses": {
            "200": {"description": "the response of a request", "headers": {"Mcp-Session-Id": {"schema": {"type": "string"}, "description": "on the answer to initialize"}},
              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JsonRpcMessage"}}, "text/event-stream": {"schema": {"type": "string"}}}},
            "202": {"description": "a notification or a response, accepted"},
            "400": mcp_bad_request("not JSON (-32700), a batch or not JSON-RPC (-32600), or no Mcp-Session-Id after initialize (reason missing_session_id)"),
            "404": mcp_error("unknown or ended Mcp-Session-Id (reason unknown_mcp_session), unknown session (-32011) or serverKey (-32014, reason unknown_server)"),
            "406": mcp_error("Accept allows neither application/json nor text/event-stream"),
            "410": mcp_error("the session ended"),
            "413": mcp_error("larger than maxMcpFrameBytes as carried in mcp.frame (-32013)"),
            "415": mcp_error("Content-Type is not application/json"),
            "429": mcp_error("too many MCP client sessions on this server, or MCP channels on this harness (-32015)"),
            "503": mcp_error("the harness is shutting down, or the channel is not answering")}},
        "get": {"summary": "The client session's notification stream (text/event-stream): the server's notifications (tools/list_changed, message, resources/updated, ...). One stream per client session; a client that falls 256 messages behind loses it.",
          "parameters": [required_header.clone()],
          "responses": {"200": {"description": "SSE stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "400": mcp_bad_request("no Mcp-Session-Id"), "404": mcp_error("unknown Mcp-Session-Id, session or serverKey"),
            "410": mcp_error("the session ended"),
            "406": mcp_error("Accept does not allow text/event-stream"), "409": mcp_error("this client session already has a stream open")}},
        "delete": {"summary": "End the client session (its requests in flight are answered with client_session_ended and cancelled at the server)",
          "parameters": [required_header],
          "responses": {"204": {"description": "ended"}, "400": mcp_bad_request("no Mcp-Session-Id"), "404": mcp_error("unknown Mcp-Session-Id, session or serverKey"),
            "410": mcp_error("the session ended")}}}
    })
}

fn eid() -> Value {
    json!({"name": "id", "in": "path", "required": true, "schema": {"type": "string"}, "description": "executor id"})
}

fn tid() -> Value {
    json!({"name": "tid", "in": "path", "required": true, "schema": {"type": "string"}, "description": "terminal id"})
}

fn terminal_errors(mut responses: Value) -> Value {
    let m = responses.as_object_mut().expect("object");
    m.insert(
        "400".into(),
        err("bad input (-32602), or an executor on protocol 1 (-32016)"),
    );
    m.insert("404".into(), err("unknown executor (reason unknown_executor) or terminal (reason unknown_terminal), -32004"));
    m.insert(
        "409".into(),
        err("conflict (-32009): the id is open with another spec"),
    );
    m.insert("429".into(), err("a limit is full (-32015): the executor's terminal.maxSessions, the harness's registry, tickets or relays"));
    m.insert(
        "501".into(),
        err("the executor does not offer terminals (-32012)"),
    );
    m.insert(
        "502".into(),
        err("the executor connection closed mid-request (reason executor_lost), or the replica holding the executor did not answer (reason replica_unreachable)"),
    );
    m.insert(
        "503".into(),
        err("the executor is disconnected (reason executor_disconnected, retryable)"),
    );
    m.insert(
        "504".into(),
        err("the executor did not answer in time (-32008)"),
    );
    responses
}

fn terminal_schemas() -> Value {
    json!({
      "RfbOffer": {"type": "object", "required": ["url", "expiresInMs"], "properties": {
          "url": {"type": "string", "description": "ws(s)://…/v1/relay/rfb/<ticket>: open once"},
          "expiresInMs": {"type": "integer"}}},
      "OpenTerminal": {"type": "object", "additionalProperties": false, "properties": {
          "terminalId": {"type": "string", "description": "default: a fresh t-<uuid>; 1-128 characters, no '/'"},
          "kind": {"type": "string"}, "argv": {"type": "array", "minItems": 1, "items": {"type": "string"}, "description": "default: the shell; when given, not empty"},
          "shell": {"type": "string"}, "cwd": {"type": "string"},
          "env": {"type": "object", "additionalProperties": {"type": "string"}},
          "cols": {"type": "integer", "minimum": 1, "maximum": 4096, "default": 80}, "rows": {"type": "integer", "minimum": 1, "maximum": 4096, "default": 24}}},
      "Terminal": {"type": "object", "properties": {
          "terminalId": {"type": "string"}, "executorId": {"type": "string"}, "pid": {"type": "integer"},
          "cols": {"type": "integer"}, "rows": {"type": "integer"}, "createdAt": {"type": "string"},
          "epoch": {"type": "integer", "description": "highest writer epoch seen or allocated"},
          "earliestSeq": {"type": "integer"}, "latestSeq": {"type": "integer"},
          "state": {"type": "string", "enum": ["running", "exited"]}, "exitCode": {"type": "integer"},
          "viewers": {"type": "integer"}, "argv": {"type": "array", "items": {"type": "string"}}, "shell": {"type": "string"}}},
      "Terminals": {"type": "object", "properties": {"terminals": {"type": "array", "items": {"$ref": "#/components/schemas/Terminal"}}}},
      "TerminalClosed": {"type": "object", "properties": {"closed": {"type": "boolean"}, "exitCode": {"type": "integer"}}}
    })
}

fn terminal_paths() -> Value {
    json!({
      "/v1/executors/{id}/terminals": {
        "parameters": [eid()],
        "get": {"summary": "Terminals opened through this harness on the executor (the harness's registry: the protocol has no terminal.list)",
          "responses": {"200": ok("terminals", "Terminals"), "404": err("unknown executor")}},
        "post": {"summary": "terminal.open (idempotent for the same id and spec)", "requestBody": body("OpenTerminal", false),
          "responses": terminal_errors(json!({"200": ok("the terminal", "Terminal")}))}},
      "/v1/executors/{id}/terminals/{tid}": {
        "parameters": [eid(), tid()],
        "get": {"summary": "One terminal", "responses": {"200": ok("the terminal", "Terminal"), "404": err("unknown executor or terminal")}},
        "delete": {"summary": "terminal.close: SIGHUP, SIGKILL after the executor's grace; attached viewers are closed with 4100",
          "responses": terminal_errors(json!({"200": ok("closed", "TerminalClosed")}))}},
      "/v1/executors/{id}/terminals/{tid}/attach": {
        "parameters": [eid(), tid(),
          {"name": "fromSeq", "in": "query", "schema": {"type": "integer"}, "description": "replay from this seq (default: the oldest retained chunk)"},
          {"name": "write", "in": "query", "schema": {"type": "string", "enum": ["0", "1", "true", "false"], "default": "0"}, "description": "take the writer role (a new epoch above every earlier one)"},
          {"name": "streamId", "in": "query", "schema": {"type": "string"}, "description": "default: a fresh v-<uuid>"}],
        "get": {"summary": "WebSocket: the terminal's binary frames (PROTOCOL.md §8: byte 0 op 1 output / 2 input / 3 snapshot, empty snapshot = gap; bytes 1-8 seq u64 BE; data), relayed from the executor's host stream. Text frames: viewer → {\"type\":\"resize\",\"cols\",\"rows\"}; harness → attached, resized, error, exited notices. Close 1000 'exited N' when the program ends, 4100 terminal closed, 4102 executor stream ended, 1001 harness shutdown, 1009 frame too large. Subprotocol bmx.terminal.v1 is echoed when offered. Over several replicas, made on any replica: passed on frame by frame to the one the executor is connected to (1011 when that replica is lost).",
          "responses": terminal_errors(json!({"101": {"description": "switching protocols"}}))}},
      "/v1/sessions/{id}/display/rfb": {
        "parameters": [sid()],
        "post": {"summary": "A one-time viewer URL for the session's display as VNC (RFB in binary WebSocket frames, what noVNC and websockify speak); the display starts if it is not running. Open the URL once, within expiresInMs.",
          "responses": session_errors(json!({"200": ok("the viewer URL", "RfbOffer"),
            "429": err("too many outstanding tickets (-32015, reason relay_tickets_full)"),
            "501": err("the executor does not advertise display {rfb: true} (-32012)")}))}},
      "/v1/relay/rfb/{ticket}": {
        "parameters": [{"name": "ticket", "in": "path", "required": true, "schema": {"type": "string"}, "description": "the whole one-time viewer ticket (id.secret)"}],
        "get": {"summary": "Viewer side of a display relay (the url of POST /v1/sessions/{id}/display/rfb): WebSocket, binary frames carry the RFB stream both ways. The ticket is the credential (no API token). Subprotocol binary is echoed when offered. Close 1000 when the executor's stream ends, 1001 harness shutdown, 1009 frame over 64 KiB.",
          "security": [],
          "responses": {"101": {"description": "switching protocols"}, "400": err("not an upgrade"), "401": err("unknown, used, expired or wrong ticket (reason bad_ticket)"),
            "404": err("the session is gone"), "429": err("max_relays viewers, or 8 on this display (-32015)"), "501": err("no display.rfb (-32012)"),
            "502": err("the executor cannot start the display or x11vnc (reason display_error), cannot reach the relay (relay_unreachable), or answered but did not dial (relay_not_dialed)"), "503": err("the executor is disconnected")}}},
      "/v1/relay/display/{ticket}": {
        "parameters": [{"name": "ticket", "in": "path", "required": true, "schema": {"type": "string"}, "description": "ticket id"}],
        "get": {"summary": "Executor side of a display relay (the host.url of display.rfb): WebSocket, bearer = the one-time ticket; not for API clients",
          "security": [],
          "responses": {"101": {"description": "switching protocols"}, "400": err("not an upgrade"), "401": err("unknown, used, expired or wrong ticket (reason bad_ticket)")}}},
      "/v1/relay/terminals/{ticket}": {
        "parameters": [{"name": "ticket", "in": "path", "required": true, "schema": {"type": "string"}, "description": "ticket id"}],
        "get": {"summary": "Executor side of a terminal relay (the host.url of terminal.attach): WebSocket, bearer = the one-time ticket; not for API clients",
          "security": [],
          "responses": {"101": {"description": "switching protocols"}, "400": err("not an upgrade"), "401": err("unknown, used, expired or wrong ticket (reason bad_ticket)")}}}
    })
}

fn base() -> Value {
    json!({
      "openapi": "3.0.3",
      "info": {
        "title": "bmx harness API",
        "version": env!("CARGO_PKG_VERSION"),
        "description": "Control plane of the executor protocol: executors, sessions, processes, tools, terminals, MCP servers, agent turns. Errors are {\"error\": {code, message, data}} with the JSON-RPC code inside. With --api-token every route needs `Authorization: Bearer <token>`."
      },
      "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
          "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
              "code": {"type": "integer", "example": -32011},
              "message": {"type": "string"},
              "data": {"type": "object", "properties": {"reason": {"type": "string"}, "retryable": {"type": "boolean"}, "detail": {"type": "string"}, "capability": {"type": "string"}}}}}}},
          "Executor": {"type": "object", "properties": {
              "executorId": {"type": "string"}, "connectionId": {"type": "string"}, "state": {"type": "string", "enum": ["ready", "draining"]},
              "name": {"type": "string"}, "version": {"type": "string"}, "activeSessions": {"type": "array", "items": {"type": "string"}},
              "connectedAt": {"type": "string", "format": "date-time"}, "lastHeartbeatAt": {"type": "string", "format": "date-time"},
              "protocol": {"type": "string"}, "capabilities": {"type": "object"},
              "replica": {"type": "string", "description": "over several replicas: the replica holding the connection. An executor of another replica is listed from the shared database: executorId, connectionId, connectedAt, activeSessions and replica; state ready; name and version empty; no lastHeartbeatAt, protocol or capabilities"}}},
          "DrainExecutor": {"type": "object", "properties": {
              "reason": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f]*$", "description": "default operator"},
              "deadlineMs": {"type": "integer", "maximum": 86400000, "description": "how long running sessions may go on (default: the executor's)"}}},
          "DrainResult": {"type": "object", "properties": {"accepted": {"type": "boolean"}, "activeSessions": {"type": "array", "items": {"type": "string"}}}},
          "Executors": {"type": "object", "properties": {"executors": {"type": "array", "items": {"$ref": "#/components/schemas/Executor"}}}},
          "CreateSession": {"type": "object", "properties": {"executorId": {"type": "string"}, "sessionId": {"type": "string"}, "metadata": {"type": "object"},
              "mcpServers": {"type": "array", "maxItems": 32, "items": {"$ref": "#/components/schemas/McpServerSpec"}, "description": "sent in session.assign; keys unique"},
              "restoreFrom": {"type": "object", "additionalProperties": false, "description": "start from a workspace backup: exactly one of backupId (of sessionId, default any session's, newest) and artifactId; unpacked before session.ready. A failed restore leaves the session not ready with status error and statusDetail restore_failed: <code>: <message>", "properties": {
                "backupId": {"type": "string"}, "sessionId": {"type": "string"}, "artifactId": {"type": "string"}},
                "oneOf": [{"required": ["backupId"], "not": {"required": ["artifactId"]}}, {"required": ["artifactId"], "not": {"required": ["backupId"]}}]}}},
          "Session": {"type": "object", "properties": {
              "sessionId": {"type": "string"}, "executorId": {"type": "string"}, "connectionId": {"type": "string"},
              "fencingToken": {"type": "integer"}, "leaseToken": {"type": "string"},
              "state": {"type": "string", "enum": ["assigning", "active", "disconnected", "stopping", "ended"]},
              "ready": {"type": "boolean"}, "status": {"type": "string", "enum": ["starting", "running", "idle", "stopping", "stopped", "error"]}, "statusDetail": {"type": "string"},
              "createdAt": {"type": "string"}, "endedAt": {"type": "string"}, "endedReason": {"type": "string"},
              "metadata": {"type": "object"}, "processes": {"type": "array", "items": {"$ref": "#/components/schemas/ProcessStatus"}},
              "mcpServers": {"type": "array", "description": "present when the session has MCP servers: spec (secretEnv values redacted) and state; tools are in GET /v1/sessions/{id}/mcp", "items": {"$ref": "#/components/schemas/McpServer"}}}},
          "Sessions": {"type": "object", "properties": {"sessions": {"type": "array", "items": {"$ref": "#/components/schemas/Session"}}, "next": {"type": "string", "description": "present when more may follow: ask again with after=next"}}},
          "ProcessStart": {"type": "object",
            "anyOf": [{"required": ["argv"], "properties": {"argv": {"minItems": 1}}}, {"required": ["fileTransfer"], "properties": {"argv": {"maxItems": 0}}}],
            "properties": {
              "processId": {"type": "string", "description": "default: a fresh p-<uuid>"}, "argv": {"type": "array", "items": {"type": "string"}, "description": "required and not empty, except with fileTransfer (then empty or absent)"},
              "fileTransfer": {"$ref": "#/components/schemas/FileTransfer"},
              "cwd": {"type": "string"}, "env": {"type": "object", "additionalProperties": {"type": "string"}},
              "stdin": {"type": "string", "enum": ["open", "closed"]}, "stderr": {"type": "string", "enum": ["separate", "merge"]},
              "ioMode": {"type": "string", "enum": ["pipe", "pty"]}, "timeoutMs": {"type": "integer"}, "waitMs": {"type": "integer"}, "metadata": {"type": "object"}}},
          "ProcessState": {"type": "object", "properties": {
              "accepted": {"type": "boolean"}, "processId": {"type": "string"}, "pid": {"type": "integer"},
              "state": {"type": "string", "enum": ["running", "exited", "failed", "killed"]}, "startedAt": {"type": "string"}, "endedAt": {"type": "string"},
              "exitCode": {"type": "integer"}, "exitSignal": {"type": "integer"}, "reason": {"type": "string"},
              "cursors": {"type": "object", "properties": {"stdout": {"type": "integer"}, "stderr": {"type": "integer"}}}}},
          "ProcessStatus": {"type": "object", "properties": {"sessionId": {"type": "string"}, "processId": {"type": "string"}, "state": {"type": "string"}, "exitCode": {"type": "integer"}, "observedAt": {"type": "string"}}},
          "Processes": {"type": "object", "properties": {"processes": {"type": "array", "items": {"$ref": "#/components/schemas/ProcessState"}}}},
          "ProcessRead": {"type": "object", "properties": {
              "processId": {"type": "string"}, "stream": {"type": "string", "enum": ["stdout", "stderr"]},
              "data": {"type": "string", "format": "byte", "description": "base64"},
              "fromCursor": {"type": "integer"}, "nextCursor": {"type": "integer"}, "earliestCursor": {"type": "integer"},
              "gap": {"type": "boolean"}, "truncated": {"type": "boolean"}, "eof": {"type": "boolean"},
              "state": {"type": "string"}, "exitCode": {"type": "integer"}, "exitSignal": {"type": "integer"}, "endedAt": {"type": "string"}, "reason": {"type": "string"},
              "fileTransfer": {"$ref": "#/components/schemas/FileTransferResult"}}},
          "FileTransfer": {"type": "object", "required": ["direction", "localPath"], "description": "a file-transfer process (docs/protocol.md, File transfers); the harness fills in the data path (downloadUrl, downloadToken, upload)", "properties": {
              "direction": {"type": "string", "enum": ["download", "upload"]},
              "localPath": {"type": "string", "description": "relative to the workspace, no .."},
              "expectedDigest": {"type": "string", "pattern": "^(sha256:[0-9a-fA-F]{64})?$", "description": "the digest the local file must have now (\"\": must not exist); otherwise error conflict with currentDigest"},
              "digest": {"type": "string", "description": "download: the blob (sha256:<hex>)"},
              "artifactId": {"type": "string", "description": "download: the blob of this artifact"},
              "maxBytes": {"type": "integer", "minimum": 0}}},
          "FileTransferResult": {"type": "object", "required": ["path", "digest"], "properties": {
              "path": {"type": "string"}, "digest": {"type": "string"}, "sizeBytes": {"type": "integer"}, "artifactId": {"type": "string"},
              "error": {"type": "object", "required": ["code", "message"], "properties": {
                "code": {"type": "string", "enum": ["conflict", "digest_mismatch", "too_large", "workspace_boundary", "not_found", "not_a_file", "token_expired", "token_invalid", "download_failed", "upload_failed", "disk_full", "io_error", "canceled"]},
                "currentDigest": {"type": "string"}, "message": {"type": "string"}}}}},
          "Stdin": {"type": "object", "properties": {"data": {"type": "string", "format": "byte"}, "text": {"type": "string"}, "closeStdin": {"type": "boolean"}}},
          "Terminate": {"type": "object", "properties": {"graceMs": {"type": "integer"}}},
          "Accepted": {"type": "object", "properties": {"accepted": {"type": "boolean"}}},
          "ToolCall": {"type": "object", "required": ["tool"], "properties": {
              "tool": {"type": "string", "minLength": 1, "example": "bash"}, "input": {"type": "object", "example": {"command": "echo hi"}},
              "toolCallId": {"type": "string"}, "deadlineMs": {"type": "integer"}}},
          "ToolResult": {"type": "object", "properties": {
              "sessionId": {"type": "string"}, "toolCallId": {"type": "string"}, "outcome": {"type": "string", "enum": ["succeeded", "failed", "canceled"]},
              "isError": {"type": "boolean"}, "content": {"type": "array", "items": {"type": "object", "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}},
              "artifacts": {"type": "array", "items": {}}, "durationMs": {"type": "integer"}, "reason": {"type": "string"}}}
        }
      },
      "security": [{"bearer": []}, {}],
      "paths": {
        "/v1/executor/connect": {"get": {"summary": "Executor WebSocket upgrade (PROTOCOL.md §1)", "description": "Bearer token of the executor; Sec-WebSocket-Protocol offers bmaexecutor.v1.1+msgpack, bmaexecutor.v1.1, bmaexecutor.v1+msgpack, bmaexecutor.v1.",
            "responses": {"101": {"description": "switching protocols"}, "400": err("not an upgrade, or no common subprotocol"), "401": err("unknown token")}}},
        "/v1/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3 document"}}}},
        "/v1/health": {"get": {"summary": "Liveness", "responses": {"200": {"description": "{\"ok\": true}"}}}},
        "/metrics": {"get": {"summary": "Metrics (OpenMetrics text; docs/reliability.md)", "responses": {"200": {"description": "application/openmetrics-text; version=1.0.0"}}}},
        "/v1/executors": {"get": {"summary": "Live executor connections; over several replicas every live replica's (the others' from the database), each with its replica", "responses": {"200": ok("executors", "Executors"), "503": err("the shared database failed (reason store_unavailable)")}}},
        "/v1/executors/{id}/drain": {
          "parameters": [eid()],
          "post": {"summary": "executor.drain: the executor refuses new sessions, lets its sessions run until the deadline, stops the rest and closes with 1001; the harness places no new session on it (state draining)",
            "requestBody": body("DrainExecutor", false),
            "responses": {"200": ok("the executor's answer", "DrainResult"), "400": err("bad reason or deadlineMs"), "404": err("no such executor connected (reason unknown_executor)"), "502": err("the replica holding the executor did not answer (reason replica_unreachable)"), "504": err("the executor did not answer")}}},
        "/v1/sessions": {
          "get": {"summary": "Sessions (live and recently ended), one page by session id; over several replicas every replica's (from the database)",
            "parameters": [{"name": "after", "in": "query", "schema": {"type": "string"}, "description": "list ids above this one (the previous page's next)"},
                           {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 1000}}],
            "responses": {"200": ok("sessions, and next when more may follow", "Sessions"), "400": err("a bad limit"), "503": err("the shared database failed (reason store_unavailable)")}},
          "post": {"summary": "Create a session: grant a lease, send session.assign, answer once accepted", "requestBody": body("CreateSession", false),
            "responses": {"201": ok("the session", "Session"), "400": err("bad input"), "404": err("restoreFrom names no stored backup or artifact"), "409": err("the session id is in use"), "501": err("restoreFrom without a blob store, or an executor that does not restore (-32012)"), "503": err("no executor connected, or the executor is busy (-32029)"), "504": err("the executor did not answer")}}},
        "/v1/sessions/{id}": {
          "parameters": [sid()],
          "get": {"summary": "One session", "responses": {"200": ok("the session", "Session"), "404": err("unknown session")}},
          "delete": {"summary": "Stop a session: session.stop, answer when session.ended arrives or the deadline passes", "responses": session_errors(json!({"200": ok("the ended session", "Session")}))}},
        "/v1/sessions/{id}/processes": {
          "parameters": [sid()],
          "get": {"summary": Method::ProcessList.as_str(), "responses": session_errors(json!({"200": ok("processes", "Processes")}))},
          "post": {"summary": "process.start (params without sessionId)", "requestBody": body("ProcessStart", true), "responses": session_errors(json!({"200": ok("process state", "ProcessState"),
            "501": err("fileTransfer without a blob store, or an executor that does not run file transfers (-32012)")}))}},
        "/v1/sessions/{id}/processes/{pid}/output": {
          "parameters": [sid(), pid(),
            {"name": "stream", "in": "query", "schema": {"type": "string", "enum": ["stdout", "stderr"], "default": "stdout"}},
            {"name": "cursor", "in": "query", "schema": {"type": "integer", "default": 0}},
            {"name": "maxBytes", "in": "query", "schema": {"type": "integer"}},
            {"name": "waitMs", "in": "query", "schema": {"type": "integer"}, "description": "long poll: wait this long for bytes or the end"}],
          "get": {"summary": "process.read (data in base64)", "responses": session_errors(json!({"200": ok("read result", "ProcessRead")}))}},
        "/v1/sessions/{id}/processes/{pid}/stdin": {
          "parameters": [sid(), pid()],
          "post": {"summary": Method::ProcessWrite.as_str(), "requestBody": body("Stdin", false), "responses": session_errors(json!({"200": ok("accepted", "Accepted"), "413": err("too large (-32013)")}))}},
        "/v1/sessions/{id}/processes/{pid}/interrupt": {
          "parameters": [sid(), pid()],
          "post": {"summary": "process.interrupt (SIGINT to the group)", "responses": session_errors(json!({"200": ok("process state", "ProcessState")}))}},
        "/v1/sessions/{id}/processes/{pid}/terminate": {
          "parameters": [sid(), pid()],
          "post": {"summary": "process.terminate (SIGTERM, SIGKILL after graceMs)", "requestBody": body("Terminate", false), "responses": session_errors(json!({"200": ok("process state", "ProcessState")}))}},
        "/v1/sessions/{id}/files/uploads/{path}": {
          "parameters": [sid(), {"name": "path", "in": "path", "required": true, "schema": {"type": "string", "minLength": 1}, "description": "the file under uploads/: plain names joined by /"}],
          "put": {"summary": "Put a file into the session's uploads/ (the body is the file; a file-transfer process writes it whole)",
            "parameters": [{"name": "If-Match", "in": "header", "schema": {"type": "string", "pattern": "^\"?sha256:[0-9a-f]{64}\"?$"}, "description": "\"sha256:<hex>\": the file must have this digest now"},
                           {"name": "If-None-Match", "in": "header", "schema": {"type": "string", "enum": ["*"]}, "description": "*: the file must not exist"}],
            "requestBody": {"required": true, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
            "responses": session_errors(json!({"200": ok("the file, written", "FileTransferResult"),
              "400": err("a bad path (reason invalid_path: .., absolute, a symlink out) or precondition"),
              "404": err("unknown session"),
              "409": err("the file's digest is not the one If-Match names (reason conflict), or the session's process id is taken"),
              "413": err("over 64 MiB (-32013)"), "501": err("no blob store, or the executor does not run file transfers (-32012)"),
              "502": err("the transfer failed on the executor"), "507": err("the executor's disk is full")}))}},
        "/v1/sessions/{id}/files/outputs/{path}": {
          "parameters": [sid(), {"name": "path", "in": "path", "required": true, "schema": {"type": "string", "minLength": 1}, "description": "the file under outputs/: plain names joined by /"}],
          "get": {"summary": "Fetch a file of the session's outputs/ (a file-transfer process uploads it; it is listed among the session's artifacts)",
            "responses": session_errors(json!({"200": {"description": "the file's bytes; ETag is its digest", "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
              "400": err("a bad path (reason invalid_path)"), "404": err("unknown session, or no such file"),
              "413": err("over the blob store's limit (-32013)"), "501": err("no blob store, or the executor does not run file transfers (-32012)"),
              "502": err("the transfer failed on the executor")}))}},
        "/v1/sessions/{id}/tools": {
          "parameters": [sid()],
          "post": {"summary": "tool.call, answered with the tool.result (once per toolCallId)", "requestBody": body("ToolCall", true),
            "responses": session_errors(json!({"200": ok("the tool result", "ToolResult"), "502": err("the executor was lost and its lease expired: data.reason tool_outcome_unknown")}))}}
      }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_path_is_documented() {
        let doc = super::document();
        let paths = doc["paths"].as_object().unwrap();
        for p in [
            "/v1/executor/connect",
            "/v1/openapi.json",
            "/v1/executors",
            "/v1/sessions",
            "/v1/sessions/{id}",
            "/v1/sessions/{id}/processes",
            "/v1/sessions/{id}/processes/{pid}/output",
            "/v1/sessions/{id}/processes/{pid}/stdin",
            "/v1/sessions/{id}/processes/{pid}/interrupt",
            "/v1/sessions/{id}/processes/{pid}/terminate",
            "/v1/sessions/{id}/tools",
            "/v1/sessions/{id}/files/uploads/{path}",
            "/v1/sessions/{id}/files/outputs/{path}",
            "/v1/sessions/{id}/mcp",
            "/v1/sessions/{id}/mcp/{serverKey}",
            "/v1/executors/{id}/terminals",
            "/v1/executors/{id}/terminals/{tid}",
            "/v1/executors/{id}/terminals/{tid}/attach",
            "/v1/relay/terminals/{ticket}",
            "/v1/sessions/{id}/display/rfb",
            "/v1/relay/rfb/{ticket}",
            "/v1/relay/display/{ticket}",
            "/v1/sessions/{id}/turns",
            "/v1/sessions/{id}/turns/{turnId}/input",
            "/v1/sessions/{id}/turns/{turnId}/cancel",
            "/v1/sessions/{id}/events",
            "/v1/sessions/{id}/events/ws",
            "/v1/sessions/{id}/interactions",
            "/v1/sessions/{id}/interactions/{interactionId}",
        ] {
            assert!(paths.contains_key(p), "{p} missing");
        }
        // Every $ref resolves.
        let text = doc.to_string();
        for r in text.split("#/components/schemas/").skip(1) {
            let name: String = r.chars().take_while(|c| c.is_alphanumeric()).collect();
            assert!(doc["components"]["schemas"].get(&name).is_some(), "{name}");
        }
    }
}

#[cfg(test)]
mod input_tests {
    #[test]
    fn request_integers_are_unsigned_and_responses_are_left_alone() {
        let doc = super::document();
        let s = &doc["components"]["schemas"];
        // A request body, and a schema it reaches through a $ref.
        assert_eq!(s["ToolCall"]["properties"]["deadlineMs"]["minimum"], 0);
        assert_eq!(
            s["FileTransfer"]["properties"]["maxBytes"]["minimum"], 0,
            "reached from ProcessStart"
        );
        // A minimum of its own is kept.
        assert_eq!(s["OpenTerminal"]["properties"]["cols"]["minimum"], 1);
        // Response-only schemas keep signed integers (an exit code).
        assert!(s["ProcessState"]["properties"]["exitCode"]
            .get("minimum")
            .is_none());
    }
}
