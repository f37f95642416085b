//! An MCP server over Streamable HTTP (MCP 2025-03-26 and later): every
//! message is a POST; the answer to a request comes as one JSON body or as
//! an SSE stream (progress notifications first, the response last).
//!
//! The server's `Mcp-Session-Id` (from the `initialize` answer) and the
//! negotiated `MCP-Protocol-Version` go on every later request. A GET
//! stream carries what the server sends unprompted, when it offers one.
//! A 404 on a request with a session id means the server forgot the
//! session: the server is treated as crashed (its actor restarts and
//! initializes again). A request unanswered within `timeoutMs` gets a
//! timeout error; one the server refuses (HTTP error, unreachable) gets an
//! internal error; all of them are answered, none is dropped.

use super::peer::{PeerEvent, Sink};
use super::sse::SseReader;
use crate::mcp::message::{self, code};
use futures_util::StreamExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";
/// Consecutive GET stream failures before it is given up.
const GET_RETRIES: u32 = 5;

struct Inner {
    client: reqwest::Client,
    url: String,
    session: Mutex<Option<String>>,
    version: Mutex<Option<String>>,
    timeout: Duration,
    max: usize,
    sink: Sink,
}

pub struct Http {
    inner: Arc<Inner>,
    tasks: Mutex<tokio::task::JoinSet<()>>,
}

impl Http {
    pub fn new(url: String, timeout: Duration, max: usize, sink: Sink) -> Result<Http, String> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| format!("http client: {e}"))?;
        Ok(Http {
            inner: Arc::new(Inner {
                client,
                url,
                session: Mutex::new(None),
                version: Mutex::new(None),
                timeout,
                max,
                sink,
            }),
            tasks: Mutex::new(tokio::task::JoinSet::new()),
        })
    }

    fn spawn(&self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        if let Ok(mut t) = self.tasks.lock() {
            // Reap finished POSTs so the set stays as large as what runs.
            while t.try_join_next().is_some() {}
            t.spawn(f);
        }
    }

    /// POST one message. `request`: its id, when it is a request.
    pub fn send(&self, msg: String, request: Option<String>) {
        let inner = self.inner.clone();
        self.spawn(async move {
            let is_init = request.as_deref() == Some(crate::mcp::relay::INIT_ID);
            let post = inner.post(msg, is_init);
            let outcome = match &request {
                Some(_) => match tokio::time::timeout(inner.timeout, post).await {
                    Ok(r) => r,
                    Err(_) => Err((
                        code::TIMEOUT,
                        format!("no answer within {} ms", inner.timeout.as_millis()),
                        "timeout",
                    )),
                },
                None => post.await,
            };
            if let Err((code, text, reason)) = outcome {
                match request {
                    Some(id) => (inner.sink)(PeerEvent::Message(message::error_response(
                        &id, code, &text, reason,
                    ))),
                    None => {
                        tracing::warn!(error = %text, "mcp http: a notification was not delivered")
                    }
                }
            }
        });
    }

    /// `initialize` answered: later requests carry the version, and the
    /// server's own stream is opened.
    pub fn initialized(&self, version: Option<String>) {
        if let Ok(mut v) = self.inner.version.lock() {
            *v = version;
        }
        let inner = self.inner.clone();
        self.spawn(async move { inner.listen().await });
    }

    pub async fn shutdown(&mut self) {
        if let Ok(mut t) = self.tasks.lock() {
            t.abort_all();
        }
        let session = self.inner.session.lock().ok().and_then(|s| s.clone());
        if let Some(session) = session {
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                self.inner
                    .client
                    .delete(&self.inner.url)
                    .header(SESSION_HEADER, session)
                    .send(),
            )
            .await;
        }
    }
}

