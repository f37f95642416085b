//! Transports: the same WebSocket framing over TCP, a Unix domain socket, or
//! an in-process pipe (PROTOCOL.md §1). Every transport ends as a
//! [`Transport`]: a WebSocket stream over a boxed byte stream plus the
//! negotiated subprotocol, so the actors above never know which one it is.

use super::codec::Subprotocol;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

/// Any byte stream a WebSocket can run over.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

pub type BoxIo = Box<dyn Io>;
pub type WsStream = WebSocketStream<BoxIo>;

/// The path executors connect to.
pub const CONNECT_PATH: &str = "/v1/executor/connect";

/// An open, negotiated connection.
pub struct Transport {
    pub ws: WsStream,
    pub subprotocol: Subprotocol,
}

/// Where an executor dials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `ws://host:port/path`.
    Tcp { url: String },
    /// `unix:/path/to.sock` (request path [`CONNECT_PATH`]).
    Unix { socket: PathBuf },
    /// A harness in this process (`bmx up`, an embedding platform): each
    /// dial is a fresh in-process pipe whose far end the harness serves
    /// like a socket it accepted. No URL names it; only the harness hands
    /// it out ([`InProcess`]).
    InProcess(InProcess),
}

/// The dialing end of a harness's in-process listener.
///
/// Why a listener at all rather than one pipe made up front: an executor
/// reconnects (a dropped connection, a 4004 replacement, a restart of its
/// connection actor), and every dial must get a new connection through the
/// same handshake, authentication included, that a socket gets.
#[derive(Clone)]
pub struct InProcess {
    accept: tokio::sync::mpsc::Sender<BoxIo>,
}

impl InProcess {
    /// The pipe's capacity in each direction: a write past it waits for
    /// the reader, like a full socket buffer.
    pub const PIPE_BYTES: usize = 1 << 20;

    /// A dialer and the receiver its listener takes connections from.
    pub fn channel(backlog: usize) -> (InProcess, tokio::sync::mpsc::Receiver<BoxIo>) {
        let (accept, rx) = tokio::sync::mpsc::channel(backlog.max(1));
        (InProcess { accept }, rx)
    }

    async fn connect(&self) -> std::io::Result<BoxIo> {
        let (near, far) = tokio::io::duplex(Self::PIPE_BYTES);
        self.accept.send(Box::new(far)).await.map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "the in-process harness stopped",
            )
        })?;
        Ok(Box::new(near))
    }
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("in-process")
    }
}

impl PartialEq for InProcess {
    fn eq(&self, other: &Self) -> bool {
        self.accept.same_channel(&other.accept)
    }
}

impl Eq for InProcess {}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, DialError> {
        if let Some(rest) = url.strip_prefix("unix:") {
            let path = rest.trim_start_matches("//");
            if path.is_empty() {
                return Err(DialError::BadUrl(url.into()));
            }
            return Ok(Endpoint::Unix {
                socket: PathBuf::from(path),
            });
        }
        if url.starts_with("ws://") {
            return Ok(Endpoint::Tcp { url: url.into() });
        }
        Err(DialError::BadUrl(format!(
            "{url:?}: use ws://HOST:PORT{CONNECT_PATH} or unix:/PATH (wss is not built in: terminate TLS in front)"
        )))
    }
}

/// Why a dial failed.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("bad url: {0}")]
    BadUrl(String),
    #[error("connect: {0}")]
    Io(#[from] std::io::Error),
    #[error("the harness refused the credential (HTTP 401)")]
    Unauthorized,
    #[error("no common subprotocol (HTTP 400)")]
    NoCommonProtocol,
    #[error("upgrade refused with HTTP {0}")]
    Http(u16),
    #[error("handshake: {0}")]
    Handshake(String),
    #[error("connect timed out")]
    Timeout,
}

impl DialError {
    /// A refused credential is final, like close 4001: reconnecting with the
    /// same token cannot succeed.
    pub fn is_final(&self) -> bool {
        matches!(self, DialError::Unauthorized | DialError::BadUrl(_))
    }
}

/// The most a WebSocket reads per `read` call, and its first buffer.
///
/// tungstenite's default is 128 KiB, allocated per connection and
/// zero-filled up to its capacity before every `read`
/// (`FrameCodec::read_in`): a `memset` of up to 128 KiB for each small
/// frame, and 128 KiB resident per idle connection. At 10 000 executors
/// the harness held 1 550 MB with it and 405 MB with 16 KiB
/// (docs/benchmarks.md, "A 16 KiB WebSocket read buffer").
pub const READ_BUFFER_BYTES: usize = 16 << 10;

/// WebSocket limits for a connection: the transport refuses (close 1009)
/// any message above `max_frame_bytes` before buffering it.
pub fn ws_config(max_frame_bytes: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_BYTES)
        .max_message_size(Some(max_frame_bytes))
        .max_frame_size(Some(max_frame_bytes))
}

