//! Sans-IO numbered terminal scrollback, and the filter that makes replayed
//! output safe to feed to a viewer's terminal.
//!
//! Every chunk read from a PTY gets the next sequence number (`seq`, starting
//! at 1). A viewer that reconnects asks for everything from the last `seq` it
//! saw; chunks are kept whole (never split mid-chunk, except a single oversize
//! chunk) so replay hands back exactly the `Bytes` that were read, without
//! copying.
//!
//! None of the functions here panic on any input; clamps are documented.

use std::borrow::Cow;
use std::collections::VecDeque;

use bytes::Bytes;

/// Default scrollback budget (1 MiB).
pub const DEFAULT_MAX_BYTES: usize = 1 << 20;

/// Recent PTY output as numbered chunks, bounded by total bytes.
#[derive(Debug, Clone)]
pub struct Scrollback {
    /// Retained chunks, oldest first. Seqs are consecutive (every pushed
    /// chunk, even an empty one, is stored), which lets `replay` index
    /// instead of search.
    chunks: VecDeque<(u64, Bytes)>,
    /// Sum of the retained chunk lengths.
    bytes: usize,
    /// Budget, >= 1.
    max_bytes: usize,
    /// Seq of the newest chunk; 0 before the first push.
    latest: u64,
}

/// Result of [`Scrollback::replay`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// `Some((from_seq, earliest_seq))` when chunks the caller asked for were
    /// already dropped: seqs `from_seq..earliest_seq` are lost.
    pub gap: Option<(u64, u64)>,
    /// Retained chunks with `seq >= from_seq`, oldest first.
    pub chunks: Vec<(u64, Bytes)>,
}

impl Default for Scrollback {
    /// A scrollback of [`DEFAULT_MAX_BYTES`].
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BYTES)
    }
}

impl Scrollback {
    /// Creates an empty scrollback retaining about `max_bytes` of output.
    /// `max_bytes` 0 is clamped to 1, so the newest chunk always keeps at
    /// least its last byte.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            chunks: VecDeque::new(),
            bytes: 0,
            max_bytes: max_bytes.max(1),
            latest: 0,
        }
    }

    /// Records a chunk and returns the seq given to it.
    ///
    /// Oldest whole chunks are dropped until the total fits `max_bytes`. A
    /// chunk bigger than `max_bytes` on its own replaces everything and is
    /// trimmed to its last `max_bytes` bytes (a zero-copy `Bytes::slice`).
    /// Empty chunks get a seq too and are retained (they cost no bytes), so
    /// retained seqs stay consecutive.
    pub fn push(&mut self, data: Bytes) -> u64 {
        self.latest = self.latest.saturating_add(1);
        let seq = self.latest;
        if data.len() > self.max_bytes {
            let data = data.slice(data.len() - self.max_bytes..);
            self.chunks.clear();
            self.bytes = data.len();
            self.chunks.push_back((seq, data));
            return seq;
        }
        self.bytes += data.len();
        self.chunks.push_back((seq, data));
        while self.bytes > self.max_bytes {
            // Cannot empty the deque: the newest chunk alone fits.
            match self.chunks.pop_front() {
                Some((_, old)) => self.bytes -= old.len(),
                None => break,
            }
        }
        seq
    }

    /// Seq of the oldest retained chunk; `latest_seq() + 1` when empty.
    pub fn earliest_seq(&self) -> u64 {
        match self.chunks.front() {
            Some((seq, _)) => *seq,
            None => self.latest.saturating_add(1),
        }
    }

    /// Seq of the newest chunk; 0 when nothing was written yet.
    pub fn latest_seq(&self) -> u64 {
        self.latest
    }

    /// Total bytes retained.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes retained in chunks with `seq >= from_seq` (what a reader at
    /// `from_seq` has still to take); walks from the newest chunk, so it
    /// costs the reader's lag, not the scrollback's size.
    pub fn bytes_from(&self, from_seq: u64) -> usize {
        self.chunks
            .iter()
            .rev()
            .take_while(|(seq, _)| *seq >= from_seq)
            .map(|(_, b)| b.len())
            .sum()
    }

    /// The byte budget (after clamping).
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Retained chunks with `seq >= from_seq`, oldest first (cheap `Bytes`
    /// clones, no copying).
    ///
    /// `gap` is `Some((from_seq, earliest_seq()))` when some chunk with seq
    /// `>= from_seq` was dropped. Seq 0 is never issued, so `from_seq` 0
    /// means the same as 1 ("everything"): it reports a gap only if chunk 1
    /// is gone. Before sending the chunks to a viewer, concatenate them and
    /// pass them through [`strip_terminal_replies`].
    pub fn replay(&self, from_seq: u64) -> Replay {
        let earliest = self.earliest_seq();
        let gap = (from_seq.max(1) < earliest).then_some((from_seq, earliest));
        // Retained seqs are consecutive, so the position is an offset.
        let skip = usize::try_from(from_seq.saturating_sub(earliest)).unwrap_or(usize::MAX);
        let chunks = self.chunks.iter().skip(skip).cloned().collect();
        Replay { gap, chunks }
    }
}

