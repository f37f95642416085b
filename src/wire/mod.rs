//! The wire: frames, codecs, the method table, typed params and results,
//! error and close codes, transports, and the per-connection I/O with its
//! request correlator. Nothing here holds business state.

pub mod blob;
pub mod codec;
pub mod error;
pub mod frame;
pub mod id;
pub mod link;
pub mod method;
pub mod outbox;
pub mod pending;
pub mod request;
pub mod secret;
pub mod transport;
pub mod types;
mod writer;

pub use blob::{Blob, BlobRef};
pub use codec::{Codec, Subprotocol};
pub use error::{CloseCode, ErrorCode, RpcError};
pub use frame::{FrameKind, Id, Inbound};
pub use link::{
    decode_params, CallError, Closed, Dispatch, Link, LinkLimits, Reader, Responder,
    DEFAULT_PEER_FRAME_BYTES,
};
pub use method::{Method, Owner, Version, METHODS};
pub use request::Request;
pub use secret::Secret;
pub use transport::{Endpoint, Transport};
