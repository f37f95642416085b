//! Byte payloads: base64 in the JSON codec, MessagePack `bin` in the binary one.
//!
//! The choice is made by the serializer itself (`is_human_readable`), so one
//! params type serves both codecs and a byte field never becomes a JSON
//! array of numbers.

use bytes::Bytes;
use serde::de::{DeserializeOwned, Error as _, Visitor};
use serde::ser::SerializeStruct as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::cell::{Cell, RefCell};
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
            if DIRECT.get() == Direct::Armed {
                return serialize_direct(self.0, serializer);
            }
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

/// Where [`encode_json`] stands on this thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direct {
    /// No [`encode_json`] running: a [`BlobRef`] writes its literal itself.
    Off,
    /// [`encode_json`] running, no blob handed over.
    Armed,
    /// A [`BlobRef`] (these bytes) is being serialized and has written
    /// [`MARK`]; the [`DirectWriter`] that receives it encodes the bytes.
    Pending(*const u8, usize),
    /// A [`MARK`] went to some other writer: the output is wrong.
    Spoiled,
}

thread_local! {
    static DIRECT: Cell<Direct> = const { Cell::new(Direct::Off) };
}

/// The raw JSON a [`BlobRef`] hands serde_json during [`encode_json`]: a
/// [`DirectWriter`] recognises it by its address, not its text, so no other
/// fragment can be taken for it.
static MARK: &str = "\"bmx:blob\"";

/// A [`BlobRef`] during [`encode_json`]: write [`MARK`] and let the
/// [`DirectWriter`] put the base64 in its place, straight into the frame.
fn serialize_direct<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    DIRECT.set(Direct::Pending(bytes.as_ptr(), bytes.len()));
    let done = serializer
        .serialize_struct(RAW_JSON, 1)
        .and_then(|mut raw| {
            raw.serialize_field(RAW_JSON, MARK)?;
            raw.end()
        });
    // Still pending: the mark was written by a serializer that is not
    // [`encode_json`]'s (a nested `to_string`, a `to_value`).
    if let Direct::Pending(..) = DIRECT.get() {
        DIRECT.set(Direct::Spoiled);
    }
    done
}

/// The writer of [`encode_json`]: everything goes to `out`, except that
/// [`MARK`] becomes the pending blob's base64 literal.
struct DirectWriter<'a> {
    out: &'a mut Vec<u8>,
}

impl DirectWriter<'_> {
    fn put(&mut self, buf: &[u8]) {
        let Direct::Pending(ptr, len) = DIRECT.get() else {
            return self.out.extend_from_slice(buf);
        };
        if !std::ptr::eq(buf, MARK.as_bytes()) {
            return self.out.extend_from_slice(buf);
        }
        // SAFETY: `Pending` holds the slice of the `BlobRef` whose
        // `serialize_direct` is running below us on this thread (it set the
        // state and clears it before it returns), so the slice is borrowed
        // and alive for the whole of this call.
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
        self.out.push(b'"');
        base64_simd::STANDARD.encode_append(bytes, self.out);
        self.out.push(b'"');
        DIRECT.set(Direct::Armed);
    }
}

impl std::io::Write for DirectWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.put(buf);
        Ok(buf.len())
    }
    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.put(buf);
        Ok(())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Append `value` as JSON to `out`, each [`BlobRef`]'s base64 encoded