const ENQ: u8 = 0x05;
const BEL: u8 = 0x07;
const CAN: u8 = 0x18;
const SUB: u8 = 0x1a;
const ESC: u8 = 0x1b;

/// Removes terminal *query* sequences from output that is about to be
/// replayed to a viewer, leaving every other byte identical.
///
/// Why: a query makes the viewer's terminal emulator answer as though the
/// user typed the answer. Replaying old output would then inject stale
/// cursor reports, colour values, window titles (a classic injection vector
/// when a title can be set and then reported) or clipboard contents into the
/// viewer's input. The live program already got its answers when the query
/// was first sent.
///
/// Removed (7-bit forms only; raw 8-bit C1 bytes are UTF-8 continuation bytes
/// in practice and are left alone):
///
/// | sequence | meaning |
/// | --- | --- |
/// | `ENQ` (0x05) | answerback request |
/// | `ESC Z` | DECID (old device attributes request) |
/// | `CSI 5 n`, `CSI 6 n`, `CSI ? Ps n` | DSR: status / cursor position / DEC reports |
/// | `CSI Ps c`, `CSI > Ps c`, `CSI = Ps c` | primary / secondary / tertiary DA |
/// | `CSI Ps x` (Ps 0 or 1) | DECREQTPARM |
/// | `CSI Ps ... t`, Ps in 11, 13-16, 18-21 | XTWINOPS state/size/position/title reports |
/// | `CSI Ps $ p`, `CSI ? Ps $ p` | DECRQM (ANSI / DEC mode) |
/// | `CSI > Ps q` | XTVERSION |
/// | `CSI ? u` | kitty keyboard flags query |
/// | `CSI ? Pp m` | XTQMODKEYS |
/// | `CSI ? Pi ; Pa ; ... S` (Pa 1 or 4) | XTSMGRAPHICS read |
/// | `CSI ... * y`, `CSI Ps $ w`, `CSI Ps $ u`, `CSI & u`, `CSI " v`, `CSI ... # \|` | DECRQCRA, DECRQPSR, DECRQTSR, DECRQUPSS, DECRQDE, XTREPORTSGR |
/// | `OSC Ps ; ... ? (BEL or ST)`, Ps in 4, 5, 10-19, 52, with a field exactly `?` | colour / special colour / dynamic colour / clipboard queries (the whole OSC goes, even if it mixes sets and queries) |
/// | `DCS $ q ... ST`, `DCS + q ... ST` | DECRQSS, XTGETTCAP |
/// | `APC G ... a=q ... ST` | kitty graphics query |
///
/// C0 controls embedded in a removed CSI (terminals execute them mid-sequence)
/// are kept. Sequences aborted by `ESC`, `CAN` or `SUB`, malformed ones, and
/// everything else are kept.
///
/// Chunk boundaries: a sequence may be split across PTY chunks, so the
/// caller must pass the **concatenated** replay, not chunk by chunk. An
/// incomplete sequence at the very end (which the live stream would complete
/// later) is kept as-is. Returns `Cow::Borrowed` when nothing was removed.
pub fn strip_terminal_replies(data: &[u8]) -> Cow<'_, [u8]> {
    let mut out: Option<Vec<u8>> = None;
    // data[..copied] has been accounted for in `out`.
    let mut copied = 0;
    let mut i = 0;
    while let Some(off) = data[i..].iter().position(|&b| b == ESC || b == ENQ) {
        let start = i + off;
        let seq = if data[start] == ENQ {
            Seq::Strip {
                len: 1,
                keep_c0: false,
            }
        } else {
            parse_escape(&data[start..])
        };
        match seq {
            Seq::Keep(len) => i = start + len,
            Seq::Incomplete => break,
            Seq::Strip { len, keep_c0 } => {
                let o = out.get_or_insert_with(|| Vec::with_capacity(data.len()));
                o.extend_from_slice(&data[copied..start]);
                if keep_c0 {
                    o.extend(
                        data[start..start + len]
                            .iter()
                            .filter(|&&b| b < 0x20 && b != ESC),
                    );
                }
                copied = start + len;
                i = copied;
            }
        }
    }
    match out {
        None => Cow::Borrowed(data),
        Some(mut o) => {
            o.extend_from_slice(&data[copied..]);
            Cow::Owned(o)
        }
    }
}

