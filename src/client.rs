//! A small HTTP/1.1 client for the harness API (`bmx exec`, `bmx ps`, tests):
//! one request per connection, JSON in and out. No TLS: put a proxy in
//! front of a remote harness.

use serde_json::Value;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Why a request did not produce an HTTP answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("bad harness url {0:?}: use http://HOST:PORT")]
    BadUrl(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("malformed HTTP answer: {0}")]
    Malformed(String),
    /// The harness answered the WebSocket upgrade with an HTTP error.
    #[error("HTTP {status}: {body}")]
    Refused { status: u16, body: Value },
    #[error("WebSocket handshake failed: {0}")]
    Handshake(String),
}

/// A viewer's socket to a terminal (binary frames of PROTOCOL.md §8, text
/// control messages; docs/terminals.md "Harness side").
pub type TerminalSocket = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Options of [`ApiClient::attach_terminal`].
#[derive(Debug, Clone, Default)]
pub struct AttachOptions {
    /// Replay from this seq (default: the oldest retained chunk).
    pub from_seq: Option<u64>,
    /// Take the writer role.
    pub write: bool,
    /// Name the stream (default: one the harness makes up).
    pub stream_id: Option<String>,
}

/// Percent-encode one path segment or query value.
pub fn encode_component(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Answers above this size are refused.
const MAX_ANSWER: usize = 64 << 20;

/// A client of one harness.
#[derive(Debug, Clone)]
pub struct ApiClient {
    hostport: String,
    token: Option<String>,
    timeout: Duration,
}

impl ApiClient {
    /// `url`: `http://HOST:PORT` (a trailing path is ignored).
    pub fn new(url: &str) -> Result<ApiClient, ClientError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| ClientError::BadUrl(url.into()))?;
        let hostport = rest.split('/').next().unwrap_or_default();
        if hostport.is_empty() {
            return Err(ClientError::BadUrl(url.into()));
        }
        Ok(ApiClient {
            hostport: hostport.to_owned(),
            token: None,
            timeout: Duration::from_secs(120),
        })
    }

    pub fn token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub async fn get(&self, path: &str) -> Result<(u16, Value), ClientError> {
        self.request("GET", path, None).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Result<(u16, Value), ClientError> {
        self.request("POST", path, Some(body)).await
    }

    pub async fn delete(&self, path: &str) -> Result<(u16, Value), ClientError> {
        self.request("DELETE", path, None).await
    }

    /// `GET /v1/executors`.
    pub async fn executors(&self) -> Result<(u16, Value), ClientError> {
        self.get("/v1/executors").await
    }

    fn terminals_path(executor_id: &str) -> String {
        format!("/v1/executors/{}/terminals", encode_component(executor_id))
    }

    fn terminal_path(executor_id: &str, terminal_id: &str) -> String {
        format!(
            "{}/{}",
            Self::terminals_path(executor_id),
            encode_component(terminal_id)
        )
    }

    /// `POST /v1/executors/{id}/terminals` (body: `terminalId`, `argv` or
    /// `shell`, `cwd`, `env`, `cols`, `rows`, all optional).
    pub async fn open_terminal(
        &self,
        executor_id: &str,
        body: &Value,
    ) -> Result<(u16, Value), ClientError> {
        self.post(&Self::terminals_path(executor_id), body).await
    }

    /// `GET /v1/executors/{id}/terminals`.
    pub async fn list_terminals(&self, executor_id: &str) -> Result<(u16, Value), ClientError> {
        self.get(&Self::terminals_path(executor_id)).await
    }

    /// `GET /v1/executors/{id}/terminals/{tid}`.
    pub async fn get_terminal(
        &self,
        executor_id: &str,
        terminal_id: &str,
    ) -> Result<(u16, Value), ClientError> {
        self.get(&Self::terminal_path(executor_id, terminal_id))
            .await
    }

    /// `DELETE /v1/executors/{id}/terminals/{tid}`: `{closed, exitCode}`.
    pub async fn close_terminal(
        &self,
        executor_id: &str,
        terminal_id: &str,
    ) -> Result<(u16, Value), ClientError> {
        self.delete(&Self::terminal_path(executor_id, terminal_id))
            .await
    }

    /// `GET /v1/executors/{id}/terminals/{tid}/attach` as a WebSocket.
    pub async fn attach_terminal(
        &self,
        executor_id: &str,
        terminal_id: &str,
        opts: &AttachOptions,
    ) -> Result<TerminalSocket, ClientError> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let mut query = vec![format!("write={}", u8::from(opts.write))];
        if let Some(f) = opts.from_seq {
            query.push(format!("fromSeq={f}"));
        }
        if let Some(s) = &opts.stream_id {
            query.push(format!("streamId={}", encode_component(s)));
        }
        let url = format!(
            "ws://{}{}/attach?{}",
            self.hostport,
            Self::terminal_path(executor_id, terminal_id),
            query.join("&")
        );
        let mut request = url
            .as_str()
            .into_client_request()
            .map_err(|e| ClientError::BadUrl(e.to_string()))?;
        if let Some(t) = &self.token {
            let v = http::HeaderValue::from_str(&format!("Bearer {t}"))
                .map_err(|_| ClientError::BadUrl("the token is not a valid header value".into()))?;
            request.headers_mut().insert(http::header::AUTHORIZATION, v);
        }
        let connect = async {
            let tcp = tokio::net::TcpStream::connect(&self.hostport).await?;
            tcp.set_nodelay(true)?;
            let config = crate::wire::transport::ws_config(16 << 20);
            match tokio_tungstenite::client_async_with_config(request, tcp, Some(config)).await {
                Ok((ws, _)) => Ok(ws),
                Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                    let body = resp
                        .body()
                        .as_deref()
                        .map(|b| {
                            serde_json::from_slice(b).unwrap_or_else(|_| {
                                Value::String(String::from_utf8_lossy(b).into_owned())
                            })
                        })
                        .unwrap_or(Value::Null);
                    Err(ClientError::Refused {
                        status: resp.status().as_u16(),
                        body,
                    })
                }
                Err(tokio_tungstenite::tungstenite::Error::Io(e)) => Err(ClientError::Io(e)),
                Err(e) => Err(ClientError::Handshake(e.to_string())),
            }
        };
        tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| ClientError::Timeout(self.timeout))?
    }

    /// One request; the answer's status and JSON body (`null` when empty,
    /// a string when not JSON).
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), ClientError> {
        tokio::time::timeout(self.timeout, self.request_inner(method, path, body))
            .await
            .map_err(|_| ClientError::Timeout(self.timeout))?
    }

    async fn request_inner(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), ClientError> {
        let mut stream = tokio::net::TcpStream::connect(&self.hostport).await?;
        let payload = body.map(|b| b.to_string()).unwrap_or_default();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: application/json\r\n",
            self.hostport
        );
        if let Some(t) = &self.token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        if body.is_some() {
            head.push_str("Content-Type: application/json\r\n");
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", payload.len()));
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(payload.as_bytes()).await?;
        stream.flush().await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.len() > MAX_ANSWER {
                return Err(ClientError::Malformed("answer too large".into()));
            }
        }
        parse_response(&buf)
    }
}

