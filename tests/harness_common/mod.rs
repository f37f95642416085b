//! A fake executor for the harness tests: a real WebSocket client (the
//! project's own `transport::dial` + `Link`) whose inbound requests land in
//! a channel the test answers by hand.

#![allow(dead_code)]

use bmx::client::ApiClient;
use bmx::harness::{Harness, HarnessHandle};
use bmx::wire::transport::{self, DialError};
use bmx::wire::types::{
    ExecutorInfo, HeartbeatParams, HeartbeatResult, RegisterParams, RegisterResult, Resume,
};
use bmx::wire::{
    CallError, Closed, Dispatch, Endpoint, Inbound, Link, LinkLimits, Method, Responder,
    Subprotocol,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

pub const HEARTBEAT_MS: u64 = 200;
pub const TTL_MS: u64 = 1_000;
pub const WAIT: Duration = Duration::from_secs(5);

/// A harness on 127.0.0.1:0 with tokens `secret-a` → `exec-a`, `secret-b` →
/// `exec-b`, and any token `id:ID` → `ID`; heartbeat 200 ms, TTL 1 s.
pub async fn harness() -> HarnessHandle {
    Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("exec-a", "secret-a")
        .token("exec-b", "secret-b")
        .authenticate(|t| t.strip_prefix("id:").map(str::to_owned))
        .heartbeat_ms(HEARTBEAT_MS)
        .lease_ttl_ms(TTL_MS)
        .build()
        .await
        .expect("harness starts")
}

pub fn api(h: &HarnessHandle) -> ApiClient {
    ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(20))
}

struct Inbox(mpsc::UnboundedSender<(Inbound, Option<Responder>)>);

impl Dispatch for Inbox {
    fn dispatch(&self, frame: Inbound, reply: Option<Responder>) {
        let _ = self.0.send((frame, reply));
    }
}

pub struct Fake {
    pub link: Link,
    pub closed: oneshot::Receiver<Closed>,
    pub inbox: mpsc::UnboundedReceiver<(Inbound, Option<Responder>)>,
    pub connection_id: String,
}

pub async fn dial(h: &HarnessHandle, token: &str) -> Result<Fake, DialError> {
    dial_endpoint(&Endpoint::parse(&h.executor_url()).unwrap(), token).await
}

pub async fn dial_endpoint(endpoint: &Endpoint, token: &str) -> Result<Fake, DialError> {
    let t = transport::dial(endpoint, token, &Subprotocol::ALL, 4 << 20, WAIT).await?;
    let (link, reader) = Link::start(t, "e", LinkLimits::default());
    let (tx, inbox) = mpsc::unbounded_channel();
    let (ctx, closed) = oneshot::channel();
    tokio::spawn(async move {
        let c = reader.run(Arc::new(Inbox(tx))).await;
        let _ = ctx.send(c);
    });
    Ok(Fake {
        link,
        closed,
        inbox,
        connection_id: String::new(),
    })
}

pub fn register_params(resume: Option<Resume>) -> RegisterParams {
    RegisterParams {
        protocol: "1.1".into(),
        executor: ExecutorInfo {
            name: "fake".into(),
            version: "0.0.1".into(),
            os: "linux".into(),
            arch: "x86_64".into(),
        },
        environment_id: None,
        capabilities: Default::default(),
        resume,
    }
}

impl Fake {
    pub async fn register(&mut self, resume: Option<Resume>) -> Result<RegisterResult, CallError> {
        let r: RegisterResult = self
            .link
            .request(Method::ExecutorRegister, &register_params(resume), WAIT)
            .await?;
        self.connection_id = r.connection_id.clone();
        Ok(r)
    }

    pub async fn heartbeat(&self) -> Result<HeartbeatResult, CallError> {
        self.link
            .request(
                Method::ExecutorHeartbeat,
                &HeartbeatParams {
                    connection_id: self.connection_id.clone(),
                    active_sessions: vec![],
                    load: None,
                },
                WAIT,
            )
            .await
    }

    /// Heartbeat every HEARTBEAT_MS until the connection closes.
    pub fn keep_alive(&self) {
        let link = self.link.clone();
        let cid = self.connection_id.clone();
        tokio::spawn(async move {
            while !link.is_closed() {
                let _ = link
                    .request::<_, HeartbeatResult>(
                        Method::ExecutorHeartbeat,
                        &HeartbeatParams {
                            connection_id: cid.clone(),
                            active_sessions: vec![],
                            load: None,
                        },
                        WAIT,
                    )
                    .await;
                tokio::time::sleep(Duration::from_millis(HEARTBEAT_MS)).await;
            }
        });
    }

