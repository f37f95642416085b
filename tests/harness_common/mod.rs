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
