//! The binary frames of a `host` terminal stream (PROTOCOL.md §8), shared by
//! the executor (which dials the host), the harness relay and `bmx attach`.
//!
//! Frame: byte 0 op, bytes 1-8 seq (u64 big-endian), then data.
//!
//! | op | direction | meaning |
//! | --- | --- | --- |
//! | 1 output | executor → viewer | a live chunk `seq` |
//! | 2 input | viewer → executor | bytes to type (seq ignored) |
//! | 3 snapshot | executor → viewer | a replayed chunk `seq`; empty data = gap marker, `seq` = the last lost seq |

use bytes::{BufMut, Bytes, BytesMut};

pub const OP_OUTPUT: u8 = 1;
pub const OP_INPUT: u8 = 2;
pub const OP_SNAPSHOT: u8 = 3;

/// Bytes before the data.
pub const HEADER_LEN: usize = 9;

/// Encode one frame.
pub fn frame(op: u8, seq: u64, data: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + data.len());
    b.put_u8(op);
    b.put_u64(seq);
    b.put_slice(data);
    b.freeze()
}

/// Decode one frame: (op, seq, data); `None` when shorter than the header.
pub fn parse(frame: &Bytes) -> Option<(u8, u64, Bytes)> {
    if frame.len() < HEADER_LEN {
        return None;
    }
    let seq = u64::from_be_bytes(frame[1..HEADER_LEN].try_into().ok()?);
    Some((frame[0], seq, frame.slice(HEADER_LEN..)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let f = frame(OP_OUTPUT, 0x0102_0304_0506_0708, b"hi");
        assert_eq!(&f[..9], &[1, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            parse(&f),
            Some((1, 0x0102_0304_0506_0708, Bytes::from_static(b"hi")))
        );
        assert_eq!(parse(&Bytes::from_static(b"\x02\0\0")), None);
        assert_eq!(
            parse(&frame(OP_SNAPSHOT, 7, b"")).map(|f| f.2.len()),
            Some(0)
        );
    }
}
