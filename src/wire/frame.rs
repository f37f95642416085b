//! JSON-RPC 2.0 frames (PROTOCOL.md §2), decoded in two steps.
//!
//! [`Inbound::parse`] reads only the envelope (`id`, `method`, whether a
//! `result` or `error` is present) and skips `params`; the router then decodes
//! the params into the type the method names. Both steps read the same
//! buffer, so a frame is never copied into an intermediate tree.

use super::codec::{Codec, CodecError};
use super::error::RpcError;
use bytes::Bytes;
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

/// A request id. The protocol says ids are strings; numbers from a lenient
/// peer are accepted and echoed back as they came.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Id {
    Str(String),
    Num(i64),
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Id::Str(s) => f.write_str(s),
            Id::Num(n) => write!(f, "{n}"),
        }
    }
}

impl From<String> for Id {
    fn from(s: String) -> Self {
        Id::Str(s)
    }
}

/// True when the member is present, whatever its value (even `null`).
#[derive(Debug, Default, Clone, Copy)]
struct Present(bool);

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        IgnoredAny::deserialize(d).map(|_| Present(true))
    }
}

/// Whether the `jsonrpc` member is the string `"2.0"`, read without
/// allocating (this runs for every frame).
#[derive(Debug, Default, Clone, Copy)]
struct Version2(bool);

