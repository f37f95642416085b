//! The benches' HTTP/1.1 client: one kept-alive connection, a request
//! written in one piece, the answer read in place.
//!
//! Why not hyper's client: the bench's client shares two CPUs with the
//! harness, the executor and node, so whatever it spends per call is taken
//! from the path it measures. hyper's connection runs as a task of its
//! own, and each request crosses a channel to it and a oneshot back, with
//! a `HeaderMap` built both ways: 12 µs of CPU per call at 32 in flight
//! (median of twelve runs), where the direct path's client spends 3.5
//! (docs/benchmarks.md, "A minimal HTTP client for the bench"); this one
//! spends about 9. It does the exchange in the caller's task, as the direct
//! client does on its pipes, and reads only what a bench needs: the
//! status, `Content-Type`, `Mcp-Session-Id`, `Connection`, and a body
//! framed by `Content-Length` or chunked.

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Headers of one answer above this many bytes are an error.
const MAX_HEAD: usize = 64 << 10;
/// Bodies above this many bytes are an error.
const MAX_BODY: usize = 16 << 20;
/// Header lines of one answer the parser has room for.
const MAX_HEADERS: usize = 32;
/// What one read asks the socket for at least.
const READ_CHUNK: usize = 16 << 10;

/// A byte stream a connection can run on (TCP, a Unix socket).
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// One answer.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub media: Media,
    pub session: Option<String>,
    pub body: Bytes,
}

impl Reply {
    pub fn is_json(&self) -> bool {
        self.media == Media::Json
    }

    pub fn is_sse(&self) -> bool {
        self.media == Media::EventStream
    }
}

/// The media type of `Content-Type`, parameters aside: the two a bench
/// tells apart, and the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Media {
    Json,
    EventStream,
    /// Another type, or none.
    Other,
}

impl Media {
    fn of(content_type: &str) -> Media {
        let media = content_type.split(';').next().unwrap_or_default().trim();
        if media.eq_ignore_ascii_case("application/json") {
            Media::Json
        } else if media.eq_ignore_ascii_case("text/event-stream") {
            Media::EventStream
        } else {
            Media::Other
        }
    }
}

/// How the body of an answer is delimited.
enum Framing {
    Length(usize),
    Chunked,
}

/// What the head of an answer says.
struct Head {
    len: usize,
    status: u16,
    media: Media,
    session: Option<String>,
    framing: Framing,
    /// `Connection: close`: the connection is not used again.
    close: bool,
}

/// One kept-alive connection.
pub struct Conn {
    io: Box<dyn Io>,
    /// Read and not yet consumed.
    buf: BytesMut,
    /// Set once the connection can carry no further exchange.
    spent: bool,
    /// Bytes read during the current exchange.
    got: usize,
}

impl Conn {
    pub fn new(io: impl Io + 'static) -> Conn {
        Conn {
            io: Box::new(io),
            buf: BytesMut::with_capacity(READ_CHUNK),
            spent: false,
            got: 0,
        }
    }

    /// Whether another exchange may run on this connection.
    pub fn reusable(&self) -> bool {
        !self.spent
    }

    /// Whether the last exchange failed before a byte of its answer came.
    /// On a connection that had been idle, that is the server's idle
    /// timeout closing it: the request was never read, and may be sent
    /// again on a new connection.
    pub fn unanswered(&self) -> bool {
        self.got == 0
    }

    /// Write `request` (a whole HTTP/1.1 request) and read its answer. A
    /// failure leaves the connection spent.
    pub async fn exchange(&mut self, request: &[u8]) -> Result<Reply, String> {
        self.spent = true;
        self.got = 0;
        self.io
            .write_all(request)
            .await
            .map_err(|e| e.to_string())?;
        let head = self.head().await?;
        let body = match head.framing {
            Framing::Length(n) => self.take(n).await?,
            Framing::Chunked => self.chunked().await?,
        };
        // Bytes past the answer would be an answer to nothing.
        self.spent = head.close || !self.buf.is_empty();
        Ok(Reply {
            status: head.status,
            media: head.media,
            session: head.session,
            body,
        })
    }