    /// The next request of `method` from the harness (notifications and
    /// other methods are skipped).
    pub async fn expect<P: DeserializeOwned>(&mut self, method: Method) -> (P, Responder) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let next = tokio::time::timeout_at(deadline, self.inbox.recv())
                .await
                .unwrap_or_else(|_| panic!("no {method} within {WAIT:?}"))
                .expect("connection open");
            if next.0.method() == Some(method.as_str()) {
                if let Some(r) = next.1 {
                    return (next.0.params::<P>().expect("params decode"), r);
                }
            }
        }
    }

    /// Whether some request of `method` arrives within `within`.
    pub async fn sees(&mut self, method: Method, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.inbox.recv()).await {
                Err(_) | Ok(None) => return false,
                Ok(Some((f, _))) if f.method() == Some(method.as_str()) => return true,
                Ok(Some(_)) => {}
            }
        }
    }

    pub async fn call<P: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        params: &P,
    ) -> Result<R, CallError> {
        self.link.request(method, params, WAIT).await
    }

    /// The executor's side of a session stop: the next `session.stop` is
    /// for `session` and is acknowledged, then `session.ended` (reason
    /// `stopped`) is reported and accepted. What a DELETE of the session
    /// waits for.
    pub async fn end_as_stopped(&mut self, session: &str) {
        use bmx::wire::types::{Accepted, EndedParams, StopParams, StopResult};
        let (p, r): (StopParams, Responder) = self.expect(Method::SessionStop).await;
        assert_eq!(p.session_id, session);
        r.ok(&StopResult { stopped: true });
        let a: Accepted = self
            .call(
                Method::SessionEnded,
                &EndedParams {
                    session_id: session.into(),
                    reason: "stopped".into(),
                },
            )
            .await
            .unwrap();
        assert!(a.accepted);
    }

    /// How the connection ended, waiting at most `within`.
    pub async fn closed_within(&mut self, within: Duration) -> Option<Closed> {
        tokio::time::timeout(within, &mut self.closed)
            .await
            .ok()
            .and_then(Result::ok)
    }
}

pub fn rpc_code(e: &CallError) -> Option<i32> {
    match e {
        CallError::Rpc(r) => Some(r.code),
        _ => None,
    }
}

pub fn rpc_reason(e: &CallError) -> Option<String> {
    match e {
        CallError::Rpc(r) => r.reason().map(str::to_owned),
        _ => None,
    }
}

/// Create a session through the API with `body`; the fake accepts the
/// assign. Returns the API's answer.
pub async fn create_session(
    h: &HarnessHandle,
    fake: &mut Fake,
    body: serde_json::Value,
) -> serde_json::Value {
    use bmx::wire::types::{AssignParams, AssignResult};
    let client = api(h);
    let task = tokio::spawn(async move { client.post("/v1/sessions", &body).await.unwrap() });
    let (p, r): (AssignParams, Responder) = fake.expect(Method::SessionAssign).await;
    r.ok(&AssignResult {
        accepted: true,
        session_id: p.session_id.clone(),
    });
    let (status, v) = task.await.unwrap();
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["sessionId"], p.session_id.as_str());
    assert_eq!(v["fencingToken"], p.lease.fencing_token);
    v
}

/// A successful `tool.result` with one text block.
pub fn tool_result(session: &str, id: &str, text: &str) -> bmx::wire::types::ToolResultParams {
    use bmx::wire::types::{ContentBlock, Outcome, ToolResultParams};
    ToolResultParams {
        session_id: session.into(),
        tool_call_id: id.into(),
        outcome: Outcome::Succeeded,
        is_error: false,
        content: vec![ContentBlock::text(text)],
        artifacts: vec![],
        duration_ms: 1,
        reason: None,
    }
}

/// A harness (heartbeat 200 ms, lease TTL `lease_ttl_ms`) and a real
/// executor registered with it as `executor_id`. The temporary directory
/// is the executor's work root: keep it alive for the test.
pub async fn harness_with_executor(
    executor_id: &str,
    lease_ttl_ms: u64,
) -> (
    HarnessHandle,
    bmx::executor::ExecutorHandle,
    tempfile::TempDir,
) {
    harness_with_executor_tweaked(
        executor_id,
        |b| b.heartbeat_ms(200).lease_ttl_ms(lease_ttl_ms),
        |_| {},
    )
    .await
}