/// What the scanner found at an `ESC`.
#[derive(Debug, PartialEq, Eq)]
enum Seq {
    /// Not a query: copy `len` (>= 1) bytes and continue after them.
    Keep(usize),
    /// A query of `len` bytes to drop; `keep_c0` re-emits embedded C0s.
    Strip { len: usize, keep_c0: bool },
    /// Runs past the end of the data: keep the rest verbatim.
    Incomplete,
}

/// Kind of control string (terminated by ST).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Str {
    Osc,
    Dcs,
    Apc,
    /// SOS and PM: never queries, but must be skipped as a unit.
    Other,
}

/// `s[0] == ESC`.
fn parse_escape(s: &[u8]) -> Seq {
    match s.get(1) {
        None => Seq::Incomplete,
        Some(b'[') => parse_csi(s),
        Some(b']') => parse_string(s, Str::Osc),
        Some(b'P') => parse_string(s, Str::Dcs),
        Some(b'_') => parse_string(s, Str::Apc),
        Some(b'X' | b'^') => parse_string(s, Str::Other),
        Some(b'Z') => Seq::Strip {
            len: 2,
            keep_c0: false,
        },
        // Other escape sequences (charset selection, keypad modes, ...) are
        // never queries; only the ESC is consumed so that a following ESC is
        // examined on its own.
        Some(_) => Seq::Keep(1),
    }
}

/// Longest parameter string a query can have; longer CSIs are kept.
const MAX_PARAMS: usize = 32;

/// `s` starts with `ESC [`. Follows the ECMA-48 / VT500 parser: parameter
/// bytes 0x30-0x3F, intermediates 0x20-0x2F, final 0x40-0x7E; C0 controls are
/// executed in the middle, DEL is ignored, ESC / CAN / SUB abort.
fn parse_csi(s: &[u8]) -> Seq {
    let mut params = [0u8; MAX_PARAMS];
    let mut np = 0;
    let mut inter = [0u8; 2];
    let mut ni = 0;
    // Set for sequences a terminal ignores (params after intermediates,
    // overlong): they are kept.
    let mut invalid = false;
    for (i, &b) in s.iter().enumerate().skip(2) {
        match b {
            ESC | CAN | SUB => return Seq::Keep(i),
            0x00..=0x1f | 0x7f => {}
            0x30..=0x3f => {
                if ni > 0 || np == MAX_PARAMS {
                    invalid = true;
                } else {
                    params[np] = b;
                    np += 1;
                }
            }
            0x20..=0x2f => {
                if ni == inter.len() {
                    invalid = true;
                } else {
                    inter[ni] = b;
                    ni += 1;
                }
            }
            0x40..=0x7e => {
                let len = i + 1;
                return if !invalid && csi_is_query(&params[..np], &inter[..ni], b) {
                    Seq::Strip { len, keep_c0: true }
                } else {
                    Seq::Keep(len)
                };
            }
            // Non-ASCII inside a CSI: not something we recognise; keep it.
            _ => return Seq::Keep(i),
        }
    }
    Seq::Incomplete
}

