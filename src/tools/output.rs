//! Head + tail truncation of tool output.
//!
//! Tool results travel inline in protocol messages, so output above the
//! inline limit is cut. We keep the head *and* the tail, because the end of
//! a build log or a test run (the error, the summary) matters as much as its
//! start, and we say exactly how many bytes were left out so the model never
//! mistakes a cut output for a complete one.
//!
//! [`HeadTail`] collects a stream of unknown length in bounded memory: it
//! keeps the first `cap` and the last `cap` bytes and only counts the rest.

use std::collections::VecDeque;

/// The line put where bytes were cut out.
pub fn marker(omitted: u64) -> String {
    format!("\n… [{omitted} bytes omitted] …\n")
}

/// A rendered, possibly truncated, output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// Head, marker and tail (or everything, when it fitted).
    pub text: String,
    /// Bytes of the original left out; 0 when nothing was cut.
    pub omitted: u64,
}

impl Rendered {
    /// Whether anything was cut.
    pub fn truncated(&self) -> bool {
        self.omitted > 0
    }
}

/// Bounded-memory collector of a byte stream that remembers its first and
/// last `cap` bytes and the total length.
#[derive(Debug, Clone)]
pub struct HeadTail {
    cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total: u64,
}

impl HeadTail {
    /// A collector that can later render any budget up to `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            head: Vec::new(),
            tail: VecDeque::new(),
            total: 0,
        }
    }

    /// Appends bytes, retaining at most `2 * cap` of them.
    pub fn push(&mut self, bytes: &[u8]) {
        self.total = self.total.saturating_add(bytes.len() as u64);
        if self.head.len() < self.cap {
            let take = (self.cap - self.head.len()).min(bytes.len());
            self.head.extend_from_slice(&bytes[..take]);
        }
        if bytes.len() >= self.cap {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - self.cap..]);
        } else {
            self.tail.extend(bytes);
            let excess = self.tail.len().saturating_sub(self.cap);
            self.tail.drain(..excess);
        }
    }

    /// Total bytes pushed so far, retained or not.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The retained head: the first `min(total, cap)` bytes.
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    /// Renders at most `budget` bytes of content (clamped to `cap`) as text,
    /// splitting the budget evenly between head and tail and cutting on
    /// UTF-8 character boundaries. Invalid UTF-8 is replaced lossily.
    pub fn render(&self, budget: usize) -> Rendered {
        let budget = budget.min(self.cap);
        if self.total <= budget as u64 {
            return Rendered {
                text: String::from_utf8_lossy(&self.head).into_owned(),
                omitted: 0,
            };
        }
        let head_len = head_boundary(&self.head, budget / 2);
        let head = &self.head[..head_len];
        let want_tail = (budget - budget / 2).min(self.tail.len());
        let tail: Vec<u8> = self
            .tail
            .iter()
            .skip(self.tail.len() - want_tail)
            .copied()
            .collect();
        let tail_start = tail_boundary(&tail);
        let tail = &tail[tail_start..];
        let omitted = self.total - head.len() as u64 - tail.len() as u64;
        let mut text = String::from_utf8_lossy(head).into_owned();
        text.push_str(&marker(omitted));
        text.push_str(&String::from_utf8_lossy(tail));
        Rendered { text, omitted }
    }
}

/// Cuts `text` to at most `limit` bytes of content, keeping head and tail.
pub fn truncate_text(text: &str, limit: usize) -> Rendered {
    if text.len() <= limit {
        return Rendered {
            text: text.to_string(),
            omitted: 0,
        };
    }
    let mut head_end = limit / 2;
    while !text.is_char_boundary(head_end) {
        head_end -= 1;
    }
    let mut tail_start = text.len() - (limit - limit / 2);
    while !text.is_char_boundary(tail_start) {
        tail_start += 1;
    }
    let omitted = (tail_start - head_end) as u64;
    Rendered {
        text: format!(
            "{}{}{}",
            &text[..head_end],
            marker(omitted),
            &text[tail_start..]
        ),
        omitted,
    }
}

fn is_continuation(byte: u8) -> bool {
    byte & 0b1100_0000 == 0b1000_0000
}

