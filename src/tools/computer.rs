//! `computer_observe` / `computer_action` inputs (issue 20, part 2): parsing
//! and validation without any X connection, so every rule is unit-tested.
//! The display actor (`executor::actors::display`) executes what passes.
//!
//! Input is from a model and hostile: actions from a fixed set, coordinates
//! checked against the screen, key names from a fixed table of keysyms,
//! typed text bounded and limited to what a US keymap can type.

use serde::Deserialize;

/// Characters `type` accepts in one action.
pub const MAX_TEXT: usize = 4096;
/// Keys in one `key` chord (`ctrl+shift+t`).
pub const MAX_CHORD: usize = 5;
/// Scroll clicks in one action.
pub const MAX_SCROLL: u32 = 50;
/// The largest image `computer_observe` returns; a bigger screen is scaled
/// down (aspect kept) to fit.
pub const MAX_IMAGE_WIDTH: u16 = 1280;
pub const MAX_IMAGE_HEIGHT: u16 = 800;

/// A failed input: `isError`, reason `invalid_input`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InputError(pub String);

fn bad(s: impl Into<String>) -> InputError {
    InputError(s.into())
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawAction {
    action: String,
    x: Option<i64>,
    y: Option<i64>,
    to_x: Option<i64>,
    to_y: Option<i64>,
    button: Option<serde_json::Value>,
    keys: Option<serde_json::Value>,
    text: Option<String>,
    /// Scroll: clicks, negative up.
    amount: Option<i64>,
    display: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawObserve {
    #[allow(dead_code)]
    display: Option<String>,
}

/// A checked action, in screen coordinates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Click {
        x: u16,
        y: u16,
        button: u8,
    },
    Drag {
        x: u16,
        y: u16,
        to_x: u16,
        to_y: u16,
        button: u8,
    },
    /// Keysyms pressed in order, released in reverse.
    Key {
        keysyms: Vec<u32>,
    },
    /// Buttons 4 (up) or 5 (down), `clicks` times, at `(x, y)` when given.
    Scroll {
        at: Option<(u16, u16)>,
        button: u8,
        clicks: u32,
    },
    /// Each char as (keysym, needs shift) of a US keymap.
    Type {
        keysyms: Vec<u32>,
    },
}

/// `computer_observe`'s input: only `display`, which must be absent or
/// this session's own (`":N"` as given in the result, or `"default"`).
///
/// # Errors
/// [`InputError`] for other members.
pub fn parse_observe(input: &serde_json::Value) -> Result<(), InputError> {
    if input.is_null() {
        return Ok(());
    }
    serde_json::from_value::<RawObserve>(input.clone())
        .map(|_| ())
        .map_err(|e| bad(e.to_string()))
}

/// The `display` member of either tool's input, when given, must name
/// this session's display (`own`, `":N"`) or be `"default"`: a session
/// has one display, and another session's is not its to drive.
///
/// # Errors
/// [`InputError`] for any other value.
pub fn check_display(input: &serde_json::Value, own: &str) -> Result<(), InputError> {
    match input.get("display") {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(serde_json::Value::String(d)) if d == own || d == "default" => Ok(()),
        Some(_) => Err(bad(format!(
            "display must be {own:?} (this session's) or \"default\""
        ))),
    }
}

fn coord(v: Option<i64>, name: &str, limit: u16) -> Result<u16, InputError> {
    let v = v.ok_or_else(|| bad(format!("{name} is required")))?;
    if v < 0 || v >= i64::from(limit) {
        return Err(bad(format!(
            "{name} {v} is outside the screen (0..{limit})"
        )));
    }
    Ok(v as u16)
}

fn button(v: &Option<serde_json::Value>) -> Result<u8, InputError> {
    match v {
        None => Ok(1),
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "left" => Ok(1),
            "middle" => Ok(2),
            "right" => Ok(3),
            other => Err(bad(format!("unknown button {:?}", truncate(other)))),
        },
        Some(serde_json::Value::Number(n)) => match n.as_u64() {
            Some(b @ 1..=3) => Ok(b as u8),
            _ => Err(bad(format!("unknown button {n}"))),
        },
        Some(_) => Err(bad("button is left, middle, right or 1..3")),
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(32).collect()
}