/// [`harness_with_executor`] with the harness builder and the executor's
/// config adjusted by the test.
pub async fn harness_with_executor_tweaked(
    executor_id: &str,
    harness: impl FnOnce(bmx::harness::HarnessBuilder) -> bmx::harness::HarnessBuilder,
    executor: impl FnOnce(&mut bmx::executor::ExecutorConfig),
) -> (
    HarnessHandle,
    bmx::executor::ExecutorHandle,
    tempfile::TempDir,
) {
    use bmx::executor::{Executor, ExecutorConfig, TokenSource};
    let token = format!("tok-{executor_id}");
    let builder = Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token(executor_id, &token);
    let h = harness(builder).build().await.unwrap();
    let work = tempfile::tempdir().unwrap();
    let mut config = ExecutorConfig::new(
        Endpoint::parse(&h.executor_url()).unwrap(),
        TokenSource::Static(token),
    );
    config.work_root = work.path().to_owned();
    executor(&mut config);
    let running = Executor::start(config).await.unwrap();
    assert!(
        h.wait_for_executor(Some(executor_id), Duration::from_secs(10))
            .await,
        "the executor registers"
    );
    (h, running, work)
}

/// One Server-Sent Event as a test sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct SseMsg {
    /// `event:` (None for the default `message`).
    pub event: Option<String>,
    pub id: Option<String>,
    pub data: serde_json::Value,
}

/// A real SSE client (reqwest, streaming) of `GET path` with an optional
/// `Last-Event-ID`; parses events as they arrive.
pub struct Sse {
    pub status: u16,
    pub body: Option<serde_json::Value>,
    stream: Option<
        std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    >,
    buf: Vec<u8>,
}

pub async fn sse(
    h: &HarnessHandle,
    path: &str,
    last_event_id: Option<u64>,
    token: Option<&str>,
) -> Sse {
    sse_at(&h.api_url(), path, last_event_id, token).await
}

/// [`sse`] against the harness API at `api_url` (a harness in another
/// process).
pub async fn sse_at(
    api_url: &str,
    path: &str,
    last_event_id: Option<u64>,
    token: Option<&str>,
) -> Sse {
    let mut req = reqwest::Client::new()
        .get(format!("{api_url}{path}"))
        .header("accept", "text/event-stream");
    if let Some(id) = last_event_id {
        req = req.header("last-event-id", id.to_string());
    }
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("SSE request");
    let status = resp.status().as_u16();
    if status != 200 {
        let body = resp
            .bytes()
            .await
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        return Sse {
            status,
            body,
            stream: None,
            buf: Vec::new(),
        };
    }
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    Sse {
        status,
        body: None,
        stream: Some(Box::pin(resp.bytes_stream())),
        buf: Vec::new(),
    }
}

impl Sse {
    /// The next event (comments skipped), or None when the stream ends or
    /// nothing comes within `within`.
    pub async fn next_within(&mut self, within: Duration) -> Option<SseMsg> {
        use futures_util::StreamExt;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // A complete event ends with a blank line.
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buf.drain(..end + 2).collect();
                let text = String::from_utf8(block).expect("utf-8");
                let mut msg = SseMsg {
                    event: None,
                    id: None,
                    data: serde_json::Value::Null,
                };
                let mut data = String::new();
                for line in text.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        msg.event = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("id:") {
                        msg.id = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.strip_prefix(' ').unwrap_or(v));
                    }
                }
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                msg.data = serde_json::from_str(&data).expect("data is JSON");
                return Some(msg);
            }
            let stream = self.stream.as_mut()?;
            match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(Some(Ok(chunk))) => self.buf.extend_from_slice(&chunk),
                _ => return None,
            }
        }
    }

    pub async fn next(&mut self) -> SseMsg {
        self.next_within(WAIT).await.expect("an SSE event")
    }
}

/// A fake executor registered as `exec-a` (heartbeating) and a session
/// created on it.
pub async fn fake_with_session(h: &HarnessHandle) -> (Fake, String) {
    let mut fake = dial(h, "secret-a").await.unwrap();
    fake.register(None).await.unwrap();
    fake.keep_alive();
    let v = create_session(h, &mut fake, serde_json::json!({})).await;
    let id = v["sessionId"].as_str().unwrap().to_owned();
    (fake, id)
}

/// `session.event` from the fake: its answer.
pub async fn send_event(
    fake: &Fake,
    session: &str,
    turn: &str,
    sequence: u64,
    event: serde_json::Value,
) -> Result<serde_json::Value, CallError> {
    fake.call(
        Method::SessionEvent,
        &serde_json::json!({
            "sessionId": session, "turnId": turn, "eventId": format!("ev-{sequence}"),
            "sequence": sequence, "event": event,
        }),
    )
    .await
}
