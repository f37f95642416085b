//! Issue 11, harness side: MCP servers through the harness.
//!
//! Against a scripted executor (a real WebSocket client, the project's own
//! `Link`) that answers `session.assign`, `mcp.open` and the MCP messages
//! it receives over `mcp.frame` the way the executor's contract says:
//! session creation with `mcpServers` (secrets redacted everywhere), the
//! server state and tool list (`GET .../mcp`), and the Streamable HTTP
//! endpoint driven with plain HTTP: id rewriting with two clients using
//! the same request id, progress over SSE, JSON answers, 202, client
//! session ids (400/404), sizes (413), media types (406/415), the
//! notification stream, timeouts, a lost executor (every request in flight
//! answered, the channel re-opened after the reconnect), the session's end
//! and the API token (401).

use crate::harness_common;
use bmx::harness::{Harness, HarnessConfig, HarnessEvent, HarnessHandle};
use bmx::wire::types::{
    AssignParams, AssignResult, EndedParams, McpFrameParams, McpOpenParams, McpOpenResult,
    McpServerState, McpServerStatus, Resume, SessionStatus, StatusParams, StopParams, StopResult,
};
use bmx::wire::{ErrorCode, Link, Method, RpcError};
use futures_util::StreamExt;
use harness_common::*;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECRET: &str = "hunter2-very-secret-value";
/// Generous: the machine may be busy building.
const LONG: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------
// A scripted executor that runs "MCP servers" the way the contract says.
// ---------------------------------------------------------------------

#[derive(Default)]
struct Seen {
    /// Every MCP payload received over `mcp.frame`, parsed.
    payloads: Vec<Value>,
    opens: Vec<McpOpenParams>,
    assigns: Vec<AssignParams>,
}

struct FakeMcp {
    link: Link,
    seen: Arc<Mutex<Seen>>,
    tools: Arc<Mutex<Vec<Value>>>,
    closed: tokio::sync::oneshot::Receiver<bmx::wire::Closed>,
}

fn echo_tool() -> Value {
    json!({"name": "echo", "description": "Echoes back the input",
           "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}}})
}

/// Send one MCP message to the harness on the channel (session, key).
fn frame(link: &Link, session: &str, key: &str, msg: Value) {
    link.notify(
        Method::McpFrame,
        &McpFrameParams {
            session_id: session.into(),
            server_key: key.into(),
            payload: msg.to_string(),
        },
    )
    .expect("link open");
}

/// Dial, register (with `resume` if given), and serve.
async fn fake_mcp(h: &HarnessHandle, token: &str, resume: Option<Resume>) -> FakeMcp {
    let mut f = dial(h, token).await.unwrap();
    f.register(resume).await.unwrap();
    f.keep_alive();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let tools = Arc::new(Mutex::new(vec![echo_tool()]));
    let (link, mut inbox) = (f.link.clone(), f.inbox);
    let (s, t, l) = (seen.clone(), tools.clone(), link.clone());
    tokio::spawn(async move {
        while let Some((frame_in, reply)) = inbox.recv().await {
            let Some(method) = frame_in.method().and_then(Method::from_name) else {
                continue;
            };
            match method {
                Method::SessionAssign => {
                    let p: AssignParams = frame_in.params().unwrap();
                    let sid = p.session_id.clone();
                    s.lock().unwrap().assigns.push(p);
                    if let Some(r) = reply {
                        r.ok(&AssignResult {
                            accepted: true,
                            session_id: sid,
                        });
                    }
                }
                Method::SessionStop => {
                    let p: StopParams = frame_in.params().unwrap();
                    if let Some(r) = reply {
                        r.ok(&StopResult { stopped: true });
                    }
                    let l = l.clone();
                    tokio::spawn(async move {
                        let _ = l
                            .request::<_, Value>(
                                Method::SessionEnded,
                                &EndedParams {
                                    session_id: p.session_id,
                                    reason: "stopped".into(),
                                },
                                WAIT,
                            )
                            .await;
                    });
                }
                Method::McpOpen => {
                    let p: McpOpenParams = frame_in.params().unwrap();
                    let broken = p.server_key == "broken";
                    s.lock().unwrap().opens.push(p);
                    if let Some(r) = reply {
                        if broken {
                            r.err(
                                RpcError::new(ErrorCode::McpUnavailable, "server unavailable")
                                    .with_reason("spawn_failed"),
                            );
                        } else {
                            r.ok(&McpOpenResult { opened: true });
                        }
                    }
                }
                Method::McpFrame => {
                    let p: McpFrameParams = frame_in.params().unwrap();
                    let msg: Value = serde_json::from_str(&p.payload).unwrap();
                    s.lock().unwrap().payloads.push(msg.clone());
                    serve_mcp(&l, &p.session_id, &p.server_key, msg, &t);
                }
                _ => {
                    if let Some(r) = reply {
                        r.ok(&json!({}));
                    }
                }
            }
        }
    });
    FakeMcp {
        link,
        seen,
        tools,
        closed: f.closed,
    }
}

/// One MCP message to the "server": answer as the executor would.
fn serve_mcp(link: &Link, sid: &str, key: &str, msg: Value, tools: &Arc<Mutex<Vec<Value>>>) {
    let Some(method) = msg.get("method").and_then(Value::as_str) else {
        return;
    };
    let Some(id) = msg.get("id").cloned() else {
        return; // a notification: swallowed
    };
    let answer = |result: Value| json!({"jsonrpc": "2.0", "id": id, "result": result});
    match method {
        "initialize" => frame(
            link,
            sid,
            key,
            answer(json!({"protocolVersion": "2025-06-18",
                "capabilities": {"tools": {"listChanged": true}},
                "serverInfo": {"name": "fake-everything", "version": "1.0.0"}})),
        ),
        "tools/list" => {
            let list = tools.lock().unwrap().clone();
            frame(link, sid, key, answer(json!({ "tools": list })))
        }
        "ping" => frame(link, sid, key, answer(json!({}))),
        "tools/call" => {
            let params = msg["params"].clone();
            let name = params["name"].as_str().unwrap_or_default().to_owned();
            let text = params["arguments"]["message"].clone();
            match name.as_str() {
                "echo" => {
                    if let Some(token) = params["_meta"].get("progressToken") {
                        for i in 1..=2 {
                            frame(
                                link,
                                sid,
                                key,
                                json!({"jsonrpc": "2.0", "method": "notifications/progress",
                                    "params": {"progressToken": token, "progress": i, "total": 2}}),
                            );
                        }
                    }
                    frame(
                        link,
                        sid,
                        key,
                        answer(
                            json!({"content": [{"type": "text", "text": format!("Echo: {}", text.as_str().unwrap_or_default())}]}),
                        ),
                    )
                }
                "slow" => {
                    let ms = params["arguments"]["ms"].as_u64().unwrap_or(100);
                    let (link, sid, key) = (link.clone(), sid.to_owned(), key.to_owned());
                    let reply = answer(json!({"content": [{"type": "text", "text": text}]}));
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        frame(&link, &sid, &key, reply);
                    });
                }
                _ => {} // "hang": never answered
            }
        }
        _ => frame(
            link,
            sid,
            key,
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "Method not found"}}),
        ),
    }
}

