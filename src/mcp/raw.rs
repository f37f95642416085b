//! A JSON object held as its members' text, so that a relay can change one
//! member (an id, a progress token) and send the other members' values on
//! byte for byte (their names are written again, plainly).
//!
//! Why not `serde_json::Value`: the harness rewrites the id of every MCP
//! request and answer it carries. Building a `Value` tree for that (a map
//! and a string per member, all the way down into the arguments and the
//! result) and printing it again was the largest part of the harness's own
//! work per relayed call (docs/benchmarks.md, "Ids rewritten in place"),
//! and it changed what it did not need to touch: `1E9` came out as
//! `1000000000.0`, escapes were redone. Here only the top level is split;
//! each member's value stays the text it came as (checked to be JSON).
//!
//! A repeated key keeps its first place and its last value, as a
//! `serde_json::Value` object (with `preserve_order`) does, so both read a
//! message the same way.

use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;

/// Members past which a repeated key is found through an index rather
/// than by scanning: a hostile object of many members stays linear.
const SCAN_MEMBERS: usize = 16;

/// The members of one JSON object, borrowed from its text, in order.
#[derive(Debug)]
pub struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Members<'a> {
    /// The members of `text`, which must be one JSON object.
    ///
    /// # Errors
    ///
    /// When `text` is not JSON, or is JSON but not an object.
    pub fn parse(text: &'a str) -> Result<Members<'a>, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The text of member `key`'s value.
    pub fn get(&self, key: &str) -> Option<&'a str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.get())
    }
}

/// A key, borrowed from the text when it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::with_capacity(8);
                let mut index: Option<HashMap<Cow<'de, str>, usize>> = None;
                while let Some(Key(key)) = map.next_key()? {
                    let value: &'de RawValue = map.next_value()?;
                    let at = match &index {
                        Some(index) => index.get(&key).copied(),
                        None => members.iter().position(|(k, _)| *k == key),
                    };
                    if let Some(at) = at {
                        members[at].1 = value;
                        continue;
                    }
                    if let Some(index) = &mut index {
                        index.insert(key.clone(), members.len());
                    } else if members.len() == SCAN_MEMBERS {
                        let mut built: HashMap<Cow<'de, str>, usize> = members
                            .iter()
                            .enumerate()
                            .map(|(i, (k, _))| (k.clone(), i))
                            .collect();
                        built.insert(key.clone(), members.len());
                        index = Some(built);
                    }
                    members.push((key, value));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(MembersVisitor)
    }
}

/// Where a member's value text is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Text {
    /// A range of the object's own text.
    At(Range<usize>),
    /// Text of its own: a value set since ([`RawObject::put`]), or a
    /// parsed value that was not a slice of the object's text. Valid JSON
    /// either way.
    Own(String),
}

/// An owned JSON object of raw members: what a client sent, held until it
/// is rewritten and sent on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawObject {
    text: String,
    members: Vec<(String, Text)>,
}

impl RawObject {
    /// Split `text`, one JSON object, into its members.
    ///
    /// # Errors
    ///
    /// When `text` is not JSON, or is JSON but not an object.
    pub fn parse(text: String) -> Result<RawObject, serde_json::Error> {
        let members = {
            let base = text.as_ptr() as usize;
            Members::parse(&text)?
                .0
                .into_iter()
                .map(|(k, v)| {
                    // A borrowed raw value is a slice of `text`; were it
                    // ever not, its own copy is kept.
                    let value = v.get();
                    let at = (value.as_ptr() as usize)
                        .checked_sub(base)
                        .filter(|&start| text.get(start..start + value.len()) == Some(value));
                    let t = match at {
                        Some(start) => Text::At(start..start + value.len()),
                        None => Text::Own(value.to_owned()),
                    };
                    (k.into_owned(), t)
                })
                .collect()
        };
        Ok(RawObject { text, members })
    }

    /// The text of member `key`'s value.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.members
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| self.text_of(t))
    }

    /// Member `key`'s value, parsed.
    pub fn value(&self, key: &str) -> Option<serde_json::Value> {
        self.get(key).and_then(|t| serde_json::from_str(t).ok())
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.members.iter().any(|(k, _)| k == key)
    }

    /// Set member `key` to a JSON string holding `s`.
    pub fn set_str(&mut self, key: &str, s: &str) {
        let mut json = String::with_capacity(s.len() + 2);
        push_json_str(&mut json, s);
        self.put(key, json);
    }

    /// Set member `key` to `value`.
    pub fn set_value(&mut self, key: &str, value: &serde_json::Value) {
        self.put(key, value.to_string());
    }

    fn put(&mut self, key: &str, json: String) {
        match self.members.iter_mut().find(|(k, _)| k == key) {
            Some((_, t)) => *t = Text::Own(json),
            None => self.members.push((key.to_owned(), Text::Own(json))),
        }
    }

    fn text_of<'s>(&'s self, t: &'s Text) -> &'s str {
        match t {
            Text::At(r) => &self.text[r.clone()],
            Text::Own(s) => s,
        }
    }

    /// The object as JSON text: the members in order, each value as it
    /// came unless it was set.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(self.text.len() + 32);
        out.push('{');
        for (k, t) in &self.members {
            push_member(&mut out, k, self.text_of(t));
        }
        out.push('}');
        out
    }
}