type Failure = (i64, String, &'static str);

impl Inner {
    fn headers(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let mut req = req;
        if let Some(s) = self.session.lock().ok().and_then(|s| s.clone()) {
            req = req.header(SESSION_HEADER, s);
        }
        if let Some(v) = self.version.lock().ok().and_then(|v| v.clone()) {
            req = req.header(VERSION_HEADER, v);
        }
        req
    }

    async fn post(&self, msg: String, is_init: bool) -> Result<(), Failure> {
        let had_session = self.session.lock().map(|s| s.is_some()).unwrap_or(false);
        let req = self
            .headers(self.client.post(&self.url))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(
                reqwest::header::ACCEPT,
                "application/json, text/event-stream",
            )
            .body(msg);
        let resp = req.send().await.map_err(|e| {
            (
                code::INTERNAL_ERROR,
                format!("the server cannot be reached: {}", without_url(&e)),
                "unreachable",
            )
        })?;
        let status = resp.status();
        if is_init {
            if let Some(s) = resp
                .headers()
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
            {
                if let Ok(mut g) = self.session.lock() {
                    *g = Some(s.to_owned());
                }
            }
        }
        if status == reqwest::StatusCode::NOT_FOUND && had_session {
            (self.sink)(PeerEvent::Closed(
                "the server ended its MCP session (404)".into(),
            ));
            return Err((
                code::INTERNAL_ERROR,
                "server restarted".into(),
                "server_crashed",
            ));
        }
        if !status.is_success() {
            return Err((
                code::INTERNAL_ERROR,
                format!("the server answered HTTP {status}"),
                "http_error",
            ));
        }
        if status == reqwest::StatusCode::ACCEPTED {
            return Ok(());
        }
        let event_stream = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|c| c.starts_with("text/event-stream"));
        if event_stream {
            self.read_events(resp).await
        } else {
            self.read_json(resp).await
        }
    }

    async fn read_json(&self, resp: reqwest::Response) -> Result<(), Failure> {
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                (
                    code::INTERNAL_ERROR,
                    format!("reading the answer: {}", without_url(&e)),
                    "http_error",
                )
            })?;
            if body.len() + chunk.len() > self.max {
                (self.sink)(PeerEvent::Oversized(None));
                return Err((
                    code::INTERNAL_ERROR,
                    format!("the server's answer is larger than {} bytes", self.max),
                    "payload_too_large",
                ));
            }
            body.extend_from_slice(&chunk);
        }
        let text = String::from_utf8_lossy(&body);
        if text.trim().is_empty() {
            return Ok(());
        }
        match serde_json::from_str::<Vec<Box<serde_json::value::RawValue>>>(&text) {
            Ok(batch) => batch
                .into_iter()
                .for_each(|m| (self.sink)(PeerEvent::Message(m.get().to_owned()))),
            Err(_) => (self.sink)(PeerEvent::Message(text.into_owned())),
        }
        Ok(())
    }

    async fn read_events(&self, resp: reqwest::Response) -> Result<(), Failure> {
        let mut reader = SseReader::new(self.max);
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                (
                    code::INTERNAL_ERROR,
                    format!("reading the stream: {}", without_url(&e)),
                    "http_error",
                )
            })?;
            match reader.feed(&chunk) {
                Ok(events) => events
                    .into_iter()
                    .for_each(|e| (self.sink)(PeerEvent::Message(e))),
                Err(_) => {
                    return Err((
                        code::INTERNAL_ERROR,
                        format!("the server sent an event larger than {} bytes", self.max),
                        "payload_too_large",
                    ))
                }
            }
        }
        Ok(())
    }

    /// The GET stream, while the server offers one (405: it does not).
    async fn listen(&self) {
        let mut failures = 0;
        while failures < GET_RETRIES {
            let req = self
                .headers(self.client.get(&self.url))
                .header(reqwest::header::ACCEPT, "text/event-stream");
            match req.send().await {
                Ok(resp) if resp.status().is_success() => {
                    failures = 0;
                    let _ = self.read_events(resp).await;
                }
                Ok(resp) if resp.status() == reqwest::StatusCode::METHOD_NOT_ALLOWED => return,
                Ok(_) | Err(_) => failures += 1,
            }
            tokio::time::sleep(Duration::from_millis(500 << failures.min(4))).await;
        }
    }
}

/// reqwest's errors name the URL, which may carry a token in its query.
fn without_url(e: &reqwest::Error) -> String {
    let mut e = e.to_string();
    if let Some(i) = e.find(" for url") {
        e.truncate(i);
    }
    e
}