/// Largest cut `<= n` that does not split a UTF-8 character. Gives up after
/// three steps back (the longest continuation run) so garbage stays cheap.
fn head_boundary(bytes: &[u8], n: usize) -> usize {
    if n >= bytes.len() {
        return bytes.len();
    }
    let mut cut = n;
    while cut > 0 && n - cut < 3 && is_continuation(bytes[cut]) {
        cut -= 1;
    }
    if is_continuation(bytes[cut]) {
        n
    } else {
        cut
    }
}

/// Start offset that skips a partial UTF-8 character at the front.
fn tail_boundary(bytes: &[u8]) -> usize {
    let mut start = 0;
    while start < bytes.len() && start < 3 && is_continuation(bytes[start]) {
        start += 1;
    }
    start
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_output_is_untouched() {
        let mut ht = HeadTail::new(100);
        ht.push(b"hello ");
        ht.push(b"world");
        let r = ht.render(100);
        assert_eq!(r.text, "hello world");
        assert!(!r.truncated());
        assert_eq!(ht.total(), 11);
    }

    #[test]
    fn keeps_head_and_tail_with_marker() {
        let data: Vec<u8> = (0..10_000u32)
            .flat_map(|i| format!("{i}\n").into_bytes())
            .collect();
        let mut ht = HeadTail::new(1000);
        for chunk in data.chunks(7) {
            ht.push(chunk);
        }
        let r = ht.render(1000);
        assert!(r.text.starts_with("0\n1\n2\n"));
        assert!(r.text.ends_with("9998\n9999\n"));
        assert_eq!(r.omitted, data.len() as u64 - 1000);
        assert!(r.text.contains(&format!("[{} bytes omitted]", r.omitted)));
        assert_eq!(ht.total(), data.len() as u64);
    }

    #[test]
    fn memory_is_bounded() {
        let mut ht = HeadTail::new(64);
        for _ in 0..10_000 {
            ht.push(&[b'x'; 1000]);
        }
        assert_eq!(ht.head.len(), 64);
        assert_eq!(ht.tail.len(), 64);
        assert_eq!(ht.total(), 10_000_000);
    }

    #[test]
    fn smaller_budget_than_cap() {
        let mut ht = HeadTail::new(100);
        ht.push(b"abcdefghijklmnopqrstuvwxyz");
        let r = ht.render(10);
        assert_eq!(r.text, format!("abcde{}vwxyz", marker(16)));
        assert_eq!(r.omitted, 16);
    }

    #[test]
    fn cuts_on_char_boundaries() {
        let text = "é".repeat(100); // 200 bytes, 2 per char
        let mut ht = HeadTail::new(1000);
        ht.push(text.as_bytes());
        let r = ht.render(11);
        assert!(!r.text.contains('\u{FFFD}'), "{}", r.text);
        let kept: usize = r.text.split(&marker(r.omitted)).map(str::len).sum();
        assert_eq!(kept as u64 + r.omitted, 200);
        let t = truncate_text(&text, 11);
        assert!(!t.text.contains('\u{FFFD}'));
        assert_eq!(t.omitted, 200 - 4 - 6);
        let t = truncate_text("€€€€", 5); // 12 bytes, 3 per char
        assert_eq!(t.text, format!("{}€", marker(9)));
    }

    #[test]
    fn invalid_utf8_is_lossy_not_panicking() {
        let mut ht = HeadTail::new(16);
        ht.push(&[0xff, 0xfe, b'a', 0x80, 0x80, 0x80, 0x80, 0x80]);
        ht.push(&[0x80; 40]);
        let r = ht.render(8);
        assert!(r.truncated());
        assert!(r.text.contains('\u{FFFD}'));
        let empty = HeadTail::new(0);
        assert_eq!(empty.render(0).text, "");
        let mut zero = HeadTail::new(0);
        zero.push(b"abc");
        assert_eq!(zero.render(10).omitted, 3);
    }

    #[test]
    fn truncate_text_small_is_identity() {
        let t = truncate_text("abc", 3);
        assert_eq!(t.text, "abc");
        assert!(!t.truncated());
    }
}
