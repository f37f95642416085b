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
