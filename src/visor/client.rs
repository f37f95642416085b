//! A small client of the visor's socket for the CLI: one HTTP/1.1 request
//! per connection (`Connection: close`), and WebSocket streams.

use serde_json::Value;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Largest response read.
const MAX_RESPONSE: usize = 64 << 20;
const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no visor at {0} (start one with `bmx visor`): {1}")]
    Connect(String, std::io::Error),
    #[error("visor connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("the visor did not answer within {0:?}")]
    Timeout(Duration),
    #[error("bad response from the visor: {0}")]
    Bad(String),
    #[error("{code}: {message}")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
}

async fn connect(socket: &Path) -> Result<UnixStream, ClientError> {
    UnixStream::connect(socket)
        .await
        .map_err(|e| ClientError::Connect(socket.display().to_string(), e))
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>, ClientError> {
    let mut out = Vec::new();
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| ClientError::Bad("chunk size".into()))?;
        let size = std::str::from_utf8(&body[..line_end])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok())
            .ok_or_else(|| ClientError::Bad("chunk size".into()))?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if body.len() < size + 2 {
            return Err(ClientError::Bad("short chunk".into()));
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

/// One request; an error envelope becomes [`ClientError::Api`].
pub async fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, ClientError> {
    let (status, v) = raw(socket, method, path, body).await?;
    if status >= 400 {
        let e = v.get("error");
        let field = |k| {
            e.and_then(|e| e.get(k))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        return Err(ClientError::Api {
            status,
            code: field("code"),
            message: field("message"),
        });
    }
    Ok(v)
}

/// One request: status and JSON body (`null` when empty).
pub async fn raw(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), ClientError> {
    let work = async {
        let mut s = connect(socket).await?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: visor\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        let mut buf = Vec::new();
        (&mut s)
            .take(MAX_RESPONSE as u64)
            .read_to_end(&mut buf)
            .await?;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        let n = match resp.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => n,
            _ => return Err(ClientError::Bad("incomplete response head".into())),
        };
        let status = resp.code.unwrap_or(0);
        let chunked = resp.headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("transfer-encoding")
                && String::from_utf8_lossy(h.value).contains("chunked")
        });
        let body = if chunked {
            dechunk(&buf[n..])?
        } else {
            buf[n..].to_vec()
        };
        let v = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).map_err(|e| ClientError::Bad(e.to_string()))?
        };
        Ok((status, v))
    };
    tokio::time::timeout(TIMEOUT, work)
        .await
        .map_err(|_| ClientError::Timeout(TIMEOUT))?
}

pub type Ws = tokio_tungstenite::WebSocketStream<UnixStream>;

/// Open a WebSocket stream on `path` (with its query).
pub async fn websocket(socket: &Path, path: &str) -> Result<Ws, ClientError> {
    let s = connect(socket).await?;
    let url = format!("ws://visor{path}");
    let (ws, _) = tokio::time::timeout(TIMEOUT, tokio_tungstenite::client_async(url, s))
        .await
        .map_err(|_| ClientError::Timeout(TIMEOUT))?
        .map_err(|e| match e {
            tokio_tungstenite::tungstenite::Error::Http(r) => {
                let body = r
                    .body()
                    .as_deref()
                    .and_then(|b| serde_json::from_slice::<Value>(b).ok())
                    .unwrap_or(Value::Null);
                let field = |k| body["error"][k].as_str().unwrap_or("").to_owned();
                ClientError::Api {
                    status: r.status().as_u16(),
                    code: field("code"),
                    message: field("message"),
                }
            }
            other => ClientError::Bad(other.to_string()),
        })?;
    Ok(ws)
}