/// Dial the harness, authenticate and negotiate.
pub async fn dial(
    endpoint: &Endpoint,
    token: &str,
    offered: &[Subprotocol],
    max_frame_bytes: usize,
    timeout: Duration,
) -> Result<Transport, DialError> {
    tokio::time::timeout(
        timeout,
        dial_inner(endpoint, token, offered, max_frame_bytes),
    )
    .await
    .map_err(|_| DialError::Timeout)?
}

async fn dial_inner(
    endpoint: &Endpoint,
    token: &str,
    offered: &[Subprotocol],
    max_frame_bytes: usize,
) -> Result<Transport, DialError> {
    let (io, url): (BoxIo, String) = match endpoint {
        Endpoint::Tcp { url } => {
            let hostport = url
                .trim_start_matches("ws://")
                .split('/')
                .next()
                .unwrap_or_default();
            let stream = tokio::net::TcpStream::connect(hostport).await?;
            stream.set_nodelay(true)?;
            (Box::new(stream), url.clone())
        }
        Endpoint::Unix { socket } => {
            let stream = tokio::net::UnixStream::connect(socket).await?;
            (Box::new(stream), format!("ws://localhost{CONNECT_PATH}"))
        }
        Endpoint::InProcess(dialer) => (
            dialer.connect().await?,
            format!("ws://in-process{CONNECT_PATH}"),
        ),
    };
    client_handshake(io, &url, token, offered, max_frame_bytes).await
}

/// Run the client side of the upgrade over any byte stream.
pub async fn client_handshake(
    io: BoxIo,
    url: &str,
    token: &str,
    offered: &[Subprotocol],
    max_frame_bytes: usize,
) -> Result<Transport, DialError> {
    let mut request = url
        .into_client_request()
        .map_err(|e| DialError::BadUrl(e.to_string()))?;
    let protocols = offered
        .iter()
        .map(|p| p.name())
        .collect::<Vec<_>>()
        .join(", ");
    let headers = request.headers_mut();
    headers.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_str(&protocols).map_err(|e| DialError::BadUrl(e.to_string()))?,
    );
    headers.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| DialError::BadUrl("token is not a valid header value".into()))?,
    );
    let config = ws_config(max_frame_bytes);
    let (ws, response) =
        match tokio_tungstenite::client_async_with_config(request, io, Some(config)).await {
            Ok(ok) => ok,
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                return Err(match resp.status() {
                    StatusCode::UNAUTHORIZED => DialError::Unauthorized,
                    StatusCode::BAD_REQUEST => DialError::NoCommonProtocol,
                    s => DialError::Http(s.as_u16()),
                })
            }
            Err(tokio_tungstenite::tungstenite::Error::Io(e)) => return Err(DialError::Io(e)),
            Err(e) => return Err(DialError::Handshake(e.to_string())),
        };
    let chosen = response
        .headers()
        .get(header::SEC_WEBSOCKET_PROTOCOL)
        .and_then(|v| v.to_str().ok())
        .and_then(Subprotocol::parse)
        .filter(|p| offered.contains(p))
        .ok_or(DialError::NoCommonProtocol)?;
    Ok(Transport {
        ws,
        subprotocol: chosen,
    })
}

/// The `Sec-WebSocket-Accept` for a WebSocket upgrade request, `None` if
/// it is not one (no `Upgrade: websocket` or no key). Every server-side
/// upgrade (harness routes, the visor socket) answers through this.
pub fn ws_accept(headers: &HeaderMap) -> Option<String> {
    let is_ws = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let key = headers.get(header::SEC_WEBSOCKET_KEY).filter(|_| is_ws)?;
    Some(tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes()))
}

/// The bearer token of an upgrade request.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// The harness's subprotocol choice for an upgrade request.
pub fn negotiate(headers: &HeaderMap, supported: &[Subprotocol]) -> Option<Subprotocol> {
    let offered = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok());
    Subprotocol::negotiate(offered, supported)
}

/// Why an upgrade was refused on the server side.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error("unauthorized")]
    Unauthorized,
    #[error("no common subprotocol")]
    NoCommonProtocol,
    #[error("not found")]
    NotFound,
    #[error("handshake: {0}")]
    Handshake(String),
}

fn refuse(status: StatusCode, body: &str) -> ErrorResponse {
    let mut r = ErrorResponse::new(Some(body.to_owned()));
    *r.status_mut() = status;
    r
}