/// The `n`th `;`-separated parameter as a number; `None` if absent or not
/// a plain decimal (empty counts as absent).
fn param(params: &[u8], n: usize) -> Option<u32> {
    let field = params.split(|&b| b == b';').nth(n)?;
    if field.is_empty() || field.len() > 9 || !field.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        field
            .iter()
            .fold(0u32, |acc, &d| acc * 10 + u32::from(d - b'0')),
    )
}

fn csi_is_query(params: &[u8], inter: &[u8], fin: u8) -> bool {
    let (prefix, rest) = match params.first() {
        Some(&p @ (b'<' | b'=' | b'>' | b'?')) => (Some(p), &params[1..]),
        _ => (None, params),
    };
    // A private marker anywhere else makes the sequence unusual; leave it.
    if rest.iter().any(|b| matches!(b, b'<' | b'=' | b'>' | b'?')) {
        return false;
    }
    let nparams = if rest.is_empty() {
        0
    } else {
        rest.split(|&b| b == b';').count()
    };
    match (inter, prefix, fin) {
        // DSR: operating status (5) and cursor position (6).
        (b"", None, b'n') => nparams == 1 && matches!(param(rest, 0), Some(5 | 6)),
        // DEC-private DSR: every form is a request.
        (b"", Some(b'?'), b'n') => true,
        // Primary / secondary / tertiary device attributes.
        (b"", None | Some(b'>') | Some(b'='), b'c') => true,
        // DECREQTPARM (replies use 2 and 3).
        (b"", None, b'x') => rest.is_empty() || matches!(param(rest, 0), Some(0 | 1)),
        // XTWINOPS reports; other Ps move/resize/push titles.
        (b"", None, b't') => matches!(
            param(rest, 0),
            Some(11 | 13 | 14 | 15 | 16 | 18 | 19 | 20 | 21)
        ),
        // DECRQM, ANSI and DEC modes.
        (b"$", None | Some(b'?'), b'p') => true,
        // XTVERSION.
        (b"", Some(b'>'), b'q') => true,
        // kitty keyboard protocol flags query (the reply carries flags).
        (b"", Some(b'?'), b'u') => rest.is_empty(),
        // XTQMODKEYS.
        (b"", Some(b'?'), b'm') => true,
        // XTSMGRAPHICS: Pa 1 = read, 4 = read maximum.
        (b"", Some(b'?'), b'S') => matches!(param(rest, 1), Some(1 | 4)),
        // DECRQCRA, DECRQPSR, DECRQTSR, DECRQUPSS, DECRQDE, XTREPORTSGR.
        (b"*", None, b'y')
        | (b"$", None, b'w')
        | (b"$", None, b'u')
        | (b"&", None, b'u')
        | (b"\"", None, b'v')
        | (b"#", None, b'|') => true,
        _ => false,
    }
}