    /// Read more into `buf`; the peer closing is an error.
    async fn fill(&mut self) -> Result<(), String> {
        self.buf.reserve(READ_CHUNK);
        match self.io.read_buf(&mut self.buf).await {
            Ok(0) => Err("the server closed the connection".into()),
            Ok(n) => {
                self.got += n;
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }
    }

    async fn head(&mut self) -> Result<Head, String> {
        loop {
            if let Some(head) = parse_head(&self.buf)? {
                self.buf.advance(head.len);
                return Ok(head);
            }
            if self.buf.len() > MAX_HEAD {
                return Err(format!("an answer's head above {MAX_HEAD} bytes"));
            }
            self.fill().await?;
        }
    }

    /// The next `n` bytes.
    async fn take(&mut self, n: usize) -> Result<Bytes, String> {
        if n > MAX_BODY {
            return Err(format!("a body of {n} bytes (at most {MAX_BODY})"));
        }
        while self.buf.len() < n {
            self.fill().await?;
        }
        Ok(self.buf.split_to(n).freeze())
    }

    /// The next line, without its CRLF.
    async fn line(&mut self) -> Result<Bytes, String> {
        loop {
            if let Some(at) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = self.buf.split_to(at).freeze();
                self.buf.advance(2);
                return Ok(line);
            }
            if self.buf.len() > MAX_HEAD {
                return Err("a chunk line without an end".into());
            }
            self.fill().await?;
        }
    }

    /// A chunked body, joined.
    async fn chunked(&mut self) -> Result<Bytes, String> {
        let mut body = BytesMut::new();
        loop {
            let line = self.line().await?;
            let size = line.split(|&b| b == b';').next().unwrap_or_default();
            let size = std::str::from_utf8(size)
                .ok()
                .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
                .ok_or_else(|| format!("a bad chunk size: {:?}", String::from_utf8_lossy(&line)))?;
            if size == 0 {
                // Trailers, if any, up to the empty line.
                while !self.line().await?.is_empty() {}
                return Ok(body.freeze());
            }
            if body.len().saturating_add(size) > MAX_BODY {
                return Err(format!("a chunked body above {MAX_BODY} bytes"));
            }
            let chunk = self.take(size).await?;
            body.extend_from_slice(&chunk);
            if self.line().await? != b"".as_slice() {
                return Err("a chunk longer than its size".into());
            }
        }
    }
}