/// straight into `out`: exactly what `serde_json::to_writer` writes.
///
/// Why: the literal a [`BlobRef`] otherwise builds is a second buffer of
/// the answer's size, allocated (its pages faulted in), filled and copied
/// into the frame for every JSON `process.read` answer.
///
/// Should a mark reach another writer (a [`BlobRef`] serialized by some
/// nested serializer inside `value`), the output is thrown away and
/// `value` encoded again the plain way.
pub fn encode_json<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> serde_json::Result<()> {
    let start = out.len();
    let previous = DIRECT.replace(Direct::Armed);
    // Restored on unwind as well: a panic must not leave a later
    // `BlobRef` on this thread writing a mark into a plain serializer.
    struct Restore(Direct);
    impl Drop for Restore {
        fn drop(&mut self) {
            DIRECT.set(self.0);
        }
    }
    let restore = Restore(previous);
    let done = serde_json::to_writer(DirectWriter { out: &mut *out }, value);
    let spoiled = DIRECT.get() == Direct::Spoiled;
    DIRECT.set(Direct::Off);
    let again = spoiled.then(|| {
        out.truncate(start);
        serde_json::to_writer(&mut *out, value)
    });
    drop(restore);
    again.unwrap_or(done)
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

thread_local! {
    /// The one base64 string of the frame [`decode_json_spliced`] is
    /// decoding, decoded ahead of serde_json: taken by the [`Blob`] that
    /// finds [`STAND_IN`] where the string was.
    static PREDECODED: RefCell<Option<Bytes>> = const { RefCell::new(None) };
}

/// What stands in a spliced frame where its large base64 string was. Not
/// base64 (`!`), so no frame's [`Blob`] can legitimately hold it.
const STAND_IN: &str = "!bmx:predecoded!";

/// Strings shorter than this are left to serde_json.
const SPLICE_MIN: usize = 4 << 10;

/// The index of the first `needle` in `hay`, 64 bytes at a time: each
/// block is compared whole, without an early exit, which the compiler
/// turns into (partly) vector compares. A hand-written SSE2 loop took no
/// smaller share of a `perf` profile (one each, so not measured better):
/// this pass is the first to read a frame fresh from the socket, and
/// much of its cost is likely bringing the bytes into cache, where the
/// base64 decode after it then finds them.
fn find_byte(hay: &[u8], needle: u8) -> Option<usize> {
    let (blocks, rest) = hay.as_chunks::<64>();
    for (i, block) in blocks.iter().enumerate() {
        if block.iter().fold(false, |seen, &b| seen | (b == needle)) {
            return block.iter().position(|&b| b == needle).map(|j| i * 64 + j);
        }
    }
    let done = blocks.len() * 64;
    rest.iter().position(|&b| b == needle).map(|j| done + j)
}

/// The first run of at least [`SPLICE_MIN`] bytes between two consecutive
/// `"` of `frame`, as the range between them.
fn long_quoted(frame: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut open = find_byte(frame, b'"')?;
    loop {
        let close = open + 1 + find_byte(&frame[open + 1..], b'"')?;
        if close - open > SPLICE_MIN {
            return Some(open + 1..close);
        }
        open = close;
    }
}

/// Decode a large JSON frame whose one large string is base64 (a
/// `process.read` answer) without serde_json reading that string: the
/// string is decoded here, and serde_json parses a copy of the frame in
/// which [`STAND_IN`] replaces it; the [`Blob`] that finds the stand-in
/// takes the decoded bytes. `None`: the frame is not like that, or the
/// spliced decode could not vouch for its result; decode the frame itself.
///
/// Why: serde_json scans every byte of a string for quotes and escapes
/// and then checks it is UTF-8 before a visitor sees it: for a megabyte of
/// base64, two passes more than the decode, which is itself a full check
/// (a byte outside the alphabet, `"` and `\` included, fails it).
///
/// Why the result is the frame's: the run between two consecutive quotes
/// is either a string's contents or JSON between two strings, and nothing
/// made only of base64 characters can follow a closing quote in JSON; so
/// in a valid frame it is a string, and the splice changes nothing else
/// (an invalid frame stays invalid). The stand-in occurs nowhere else in
/// the frame, so the decoded bytes go to the value that held the string,
/// and only when that value is a [`Blob`], which would have decoded the
/// same bytes; if anything else read the stand-in, nothing took the bytes,
/// and the answer is `None`.
pub fn decode_json_spliced<T: DeserializeOwned>(frame: &[u8]) -> Option<T> {
    let run = long_quoted(frame)?;
    let (head, text, tail) = (&frame[..run.start], &frame[run.clone()], &frame[run.end..]);
    let bytes = base64_simd::STANDARD.decode_to_vec(text).ok()?;
    let stand_in = STAND_IN.as_bytes();
    let occurs = |hay: &[u8]| hay.windows(stand_in.len()).any(|w| w == stand_in);
    if occurs(head) || occurs(tail) {
        return None;
    }
    let mut spliced = Vec::with_capacity(head.len() + stand_in.len() + tail.len());
    spliced.extend_from_slice(head);
    spliced.extend_from_slice(stand_in);
    spliced.extend_from_slice(tail);
    let previous = PREDECODED.with(|p| p.replace(Some(Bytes::from(bytes))));
    // Restored on unwind as well, like `decode_within`'s source.
    struct Restore(Option<Bytes>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            PREDECODED.with(|p| *p.borrow_mut() = previous);
        }
    }
    let restore = Restore(previous);
    let decoded = serde_json::from_slice::<T>(&spliced);
    let unclaimed = PREDECODED.with(|p| p.borrow_mut().take()).is_some();
    drop(restore);
    match decoded {
        Ok(v) if !unclaimed => Some(v),
        _ => None,
    }
}

/// The bytes [`decode_json_spliced`] decoded ahead, if `v` is its stand-in.
fn predecoded(v: &str) -> Option<Bytes> {
    if v != STAND_IN {
        return None;
    }
    PREDECODED.with(|p| p.borrow_mut().take())
}

struct BlobVisitor;

impl<'de> Visitor<'de> for BlobVisitor {
    type Value = Blob;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("base64 text or binary bytes")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Blob, E> {
        if let Some(bytes) = predecoded(v) {
            return Ok(Blob(bytes));
        }
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

    /// Serializes a [`BlobRef`] through a serializer of its own, inside
    /// the value being encoded.
    struct Nested<'a>(&'a [u8]);