/// `s` starts with `ESC x` where `x` opens a control string. OSC ends at
/// BEL or ST; the others only at ST (`ESC \`). ESC followed by anything
/// else, CAN and SUB abort the string.
fn parse_string(s: &[u8], kind: Str) -> Seq {
    let mut i = 2;
    while let Some(off) = s[i..]
        .iter()
        .position(|&b| matches!(b, BEL | ESC | CAN | SUB))
    {
        let at = i + off;
        let (payload_end, len) = match s[at] {
            BEL if kind == Str::Osc => (at, at + 1),
            BEL => {
                i = at + 1;
                continue;
            }
            ESC => match s.get(at + 1) {
                None => return Seq::Incomplete,
                Some(b'\\') => (at, at + 2),
                Some(_) => return Seq::Keep(at),
            },
            _ => return Seq::Keep(at),
        };
        let payload = &s[2..payload_end];
        let query = match kind {
            Str::Osc => osc_is_query(payload),
            Str::Dcs => payload.starts_with(b"$q") || payload.starts_with(b"+q"),
            Str::Apc => kitty_graphics_is_query(payload),
            Str::Other => false,
        };
        return if query {
            Seq::Strip {
                len,
                keep_c0: false,
            }
        } else {
            Seq::Keep(len)
        };
    }
    Seq::Incomplete
}

/// OSC colour (4, 5, 10-19) and clipboard (52) commands with a `?` field.
/// Restricted to those numbers because elsewhere `?` can be real data (a
/// window title of "?").
fn osc_is_query(payload: &[u8]) -> bool {
    let mut fields = payload.split(|&b| b == b';');
    let is_queryable = match fields.next().and_then(|ps| param(ps, 0)) {
        Some(n) => matches!(n, 4 | 5 | 10..=19 | 52),
        None => false,
    };
    is_queryable && fields.any(|f| f == b"?")
}

