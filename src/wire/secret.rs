//! [`Secret`]: a credential that never prints (issue 18, finding 7).
//!
//! Executor tokens, the API token, refreshed tokens: whatever holds one
//! may be `Debug`-printed by a log line, an error or a panic; `Secret`
//! prints `***` in `Debug` and `Display` alike, and hands the value out
//! only through [`Secret::expose`], so every place that needs the real
//! bytes says so. On the wire it is the plain string (serde transparent).

use serde::{Deserialize, Serialize};

#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the one place that must send or compare it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret(s)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

#[cfg(test)]
impl proptest::arbitrary::Arbitrary for Secret {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Secret>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        use proptest::strategy::Strategy;
        proptest::arbitrary::any::<String>()
            .prop_map(Secret)
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_printed_but_sent_as_is() {
        let s = Secret::new("hunter2");
        assert_eq!(
            format!("{s} {s:?} {:?}", Some(&s)),
            "*** Secret(***) Some(Secret(***))"
        );
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"hunter2\"");
        let back: Secret = serde_json::from_str("\"hunter2\"").unwrap();
        assert_eq!(back.expose(), "hunter2");
    }
}
