//! Byte payloads: base64 in the JSON codec, MessagePack `bin` in the binary one.
//!
//! The choice is made by the serializer itself (`is_human_readable`), so one
//! params type serves both codecs and a byte field never becomes a JSON
//! array of numbers.

use bytes::Bytes;
use serde::de::{Error as _, Visitor};
use serde::ser::SerializeStruct as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::cell::RefCell;
use std::fmt;

/// An owned byte payload on the wire (`data` fields).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Blob(pub Bytes);

impl Blob {
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        Blob(bytes.into())
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

impl From<Vec<u8>> for Blob {
    fn from(v: Vec<u8>) -> Self {
        Blob(Bytes::from(v))
    }
}

impl From<&'static [u8]> for Blob {
    fn from(v: &'static [u8]) -> Self {
        Blob(Bytes::from_static(v))
    }
}

/// Encode bytes as standard base64 with the SIMD codec: the JSON codec's hot
/// path for `process.read` results.
pub fn base64_encode(data: &[u8]) -> String {
    base64_simd::STANDARD.encode_to_string(data)
}

pub fn base64_decode(text: &str) -> Result<Vec<u8>, base64_simd::Error> {
    base64_simd::STANDARD.decode_to_vec(text.as_bytes())
}

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        BlobRef(&self.0).serialize(serializer)
    }
}

/// A borrowed byte payload, serialized exactly like [`Blob`]: lets an
/// answer be encoded straight from the bytes where they already are (a
/// process's output ring) instead of from a copy made for the occasion.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlobRef<'a>(pub &'a [u8]);

impl fmt::Debug for BlobRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobRef({} bytes)", self.0.len())
    }
}

/// serde_json's marker for a value written out verbatim (what
/// `serde_json::value::RawValue` serializes as).
const RAW_JSON: &str = "$serde_json::private::RawValue";

impl Serialize for BlobRef<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            // Base64 never needs JSON escaping, yet `serialize_str` would
            // scan every byte of it for characters to escape: the largest
            // cost of a JSON `process.read` answer. Hand serde_json the
            // finished string literal instead, the way its own `RawValue`
            // serializes (the `blob_is_a_plain_base64_string` test pins
            // the output, so a serde_json that changed this would fail it).
            let mut literal = String::with_capacity(self.0.len().div_ceil(3) * 4 + 2);
            literal.push('"');
            base64_simd::STANDARD.encode_append(self.0, &mut literal);
            literal.push('"');
            let mut raw = serializer.serialize_struct(RAW_JSON, 1)?;
            raw.serialize_field(RAW_JSON, &literal)?;
            raw.end()
        } else {
            serializer.serialize_bytes(self.0)
        }
    }
}

thread_local! {
    /// The frame being decoded on this thread, while [`decode_within`]
    /// runs: a `bin` field borrowed from it becomes a view of the frame
    /// instead of a copy.
    static SOURCE: RefCell<Option<Bytes>> = const { RefCell::new(None) };
}

/// Run `decode` (a decode of `frame`'s own bytes) with `frame` as the
/// source of the [`Blob`]s it produces: each MessagePack `bin` that lies
/// inside `frame` is taken with [`Bytes::slice_ref`], sharing the frame's
/// allocation.
///
/// Why: a `process.read` answer is one `bin` of up to a megabyte; copying
/// it out of the frame was one more pass over every output byte on the
/// receiving side. The blob keeps the frame's buffer alive while it
/// lives, which is the frame plus a small envelope.
pub fn decode_within<T>(frame: &Bytes, decode: impl FnOnce() -> T) -> T {
    let previous = SOURCE.with(|s| s.replace(Some(frame.clone())));
    // Restored on unwind as well: a panic in a decoder must not leave a
    // stale source for the next decode on this thread.
    struct Restore(Option<Bytes>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            SOURCE.with(|s| *s.borrow_mut() = previous);
        }
    }
    let _restore = Restore(previous);
    decode()
}

/// `v` as a view of the current [`decode_within`] source when it lies
/// inside it, else `None`.
fn borrowed_view(v: &[u8]) -> Option<Bytes> {
    SOURCE.with(|s| {
        let s = s.borrow();
        let src = s.as_ref()?;
        let (start, end) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
        let (vs, ve) = (v.as_ptr() as usize, v.as_ptr() as usize + v.len());
        // `slice_ref` panics on a slice outside its buffer: check first.
        (!v.is_empty() && vs >= start && ve <= end).then(|| src.slice_ref(v))
    })
}