/// kitty graphics protocol: `APC G <key=value,...> [; payload]` with `a=q`.
fn kitty_graphics_is_query(payload: &[u8]) -> bool {
    let Some(rest) = payload.strip_prefix(b"G") else {
        return false;
    };
    let control = rest.split(|&b| b == b';').next().unwrap_or_default();
    control.split(|&b| b == b',').any(|kv| kv == b"a=q")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b(s: &'static [u8]) -> Bytes {
        Bytes::from_static(s)
    }

    #[test]
    fn seqs_start_at_one() {
        let mut sb = Scrollback::new(10);
        assert_eq!((sb.latest_seq(), sb.earliest_seq(), sb.bytes()), (0, 1, 0));
        assert_eq!(
            sb.replay(0),
            Replay {
                gap: None,
                chunks: vec![]
            }
        );
        assert_eq!(sb.push(b(b"abc")), 1);
        assert_eq!(sb.push(b(b"de")), 2);
        assert_eq!((sb.latest_seq(), sb.earliest_seq(), sb.bytes()), (2, 1, 5));
    }

    #[test]
    fn drops_oldest_whole_chunks() {
        let mut sb = Scrollback::new(6);
        sb.push(b(b"aaa"));
        sb.push(b(b"bb"));
        sb.push(b(b"cc"));
        assert_eq!((sb.earliest_seq(), sb.bytes()), (2, 4));
        let r = sb.replay(1);
        assert_eq!(r.gap, Some((1, 2)));
        assert_eq!(r.chunks, vec![(2, b(b"bb")), (3, b(b"cc"))]);
        let r = sb.replay(3);
        assert_eq!(r.gap, None);
        assert_eq!(r.chunks, vec![(3, b(b"cc"))]);
        assert_eq!(sb.replay(4).chunks, vec![]);
        assert_eq!(
            sb.replay(u64::MAX),
            Replay {
                gap: None,
                chunks: vec![]
            }
        );
        let r = sb.replay(0);
        assert_eq!(r.gap, Some((0, 2)));
        assert_eq!(r.chunks.len(), 2);
    }

    #[test]
    fn oversize_chunk_kept_alone_trimmed() {
        let mut sb = Scrollback::new(4);
        sb.push(b(b"xy"));
        assert_eq!(sb.push(b(b"0123456789")), 2);
        assert_eq!((sb.earliest_seq(), sb.bytes()), (2, 4));
        assert_eq!(sb.replay(2).chunks, vec![(2, b(b"6789"))]);
        sb.push(b(b"z"));
        assert_eq!(sb.replay(0).chunks, vec![(3, b(b"z"))]);
    }

    #[test]
    fn zero_budget_clamped_and_empty_chunks_numbered() {
        let mut sb = Scrollback::new(0);
        assert_eq!(sb.max_bytes(), 1);
        sb.push(b(b"abc"));
        assert_eq!(sb.push(Bytes::new()), 2);
        assert_eq!(sb.replay(1).chunks, vec![(1, b(b"c")), (2, Bytes::new())]);
    }

    #[derive(Debug)]
    struct Case(&'static [u8], &'static [u8]);

    fn check(cases: &[Case]) {
        for Case(input, want) in cases {
            let got = strip_terminal_replies(input);
            assert_eq!(&*got, *want, "input {:?}", String::from_utf8_lossy(input));
            assert_eq!(
                matches!(got, Cow::Borrowed(_)),
                input == want,
                "borrowed iff unchanged: {:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn strips_device_status_and_attributes() {
        check(&[
            Case(b"a\x1b[6nb", b"ab"),
            Case(b"a\x1b[5nb", b"ab"),
            Case(b"\x1b[?6n", b""),
            Case(b"\x1b[?996n", b""),
            Case(b"\x1b[c", b""),
            Case(b"\x1b[0c", b""),
            Case(b"\x1b[>c", b""),
            Case(b"\x1b[>0c", b""),
            Case(b"\x1b[=c", b""),
            Case(b"\x1bZ", b""),
            Case(b"x\x05y", b"xy"),
            Case(b"\x1b[x\x1b[1x", b""),
        ]);
    }

    #[test]
    fn strips_mode_window_and_misc_reports() {
        check(&[
            Case(b"\x1b[?2004$p", b""),
            Case(b"\x1b[4$p", b""),
            Case(b"\x1b[18t", b""),
            Case(b"\x1b[14t", b""),
            Case(b"\x1b[14;2t", b""),
            Case(b"\x1b[21t", b""),
            Case(b"\x1b[>q", b""),
            Case(b"\x1b[>0q", b""),
            Case(b"\x1b[?u", b""),
            Case(b"\x1b[?4m", b""),
            Case(b"\x1b[?1;1;0S", b""),
            Case(b"\x1b[1;1;1;1;1;1*y", b""),
            Case(b"\x1b[1$w", b""),
            Case(b"\x1b[1$u", b""),
            Case(b"\x1b[&u", b""),
            Case(b"\x1b[\"v", b""),
            Case(b"\x1b[1;1;2;2#|", b""),
        ]);
    }

    #[test]
    fn strips_osc_dcs_apc_queries() {
        check(&[
            Case(b"a\x1b]10;?\x07b", b"ab"),
            Case(b"a\x1b]11;?\x1b\\b", b"ab"),
            Case(b"\x1b]4;1;?\x07", b""),
            Case(b"\x1b]4;1;?;2;?\x07", b""),
            Case(b"\x1b]12;?\x07", b""),
            Case(b"\x1b]52;c;?\x07", b""),
            Case(b"\x1bP$qm\x1b\\", b""),
            Case(b"\x1bP$q\"p\x1b\\", b""),
            Case(b"\x1bP+q544e\x1b\\", b""),
            Case(b"\x1b_Gi=31,s=1,v=1,a=q,t=d,f=24;AAAA\x1b\\", b""),
        ]);
    }

    #[test]
    fn keeps_everything_else() {
        check(&[
            Case(b"plain text\r\n", b"plain text\r\n"),
            Case(b"\x1b[1;31mred\x1b[0m", b"\x1b[1;31mred\x1b[0m"),
            Case(b"\x1b[2J\x1b[H", b"\x1b[2J\x1b[H"),
            Case(b"\x1b[0n", b"\x1b[0n"),             // DSR reply "OK"
            Case(b"\x1b[12;40R", b"\x1b[12;40R"),     // CPR reply
            Case(b"\x1b[?62;22c", b"\x1b[?62;22c"),   // DA reply
            Case(b"\x1b[>1n", b"\x1b[>1n"),           // XTMODKEYS reset
            Case(b"\x1b[8;24;80t", b"\x1b[8;24;80t"), // resize
            Case(b"\x1b[22;0t", b"\x1b[22;0t"),       // push title
            Case(b"\x1b[!p", b"\x1b[!p"),             // DECSTR
            Case(b"\x1b[?2004h", b"\x1b[?2004h"),
            Case(b"\x1b[>1u\x1b[<u", b"\x1b[>1u\x1b[<u"), // kitty push/pop
            Case(b"\x1b]0;?\x07", b"\x1b]0;?\x07"),       // title "?"
            Case(
                b"\x1b]11;rgb:0000/0000/0000\x07",
                b"\x1b]11;rgb:0000/0000/0000\x07",
            ),
            Case(b"\x1b]8;;http://x/?\x1b\\", b"\x1b]8;;http://x/?\x1b\\"),
            Case(b"\x1b]52;c;aGk=\x07", b"\x1b]52;c;aGk=\x07"),
            Case(b"\x1bPq#0;2;0;0;0~-\x1b\\", b"\x1bPq#0;2;0;0;0~-\x1b\\"), // sixel
            Case(b"\x1b_Ga=T,f=100;AAAA\x1b\\", b"\x1b_Ga=T,f=100;AAAA\x1b\\"),
            Case(b"\x1b(B\x1b=\x1b7\x1b8", b"\x1b(B\x1b=\x1b7\x1b8"),
            Case("héllo ✓".as_bytes(), "héllo ✓".as_bytes()),
            Case(b"", b""),
        ]);
    }

    #[test]
    fn escapes_inside_control_strings() {
        // BEL is data inside SOS/PM/APC/DCS; ESC not followed by '\' aborts
        // any control string, and a terminal then runs what follows, so a
        // DSR there is a real query.
        check(&[
            Case(b"\x1bXab\x07\x1b[6n\x1b\\", b"\x1bXab\x07\x1b\\"),
            Case(b"\x1bPab\x07cd\x1b\\", b"\x1bPab\x07cd\x1b\\"),
            Case(b"\x1b]0;t\x1b[6nx", b"\x1b]0;tx"),
        ]);
    }

    #[test]
    fn incomplete_trailing_sequences_kept() {
        check(&[
            Case(b"ab\x1b", b"ab\x1b"),
            Case(b"ab\x1b[", b"ab\x1b["),
            Case(b"ab\x1b[6", b"ab\x1b[6"),
            Case(b"ab\x1b]11;?", b"ab\x1b]11;?"),
            Case(b"ab\x1b]11;?\x1b", b"ab\x1b]11;?\x1b"),
            Case(b"ab\x1bP$qm", b"ab\x1bP$qm"),
            // A complete query before an incomplete tail is still removed.
            Case(b"\x1b[6nab\x1b[6", b"ab\x1b[6"),
        ]);
    }

    #[test]
    fn aborted_and_malformed_sequences() {
        check(&[
            // CAN aborts the CSI: nothing to strip.
            Case(b"\x1b[6\x18n", b"\x1b[6\x18n"),
            // ESC aborts the first CSI; the second is a real query.
            Case(b"\x1b[6\x1b[6n", b"\x1b[6"),
            Case(b"\x1b\x1b[6n", b"\x1b"),
            // C0 executed mid-CSI survives the removal.
            Case(b"\x1b[6\rn", b"\r"),
            // Params after an intermediate: ignored by terminals, kept.
            Case(b"\x1b[$6p", b"\x1b[$6p"),
            Case(b"\x1b[6;?n", b"\x1b[6;?n"),
            // OSC aborted by another escape, then a query.
            Case(b"\x1b]11;?\x1b[c", b"\x1b]11;?"),
        ]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn scrollback_model(
            max in 0usize..64,
            sizes in prop::collection::vec(0usize..80, 0..50),
            from in 0u64..60,
        ) {
            let mut sb = Scrollback::new(max);
            let max = max.max(1);
            let mut all: Vec<(u64, Bytes)> = Vec::new();
            for (k, &n) in sizes.iter().enumerate() {
                let data = Bytes::from(vec![k as u8; n]);
                let seq = sb.push(data.clone());
                prop_assert_eq!(seq, k as u64 + 1);
                prop_assert_eq!(sb.latest_seq(), seq);
                all.push((seq, data));

                let retained = sb.replay(0).chunks;
                let total: usize = retained.iter().map(|(_, c)| c.len()).sum();
                prop_assert_eq!(total, sb.bytes());
                prop_assert!(total <= max);
                // The newest chunk is always retained (trimmed to its tail).
                let (last_seq, last) = retained.last().unwrap();
                prop_assert_eq!(*last_seq, seq);
                prop_assert_eq!(last, &all[k].1.slice(n.saturating_sub(max)..));
                // Retained = a consecutive suffix of everything pushed, each
                // chunk whole except a lone oversize one trimmed to its tail
                // (it may only be the oldest retained, followed by empty
                // chunks).
                let earliest = sb.earliest_seq();
                prop_assert_eq!(retained.len() as u64, seq - earliest + 1);
                for (i, (s, c)) in retained.iter().enumerate() {
                    let orig = &all[*s as usize - 1].1;
                    if orig.len() > max {
                        prop_assert_eq!(i, 0);
                        prop_assert_eq!(c, &orig.slice(orig.len() - max..));
                    } else {
                        prop_assert_eq!(c, orig);
                    }
                }
                // Nothing was dropped needlessly: the chunk before the oldest
                // retained one would not have fitted beside them.
                if earliest > 1 {
                    let dropped = all[earliest as usize - 2].1.len();
                    let oldest = all[earliest as usize - 1].1.len();
                    prop_assert!(total + dropped > max || oldest > max);
                }

                let r = sb.replay(from);
                prop_assert_eq!(r.gap.is_some(), from.max(1) < earliest);
                if let Some(g) = r.gap {
                    prop_assert_eq!(g, (from, earliest));
                }
                let want: Vec<_> = retained.iter().filter(|(s, _)| *s >= from).cloned().collect();
                prop_assert_eq!(r.chunks, want);
            }
        }

        #[test]
        fn strip_removes_exactly_interleaved_queries(
            parts in prop::collection::vec(
                (prop::collection::vec(any::<u8>().prop_filter("no ESC/ENQ", |b| *b != ESC && *b != ENQ), 0..20),
                 0usize..8),
                0..10,
            ),
        ) {
            const QUERIES: [&[u8]; 8] = [
                b"\x1b[6n", b"\x1b[c", b"\x1b[>c", b"\x1b]11;?\x07",
                b"\x1b]4;3;?\x1b\\", b"\x1bP$qm\x1b\\", b"\x1b[?1$p", b"\x1b[18t",
            ];
            let mut input = Vec::new();
            let mut want = Vec::new();
            for (text, q) in &parts {
                input.extend_from_slice(text);
                want.extend_from_slice(text);
                input.extend_from_slice(QUERIES[*q]);
            }
            prop_assert_eq!(&*strip_terminal_replies(&input), &want[..]);
            // Without ESC/ENQ nothing changes and nothing is copied.
            prop_assert!(matches!(strip_terminal_replies(&want), Cow::Borrowed(_)));
        }

        #[test]
        fn strip_never_panics_and_only_removes(data in prop::collection::vec(
            prop_oneof![Just(ESC), Just(b'['), Just(b']'), Just(b'?'), Just(b'6'), Just(b'n'),
                        Just(b'c'), Just(BEL), Just(b'\\'), Just(b';'), any::<u8>()], 0..64)) {
            let out = strip_terminal_replies(&data);
            // Output is a subsequence of the input.
            let mut it = data.iter();
            for b in out.iter() {
                prop_assert!(it.any(|x| x == b));
            }
        }
    }
}
