//! The screen model of a PTY session: a `vt100` parser fed with the
//! session's numbered output, and the answers to the terminal queries a
//! program sends (cursor position report, device attributes), so that a
//! program asking them does not hang when no terminal is attached.

use super::types::ScreenView;
use std::num::NonZeroU16;

/// Lines of history the parser keeps beyond the screen (the scrollback
/// proper lives in the session's numbered output).
const PARSER_HISTORY: usize = 0;
/// Most bytes of replies queued between two drains (a program flooding
/// queries cannot grow this).
const MAX_REPLIES: usize = 4096;

/// Collects the replies to queries while the parser runs.
#[derive(Default)]
pub struct Replies {
    out: Vec<u8>,
}

impl Replies {
    fn push(&mut self, b: &[u8]) {
        if self.out.len() + b.len() <= MAX_REPLIES {
            self.out.extend_from_slice(b);
        }
    }
}

impl vt100::Callbacks for Replies {
    fn unhandled_csi(
        &mut self,
        screen: &mut vt100::Screen,
        i1: Option<u8>,
        _i2: Option<u8>,
        params: &[&[u16]],
        c: char,
    ) {
        let first = params.first().and_then(|p| p.first()).copied().unwrap_or(0);
        match (i1, c, first) {
            // DSR 6: cursor position report (1-based).
            (None, 'n', 6) => {
                let (row, col) = screen.cursor_position();
                self.push(format!("\x1b[{};{}R", row + 1, col + 1).as_bytes());
            }
            // DSR 5: status OK.
            (None, 'n', 5) => self.push(b"\x1b[0n"),
            // DA1: a VT220-class terminal with ANSI colour.
            (None, 'c', 0) => self.push(b"\x1b[?62;22c"),
            // DA2 (`CSI > c`): xterm-like, version 0.
            (Some(b'>'), 'c', 0) => self.push(b"\x1b[>0;0;0c"),
            _ => {}
        }
    }
}

/// A session's screen.
pub struct Screen {
    parser: vt100::Parser<Replies>,
    /// The last output seq fed in.
    fed: u64,
}

fn nz(v: u16) -> NonZeroU16 {
    NonZeroU16::new(v).unwrap_or(NonZeroU16::MIN)
}

impl Screen {
    pub fn new(cols: u16, rows: u16) -> Screen {
        Screen {
            parser: vt100::Parser::new_with_callbacks(
                nz(rows),
                nz(cols),
                PARSER_HISTORY,
                Replies::default(),
            ),
            fed: 0,
        }
    }

    pub fn fed(&self) -> u64 {
        self.fed
    }

    /// Feed output chunk `seq`; returns the replies its queries need.
    pub fn feed(&mut self, seq: u64, data: &[u8]) -> Vec<u8> {
        self.parser.process(data);
        self.fed = self.fed.max(seq);
        std::mem::take(&mut self.parser.callbacks_mut().out)
    }

    pub fn resize(&mut self, cols: u16, rows: u16) {
        self.parser.set_size(nz(rows), nz(cols));
    }

    pub fn bracketed_paste(&self) -> bool {
        self.parser.screen().bracketed_paste()
    }

    pub fn view(&self) -> ScreenView {
        let s = self.parser.screen();
        let (rows, cols) = s.size();
        let (cursor_row, cursor_col) = s.cursor_position();
        ScreenView {
            rows: rows.get(),
            cols: cols.get(),
            cursor_row,
            cursor_col,
            lines: s.rows(0, cols.get()).collect(),
            bracketed_paste: s.bracketed_paste(),
            seq: self.fed,
        }
    }

    /// Bytes that redraw the screen on a blank terminal (an attach
    /// snapshot).
    pub fn redraw(&self) -> Vec<u8> {
        let mut out = b"\x1b[H\x1b[2J".to_vec();
        out.extend(self.parser.screen().state_formatted().into_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_answered_at_the_cursor() {
        let mut s = Screen::new(80, 24);
        let r = s.feed(1, b"ab\r\ncd\x1b[6n");
        assert_eq!(r, b"\x1b[2;3R");
        assert_eq!(s.feed(2, b"\x1b[c"), b"\x1b[?62;22c");
        let v = s.view();
        assert_eq!((v.cursor_row, v.cursor_col, v.seq), (1, 2, 2));
        assert_eq!(&v.lines[..2], ["ab", "cd"]);
        assert!(!s.bracketed_paste());
        s.feed(3, b"\x1b[?2004h");
        assert!(s.bracketed_paste());
    }
}