struct BlobVisitor;

impl<'de> Visitor<'de> for BlobVisitor {
    type Value = Blob;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("base64 text or binary bytes")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Blob, E> {
        base64_decode(v)
            .map(Blob::from)
            .map_err(|_| E::custom("invalid base64"))
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Blob, E> {
        Ok(Blob(Bytes::copy_from_slice(v)))
    }

    fn visit_borrowed_bytes<E: serde::de::Error>(self, v: &'de [u8]) -> Result<Blob, E> {
        Ok(Blob(
            borrowed_view(v).unwrap_or_else(|| Bytes::copy_from_slice(v)),
        ))
    }

    fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Blob, E> {
        Ok(Blob::from(v))
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        if deserializer.is_human_readable() {
            deserializer.deserialize_str(BlobVisitor)
        } else {
            deserializer
                .deserialize_bytes(BlobVisitor)
                .map_err(|e| D::Error::custom(format!("expected bin: {e}")))
        }
    }
}

#[cfg(test)]
impl proptest::arbitrary::Arbitrary for Blob {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Blob>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        use proptest::prelude::*;
        proptest::collection::vec(any::<u8>(), 0..64)
            .prop_map(Blob::from)
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_base64_msgpack_is_bin() {
        let b = Blob::from(vec![0u8, 1, 2, 255]);
        assert_eq!(serde_json::to_string(&b).unwrap(), "\"AAEC/w==\"");
        let m = rmp_serde::to_vec(&b).unwrap();
        // bin8 marker, length 4
        assert_eq!(&m[..2], &[0xc4, 4]);
        let back: Blob = rmp_serde::from_slice(&m).unwrap();
        assert_eq!(back, b);
        let back: Blob = serde_json::from_str("\"AAEC/w==\"").unwrap();
        assert_eq!(back, b);
        assert!(serde_json::from_str::<Blob>("\"%%%\"").is_err());
        assert!(serde_json::from_str::<Blob>("[1,2]").is_err());
    }

    #[test]
    fn a_bin_inside_the_decoded_frame_is_a_view_of_it() {
        let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let frame = Bytes::from(rmp_serde::to_vec(&(7u8, Blob::from(data.clone()))).unwrap());
        let (n, blob): (u8, Blob) =
            decode_within(&frame, || rmp_serde::from_slice(&frame).unwrap());
        assert_eq!((n, blob.as_slice()), (7, &data[..]));
        let (fs, fe) = (
            frame.as_ptr() as usize,
            frame.as_ptr() as usize + frame.len(),
        );
        let bs = blob.as_slice().as_ptr() as usize;
        assert!(bs >= fs && bs + blob.len() <= fe, "not a view of the frame");
        // Outside `decode_within`, and for bytes from elsewhere, a copy.
        let other = rmp_serde::to_vec(&Blob::from(vec![1u8, 2, 3])).unwrap();
        let copied: Blob = decode_within(&frame, || rmp_serde::from_slice(&other).unwrap());
        assert_eq!(copied.as_slice(), &[1, 2, 3]);
        let plain: (u8, Blob) = rmp_serde::from_slice(&frame).unwrap();
        let ps = plain.1.as_slice().as_ptr() as usize;
        assert!(ps < fs || ps >= fe, "a view without a source");
        // The source does not outlive the call, even when it unwinds.
        let r = std::panic::catch_unwind(|| decode_within(&frame, || panic!("boom")));
        assert!(r.is_err());
        assert!(SOURCE.with(|s| s.borrow().is_none()));
    }

    #[test]
    fn blob_is_a_plain_base64_string() {
        let b = Blob::from(vec![0u8, 1, 2, 255, 9]);
        // Inside a larger value, through every JSON path bmx uses.
        let v = serde_json::json!({"a": 1});
        let wrapped = (&v, &b, BlobRef(b"hi"));
        assert_eq!(
            serde_json::to_string(&wrapped).unwrap(),
            r#"[{"a":1},"AAEC/wk=","aGk="]"#
        );
        assert_eq!(
            String::from_utf8(serde_json::to_vec_pretty(&b).unwrap()).unwrap(),
            "\"AAEC/wk=\""
        );
        assert_eq!(
            serde_json::to_value(&b).unwrap(),
            serde_json::Value::String("AAEC/wk=".into())
        );
        assert_eq!(serde_json::to_string(&Blob::default()).unwrap(), "\"\"");
    }
}
