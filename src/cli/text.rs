//! Text from the wire, made safe to print on a terminal (issue 56, item
//! 5): the one helper every `bmx` printer passes such text through.
//!
//! A terminal acts on the control characters in what it is given: ESC
//! starts sequences that set the window title (OSC), clear the screen or
//! move the cursor; a carriage return lets the rest of a line overwrite
//! its start; a newline forges another line of a table. Names, titles,
//! messages and summaries a harness, an executor, an agent or a visor
//! sends are chosen by someone else (an unauthenticated device picks its
//! enrollment's `displayName`), so none of them reaches the terminal raw:
//!
//! * [`one_line`]: a table cell or one line of a message; every control
//!   character is shown escaped (`\x1b`, `\r`, `\n`, `\t`).
//! * [`lines`]: text meant to span lines (an agent's answer, a transcript):
//!   `\n` and `\t` stay, every other control character is escaped.
//! * [`json_line`]: serialized JSON (`--json` output). serde_json escapes
//!   C0 controls but writes DEL, the C1 controls (U+0080–U+009F, which
//!   some terminals read as 8-bit control codes even in UTF-8) and the
//!   bidi controls as they are; those become `\u` escapes, which JSON
//!   decodes to the same string.
//!
//! Escaped: every `char::is_control` character (C0, DEL, C1) and the
//! Unicode bidirectional embedding, override and isolate controls
//! (U+202A–U+202E, U+2066–U+2069), which can make text display as other
//! text. A backslash is not escaped: the output is for people, and a
//! literal `\x1b` in a name shows as the same four characters, harmlessly.
//!
//! **Raw on purpose:** byte streams meant for the terminal: `bmx exec`
//! copying a process's stdout and stderr, `bmx attach` and `bmx visor
//! attach` relaying a terminal's output. The program on the other end
//! owns that screen, as it would in `ssh`; escaping it would break every
//! full-screen program.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` is escaped by [`one_line`].
pub fn is_unsafe(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn escape(c: char, out: &mut String) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if (c as u32) < 0x80 => {
            let _ = write!(out, "\\x{:02x}", c as u32);
        }
        c => {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
    }
}

fn escaped(s: &str, keep: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !s.chars().any(|c| is_unsafe(c) && !keep(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if is_unsafe(c) && !keep(c) {
            escape(c, &mut out);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `s` on one line, every control character escaped.
pub fn one_line(s: &str) -> Cow<'_, str> {
    escaped(s, |_| false)
}

/// `s` with its line breaks and tabs, every other control escaped.
pub fn lines(s: &str) -> Cow<'_, str> {
    escaped(s, |c| c == '\n' || c == '\t')
}

/// A JSON string value's text for one table cell: the string as
/// [`one_line`], `default` when the value is not a string.
pub fn cell<'a>(v: &'a serde_json::Value, default: &'a str) -> Cow<'a, str> {
    one_line(v.as_str().unwrap_or(default))
}

/// Serialized JSON (one line from `serde_json`) with DEL, C1 and bidi
/// controls as `\u` escapes: the same JSON value, safe for a terminal.
/// Only for JSON text: outside a JSON string those characters cannot
/// occur, so every replacement is inside one.
pub fn json_line(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if is_unsafe(c) {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Print one line on stdout, escaped with [`one_line`] as a whole (the
/// format's own text has no control character; what it interpolates may).
/// A closed stdout is ignored: a reader that stopped reading must not
/// make `bmx` panic.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let line = format!($($t)*);
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", $crate::cli::text::one_line(&line));
        let _ = out.flush();
    }};
}

/// `eprintln!`, escaped like [`say!`]: every message `bmx` writes on
/// stderr is one line.
macro_rules! warn_line {
    ($($t:tt)*) => {{
        let line = format!($($t)*);
        eprintln!("{}", $crate::cli::text::one_line(&line));
    }};
}

pub(crate) use {say, warn_line};

/// Print one line of serialized JSON on stdout through [`json_line`].
pub fn say_json(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", json_line(line));
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_review_s_examples() {
        // OSC window title, clear screen, carriage return overwrite.
        assert_eq!(
            one_line("\u{1b}]0;pwned\u{7}laptop\u{1b}[2J\rok"),
            "\\x1b]0;pwned\\x07laptop\\x1b[2J\\rok"
        );
        assert_eq!(one_line("a\nb\tc"), "a\\nb\\tc");
        assert_eq!(lines("a\nb\tc\r\u{1b}[1A"), "a\nb\tc\\r\\x1b[1A");
        assert_eq!(one_line("\u{9b}31m \u{7f}"), "\\u{9b}31m \\x7f");
        assert_eq!(one_line("abc\u{202e}txt.exe"), "abc\\u{202e}txt.exe");
        assert!(matches!(one_line("plain – ünïcode"), Cow::Borrowed(_)));
        let j = serde_json::json!({"n": "x\u{1b}\u{9b}\u{7f}\u{2066}"}).to_string();
        let safe = json_line(&j);
        assert!(!safe.chars().any(is_unsafe), "{safe}");
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(back["n"], "x\u{1b}\u{9b}\u{7f}\u{2066}");
    }

    proptest! {
        /// Whatever the input: no control (or bidi) character is left in
        /// a one-line rendering, only tabs and newlines in a multi-line
        /// one, and clean text comes out unchanged.
        #[test]
        fn nothing_a_terminal_acts_on_gets_through(s in "\\PC*|[\\x00-\\x{3000}]{0,64}|.{0,64}") {
            let one = one_line(&s);
            prop_assert!(!one.chars().any(is_unsafe));
            let many = lines(&s);
            prop_assert!(!many.chars().any(|c| is_unsafe(c) && c != '\n' && c != '\t'));
            prop_assert_eq!(many.matches('\n').count(), s.matches('\n').count());
            if !s.chars().any(is_unsafe) {
                prop_assert_eq!(one.as_ref(), s.as_str());
            }
            // Escaping only adds: what was printable is kept, in order.
            let kept: String = s.chars().filter(|c| !is_unsafe(*c)).collect();
            let mut rest = one.as_ref();
            for c in kept.chars() {
                let at = rest.find(c);
                prop_assert!(at.is_some());
                rest = &rest[at.unwrap() + c.len_utf8()..];
            }
        }

        /// JSON stays the same JSON value, without any raw control.
        #[test]
        fn json_stays_json(s in "[\\x00-\\x{3000}]{0,64}|.{0,64}") {
            let line = serde_json::json!({"s": s, "list": [s.clone()]}).to_string();
            let safe = json_line(&line);
            prop_assert!(!safe.chars().any(is_unsafe));
            let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
            prop_assert_eq!(back["s"].as_str(), Some(s.as_str()));
        }
    }
}