/// Parse and check an action against a `width`×`height` screen.
///
/// # Errors
/// [`InputError`]: unknown action or key, missing or out-of-range
/// coordinates, text too long or not typable.
pub fn parse_action(
    input: &serde_json::Value,
    width: u16,
    height: u16,
) -> Result<Action, InputError> {
    let r: RawAction = serde_json::from_value(input.clone()).map_err(|e| bad(e.to_string()))?;
    let _ = r.display;
    match r.action.as_str() {
        "click" => Ok(Action::Click {
            x: coord(r.x, "x", width)?,
            y: coord(r.y, "y", height)?,
            button: button(&r.button)?,
        }),
        "drag" => Ok(Action::Drag {
            x: coord(r.x, "x", width)?,
            y: coord(r.y, "y", height)?,
            to_x: coord(r.to_x, "toX", width)?,
            to_y: coord(r.to_y, "toY", height)?,
            button: button(&r.button)?,
        }),
        "key" => {
            let names: Vec<String> = match r.keys {
                Some(serde_json::Value::String(s)) => s.split('+').map(str::to_owned).collect(),
                Some(serde_json::Value::Array(a)) => a
                    .into_iter()
                    .map(|v| match v {
                        serde_json::Value::String(s) => Ok(s),
                        _ => Err(bad("keys are strings")),
                    })
                    .collect::<Result<_, _>>()?,
                _ => {
                    return Err(bad(
                        "keys is required: \"Return\", \"ctrl+c\" or [\"ctrl\", \"c\"]",
                    ))
                }
            };
            if names.is_empty() || names.len() > MAX_CHORD {
                return Err(bad(format!("a chord has 1..{MAX_CHORD} keys")));
            }
            let keysyms = names
                .iter()
                .map(|n| keysym(n).ok_or_else(|| bad(format!("unknown key {:?}", truncate(n)))))
                .collect::<Result<_, _>>()?;
            Ok(Action::Key { keysyms })
        }
        "scroll" => {
            let at = match (r.x, r.y) {
                (None, None) => None,
                (x, y) => Some((coord(x, "x", width)?, coord(y, "y", height)?)),
            };
            let amount = r.amount.unwrap_or(3);
            if amount == 0 || amount.unsigned_abs() > u64::from(MAX_SCROLL) {
                return Err(bad(format!("amount is ±1..{MAX_SCROLL} (negative: up)")));
            }
            Ok(Action::Scroll {
                at,
                button: if amount < 0 { 4 } else { 5 },
                clicks: amount.unsigned_abs() as u32,
            })
        }
        "type" => {
            let text = r.text.ok_or_else(|| bad("text is required"))?;
            if text.chars().count() > MAX_TEXT {
                return Err(bad(format!("text is at most {MAX_TEXT} characters")));
            }
            let keysyms = text
                .chars()
                .map(|c| {
                    char_keysym(c).ok_or_else(|| {
                        bad(format!("{c:?} cannot be typed (printable ASCII, \\n, \\t)"))
                    })
                })
                .collect::<Result<_, _>>()?;
            Ok(Action::Type { keysyms })
        }
        other => Err(bad(format!(
            "unknown action {:?}: click, drag, key, scroll or type",
            truncate(other)
        ))),
    }
}

/// The keysym a typed character needs: printable ASCII is its own keysym;
/// newline is Return, tab is Tab.
pub fn char_keysym(c: char) -> Option<u32> {
    match c {
        '\n' => Some(0xff0d),
        '\t' => Some(0xff09),
        ' '..='~' => Some(c as u32),
        _ => None,
    }
}

/// The fixed table of key names (`X11/keysymdef.h` names and the usual
/// aliases, case-insensitive for the aliases).
pub fn keysym(name: &str) -> Option<u32> {
    let n = name.trim();
    if n.chars().count() == 1 {
        let c = n.chars().next()?;
        if c.is_ascii_graphic() {
            return Some(c.to_ascii_lowercase() as u32);
        }
    }
    let lower = n.to_ascii_lowercase();
    if let Some(f) = lower.strip_prefix('f') {
        if let Ok(k @ 1..=12) = f.parse::<u32>() {
            return Some(0xffbe + k - 1);
        }
    }
    Some(match lower.as_str() {
        "return" | "enter" => 0xff0d,
        "tab" => 0xff09,
        "escape" | "esc" => 0xff1b,
        "backspace" => 0xff08,
        "delete" | "del" => 0xffff,
        "insert" => 0xff63,
        "home" => 0xff50,
        "end" => 0xff57,
        "page_up" | "pageup" | "prior" => 0xff55,
        "page_down" | "pagedown" | "next" => 0xff56,
        "left" => 0xff51,
        "up" => 0xff52,
        "right" => 0xff53,
        "down" => 0xff54,
        "space" => 0x20,
        "shift" | "shift_l" => 0xffe1,
        "shift_r" => 0xffe2,
        "ctrl" | "control" | "control_l" => 0xffe3,
        "control_r" => 0xffe4,
        "alt" | "alt_l" => 0xffe9,
        "alt_r" => 0xffea,
        "super" | "super_l" | "meta" | "cmd" => 0xffeb,
        "super_r" => 0xffec,
        "menu" => 0xff67,
        "print" => 0xff61,
        _ => return None,
    })
}

