//! The two codecs of PROTOCOL.md §1 and the subprotocols that select them.
//!
//! Plain `bmaexecutor.vX` frames are WebSocket text frames holding one JSON
//! object; `+msgpack` frames are binary frames holding one MessagePack map
//! with the same keys, byte fields as `bin`.

use super::method::Version;
use serde::{de::DeserializeOwned, Serialize};
use tokio_tungstenite::tungstenite::Message;

/// How frames are encoded on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    Json,
    MsgPack,
}

/// Why a frame could not be decoded or encoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("msgpack decode: {0}")]
    MsgPackDecode(#[from] rmp_serde::decode::Error),
    #[error("msgpack encode: {0}")]
    MsgPackEncode(#[from] rmp_serde::encode::Error),
    #[error("a {got} frame on a {expected:?} connection")]
    WrongFrameType { got: &'static str, expected: Codec },
}

impl Codec {
    /// Encode a value as one WebSocket message of this codec.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Result<Message, CodecError> {
        self.encode_sized(value, 0)
    }

    /// Like [`encode`](Self::encode), into a buffer sized up front for a
    /// frame carrying about `payload` raw bytes (base64 grows them by 4/3
    /// in JSON). Why: a large answer encoded into an empty `Vec` is copied
    /// again at every doubling, and each new allocation faults in fresh
    /// pages.
    pub fn encode_sized<T: Serialize + ?Sized>(
        self,
        value: &T,
        payload: usize,
    ) -> Result<Message, CodecError> {
        let envelope = 512;
        Ok(match self {
            Codec::Json => {
                let mut out = Vec::with_capacity(payload / 3 * 4 + 4 + envelope);
                // Only a frame that says it carries bytes (a read answer)
                // takes the blob-direct writer; every other frame keeps
                // serde_json's plain one, with no thread-local check per
                // write. The bytes written are the same either way.
                if payload > 0 {
                    super::blob::encode_json(value, &mut out)?;
                } else {
                    serde_json::to_writer(&mut out, value)?;
                }
                // SAFETY: serde_json writes valid UTF-8 only (its own
                // `to_string` relies on the same); skipping the check saves
                // a pass over a megabyte-sized answer.
                let text = unsafe { String::from_utf8_unchecked(out) };
                Message::Text(text.into())
            }
            Codec::MsgPack => {
                let mut out = Vec::with_capacity(payload + envelope);
                rmp_serde::encode::write_named(&mut out, value)?;
                Message::Binary(out.into())
            }
        })
    }

    /// Decode a value from a frame's payload bytes.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, CodecError> {
        Ok(match self {
            Codec::Json => serde_json::from_slice(bytes)?,
            Codec::MsgPack => rmp_serde::from_slice(bytes)?,
        })
    }

    /// The encoding of an empty map, used when a request has no `params`.
    pub fn empty_map(self) -> &'static [u8] {
        match self {
            Codec::Json => b"{}",
            Codec::MsgPack => &[0x80],
        }
    }
}

/// One of the four subprotocols, best first in [`Subprotocol::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Subprotocol {
    pub version: Version,
    pub codec: Codec,
}

impl Subprotocol {
    /// All subprotocols bmx speaks, in the executor's order of preference.
    pub const ALL: [Subprotocol; 4] = [
        Subprotocol {
            version: Version::V1_1,
            codec: Codec::MsgPack,
        },
        Subprotocol {
            version: Version::V1_1,
            codec: Codec::Json,
        },
        Subprotocol {
            version: Version::V1,
            codec: Codec::MsgPack,
        },
        Subprotocol {
            version: Version::V1,
            codec: Codec::Json,
        },
    ];

    pub fn name(self) -> &'static str {
        match (self.version, self.codec) {
            (Version::V1_1, Codec::MsgPack) => "bmaexecutor.v1.1+msgpack",
            (Version::V1_1, Codec::Json) => "bmaexecutor.v1.1",
            (Version::V1, Codec::MsgPack) => "bmaexecutor.v1+msgpack",
            (Version::V1, Codec::Json) => "bmaexecutor.v1",
        }
    }

    pub fn parse(name: &str) -> Option<Subprotocol> {
        Self::ALL.into_iter().find(|p| p.name() == name.trim())
    }

    /// The `protocol` string of the register params (`"1"` or `"1.1"`).
    pub fn protocol_version(self) -> &'static str {
        self.version.as_str()
    }

    /// The harness's choice: the first protocol the client offered (the
    /// client lists best first) that the server supports.
    pub fn negotiate<'a>(
        offered: impl IntoIterator<Item = &'a str>,
        supported: &[Subprotocol],
    ) -> Option<Subprotocol> {
        offered
            .into_iter()
            .flat_map(|h| h.split(','))
            .filter_map(Subprotocol::parse)
            .find(|p| supported.contains(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for p in Subprotocol::ALL {
            assert_eq!(Subprotocol::parse(p.name()), Some(p));
        }
        assert_eq!(Subprotocol::parse("bmaexecutor.v2"), None);
    }

    #[test]
    fn negotiation_follows_client_order_within_server_support() {
        let offered = [
            "bmaexecutor.v1.1+msgpack, bmaexecutor.v1.1",
            "bmaexecutor.v1",
        ];
        let got = Subprotocol::negotiate(offered, &Subprotocol::ALL).unwrap();
        assert_eq!(got.name(), "bmaexecutor.v1.1+msgpack");
        let json_only = [Subprotocol::ALL[1], Subprotocol::ALL[3]];
        let got = Subprotocol::negotiate(offered, &json_only).unwrap();
        assert_eq!(got.name(), "bmaexecutor.v1.1");
        assert!(Subprotocol::negotiate(["foo"], &Subprotocol::ALL).is_none());
    }
}
