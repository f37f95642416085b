//! The one rule for the ids peers choose: session, process, terminal, tool
//! call, turn, interaction and executor ids (docs/protocol.md, "Ids").
//!
//! An id is 1 to [`MAX_ID_LEN`] bytes of `A-Z a-z 0-9 . _ : -`, and not
//! `.` or `..` (ids become directory names). Why so
//! narrow: ids travel into logs, file names, URL paths and metric labels;
//! a session id with a `\n` forged a log line (issue 18, finding 8), one
//! with `/` or `%` would need escaping in every path. Every id that enters
//! is checked here: wire params on decoding ([`check_fields`], called by
//! [`Inbound::params`](super::Inbound::params)), HTTP paths and bodies by
//! the harness's router. A refusal is -32602 (HTTP 400) and never echoes
//! the id.

use serde::Deserialize;

/// Longest id, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// The id fields of params and bodies, by their wire names.
pub const ID_FIELDS: [&str; 7] = [
    "sessionId",
    "processId",
    "terminalId",
    "toolCallId",
    "turnId",
    "interactionId",
    "executorId",
];

/// Why an id was refused. The message names the field and the rule, not
/// the id (which may be hostile).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{field} is empty")]
    Empty { field: &'static str },
    #[error("{field} is longer than {MAX_ID_LEN} bytes ({len})")]
    TooLong { field: &'static str, len: usize },
    #[error("{field}: byte {at} is not one of A-Z a-z 0-9 . _ : -")]
    BadByte { field: &'static str, at: usize },
    #[error("{field} may not be . or ..")]
    Dots { field: &'static str },
}

/// Check `id` (named `field` in errors) against the rule.
pub fn check(field: &'static str, id: &str) -> Result<(), IdError> {
    if id.is_empty() {
        return Err(IdError::Empty { field });
    }
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            field,
            len: id.len(),
        });
    }
    if let Some(at) = id.bytes().position(|b| !allowed(b)) {
        return Err(IdError::BadByte { field, at });
    }
    if id == "." || id == ".." {
        return Err(IdError::Dots { field });
    }
    Ok(())
}

fn allowed(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')
}

/// The id fields a params object or body may carry at its top level.
/// Decoded next to the method's own type, in either codec; a field that is
/// absent or not a string is left to the method's own decoding.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdFields {
    #[serde(default, deserialize_with = "lenient")]
    session_id: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    process_id: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    terminal_id: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    tool_call_id: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    turn_id: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    interaction_id: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    executor_id: Option<String>,
}

/// A string, or `None` for anything else (the typed decode reports it).
fn lenient<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Any {
        S(String),
        Other(serde::de::IgnoredAny),
    }
    Ok(match Any::deserialize(d)? {
        Any::S(s) => Some(s),
        Any::Other(_) => None,
    })
}

impl IdFields {
    /// Check every id present.
    pub fn check(&self) -> Result<(), IdError> {
        let fields = [
            (ID_FIELDS[0], &self.session_id),
            (ID_FIELDS[1], &self.process_id),
            (ID_FIELDS[2], &self.terminal_id),
            (ID_FIELDS[3], &self.tool_call_id),
            (ID_FIELDS[4], &self.turn_id),
            (ID_FIELDS[5], &self.interaction_id),
            (ID_FIELDS[6], &self.executor_id),
        ];
        for (name, value) in fields {
            if let Some(v) = value {
                check(name, v)?;
            }
        }
        Ok(())
    }
}

/// Check the id fields at the top level of a JSON object (an HTTP body).
pub fn check_fields(v: &serde_json::Value) -> Result<(), IdError> {
    let Some(obj) = v.as_object() else {
        return Ok(());
    };
    for name in ID_FIELDS {
        if let Some(serde_json::Value::String(s)) = obj.get(name) {
            check(name, s)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_rule() {
        assert!(check("sessionId", "s-0f3a.b_c:d").is_ok());
        assert!(check("sessionId", &"a".repeat(MAX_ID_LEN)).is_ok());
        assert_eq!(
            check("sessionId", ""),
            Err(IdError::Empty { field: "sessionId" })
        );
        assert!(matches!(
            check("sessionId", &"a".repeat(MAX_ID_LEN + 1)),
            Err(IdError::TooLong { .. })
        ));
        for bad in [
            "s\n1", "s 1", "s/1", "s%0a", "é", "s\u{0}", "s\r", ".", "..",
        ] {
            assert!(check("sessionId", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_message_never_carries_the_id() {
        let e = check("sessionId", "x\nFORGED level=ERROR").unwrap_err();
        let m = e.to_string();
        assert!(!m.contains('\n') && !m.contains("FORGED"), "{m}");
    }

    #[test]
    fn fields_in_both_codecs() {
        let v = serde_json::json!({"sessionId": "ok", "processId": "p\n", "argv": ["x"]});
        let f: IdFields = serde_json::from_value(v.clone()).unwrap();
        assert!(matches!(
            f.check(),
            Err(IdError::BadByte {
                field: "processId",
                ..
            })
        ));
        let packed = rmp_serde::to_vec_named(&v).unwrap();
        let f: IdFields = rmp_serde::from_slice(&packed).unwrap();
        assert!(f.check().is_err());
        assert!(check_fields(&v).is_err());
        // Not a string: left to the method's decoding.
        let f: IdFields = serde_json::from_value(serde_json::json!({"sessionId": 5})).unwrap();
        assert!(f.check().is_ok());
    }

    proptest! {
        #[test]
        fn accepted_ids_are_printable_and_bounded(s in ".{0,200}") {
            if check("sessionId", &s).is_ok() {
                prop_assert!(!s.is_empty() && s.len() <= MAX_ID_LEN);
                prop_assert!(s.bytes().all(|b| b.is_ascii_graphic()));
            }
        }
    }
}