/// The size of the image for a `width`×`height` screen: the screen itself
/// when it fits, else scaled down with its aspect kept.
pub fn image_size(width: u16, height: u16) -> (u16, u16) {
    let (w, h) = (u32::from(width.max(1)), u32::from(height.max(1)));
    let (mw, mh) = (u32::from(MAX_IMAGE_WIDTH), u32::from(MAX_IMAGE_HEIGHT));
    if w <= mw && h <= mh {
        return (w as u16, h as u16);
    }
    // scale = min(mw/w, mh/h), in integers.
    let (nw, nh) = if w * mh >= h * mw {
        (mw, (h * mw / w).max(1))
    } else {
        ((w * mh / h).max(1), mh)
    };
    (nw as u16, nh as u16)
}

/// Nearest-neighbour scale of packed RGB rows (`3 * sw` bytes each) to
/// `dw`×`dh`.
pub fn scale_rgb(src: &[u8], sw: usize, sh: usize, dw: usize, dh: usize) -> Vec<u8> {
    if (sw, sh) == (dw, dh) {
        return src.to_vec();
    }
    let mut out = Vec::with_capacity(dw * dh * 3);
    for y in 0..dh {
        let sy = (y * sh / dh).min(sh.saturating_sub(1));
        for x in 0..dw {
            let sx = (x * sw / dw).min(sw.saturating_sub(1));
            let i = (sy * sw + sx) * 3;
            out.extend_from_slice(src.get(i..i + 3).unwrap_or(&[0, 0, 0]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn actions_parse_and_coordinates_are_checked() {
        assert_eq!(
            parse_action(&json!({"action": "click", "x": 10, "y": 20}), 100, 100),
            Ok(Action::Click {
                x: 10,
                y: 20,
                button: 1
            })
        );
        for bad_input in [
            json!({"action": "click", "x": 100, "y": 0}),
            json!({"action": "click", "x": -1, "y": 0}),
            json!({"action": "click", "x": 1}),
            json!({"action": "drag", "x": 1, "y": 1, "toX": 5, "toY": 1000}),
            json!({"action": "click", "x": 1, "y": 1, "button": "thumb"}),
            json!({"action": "explode"}),
            json!({"action": "click", "x": 1, "y": 1, "extra": true}),
            json!({"action": "key", "keys": "NoSuchKey"}),
            json!({"action": "key", "keys": "a+b+c+d+e+f"}),
            json!({"action": "type", "text": "é"}),
            json!({"action": "type", "text": "x".repeat(MAX_TEXT + 1)}),
            json!({"action": "scroll", "amount": 0}),
            json!({"action": "scroll", "amount": 51}),
        ] {
            assert!(parse_action(&bad_input, 100, 100).is_err(), "{bad_input}");
        }
    }

    #[test]
    fn keys_come_from_the_table() {
        assert_eq!(keysym("Return"), Some(0xff0d));
        assert_eq!(keysym("ctrl"), Some(0xffe3));
        assert_eq!(keysym("F12"), Some(0xffc9));
        assert_eq!(keysym("F13"), None);
        assert_eq!(keysym("C"), Some('c' as u32));
        assert_eq!(
            parse_action(&json!({"action": "key", "keys": "ctrl+c"}), 10, 10),
            Ok(Action::Key {
                keysyms: vec![0xffe3, 'c' as u32]
            })
        );
        assert_eq!(
            parse_action(&json!({"action": "type", "text": "a\n"}), 10, 10),
            Ok(Action::Type {
                keysyms: vec!['a' as u32, 0xff0d]
            })
        );
    }

    #[test]
    fn images_are_bounded_and_keep_their_aspect() {
        assert_eq!(image_size(1024, 768), (1024, 768));
        assert_eq!(image_size(1920, 1080), (1280, 720));
        assert_eq!(image_size(800, 1600), (400, 800));
    }

    proptest! {
        #[test]
        fn any_input_parses_or_is_refused_without_panic(
            action in "[a-z]{0,8}", x in any::<i64>(), y in any::<i64>(),
            keys in ".{0,20}", text in ".{0,40}", w in 1u16..4000, h in 1u16..4000,
        ) {
            for input in [
                json!({"action": action, "x": x, "y": y}),
                json!({"action": "key", "keys": keys}),
                json!({"action": "type", "text": text}),
                json!({"action": "drag", "x": x, "y": y, "toX": y, "toY": x}),
            ] {
                if let Ok(Action::Click { x, y, .. } | Action::Drag { x, y, .. }) =
                    parse_action(&input, w, h)
                {
                    prop_assert!(x < w && y < h);
                }
            }
            let (iw, ih) = image_size(w, h);
            prop_assert!(iw >= 1 && ih >= 1 && iw <= MAX_IMAGE_WIDTH && ih <= MAX_IMAGE_HEIGHT);
            prop_assert!(iw <= w && ih <= h);
        }
    }
}