    impl Serialize for Nested<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let inner =
                serde_json::to_string(&BlobRef(self.0)).map_err(serde::ser::Error::custom)?;
            let value = serde_json::to_value(BlobRef(self.0)).map_err(serde::ser::Error::custom)?;
            (inner, value, BlobRef(self.0)).serialize(serializer)
        }
    }

    #[test]
    fn direct_encoding_writes_what_serde_json_writes() {
        let big: Vec<u8> = (0..=255u8).cycle().take(300_001).collect();
        let b = Blob::from(big.clone());
        let v = serde_json::json!({"k": [1, "x"]});
        let value = (&v, BlobRef(&big), &b, BlobRef(b""), "tail");
        let mut out = b"prefix".to_vec();
        encode_json(&value, &mut out).unwrap();
        let mut want = b"prefix".to_vec();
        serde_json::to_writer(&mut want, &value).unwrap();
        assert!(out == want, "direct output differs");
        // And it was the direct way: every mark was taken by the writer
        // (a redo would give the same bytes).
        DIRECT.set(Direct::Armed);
        let mut direct = Vec::new();
        serde_json::to_writer(DirectWriter { out: &mut direct }, &value).unwrap();
        assert_eq!(
            DIRECT.replace(Direct::Off),
            Direct::Armed,
            "a mark was not taken"
        );
        assert!(direct == want[b"prefix".len()..], "direct output differs");
        // A blob serialized by a serializer of its own inside the value:
        // the encode starts over the plain way, and is still right.
        let nested = (BlobRef(&big[..10]), Nested(&big[..7]), BlobRef(&big[..5]));
        let mut out = Vec::new();
        encode_json(&nested, &mut out).unwrap();
        assert_eq!(out, serde_json::to_vec(&nested).unwrap());
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains("bmx:blob"), "{text}");
        // And the state is back to off: plain serializers write literals.
        assert_eq!(DIRECT.get(), Direct::Off);
        assert_eq!(serde_json::to_string(&BlobRef(b"hi")).unwrap(), "\"aGk=\"");
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Answer {
        id: String,
        data: Blob,
        n: u64,
    }

    #[test]
    fn a_spliced_decode_gives_the_full_decodes_result_or_none() {
        let big: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let b64 = base64_encode(&big);
        let frame = format!(r#"{{"id":"a\"b","data":"{b64}","n":7}}"#);
        let want: Answer = serde_json::from_str(&frame).unwrap();
        let got: Answer = decode_json_spliced(frame.as_bytes()).unwrap();
        assert_eq!(got, want);
        assert_eq!(got.data.as_slice(), &big[..]);
        assert!(PREDECODED.with(|p| p.borrow().is_none()));
        // The long string read as text, not as a blob: nobody takes the
        // bytes, so no answer (the caller decodes the frame itself).
        #[derive(serde::Deserialize)]
        struct Text {
            #[allow(dead_code)]
            data: String,
        }
        assert!(decode_json_spliced::<Text>(frame.as_bytes()).is_none());
        // Not base64, no long string, the stand-in elsewhere, broken JSON:
        // none, and the full decode says what it says.
        let not_b64 = frame.replacen("AAEC", "AA C", 1);
        assert!(decode_json_spliced::<Answer>(not_b64.as_bytes()).is_none());
        assert!(decode_json_spliced::<Answer>(br#"{"id":"x","data":"AAEC","n":1}"#).is_none());
        let stand_in = frame.replacen(r#""a\"b""#, &format!("{STAND_IN:?}"), 1);
        assert_eq!(
            serde_json::from_str::<Answer>(&stand_in).unwrap().id,
            STAND_IN
        );
        assert!(decode_json_spliced::<Answer>(stand_in.as_bytes()).is_none());
        let cut = &frame[..frame.len() - 1];
        assert!(decode_json_spliced::<Answer>(cut.as_bytes()).is_none());
        // Base64 characters between two strings are not JSON either way.
        let between = format!(r#"{{"id":"x","data":"AAEC"{b64}"n":7}}"#);
        assert!(serde_json::from_str::<serde_json::Value>(&between).is_err());
        assert!(decode_json_spliced::<Answer>(between.as_bytes()).is_none());
        // Outside a spliced decode, the stand-in is just invalid base64.
        assert!(serde_json::from_str::<Blob>(&format!("{STAND_IN:?}")).is_err());
    }

    #[test]
    fn find_byte_finds_the_first() {
        let mut hay = vec![b'a'; 300];
        assert_eq!(find_byte(&hay, b'"'), None);
        for at in [0, 63, 64, 130, 299] {
            hay[at] = b'"';
            assert_eq!(find_byte(&hay, b'"'), Some(at));
            hay[at] = b'a';
        }
        hay[200] = b'"';
        hay[250] = b'"';
        assert_eq!(find_byte(&hay, b'"'), Some(200));
    }
}