/// The head at the start of `buf`, once it is all there.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf).map_err(|e| e.to_string())? {
        httparse::Status::Complete(len) => len,
        httparse::Status::Partial => return Ok(None),
    };
    let status = resp.code.ok_or("an answer without a status")?;
    if (100..200).contains(&status) {
        return Err(format!(
            "an interim answer ({status}) the bench never asks for"
        ));
    }
    let mut head = Head {
        len,
        status,
        media: Media::Other,
        session: None,
        framing: Framing::Length(0),
        close: resp.version == Some(0),
    };
    let mut framed = status == 204 || status == 304;
    for h in resp.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| format!("header {} is not text", h.name))?
            .trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = value
                .parse()
                .map_err(|_| format!("a bad Content-Length: {value:?}"))?;
            head.framing = Framing::Length(n);
            framed = true;
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if !value.eq_ignore_ascii_case("chunked") {
                return Err(format!("a transfer coding the bench cannot read: {value}"));
            }
            head.framing = Framing::Chunked;
            framed = true;
        } else if h.name.eq_ignore_ascii_case("content-type") {
            head.media = Media::of(value);
        } else if h.name.eq_ignore_ascii_case("mcp-session-id") {
            head.session = Some(value.to_owned());
        } else if h.name.eq_ignore_ascii_case("connection") {
            head.close = value.eq_ignore_ascii_case("close");
        }
    }
    if !framed {
        // A body up to the close: not what the servers measured send.
        return Err(format!("an answer ({status}) without a length"));
    }
    Ok(Some(head))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    /// A server on a real socket that reads one request and answers it
    /// with `answer`, written in pieces of `piece` bytes, then holds the
    /// connection open until the client is done.
    async fn serve(answer: &'static [u8], piece: usize) -> Conn {
        serve_then(answer, piece, true).await
    }

    async fn serve_then(answer: &'static [u8], piece: usize, hold: bool) -> Conn {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            tcp.set_nodelay(true).unwrap();
            let mut seen = Vec::new();
            while !seen.ends_with(b"ping") {
                let mut b = [0u8; 1024];
                let n = tcp.read(&mut b).await.unwrap();
                assert!(n > 0, "the client closed before its request was whole");
                seen.extend_from_slice(&b[..n]);
            }
            for p in answer.chunks(piece) {
                tcp.write_all(p).await.unwrap();
                tcp.flush().await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            if hold {
                let _ = tcp.read(&mut [0u8; 1]).await;
            }
        });
        Conn::new(TcpStream::connect(addr).await.unwrap())
    }

    const REQUEST: &[u8] = b"POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nping";

    #[tokio::test]
    async fn a_body_of_known_length_read_in_pieces() {
        let answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nMcp-Session-Id: s-1\r\ncontent-length: 11\r\n\r\n{\"id\":7777}";
        for piece in [1, 7, answer.len()] {
            let mut c = serve(answer, piece).await;
            let r = c.exchange(REQUEST).await.unwrap();
            assert_eq!(r.status, 200);
            assert!(r.is_json() && !r.is_sse());
            assert_eq!(r.session.as_deref(), Some("s-1"));
            assert_eq!(&r.body[..], b"{\"id\":7777}");
            assert!(c.reusable());
        }
    }

    #[tokio::test]
    async fn a_chunked_event_stream_is_joined() {
        let answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n6;ext=1\r\ndata: \r\na\r\n{\"id\":1}\n\n\r\n0\r\n\r\n";
        for piece in [1, 5, answer.len()] {
            let mut c = serve(answer, piece).await;
            let r = c.exchange(REQUEST).await.unwrap();
            assert!(r.is_sse());
            assert_eq!(&r.body[..], b"data: {\"id\":1}\n\n");
            assert!(c.reusable());
        }
    }

    #[tokio::test]
    async fn an_empty_answer_and_a_closing_one() {
        let mut c = serve(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n", 64).await;
        let r = c.exchange(REQUEST).await.unwrap();
        assert_eq!((r.status, r.body.len()), (202, 0));
        assert!(c.reusable());
        let mut c = serve(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
            64,
        )
        .await;
        assert_eq!(&c.exchange(REQUEST).await.unwrap().body[..], b"ok");
        assert!(!c.reusable(), "the server said it closes");
    }

    #[tokio::test]
    async fn what_the_bench_cannot_read_is_an_error_not_a_guess() {
        for answer in [
            b"HTTP/1.1 200 OK\r\n\r\nno length".as_slice(),
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\nffffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc\r\n0\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
        ] {
            let mut c = serve(answer, 64).await;
            assert!(c.exchange(REQUEST).await.is_err(), "{answer:?}");
            assert!(!c.reusable());
        }
    }

    #[tokio::test]
    async fn a_server_that_closes_early_is_an_error() {
        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort";
        let mut c = serve_then(answer, 64, false).await;
        let e = c.exchange(REQUEST).await.unwrap_err();
        assert!(
            e.contains("closed"),
            "five of ten bytes are not a body: {e}"
        );
        assert!(!c.reusable());
        assert!(!c.unanswered(), "part of the answer came");
    }

    #[tokio::test]
    async fn a_connection_closed_while_idle_is_unanswered() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut c = Conn::new(TcpStream::connect(addr).await.unwrap());
        // The server's idle timeout: it closes without reading.
        drop(listener.accept().await.unwrap());
        let e = c.exchange(REQUEST).await.unwrap_err();
        assert!(c.unanswered(), "{e}");
        assert!(!c.reusable());
    }
}