impl<'de> Deserialize<'de> for Version2 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Version2;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"2.0\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Version2, E> {
                Ok(Version2(v == "2.0"))
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Version2, E> {
                Ok(Version2(v == b"2.0"))
            }
            // Any other type is simply not "2.0".
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Version2, E> {
                Ok(Version2(false))
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Version2, E> {
                Ok(Version2(false))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Version2, E> {
                Ok(Version2(false))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Version2, E> {
                Ok(Version2(false))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Version2, E> {
                Ok(Version2(false))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct RawHead {
    #[serde(default)]
    jsonrpc: Version2,
    #[serde(default)]
    id: Option<Id>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    result: Present,
    #[serde(default)]
    error: Option<RpcError>,
}

/// What kind of frame arrived.
#[derive(Debug, Clone, PartialEq)]
pub enum FrameKind {
    Request { id: Id, method: String },
    Notification { method: String },
    Response { id: Id },
    Error { id: Option<Id>, error: RpcError },
}

/// A decoded envelope plus the raw bytes its params and result live in.
#[derive(Clone)]
pub struct Inbound {
    pub codec: Codec,
    pub kind: FrameKind,
    bytes: Bytes,
}

impl fmt::Debug for Inbound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbound")
            .field("kind", &self.kind)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// An envelope that is valid JSON/MessagePack but not JSON-RPC.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("parse error: {0}")]
    Parse(#[from] CodecError),
    #[error("not a JSON-RPC frame: {detail}")]
    Invalid { id: Option<Id>, detail: String },
}

impl FrameError {
    /// The error object to answer with (PROTOCOL.md §2).
    pub fn to_rpc(&self) -> (Option<Id>, RpcError) {
        match self {
            FrameError::Parse(e) => (None, RpcError::parse_error(e.to_string())),
            FrameError::Invalid { id, detail } => (
                id.clone(),
                RpcError::invalid_request("invalid_request", detail.clone()),
            ),
        }
    }
}

#[derive(Deserialize)]
struct WithParams<P> {
    #[serde(default = "Option::default")]
    params: Option<P>,
}

#[derive(Deserialize)]
struct WithResult<R> {
    result: R,
}

/// JSON frames at least this large are first tried with
/// [`json_response_id`].
const FAST_RESPONSE_MIN: usize = 16 << 10;

/// The id of a large JSON response laid out the way bmx writes them
/// (`{"jsonrpc":"2.0","id":"<id>","result":…`), read from its first bytes.
///
/// Why: the two-step decode reads a frame twice, once for the envelope and
/// once for the typed result. For a `process.read` answer in JSON, most of
/// the frame is one base64 string, and serde_json has to scan all of it
/// both times (to find where `result` ends, then to decode it). This skips
/// the first scan. It is safe because nothing is lost: `result()` still
/// parses the whole frame, so malformed JSON still fails, there, as the
/// caller's decode error (no answer is ever sent to a response). The one
/// difference: a response with both `result` and `error` counts as a result.
/// Anything else (an escaped id, other member order, a number id) takes the
/// full path.
fn json_response_id(bytes: &[u8]) -> Option<Id> {
    let rest = bytes.strip_prefix(br#"{"jsonrpc":"2.0","id":""#)?;
    let end = rest.iter().take(256).position(|&b| b == b'"')?;
    let id = &rest[..end];
    if id.iter().any(|&b| b == b'\\' || b < 0x20) {
        return None;
    }
    rest[end + 1..].strip_prefix(br#","result":"#)?;
    if bytes.last() != Some(&b'}') {
        return None;
    }
    Some(Id::Str(std::str::from_utf8(id).ok()?.to_owned()))
}

impl Inbound {
    /// Decode the envelope of one frame.
    pub fn parse(codec: Codec, bytes: Bytes) -> Result<Inbound, FrameError> {
        if codec == Codec::Json && bytes.len() >= FAST_RESPONSE_MIN {
            if let Some(id) = json_response_id(&bytes) {
                let kind = FrameKind::Response { id };
                return Ok(Inbound { codec, kind, bytes });
            }
        }
        let head: RawHead = codec.decode(&bytes)?;
        if !head.jsonrpc.0 {
            // JSON-RPC 2.0 and nothing else: a frame of another version is
            // answered -32600, never executed.
            return Err(FrameError::Invalid {
                id: head.id,
                detail: "\"jsonrpc\" must be \"2.0\"".into(),
            });
        }
        let kind = match (head.method, head.id, head.result.0, head.error) {
            (Some(method), Some(id), false, None) => FrameKind::Request { id, method },
            (Some(method), None, false, None) => FrameKind::Notification { method },
            (None, Some(id), true, None) => FrameKind::Response { id },
            (None, id, false, Some(error)) => FrameKind::Error { id, error },
            (_, id, ..) => {
                return Err(FrameError::Invalid {
                    id,
                    detail: "expected a request, a notification or a response".into(),
                })
            }
        };
        Ok(Inbound { codec, kind, bytes })
    }

    /// The method name of a request or notification.
    pub fn method(&self) -> Option<&str> {
        match &self.kind {
            FrameKind::Request { method, .. } | FrameKind::Notification { method } => Some(method),
            _ => None,
        }
    }

    pub fn id(&self) -> Option<&Id> {
        match &self.kind {
            FrameKind::Request { id, .. } | FrameKind::Response { id } => Some(id),
            FrameKind::Error { id, .. } => id.as_ref(),
            FrameKind::Notification { .. } => None,
        }
    }

    /// Decode `params` into the method's type. A missing `params` is an
    /// empty object. Failure is -32602 with the decoder's message; so is an
    /// id field (`sessionId`, `processId`, ...) that breaks the id rule
    /// ([`super::id`]), whatever the method.
    pub fn params<P: DeserializeOwned>(&self) -> Result<P, RpcError> {
        if let Ok(WithParams { params: Some(ids) }) = self
            .codec
            .decode::<WithParams<super::id::IdFields>>(&self.bytes)
        {
            ids.check()
                .map_err(|e| RpcError::invalid_params(e.to_string()).with_reason("invalid_id"))?;
        }
        let decoded: Result<WithParams<P>, _> =
            super::blob::decode_within(&self.bytes, || self.codec.decode(&self.bytes));
        match decoded {
            Ok(WithParams { params: Some(p) }) => Ok(p),
            Ok(WithParams { params: None }) => self
                .codec
                .decode(self.codec.empty_map())
                .map_err(|e| RpcError::invalid_params(e.to_string())),
            Err(e) => Err(RpcError::invalid_params(e.to_string())),
        }
    }

    /// The bmx extension param `fencingToken` of a session-scoped request
    /// (docs/protocol.md, "Fencing on every session request"): the token of
    /// the grant the harness sent it under. `Ok(None)` when absent (a seed
    /// peer); -32602 when it is not an unsigned integer.
    ///
    /// # Errors
    ///
    /// -32602 `invalid_params` for a `fencingToken` of another type.
    pub fn fencing_token(&self) -> Result<Option<u64>, RpcError> {
        #[derive(Deserialize)]
        struct Fence {
            #[serde(rename = "fencingToken", default)]
            fencing_token: Option<u64>,
        }
        match self.codec.decode::<WithParams<Fence>>(&self.bytes) {
            Ok(WithParams { params: Some(f) }) => Ok(f.fencing_token),
            Ok(WithParams { params: None }) => Ok(None),
            Err(e) => Err(RpcError::invalid_params(format!("fencingToken: {e}"))),
        }
    }

    /// Decode `result` of a response. A large JSON one with a long base64
    /// string (a `process.read` answer) first tries
    /// [`decode_json_spliced`](super::blob::decode_json_spliced), which
    /// spares serde_json the string; it gives the same result or none.
    pub fn result<R: DeserializeOwned>(&self) -> Result<R, CodecError> {
        if self.codec == Codec::Json && self.bytes.len() >= FAST_RESPONSE_MIN {
            if let Some(w) = super::blob::decode_json_spliced::<WithResult<R>>(&self.bytes) {
                return Ok(w.result);
            }
        }
        super::blob::decode_within(&self.bytes, || {
            self.codec.decode::<WithResult<R>>(&self.bytes)
        })
        .map(|w| w.result)
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// An outgoing request.
#[derive(Serialize)]
pub struct OutRequest<'a, P: Serialize> {
    pub jsonrpc: &'static str,
    pub id: &'a str,
    pub method: &'a str,
    pub params: &'a P,
}

/// An outgoing notification.
#[derive(Serialize)]
pub struct OutNotification<'a, P: Serialize> {
    pub jsonrpc: &'static str,
    pub method: &'a str,
    pub params: &'a P,
}

/// An outgoing success response.
#[derive(Serialize)]
pub struct OutResult<'a, R: Serialize> {
    pub jsonrpc: &'static str,
    pub id: &'a Id,
    pub result: &'a R,
}

/// An outgoing error response (`id: null` when the request's id is unknown).
#[derive(Serialize)]
pub struct OutError<'a> {
    pub jsonrpc: &'static str,
    pub id: Option<&'a Id>,
    pub error: &'a RpcError,
}

pub const JSONRPC: &str = "2.0";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::types::ProcessReadParams;

    fn both(json: &str) -> Vec<Inbound> {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        let mp = rmp_serde::to_vec_named(&v).unwrap();
        vec![
            Inbound::parse(Codec::Json, Bytes::from(json.to_owned())).unwrap(),
            Inbound::parse(Codec::MsgPack, Bytes::from(mp)).unwrap(),
        ]
    }

    #[test]
    fn classifies_frames() {
        for f in both(r#"{"jsonrpc":"2.0","id":"1","method":"a.b","params":{}}"#) {
            assert!(matches!(f.kind, FrameKind::Request { .. }));
        }
        for f in both(r#"{"jsonrpc":"2.0","method":"a.b"}"#) {
            assert!(matches!(f.kind, FrameKind::Notification { .. }));
        }
        for f in both(r#"{"jsonrpc":"2.0","id":"1","result":null}"#) {
            assert!(matches!(f.kind, FrameKind::Response { .. }));
        }
        for f in both(r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}"#) {
            assert!(matches!(f.kind, FrameKind::Error { id: None, .. }));
        }
    }

    #[test]
    fn rejects_non_rpc_and_garbage() {
        let e = Inbound::parse(Codec::Json, Bytes::from_static(b"{\"id\":\"3\"}")).unwrap_err();
        assert_eq!(e.to_rpc().0, Some(Id::Str("3".into())));
        assert_eq!(e.to_rpc().1.code, -32600);
        let e = Inbound::parse(Codec::Json, Bytes::from_static(b"{nope")).unwrap_err();
        assert_eq!(e.to_rpc().1.code, -32700);
        let e = Inbound::parse(Codec::MsgPack, Bytes::from_static(&[0xc1])).unwrap_err();
        assert_eq!(e.to_rpc().1.code, -32700);
    }

    #[test]
    fn params_are_typed_and_bad_params_are_32602() {
        let json = r#"{"jsonrpc":"2.0","id":"1","method":"process.read","params":{"sessionId":"s","processId":"p","stream":"stdout","cursor":5}}"#;
        for f in both(json) {
            let p: ProcessReadParams = f.params().unwrap();
            assert_eq!(p.cursor, 5);
        }
        let bad =
            r#"{"jsonrpc":"2.0","id":"1","method":"process.read","params":{"sessionId":"s"}}"#;
        for f in both(bad) {
            let e = f.params::<ProcessReadParams>().unwrap_err();
            assert_eq!(e.code, -32602);
        }
    }

    #[test]
    fn large_json_responses_skip_the_envelope_scan_and_stay_checked() {
        let big = "A".repeat(FAST_RESPONSE_MIN);
        let frame = format!(r#"{{"jsonrpc":"2.0","id":"r-7","result":{{"data":"{big}"}}}}"#);
        let f = Inbound::parse(Codec::Json, Bytes::from(frame.clone())).unwrap();
        assert_eq!(
            f.kind,
            FrameKind::Response {
                id: Id::Str("r-7".into())
            }
        );
        let v: serde_json::Value = f.result().unwrap();
        assert_eq!(v["data"].as_str().unwrap().len(), big.len());
        // Truncated: the fast path declines (no closing brace), the full
        // parse reports -32700.
        let cut = Bytes::from(frame[..frame.len() - 3].to_owned());
        let e = Inbound::parse(Codec::Json, cut).unwrap_err();
        assert_eq!(e.to_rpc().1.code, -32700);
        // Garbage inside: accepted as a response, but decoding its result
        // fails for the caller.
        let bad = frame.replacen(r#""data":""#, r#""data":"\q"#, 1);
        let f = Inbound::parse(Codec::Json, Bytes::from(bad)).unwrap();
        assert!(f.result::<serde_json::Value>().is_err());
        // Escaped ids, other layouts and errors take the full path.
        for other in [
            format!(r#"{{"jsonrpc":"2.0","id":"a\"b","result":"{big}"}}"#),
            format!(r#"{{"id":"x","jsonrpc":"2.0","result":"{big}"}}"#),
            format!(r#"{{"jsonrpc":"2.0","id":"x","error":{{"code":1,"message":"{big}"}}}}"#),
        ] {
            assert_eq!(json_response_id(other.as_bytes()), None);
            let f = Inbound::parse(Codec::Json, Bytes::from(other)).unwrap();
            assert!(matches!(
                f.kind,
                FrameKind::Response { .. } | FrameKind::Error { .. }
            ));
        }
    }

    #[test]
    fn a_large_json_read_answer_decodes_as_it_was_encoded() {
        use crate::wire::types::{ProcState, ProcessReadResult, Stream};
        use crate::wire::{Blob, BlobRef};
        let data: Vec<u8> = (0..=255u8).cycle().take(1 << 20).collect();
        let sent = ProcessReadResult {
            process_id: "p".into(),
            stream: Stream::Stdout,
            data: BlobRef(&data),
            from_cursor: 0,
            next_cursor: data.len() as u64,
            earliest_cursor: 0,
            gap: false,
            truncated: false,
            eof: false,
            state: ProcState::Running,
            exit_code: None,
            exit_signal: None,
            ended_at: None,
            reason: Some("a \"quoted\" reason".into()),
            file_transfer: None,
        };
        let id = Id::Str("r-1".into());
        let out = OutResult {
            jsonrpc: JSONRPC,
            id: &id,
            result: &sent,
        };
        let msg = Codec::Json.encode_sized(&out, data.len()).unwrap();
        let text = msg.into_text().unwrap();
        assert_eq!(text.as_str(), serde_json::to_string(&out).unwrap());
        let f = Inbound::parse(Codec::Json, Bytes::from(text)).unwrap();
        let got: ProcessReadResult<Blob> = f.result().unwrap();
        assert_eq!(got.data.as_slice(), &data[..]);
        assert_eq!(got.reason.as_deref(), sent.reason.as_deref());
        assert_eq!(got.next_cursor, sent.next_cursor);
    }

    #[test]
    fn only_jsonrpc_2_0_is_accepted() {
        for bad in [
            r#"{"jsonrpc":"1.0","id":"1","method":"a.b"}"#,
            r#"{"jsonrpc":"2.1","id":"1","method":"a.b"}"#,
            r#"{"jsonrpc":2,"id":"1","method":"a.b"}"#,
            r#"{"jsonrpc":null,"id":"1","method":"a.b"}"#,
            r#"{"id":"1","method":"a.b"}"#,
        ] {
            let v: serde_json::Value = serde_json::from_str(bad).unwrap();
            let mp = rmp_serde::to_vec_named(&v).unwrap();
            for f in [
                Inbound::parse(Codec::Json, Bytes::from(bad.to_owned())),
                Inbound::parse(Codec::MsgPack, Bytes::from(mp)),
            ] {
                match f {
                    Err(FrameError::Invalid { id, .. }) => {
                        assert_eq!(id, Some(Id::Str("1".into())), "{bad}")
                    }
                    other => panic!("{bad}: {other:?}"),
                }
            }
        }
    }
}