fn stdio_spec(key: &str) -> Value {
    json!({"serverKey": key, "connectionOrigin": "environment",
           "transport": {"type": "stdio", "command": "mcp-server-everything",
                         "env": {"PLAIN": "visible"}, "secretEnv": {"API_KEY": SECRET}}})
}

/// Create a session with `keys` as MCP servers; its id.
async fn session_with(h: &HarnessHandle, keys: &[&str]) -> String {
    let specs: Vec<Value> = keys.iter().map(|k| stdio_spec(k)).collect();
    let (status, v) = api(h)
        .post("/v1/sessions", &json!({ "mcpServers": specs }))
        .await
        .unwrap();
    assert_eq!(status, 201, "{v}");
    v["sessionId"].as_str().unwrap().to_owned()
}

// ---------------------------------------------------------------------
// A small Streamable HTTP client, written for the test.
// ---------------------------------------------------------------------

const BOTH: &str = "application/json, text/event-stream";

struct Http {
    client: reqwest::Client,
    url: String,
    token: Option<String>,
    session: Option<String>,
}

struct Reply {
    status: u16,
    content_type: String,
    session: Option<String>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }

    /// The `data` of every SSE event, parsed.
    fn events(&self) -> Vec<Value> {
        sse_data(&self.body)
    }
}

fn sse_data(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|block| {
            let data: Vec<&str> = block
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|l| l.strip_prefix(' ').unwrap_or(l))
                .collect();
            (!data.is_empty()).then(|| serde_json::from_str(&data.join("\n")).unwrap())
        })
        .collect()
}

impl Http {
    fn new(h: &HarnessHandle, session: &str, key: &str) -> Http {
        Http {
            client: reqwest::Client::new(),
            url: format!("{}/v1/sessions/{session}/mcp/{key}", h.api_url()),
            token: None,
            session: None,
        }
    }

    fn request(&self, method: reqwest::Method) -> reqwest::RequestBuilder {
        let mut r = self.client.request(method, &self.url).timeout(LONG);
        if let Some(t) = &self.token {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        if let Some(s) = &self.session {
            r = r.header("mcp-session-id", s);
        }
        r
    }

    async fn send(&self, r: reqwest::RequestBuilder) -> Reply {
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let content_type = header("content-type").unwrap_or_default();
        let session = header("mcp-session-id");
        let body = resp.text().await.unwrap();
        Reply {
            status,
            content_type,
            session,
            body,
        }
    }

    async fn post_raw(&self, body: String, accept: &str, content_type: &str) -> Reply {
        let r = self
            .request(reqwest::Method::POST)
            .header("accept", accept)
            .header("content-type", content_type)
            .body(body);
        self.send(r).await
    }

    async fn post(&self, msg: &Value, accept: &str) -> Reply {
        self.post_raw(msg.to_string(), accept, "application/json")
            .await
    }

    async fn initialize(&mut self) -> Value {
        let r = self
            .post(
                &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "test", "version": "0"}}}),
                BOTH,
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            r.content_type.starts_with("application/json"),
            "{}",
            r.content_type
        );
        let sid = r.session.clone().expect("an Mcp-Session-Id");
        assert!(sid.len() >= 32, "{sid}");
        self.session = Some(sid);
        let n = self
            .post(
                &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
                BOTH,
            )
            .await;
        assert_eq!(n.status, 202, "{}", n.body);
        r.json()
    }

    async fn call(&self, id: Value, tool: &str, args: Value, accept: &str) -> Reply {
        self.post(
            &json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                    "params": {"name": tool, "arguments": args}}),
            accept,
        )
        .await
    }
}