/// Write `members` as one object with each `(key, json)` of `set` in place
/// of that member's value (added at the end when it is not there).
pub fn write_object(members: &Members<'_>, set: &[(&str, &str)], out: &mut String) {
    out.push('{');
    for (k, v) in &members.0 {
        let json = set
            .iter()
            .find(|(key, _)| key == k)
            .map_or(v.get(), |s| s.1);
        push_member(out, k, json);
    }
    for (key, json) in set {
        if members.get(key).is_none() {
            push_member(out, key, json);
        }
    }
    out.push('}');
}

/// One `"key":json` member of an object being written after its `{`.
fn push_member(out: &mut String, key: &str, json: &str) {
    // No JSON value ends in `{`: only an object's start does.
    if !out.ends_with('{') {
        out.push(',');
    }
    push_json_str(out, key);
    out.push(':');
    out.push_str(json);
}

/// `s` as a JSON string. Why not always `serde_json`: member names and
/// ids are short plain text, copied here without a serializer; anything
/// that needs an escape goes through serde_json.
fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::Value::from(s).to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn same(a: &str, b: &str) {
        let a: Value = serde_json::from_str(a).unwrap();
        let b: Value = serde_json::from_str(b).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn members_keep_their_text_and_order() {
        let text = r#" {"b": 1E9, "a" : {"x":[1, 2]}, "c":"\u0041"} "#;
        let o = RawObject::parse(text.to_owned()).unwrap();
        assert_eq!(o.get("b"), Some("1E9"));
        assert_eq!(o.get("a"), Some(r#"{"x":[1, 2]}"#));
        assert_eq!(o.get("c"), Some(r#""\u0041""#));
        assert_eq!(o.to_json(), r#"{"b":1E9,"a":{"x":[1, 2]},"c":"\u0041"}"#);
        same(&o.to_json(), text);
    }

    #[test]
    fn set_replaces_in_place_or_appends() {
        let mut o = RawObject::parse(r#"{"jsonrpc":"2.0","id":7,"method":"m"}"#.into()).unwrap();
        o.set_str("id", "h:1");
        o.set_value("extra", &json!({"k": [true, null]}));
        assert_eq!(
            o.to_json(),
            r#"{"jsonrpc":"2.0","id":"h:1","method":"m","extra":{"k":[true,null]}}"#
        );
        o.set_str("q\"uote", "a\nb");
        same(
            &o.to_json(),
            r#"{"jsonrpc":"2.0","id":"h:1","method":"m","extra":{"k":[true,null]},"q\"uote":"a\nb"}"#,
        );
    }

    #[test]
    fn repeated_keys_read_as_value_reads_them() {
        // First place, last value; the escaped spelling is the same key.
        let text = r#"{"id":1,"m":2,"\u0069d":3}"#;
        let o = RawObject::parse(text.to_owned()).unwrap();
        assert_eq!(o.to_json(), r#"{"id":3,"m":2}"#);
        same(&o.to_json(), text);
        // Past the scan limit the index takes over, with the same result.
        let many: Vec<String> = (0..40).map(|i| format!(r#""k{i}":{i}"#)).collect();
        let text = format!(r#"{{{},"k3":"again","k39":"last"}}"#, many.join(","));
        let o = RawObject::parse(text.clone()).unwrap();
        assert_eq!(o.get("k3"), Some(r#""again""#));
        same(&o.to_json(), &text);
    }

    #[test]
    fn not_an_object_or_not_json_is_refused() {
        for bad in [
            "[1]",
            "1",
            "\"s\"",
            "null",
            "{",
            r#"{"a":}"#,
            r#"{"a":1} x"#,
            "",
        ] {
            assert!(RawObject::parse(bad.to_owned()).is_err(), "{bad}");
        }
    }

    #[test]
    fn write_object_sets_and_adds() {
        let m = Members::parse(r#"{"result":{"a":1},"id":"h:3","jsonrpc":"2.0"}"#).unwrap();
        assert_eq!(m.get("id"), Some(r#""h:3""#));
        let mut out = String::new();
        write_object(&m, &[("id", "42"), ("new", "[]")], &mut out);
        assert_eq!(
            out,
            r#"{"result":{"a":1},"id":42,"jsonrpc":"2.0","new":[]}"#
        );
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "[a-z\"\\\\\n\u{e9}]{0,6}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::vec(("[a-d\"]{0,3}", inner), 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Split and joined again, any object (repeated keys included)
        /// reads as the same `Value`; a member set reads as a `Value`
        /// insert.
        #[test]
        fn reads_as_value_reads(
            members in proptest::collection::vec(("[a-d\"\\\\]{0,3}", json_value()), 0..8),
            key in "[a-d]{1,2}",
            set in json_value(),
        ) {
            let text = format!("{{{}}}", members
                .iter()
                .map(|(k, v)| format!("{}:{}", Value::from(k.as_str()), v))
                .collect::<Vec<_>>()
                .join(" , "));
            let mut expected: Value = serde_json::from_str(&text).unwrap();
            let mut o = RawObject::parse(text.clone()).unwrap();
            prop_assert_eq!(serde_json::from_str::<Value>(&o.to_json()).unwrap(), expected.clone());
            o.set_value(&key, &set);
            expected.as_object_mut().unwrap().insert(key.clone(), set.clone());
            prop_assert_eq!(serde_json::from_str::<Value>(&o.to_json()).unwrap(), expected.clone());
            let m = Members::parse(&text).unwrap();
            let mut out = String::new();
            write_object(&m, &[(key.as_str(), &set.to_string())], &mut out);
            prop_assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), expected);
        }
    }
}
