//! The harness's blob store: content-addressed bytes (artifacts, backups,
//! skill archives) behind a trait, so an embedding platform can put them in
//! its own object store; [`FsBlobStore`] is the default, a directory under
//! the harness's data dir.
//!
//! Why content addressing: an upload is idempotent by its digest (the same
//! bytes are stored once, however often they are sent), a resumed upload
//! knows where it stands by digest alone, and a download's `ETag` is the
//! digest. Why uploads are *partial* until [`BlobStore::commit`]: a blob is
//! only ever visible whole and verified; a dropped connection leaves a
//! partial that the next attempt continues, never a corrupt blob.

mod fs;

pub use fs::FsBlobStore;

use async_trait::async_trait;
use std::fmt;
use std::pin::Pin;
use tokio::io::AsyncRead;

/// A `sha256:<64 lowercase hex>` digest, checked: it names files, so no
/// other shape is accepted (no path can be smuggled in through it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    pub const PREFIX: &'static str = "sha256:";

    /// Parse `sha256:<hex>`; upper-case hex is accepted and lowered.
    ///
    /// # Errors
    ///
    /// [`BlobError::BadDigest`] for anything else.
    pub fn parse(s: &str) -> Result<Digest, BlobError> {
        let hex = s
            .strip_prefix(Self::PREFIX)
            .ok_or_else(|| BlobError::BadDigest(short(s)))?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BlobError::BadDigest(short(s)));
        }
        Ok(Digest(format!(
            "{}{}",
            Self::PREFIX,
            hex.to_ascii_lowercase()
        )))
    }

    /// The digest of a finished SHA-256.
    pub fn from_sha256(hash: &[u8]) -> Digest {
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        Digest(format!("{}{hex}", Self::PREFIX))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        use sha2::Digest as _;
        Digest::from_sha256(&sha2::Sha256::digest(bytes))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> &str {
        &self.0[Self::PREFIX.len()..]
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// At most 80 characters of untrusted text, for an error message.
fn short(s: &str) -> String {
    s.chars().take(80).collect()
}

/// What can go wrong with a blob.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    #[error("bad digest {0:?}: expected sha256:<64 hex digits>")]
    BadDigest(String),
    #[error("no blob {0}")]
    NotFound(String),
    #[error("{size} bytes is over the blob limit of {max} bytes")]
    TooLarge { size: u64, max: u64 },
    #[error("the upload is at offset {current}, not {offset}")]
    OffsetMismatch { offset: u64, current: u64 },
    #[error("the upload has {have} of {size} bytes")]
    Incomplete { have: u64, size: u64 },
    #[error("the bytes hash to {actual}, not {expected}")]
    DigestMismatch { expected: String, actual: String },
    #[error("the blob store's disk is full (the partial file was removed)")]
    DiskFull,
    #[error("blob store: {0}")]
    Io(#[from] std::io::Error),
}

/// A byte range of a stored blob, streamed.
pub type BlobReader = Pin<Box<dyn AsyncRead + Send>>;

/// Content-addressed storage. Every method is safe to call concurrently;
/// calls for one digest are serialized by the implementation.
#[async_trait]
pub trait BlobStore: Send + Sync + 'static {
    /// The largest blob accepted.
    fn max_bytes(&self) -> u64;

    /// The size of the complete blob `digest`, if it is stored.
    async fn stat(&self, digest: &Digest) -> Result<Option<u64>, BlobError>;

    /// How many bytes of an unfinished upload of `digest` are kept (0 when
    /// there is none): where a resumed upload continues.
    async fn partial_len(&self, digest: &Digest) -> Result<u64, BlobError>;

    /// Write `data` at `offset` of the upload of `digest` (total `size`
    /// bytes), durably (fsynced) before answering the new length.
    ///
    /// # Errors
    ///
    /// [`BlobError::OffsetMismatch`] unless `offset` is the kept length
    /// (the caller asks [`partial_len`](Self::partial_len) and resends);
    /// [`BlobError::TooLarge`] past `size` or the store's limit;
    /// [`BlobError::DiskFull`] (the partial is removed).
    async fn append(
        &self,
        digest: &Digest,
        size: u64,
        offset: u64,
        data: &[u8],
    ) -> Result<u64, BlobError>;

    /// Verify the finished upload of `digest` (`size` bytes, hashing to
    /// `digest`) and publish it atomically. A blob already stored is a
    /// success (idempotent).
    ///
    /// # Errors
    ///
    /// [`BlobError::Incomplete`] before `size` bytes arrived;
    /// [`BlobError::DigestMismatch`] (the partial is removed: it can never
    /// become that blob).
    async fn commit(&self, digest: &Digest, size: u64) -> Result<(), BlobError>;

    /// Store `data` whole (small blobs: skill archives, tests).
    async fn put(&self, data: &[u8]) -> Result<Digest, BlobError>;

    /// Bytes `start..end` of the blob `digest`.
    async fn read_range(
        &self,
        digest: &Digest,
        start: u64,
        end: u64,
    ) -> Result<BlobReader, BlobError>;
}