/// The last event of an SSE answer (the response), or the JSON body.
fn answer_of(r: &Reply) -> Value {
    if r.content_type.starts_with("text/event-stream") {
        r.events().pop().expect("an event")
    } else {
        r.json()
    }
}

async fn mcp_listing(h: &HarnessHandle, session: &str) -> Value {
    let (status, v) = api(h)
        .get(&format!("/v1/sessions/{session}/mcp"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

/// Poll `GET .../mcp` until `ok` holds.
async fn listing_until(h: &HarnessHandle, session: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let v = mcp_listing(h, session).await;
        if ok(&v) {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "listing never got there: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn report(link: &Link, session: &str, key: &str, state: McpServerState, restarts: u32) {
    link.notify(
        Method::SessionStatus,
        &StatusParams {
            session_id: session.into(),
            status: SessionStatus::Running,
            detail: None,
            mcp_servers: vec![McpServerStatus {
                server_key: key.into(),
                state,
                restarts,
                reason: None,
                last_error: Some("previous crash".into()),
            }],
        },
    )
    .unwrap();
}

fn tool_names(listing: &Value, server: usize) -> Vec<String> {
    listing["servers"][server]["tools"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| t["name"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------

#[tokio::test]
async fn sessions_carry_mcp_servers_and_never_show_a_secret() {
    let h = harness().await;
    let mut events = h.events();
    let fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    // The executor got the whole spec, secret included.
    {
        let seen = fake.seen.lock().unwrap();
        let spec = &seen.assigns[0].mcp_servers[0];
        assert_eq!(spec.server_key, "everything");
        let secret = spec.transport.secret_env.as_ref().unwrap();
        assert_eq!(secret["API_KEY"], SECRET);
    }
    // Nothing the platform reads carries it.
    let c = api(&h);
    for path in [
        format!("/v1/sessions/{sid}"),
        "/v1/sessions".to_owned(),
        format!("/v1/sessions/{sid}/mcp"),
    ] {
        let (status, v) = c.get(&path).await.unwrap();
        assert_eq!(status, 200, "{path}: {v}");
        let text = v.to_string();
        assert!(!text.contains(SECRET), "{path} shows the secret: {text}");
        assert!(
            text.contains("API_KEY") && text.contains("<redacted>"),
            "{path}: {text}"
        );
    }
    let v = mcp_listing(&h, &sid).await;
    let s = &v["servers"][0];
    assert_eq!(s["serverKey"], "everything");
    assert_eq!(s["connectionOrigin"], "environment");
    assert_eq!(s["transport"]["type"], "stdio");
    assert_eq!(s["transport"]["env"]["PLAIN"], "visible");
    assert_eq!(s["state"], "starting");
    assert_eq!(s["tools"], json!([]));
    // A status report shows up in the listing and in the events.
    report(
        &fake.link,
        &sid,
        "everything",
        McpServerState::Restarting,
        1,
    );
    listing_until(&h, &sid, |v| v["servers"][0]["state"] == "restarting").await;
    let v = mcp_listing(&h, &sid).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(v["servers"][0]["restarts"], 1);
    assert_eq!(v["servers"][0]["lastError"], "previous crash");
    let mut saw_status = false;
    while let Ok(e) = events.try_recv() {
        let text = serde_json::to_string(&e).unwrap();
        assert!(!text.contains(SECRET), "an event shows the secret: {text}");
        if let HarnessEvent::SessionStatus { mcp_servers, .. } = &e {
            saw_status |= mcp_servers
                .iter()
                .any(|m| m.state == McpServerState::Restarting);
        }
    }
    assert!(saw_status, "the status event carries the MCP servers");
    h.shutdown().await;
}

#[tokio::test]
async fn bad_mcp_server_specs_are_refused_before_anything_is_sent() {
    let h = harness().await;
    let _fake = fake_mcp(&h, "secret-a", None).await;
    let c = api(&h);
    let mut service = stdio_spec("svc");
    service["connectionOrigin"] = json!("service");
    let mut no_command = stdio_spec("a");
    no_command["transport"]["command"] = Value::Null;
    let many: Vec<Value> = (0..33).map(|i| stdio_spec(&format!("s{i}"))).collect();
    for (what, specs) in [
        ("bad key", json!([stdio_spec("a b")])),
        ("repeated key", json!([stdio_spec("a"), stdio_spec("a")])),
        ("service origin", json!([service])),
        ("no command", json!([no_command])),
        ("too many", json!(many)),
    ] {
        let (status, v) = c
            .post("/v1/sessions", &json!({ "mcpServers": specs }))
            .await
            .unwrap();
        assert_eq!(status, 400, "{what}: {v}");
        assert!(!v.to_string().contains(SECRET), "{what}: {v}");
    }
    assert!(c.get("/v1/sessions").await.unwrap().1["sessions"]
        .as_array()
        .unwrap()
        .is_empty());
    h.shutdown().await;
}

#[tokio::test]
async fn tools_are_listed_once_ready_and_again_on_list_changed() {
    let h = harness().await;
    let fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything", "broken"]).await;
    report(&fake.link, &sid, "everything", McpServerState::Ready, 0);
    let v = listing_until(&h, &sid, |v| !tool_names(v, 0).is_empty()).await;
    assert_eq!(tool_names(&v, 0), vec!["echo"]);
    let echo = &v["servers"][0]["tools"][0];
    assert_eq!(echo["description"], "Echoes back the input");
    assert_eq!(echo["inputSchema"]["type"], "object");
    assert!(v["servers"][0]["toolsUpdatedAt"].is_string());
    assert_eq!(v["servers"][0]["state"], "ready");
    // The harness's own request used a harness id.
    {
        let seen = fake.seen.lock().unwrap();
        let list = seen
            .payloads
            .iter()
            .find(|p| p["method"] == "tools/list")
            .unwrap();
        assert!(list["id"].as_str().unwrap().starts_with("h:"), "{list}");
        assert_eq!(seen.opens.len(), 1, "one mcp.open");
    }
    // The server's tools change: it says so, the harness lists again.
    fake.tools
        .lock()
        .unwrap()
        .push(json!({"name": "add", "description": "Adds"}));
    frame(
        &fake.link,
        &sid,
        "everything",
        json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}),
    );
    let v = listing_until(&h, &sid, |v| tool_names(v, 0).len() == 2).await;
    assert_eq!(tool_names(&v, 0), vec!["echo", "add"]);
    // A server that cannot open: its listing says why, its clients get
    // the executor's error.
    report(&fake.link, &sid, "broken", McpServerState::Ready, 0);
    let v = listing_until(&h, &sid, |v| v["servers"][1]["toolsError"].is_string()).await;
    assert_eq!(v["servers"][1]["toolsError"], "server unavailable");
    let mut broken = Http::new(&h, &sid, "broken");
    let r = broken
        .post(
            &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}),
            BOTH,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], -32014, "{}", r.body);
    assert_eq!(r.json()["error"]["data"]["reason"], "spawn_failed");
    assert!(
        r.session.is_none(),
        "no client session for a failed initialize"
    );
    broken.session = None;
    h.shutdown().await;
}

#[tokio::test]
async fn two_clients_with_the_same_request_id_each_get_their_own_answer() {
    let h = harness().await;
    let fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    let mut a = Http::new(&h, &sid, "everything");
    let mut b = Http::new(&h, &sid, "everything");
    let init = a.initialize().await;
    assert_eq!(init["id"], 0);
    assert_eq!(init["result"]["serverInfo"]["name"], "fake-everything");
    b.initialize().await;
    assert_ne!(a.session, b.session, "each client its own session");
    // Same id (1, a number) from both, concurrently; a's answer comes later.
    let (ra, rb) = tokio::join!(
        a.call(
            json!(1),
            "slow",
            json!({"message": "from a", "ms": 300}),
            "application/json"
        ),
        b.call(
            json!(1),
            "slow",
            json!({"message": "from b", "ms": 10}),
            "application/json"
        ),
    );
    for (r, text) in [(&ra, "from a"), (&rb, "from b")] {
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["id"], json!(1), "the id keeps its type: {v}");
        assert_eq!(v["result"]["content"][0]["text"], text, "{v}");
    }
    // A string id stays a string.
    let r = a
        .call(
            json!("1"),
            "echo",
            json!({"message": "s"}),
            "application/json",
        )
        .await;
    assert_eq!(r.json()["id"], json!("1"));
    // What the server saw: unique harness ids, never the executor's.
    let payloads = fake.seen.lock().unwrap().payloads.clone();
    let ids: Vec<String> = payloads
        .iter()
        .filter_map(|p| p.get("id").and_then(Value::as_str).map(str::to_owned))
        .collect();
    assert!(ids.len() >= 5, "{ids:?}");
    let unique: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    assert!(ids.iter().all(|i| i.starts_with("h:")), "{ids:?}");
    assert!(payloads
        .iter()
        .any(|p| p["method"] == "notifications/initialized"));
    h.shutdown().await;
}

#[tokio::test]
async fn progress_then_the_answer_over_sse() {
    let h = harness().await;
    let _fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    let mut c = Http::new(&h, &sid, "everything");
    c.initialize().await;
    let r = c
        .post(
            &json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                "params": {"name": "echo", "arguments": {"message": "hi"},
                           "_meta": {"progressToken": "my-token"}}}),
            BOTH,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.content_type.starts_with("text/event-stream"),
        "{}",
        r.content_type
    );
    let events = r.events();
    assert_eq!(events.len(), 3, "{events:?}");
    for (i, e) in events[..2].iter().enumerate() {
        assert_eq!(e["method"], "notifications/progress");
        assert_eq!(
            e["params"]["progressToken"], "my-token",
            "the client's token"
        );
        assert_eq!(e["params"]["progress"], i + 1);
    }
    assert_eq!(events[2]["id"], 7);
    assert_eq!(events[2]["result"]["content"][0]["text"], "Echo: hi");
    // Accepting only JSON: the answer alone, as JSON.
    let r = c
        .call(
            json!(8),
            "echo",
            json!({"message": "j"}),
            "application/json",
        )
        .await;
    assert!(r.content_type.starts_with("application/json"));
    assert_eq!(r.json()["result"]["content"][0]["text"], "Echo: j");
    // Accepting only JSON while asking for progress: the server's progress
    // has nowhere to go (no queue is made for it) and the answer still
    // comes, as JSON.
    let r = c
        .post(
            &json!({"jsonrpc": "2.0", "id": 10, "method": "tools/call",
                "params": {"name": "echo", "arguments": {"message": "p"},
                           "_meta": {"progressToken": "lost"}}}),
            "application/json",
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.content_type.starts_with("application/json"));
    assert_eq!(r.json()["id"], 10);
    assert_eq!(r.json()["result"]["content"][0]["text"], "Echo: p");
    // Accepting both, without a progressToken: nothing could stream, so
    // the answer is one JSON body (the latency path), not SSE.
    let r = c
        .call(json!(9), "echo", json!({"message": "k"}), BOTH)
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.content_type.starts_with("application/json"),
        "{}",
        r.content_type
    );
    assert_eq!(r.json()["id"], 9);
    assert_eq!(r.json()["result"]["content"][0]["text"], "Echo: k");
    h.shutdown().await;
}