fn parse_response(buf: &[u8]) -> Result<(u16, Value), ClientError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let status = resp
        .parse(buf)
        .map_err(|e| ClientError::Malformed(e.to_string()))?;
    let httparse::Status::Complete(head_len) = status else {
        return Err(ClientError::Malformed("incomplete head".into()));
    };
    let code = resp.code.unwrap_or(0);
    let chunked = resp.headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("transfer-encoding")
            && String::from_utf8_lossy(h.value)
                .to_ascii_lowercase()
                .contains("chunked")
    });
    let raw = &buf[head_len..];
    let body = if chunked { dechunk(raw)? } else { raw.to_vec() };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok((code, Value::Null));
    }
    let value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    Ok((code, value))
}

fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>, ClientError> {
    let mut out = Vec::new();
    loop {
        let line_end = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| ClientError::Malformed("chunk size".into()))?;
        let size_text = String::from_utf8_lossy(&raw[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| ClientError::Malformed("chunk size".into()))?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if raw.len() < size {
            return Err(ClientError::Malformed("short chunk".into()));
        }
        out.extend_from_slice(&raw[..size]);
        raw = raw.get(size + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_answers() {
        let plain = b"HTTP/1.1 201 Created\r\ncontent-length: 8\r\n\r\n{\"a\":1}\n";
        assert_eq!(
            parse_response(plain).unwrap(),
            (201, serde_json::json!({"a": 1}))
        );
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":2}\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(chunked).unwrap(),
            (200, serde_json::json!({"a": 2}))
        );
        assert!(ApiClient::new("ws://x").is_err());
    }
}