/// Server side of the upgrade over a raw byte stream (tests, Unix sockets,
/// pipes). `authenticate` maps a bearer token to a principal; `None` is
/// HTTP 401 before the upgrade.
pub async fn accept<A>(
    io: BoxIo,
    supported: &[Subprotocol],
    max_frame_bytes: usize,
    authenticate: A,
) -> Result<(Transport, String), AcceptError>
where
    A: FnOnce(Option<&str>) -> Option<String> + Send + Unpin,
{
    let mut outcome: Result<(Subprotocol, String), AcceptError> = Err(AcceptError::Unauthorized);
    // The callback's error type is tungstenite's, whatever its size.
    #[allow(clippy::result_large_err)]
    let callback = |req: &Request, mut resp: Response| -> Result<Response, ErrorResponse> {
        if req.uri().path() != CONNECT_PATH {
            outcome = Err(AcceptError::NotFound);
            return Err(refuse(StatusCode::NOT_FOUND, "not found"));
        }
        let Some(principal) = authenticate(bearer(req.headers())) else {
            outcome = Err(AcceptError::Unauthorized);
            return Err(refuse(StatusCode::UNAUTHORIZED, "unauthorized"));
        };
        let Some(proto) = negotiate(req.headers(), supported) else {
            outcome = Err(AcceptError::NoCommonProtocol);
            return Err(refuse(StatusCode::BAD_REQUEST, "no common subprotocol"));
        };
        resp.headers_mut().insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(proto.name()),
        );
        outcome = Ok((proto, principal));
        Ok(resp)
    };
    let ws = tokio_tungstenite::accept_hdr_async_with_config(
        io,
        callback,
        Some(ws_config(max_frame_bytes)),
    )
    .await;
    match (ws, outcome) {
        (Ok(ws), Ok((subprotocol, principal))) => Ok((Transport { ws, subprotocol }, principal)),
        (_, Err(e)) => Err(e),
        (Err(e), Ok(_)) => Err(AcceptError::Handshake(e.to_string())),
    }
}

/// Wrap an already-upgraded stream (for example a hyper upgrade) as a
/// server-side transport.
pub async fn from_upgraded(
    io: BoxIo,
    subprotocol: Subprotocol,
    max_frame_bytes: usize,
) -> Transport {
    let ws =
        WebSocketStream::from_raw_socket(io, Role::Server, Some(ws_config(max_frame_bytes))).await;
    Transport { ws, subprotocol }
}

/// An in-process pipe: both ends of one connection, WebSocket framing over a
/// `tokio::io::duplex`, with the same negotiation as a socket.
pub async fn pipe(
    offered: &[Subprotocol],
    supported: &[Subprotocol],
    max_frame_bytes: usize,
) -> Result<(Transport, Transport), DialError> {
    let (a, b) = tokio::io::duplex(InProcess::PIPE_BYTES);
    let supported = supported.to_vec();
    let server = tokio::spawn(async move {
        accept(Box::new(b), &supported, max_frame_bytes, |_| {
            Some(String::from("in-process"))
        })
        .await
    });
    let client = client_handshake(
        Box::new(a),
        &format!("ws://in-process{CONNECT_PATH}"),
        "in-process",
        offered,
        max_frame_bytes,
    )
    .await?;
    let (server, _) = server
        .await
        .map_err(|e| DialError::Handshake(e.to_string()))?
        .map_err(|e| DialError::Handshake(e.to_string()))?;
    Ok((client, server))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert!(matches!(
            Endpoint::parse("ws://127.0.0.1:1/v1/executor/connect"),
            Ok(Endpoint::Tcp { .. })
        ));
        assert_eq!(
            Endpoint::parse("unix:/tmp/x.sock").unwrap(),
            Endpoint::Unix {
                socket: "/tmp/x.sock".into()
            }
        );
        assert_eq!(
            Endpoint::parse("unix:///tmp/x.sock").unwrap(),
            Endpoint::Unix {
                socket: "/tmp/x.sock".into()
            }
        );
        assert!(Endpoint::parse("wss://x").is_err());
        assert!(Endpoint::parse("unix:").is_err());
    }

    #[tokio::test]
    async fn pipe_negotiates_like_a_socket() {
        let (c, s) = pipe(&Subprotocol::ALL, &Subprotocol::ALL[1..], 1 << 20)
            .await
            .unwrap();
        assert_eq!(c.subprotocol, s.subprotocol);
        assert_eq!(c.subprotocol.name(), "bmaexecutor.v1.1");
    }

    /// A frame many times [`READ_BUFFER_BYTES`] arrives whole and in
    /// order between small ones: the buffer bounds each `read`, not a
    /// frame.
    #[tokio::test]
    async fn frames_larger_than_the_read_buffer_arrive_whole() {
        use futures_util::{SinkExt, StreamExt};
        use tokio_tungstenite::tungstenite::Message;
        let (mut c, mut s) = pipe(&Subprotocol::ALL, &Subprotocol::ALL, 4 << 20)
            .await
            .unwrap();
        let big: Vec<u8> = (0..READ_BUFFER_BYTES * 40 + 7)
            .map(|i| (i % 251) as u8)
            .collect();
        let sent = vec![
            Message::Binary(vec![1u8].into()),
            Message::Binary(big.clone().into()),
            Message::Binary(vec![2u8].into()),
        ];
        let writer = tokio::spawn(async move {
            for m in sent {
                c.ws.send(m).await.unwrap();
            }
            c
        });
        let mut got = Vec::new();
        while got.len() < 3 {
            match s.ws.next().await {
                Some(Ok(Message::Binary(b))) => got.push(b.to_vec()),
                other => panic!("unexpected {other:?}"),
            }
        }
        let _c = writer.await.unwrap();
        assert_eq!(got, vec![vec![1u8], big, vec![2u8]]);
    }
}