#[tokio::test]
async fn transport_rules_statuses_and_client_sessions() {
    let config = HarnessConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        max_mcp_frame_bytes: 64 << 10,
        ..Default::default()
    };
    let h = Harness::builder()
        .config(config)
        .token("exec-a", "secret-a")
        .heartbeat_ms(HEARTBEAT_MS)
        .lease_ttl_ms(TTL_MS)
        .build()
        .await
        .unwrap();
    let fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    let mut c = Http::new(&h, &sid, "everything");
    let ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"});
    // Before initialize: a session id is required.
    let r = c.post(&ping, BOTH).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["data"]["reason"], "missing_session_id");
    assert_eq!(r.json()["id"], 1);
    c.initialize().await;
    // JSON only, SSE only.
    let r = c.post(&ping, "application/json").await;
    assert_eq!((r.status, r.json()["result"].clone()), (200, json!({})));
    let r = c.post(&ping, "text/event-stream").await;
    assert!(r.content_type.starts_with("text/event-stream"));
    assert_eq!(r.events()[0]["id"], 1);
    // Media types.
    assert_eq!(c.post(&ping, "text/html").await.status, 406);
    let r = c.post_raw(ping.to_string(), BOTH, "text/plain").await;
    assert_eq!(r.status, 415);
    // Not JSON, a batch, not JSON-RPC.
    let r = c.post_raw("{nope".into(), BOTH, "application/json").await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (400, json!(-32700))
    );
    assert_eq!(r.json()["id"], Value::Null);
    let r = c.post(&json!([ping.clone()]), BOTH).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (400, json!(-32600))
    );
    let r = c.post(&json!({"jsonrpc": "2.0", "id": 3}), BOTH).await;
    assert_eq!((r.status, r.json()["id"].clone()), (400, json!(3)));
    // Too large for maxMcpFrameBytes: 413, and the connection lives on.
    let big = json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "x".repeat(70 << 10)}}});
    let r = c.post(&big, BOTH).await;
    assert_eq!(r.status, 413, "{}", r.body);
    // Escaping makes this one too large as carried in mcp.frame.
    let quoted = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "\"".repeat(25 << 10)}}});
    assert!(quoted.to_string().len() < 64 << 10);
    assert_eq!(c.post(&quoted, BOTH).await.status, 413);
    let r = c
        .call(
            json!(6),
            "echo",
            json!({"message": "still"}),
            "application/json",
        )
        .await;
    assert_eq!(r.json()["result"]["content"][0]["text"], "Echo: still");
    // Notifications and responses: 202.
    let r = c
        .post(
            &json!({"jsonrpc": "2.0", "method": "notifications/roots/list_changed"}),
            BOTH,
        )
        .await;
    assert_eq!(r.status, 202);
    let r = c
        .post(
            &json!({"jsonrpc": "2.0", "id": "bmx:9", "result": {}}),
            BOTH,
        )
        .await;
    assert_eq!(r.status, 202);
    // Unknown session ids: 404; unknown session or server: 404.
    let mut stranger = Http::new(&h, &sid, "everything");
    stranger.session = Some("0123456789abcdef0123456789abcdef".into());
    let r = stranger.post(&ping, BOTH).await;
    assert_eq!(r.status, 404, "{}", r.body);
    let r = Http::new(&h, &sid, "nope").post(&ping, BOTH).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["data"]["reason"], "unknown_server");
    let r = Http::new(&h, "no-such-session", "everything")
        .post(&ping, BOTH)
        .await;
    assert_eq!(r.status, 404);
    // DELETE ends the client session; it is then unknown.
    let r = c.send(c.request(reqwest::Method::DELETE)).await;
    assert_eq!(r.status, 204, "{}", r.body);
    let r = c.post(&ping, BOTH).await;
    assert_eq!(r.status, 404);
    let r = c.send(c.request(reqwest::Method::DELETE)).await;
    assert_eq!(r.status, 404);
    // The notification the client sent reached the server.
    assert!(fake
        .seen
        .lock()
        .unwrap()
        .payloads
        .iter()
        .any(|p| p["method"] == "notifications/roots/list_changed"));
    h.shutdown().await;
}

#[tokio::test]
async fn the_notification_stream_carries_server_notifications() {
    let h = harness().await;
    let fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    let mut c = Http::new(&h, &sid, "everything");
    c.initialize().await;
    // GET needs an SSE Accept and a session.
    let r = c
        .send(
            c.request(reqwest::Method::GET)
                .header("accept", "application/json"),
        )
        .await;
    assert_eq!(r.status, 406);
    let resp = c
        .request(reqwest::Method::GET)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    // A second stream for the same client session: 409.
    let r = c
        .send(
            c.request(reqwest::Method::GET)
                .header("accept", "text/event-stream"),
        )
        .await;
    assert_eq!(r.status, 409);
    let mut body = resp.bytes_stream();
    // The 409 above is the proof the first stream is attached: notify now.
    frame(
        &fake.link,
        &sid,
        "everything",
        json!({"jsonrpc": "2.0", "method": "notifications/message",
               "params": {"level": "info", "data": "hello stream"}}),
    );
    let mut text = String::new();
    let got = tokio::time::timeout(LONG, async {
        while let Some(chunk) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if let Some(v) = sse_data(&text).into_iter().next() {
                return v;
            }
        }
        panic!("stream ended: {text}");
    })
    .await
    .expect("a notification on the stream");
    assert_eq!(got["method"], "notifications/message");
    assert_eq!(got["params"]["data"], "hello stream");
    h.shutdown().await;
}

#[tokio::test]
async fn a_lost_executor_answers_every_request_in_flight_then_the_channel_reopens() {
    let h = harness().await;
    let mut fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    let mut a = Http::new(&h, &sid, "everything");
    a.initialize().await;
    let mut b = Http::new(&h, &sid, "everything");
    b.initialize().await;
    let started = std::time::Instant::now();
    let (ra, rb, _) = tokio::join!(
        a.call(json!(1), "hang", json!({}), BOTH),
        b.call(json!(1), "hang", json!({}), "application/json"),
        async {
            // Both requests reach the server, then the connection drops.
            let deadline = tokio::time::Instant::now() + LONG;
            while fake
                .seen
                .lock()
                .unwrap()
                .payloads
                .iter()
                .filter(|p| p["method"] == "tools/call")
                .count()
                < 2
            {
                assert!(tokio::time::Instant::now() < deadline);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            fake.link.close(bmx::wire::CloseCode::Other(1011), "gone");
        }
    );
    assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    for r in [&ra, &rb] {
        assert_eq!(r.status, 200, "{}", r.body);
        let v = answer_of(r);
        assert_eq!(v["id"], 1, "{v}");
        assert_eq!(v["error"]["code"], -32603, "{v}");
        assert_eq!(v["error"]["data"]["reason"], "executor_disconnected", "{v}");
    }
    let _ = fake.closed_within_ms(2_000).await;
    // The executor comes back with the session: the channel is opened
    // again on the new connection and requests flow.
    let fake2 = fake_mcp(
        &h,
        "secret-a",
        Some(Resume {
            executor_id: "exec-a".into(),
            last_connection_id: String::new(),
            active_sessions: vec![sid.clone()],
            fencing_tokens: Default::default(),
        }),
    )
    .await;
    let deadline = tokio::time::Instant::now() + LONG;
    while fake2.seen.lock().unwrap().opens.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the harness re-opens the channel"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = a
        .call(
            json!(2),
            "echo",
            json!({"message": "back"}),
            "application/json",
        )
        .await;
    assert_eq!(
        r.json()["result"]["content"][0]["text"],
        "Echo: back",
        "{}",
        r.body
    );
    h.shutdown().await;
}

impl FakeMcp {
    async fn closed_within_ms(&mut self, ms: u64) -> Option<bmx::wire::Closed> {
        tokio::time::timeout(Duration::from_millis(ms), &mut self.closed)
            .await
            .ok()
            .and_then(Result::ok)
    }
}

#[tokio::test]
async fn an_unanswered_request_times_out_and_is_cancelled_at_the_server() {
    let config = HarnessConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        mcp_request_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let h = Harness::builder()
        .config(config)
        .token("exec-a", "secret-a")
        .heartbeat_ms(HEARTBEAT_MS)
        .lease_ttl_ms(TTL_MS)
        .build()
        .await
        .unwrap();
    let fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    let mut c = Http::new(&h, &sid, "everything");
    c.initialize().await;
    let r = c.call(json!(42), "hang", json!({}), BOTH).await;
    let v = answer_of(&r);
    assert_eq!(v["id"], 42);
    assert_eq!(v["error"]["code"], -32001, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "timeout");
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let cancelled = fake.seen.lock().unwrap().payloads.iter().any(|p| {
            p["method"] == "notifications/cancelled"
                && p["params"]["requestId"]
                    .as_str()
                    .is_some_and(|i| i.starts_with("h:"))
        });
        if cancelled {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no notifications/cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    h.shutdown().await;
}

#[tokio::test]
async fn the_end_of_the_session_answers_requests_in_flight() {
    let h = harness().await;
    let _fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    let mut c = Http::new(&h, &sid, "everything");
    c.initialize().await;
    let c = Arc::new(c);
    let c2 = c.clone();
    let pending = tokio::spawn(async move { c2.call(json!(1), "hang", json!({}), BOTH).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, v) = api(&h)
        .delete(&format!("/v1/sessions/{sid}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    let r = tokio::time::timeout(LONG, pending).await.unwrap().unwrap();
    let v = answer_of(&r);
    assert_eq!(v["error"]["data"]["reason"], "session_ended", "{v}");
    // The endpoint of an ended session: 410.
    let r = c
        .post(&json!({"jsonrpc": "2.0", "id": 2, "method": "ping"}), BOTH)
        .await;
    assert_eq!(r.status, 410, "{}", r.body);
    h.shutdown().await;
}

#[tokio::test]
async fn the_endpoint_needs_the_api_token() {
    let h = Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("exec-a", "secret-a")
        .api_token(Some("api-token-0123456789".into()))
        .heartbeat_ms(HEARTBEAT_MS)
        .lease_ttl_ms(TTL_MS)
        .build()
        .await
        .unwrap();
    let _fake = fake_mcp(&h, "secret-a", None).await;
    let client = api(&h).token(Some("api-token-0123456789".into()));
    let (status, v) = client
        .post(
            "/v1/sessions",
            &json!({"mcpServers": [stdio_spec("everything")]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();
    let mut c = Http::new(&h, &sid, "everything");
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}});
    let r = c.post(&init, BOTH).await;
    assert_eq!(r.status, 401);
    c.token = Some("wrong".into());
    assert_eq!(c.post(&init, BOTH).await.status, 401);
    let (status, _) = api(&h)
        .get(&format!("/v1/sessions/{sid}/mcp"))
        .await
        .unwrap();
    assert_eq!(status, 401);
    // Both routes are in the OpenAPI document.
    let (_, doc) = client.get("/v1/openapi.json").await.unwrap();
    for path in ["/v1/sessions/{id}/mcp", "/v1/sessions/{id}/mcp/{serverKey}"] {
        assert!(doc["paths"].get(path).is_some(), "{path} documented");
    }
    assert!(doc["paths"]["/v1/sessions/{id}/mcp/{serverKey}"]["delete"].is_object());
    c.token = Some("api-token-0123456789".into());
    c.initialize().await;
    let r = c
        .call(
            json!(1),
            "echo",
            json!({"message": "ok"}),
            "application/json",
        )
        .await;
    assert_eq!(r.json()["result"]["content"][0]["text"], "Echo: ok");
    h.shutdown().await;
}

// ---------------------------------------------------------------------
// End to end: the real executor, real MCP servers (tests/peers), and
// rmcp's own Streamable HTTP client: an MCP client written by others.
// ---------------------------------------------------------------------

const API_TOKEN: &str = "mcp-e2e-api-token";

fn peer(bin: &str) -> String {
    format!(
        "{}/tests/peers/node_modules/.bin/{bin}",
        env!("CARGO_MANIFEST_DIR")
    )
}

async fn listing_with(
    client: &bmx::client::ApiClient,
    session: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (status, v) = client
            .get(&format!("/v1/sessions/{session}/mcp"))
            .await
            .unwrap();
        assert_eq!(status, 200, "{v}");
        if ok(&v) {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "listing never got there: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn rmcp_client(
    url: &str,
    token: &str,
) -> Result<rmcp::service::RunningService<rmcp::RoleClient, ()>, rmcp::service::ClientInitializeError>
{
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::ServiceExt;
    let config = StreamableHttpClientTransportConfig::with_uri(url.to_owned()).auth_header(token);
    ().serve(StreamableHttpClientTransport::from_config(config))
        .await
}

fn text_of(r: &rmcp::model::CallToolResult) -> String {
    serde_json::to_value(&r.content).unwrap()[0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn args(v: Value) -> rmcp::model::JsonObject {
    v.as_object().unwrap().clone()
}

#[tokio::test]
async fn an_independent_mcp_client_uses_real_servers_through_the_harness() {
    use rmcp::model::CallToolRequestParams;
    let (h, executor, work) = harness_with_executor_tweaked(
        "exec-mcp",
        |b| {
            b.heartbeat_ms(200)
                .lease_ttl_ms(10_000)
                .api_token(Some(API_TOKEN.into()))
        },
        |_| {},
    )
    .await;
    let client = api(&h).token(Some(API_TOKEN.into()));
    let sid = "e2e";
    let ws = bmx::executor::actors::session::workspace_dir(work.path(), sid);
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("note.txt"), "inside the workspace\n").unwrap();
    let ws = ws.canonicalize().unwrap();
    let (status, v) = client
        .post(
            "/v1/sessions",
            &json!({"sessionId": sid, "mcpServers": [
                {"serverKey": "everything", "connectionOrigin": "environment",
                 "transport": {"type": "stdio", "command": peer("mcp-server-everything"),
                               "secretEnv": {"E2E_SECRET": SECRET}}},
                {"serverKey": "fs", "connectionOrigin": "environment",
                 "transport": {"type": "stdio", "command": peer("mcp-server-filesystem"),
                               "args": [ws.to_str().unwrap()]}}]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{v}");
    // The platform's view: both servers ready, with their tools.
    let has = |v: &Value, i: usize, tool: &str| tool_names(v, i).iter().any(|t| t == tool);
    let v = listing_with(&client, sid, |v| {
        has(v, 0, "echo") && has(v, 1, "read_text_file")
    })
    .await;
    assert_eq!(v["servers"][0]["state"], "ready", "{v}");
    assert_eq!(v["servers"][1]["state"], "ready", "{v}");
    assert!(!v.to_string().contains(SECRET));

    let url = format!("{}/v1/sessions/{sid}/mcp/everything", h.api_url());
    // Without the API token: refused.
    assert!(rmcp_client(&url, "wrong").await.is_err());
    // Two independent clients; rmcp numbers its requests from 0 in each,
    // so their ids collide on the one server behind the harness.
    let a = rmcp_client(&url, API_TOKEN)
        .await
        .expect("client a initializes");
    let b = rmcp_client(&url, API_TOKEN)
        .await
        .expect("client b initializes");
    let info = a.peer_info().expect("the server's InitializeResult");
    assert!(info.capabilities.tools.is_some(), "{info:?}");
    let tools = a.list_all_tools().await.unwrap();
    assert!(tools.iter().any(|t| t.name == "echo"), "{tools:?}");
    let (ra, rb) = tokio::join!(
        a.call_tool(
            CallToolRequestParams::new("echo").with_arguments(args(json!({"message": "from a"})))
        ),
        b.call_tool(
            CallToolRequestParams::new("echo").with_arguments(args(json!({"message": "from b"})))
        ),
    );
    assert_eq!(text_of(&ra.unwrap()), "Echo: from a");
    assert_eq!(text_of(&rb.unwrap()), "Echo: from b");
    for i in 0..10 {
        let r = b
            .call_tool(
                CallToolRequestParams::new("echo")
                    .with_arguments(args(json!({"message": format!("n{i}")}))),
            )
            .await
            .unwrap();
        assert_eq!(text_of(&r), format!("Echo: n{i}"));
    }
    // The filesystem server reads inside the workspace.
    let fs_url = format!("{}/v1/sessions/{sid}/mcp/fs", h.api_url());
    let fs = rmcp_client(&fs_url, API_TOKEN).await.expect("fs client");
    let r = fs
        .call_tool(
            CallToolRequestParams::new("read_text_file")
                .with_arguments(args(json!({"path": ws.join("note.txt")}))),
        )
        .await
        .unwrap();
    assert!(text_of(&r).contains("inside the workspace"), "{r:?}");
    for c in [a, b, fs] {
        let _ = c.cancel().await;
    }
    // The session ends: its channels go, its listing stays readable.
    let (status, v) = client.delete(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200, "{v}");
    let r = rmcp_client(&url, API_TOKEN).await;
    assert!(r.is_err(), "an ended session's endpoint refuses");
    executor.shutdown().await;
    h.shutdown().await;
}

#[tokio::test]
async fn progress_from_a_real_server_reaches_the_client_over_sse() {
    let (h, executor, _work) = harness_with_executor("exec-mcp-progress", 10_000).await;
    let (status, v) = api(&h)
        .post(
            "/v1/sessions",
            &json!({"mcpServers": [{"serverKey": "everything", "connectionOrigin": "environment",
                "transport": {"type": "stdio", "command": peer("mcp-server-everything")}}]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();
    let tools = listing_with(&api(&h), &sid, |v| !tool_names(v, 0).is_empty()).await;
    let names = tool_names(&tools, 0);
    // server-everything's long-running tool reports progress.
    let slow = ["trigger-long-running-operation", "longRunningOperation"]
        .into_iter()
        .find(|n| names.iter().any(|t| t == n))
        .unwrap_or_else(|| panic!("no long-running tool in {names:?}"));
    let mut c = Http::new(&h, &sid, "everything");
    c.initialize().await;
    let r = c
        .post(
            &json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                "params": {"name": slow, "arguments": {"duration": 1, "steps": 3},
                           "_meta": {"progressToken": 99}}}),
            BOTH,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    let progress: Vec<&Value> = events
        .iter()
        .filter(|e| e["method"] == "notifications/progress")
        .collect();
    assert!(!progress.is_empty(), "{events:?}");
    assert!(
        progress.iter().all(|p| p["params"]["progressToken"] == 99),
        "{events:?}"
    );
    let last = events.last().unwrap();
    assert_eq!(last["id"], 3, "{last}");
    assert!(last.get("result").is_some(), "{last}");
    executor.shutdown().await;
    h.shutdown().await;
}

/// Captures everything the harness logs on this test's thread.
#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Neither a `secretEnv` value nor an MCP payload appears in what the
/// harness logs at trace level (one thread: the subscriber sees every
/// task of this test, and only those).
#[tokio::test(flavor = "current_thread")]
async fn neither_secrets_nor_payloads_are_logged_at_trace_level() {
    const IN_PAYLOAD: &str = "payload-secret-0a9f3e";
    let buf = LogBuf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let h = harness().await;
    let fake = fake_mcp(&h, "secret-a", None).await;
    let sid = session_with(&h, &["everything"]).await;
    report(&fake.link, &sid, "everything", McpServerState::Ready, 0);
    listing_until(&h, &sid, |v| !tool_names(v, 0).is_empty()).await;
    let mut c = Http::new(&h, &sid, "everything");
    c.initialize().await;
    let r = c
        .call(json!(1), "echo", json!({"message": IN_PAYLOAD}), BOTH)
        .await;
    assert_eq!(
        answer_of(&r)["result"]["content"][0]["text"],
        format!("Echo: {IN_PAYLOAD}")
    );
    h.shutdown().await;
    let logged = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    assert!(logged.contains("client request"), "trace logging ran");
    assert!(!logged.contains(SECRET), "a secretEnv value was logged");
    assert!(!logged.contains(IN_PAYLOAD), "an MCP payload was logged");
}
