//! A JSON payload read in place (issue 16).
//!
//! A pipeline reads three or four fields of each payload through JSON pointers. Read into a
//! `serde_json::Value`, a payload like `{"id": "e1", "k": "A", "v": 10}` cost six
//! allocations (a map node, three member names, two strings), about a tenth of all the
//! allocations of an input in the live changelog run (heaptrack). [`Json`] borrows member
//! names and strings from the payload text, copying only those that hold escapes, and keeps
//! an object's members in one vector: one allocation for that payload.
//!
//! It reads exactly what `serde_json::Value` reads: the parsing is serde_json's own (the
//! same errors, the same nesting limit of 128), numbers are serde_json's [`Number`], and a
//! member named twice counts with its last value, as in serde_json's map. An object's
//! members are searched in order, which a payload bounded by `log.max_payload` keeps cheap.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Number;

/// One JSON value, borrowing from the text it was read from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    /// Members in the order of the text, repeats included (see [`Json::member`]).
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

impl<'a> Json<'a> {
    /// Read `text`, which must be one JSON value.
    pub fn parse(text: &'a str) -> Result<Json<'a>, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The value of member `name` of an object: the last one when the name repeats.
    pub fn member(&self, name: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(members) => members.iter().rev().find(|(n, _)| n == name).map(|m| &m.1),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json<'de>, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json<'de>, D::Error> {
        Json::deserialize(d)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(n.into()))
    }

    /// As `serde_json::Value`: a float without a JSON form (never from JSON text) is null.
    fn visit_f64<E>(self, f: f64) -> Result<Json<'de>, E> {
        Ok(Number::from_f64(f).map_or(Json::Null, Json::Number))
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(s)))
    }

    /// A string with escapes: serde_json hands over its unescaped copy.
    fn visit_str<E>(self, s: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s.to_owned())))
    }

    fn visit_string<E>(self, s: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut members = Vec::new();
        while let Some(Name(name)) = map.next_key()? {
            members.push((name, map.next_value()?));
        }
        Ok(Json::Object(members))
    }
}

/// A member name, borrowed unless it holds escapes (serde's own `Cow` always copies).
struct Name<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Name<'de>, D::Error> {
        d.deserialize_str(NameVisitor)
    }
}

struct NameVisitor;

impl<'de> Visitor<'de> for NameVisitor {
    type Value = Name<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Borrowed(s)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Owned(s.to_owned())))
    }

    fn visit_string<E>(self, s: String) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Owned(s)))
    }
}

/// The same value as serde_json's own type, to compare the two readings (tests, and the
/// `json_payload` fuzz target of `crate::fuzzing`).
pub(crate) fn to_value(j: &Json<'_>) -> serde_json::Value {
    use serde_json::Value;
    match j {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => Value::Number(n.clone()),
        Json::String(s) => Value::String(s.to_string()),
        Json::Array(items) => Value::Array(items.iter().map(to_value).collect()),
        Json::Object(members) => {
            let mut m = serde_json::Map::new();
            for (name, v) in members {
                m.insert(name.to_string(), to_value(v));
            }
            Value::Object(m)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Texts read both ways give the same value, or both fail.
    fn same_as_serde_json(text: &str) {
        let ours = Json::parse(text);
        let theirs = serde_json::from_str::<serde_json::Value>(text);
        match (&ours, &theirs) {
            (Ok(j), Ok(v)) => assert_eq!(&to_value(j), v, "{text:?}"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{text:?}"),
            _ => panic!("{text:?}: ours {ours:?}, serde_json {theirs:?}"),
        }
    }

    #[test]
    fn reads_what_serde_json_reads() {
        for text in [
            r#"{"id": "e1", "k": "A", "v": 10}"#,
            r#"{"a": 1, "a": 2, "b": {"a": 3}, "a": 4}"#,
            r#"{"e\u00e9\n": "tab\there", "q\"": ["\\", "\/"]}"#,
            r#"[1, -1, 1.5, -0.0, 1e300, 18446744073709551615, -9223372036854775808]"#,
            r#"[18446744073709551616, 1e400]"#,
            r#"{"": null, " ": true, "x": false}"#,
            "\"plain\"",
            "  3  ",
            "",
            "{",
            r#"{"a": 1,}"#,
            r#"{"a" 1}"#,
            r#"[1, 2"#,
            r#"{"a": 1} trailing"#,
            "\"\\ud800\"",
            "nul",
        ] {
            same_as_serde_json(text);
        }
    }

    #[test]
    fn plain_names_and_strings_are_borrowed_escaped_ones_copied() {
        let text = r#"{"k": "A", "e\u00e9": "b\"c"}"#;
        let Json::Object(members) = Json::parse(text).unwrap() else {
            panic!("an object");
        };
        assert!(matches!(members[0].0, Cow::Borrowed("k")));
        assert!(matches!(members[0].1, Json::String(Cow::Borrowed("A"))));
        assert!(matches!(&members[1].0, Cow::Owned(n) if n == "eé"));
        assert!(matches!(&members[1].1, Json::String(Cow::Owned(s)) if s == "b\"c"));
    }

    #[test]
    fn a_repeated_member_counts_with_its_last_value() {
        let j = Json::parse(r#"{"v": 1, "w": 2, "v": 3}"#).unwrap();
        assert_eq!(j.member("v"), Some(&Json::Number(3.into())));
        assert_eq!(j.member("x"), None);
        assert_eq!(Json::parse("[1]").unwrap().member("0"), None);
    }

    #[test]
    fn nesting_stops_where_serde_json_stops() {
        for depth in [127, 128, 129, 10_000] {
            same_as_serde_json(&format!("{}{}", "[".repeat(depth), "]".repeat(depth)));
            let objects = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
            same_as_serde_json(&objects);
        }
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            ".{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((".{0,6}", inner), 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any JSON text serde_json writes, and that text with a member repeated or cut
        /// short, is read alike.
        #[test]
        fn any_value_is_read_alike(v in json_value(), cut in any::<prop::sample::Index>()) {
            let text = serde_json::to_string(&v).unwrap();
            same_as_serde_json(&text);
            let repeated = format!(r#"{{"a": 1, "b": {text}, "a": {text}}}"#);
            same_as_serde_json(&repeated);
            let at = cut.index(text.len() + 1);
            if text.is_char_boundary(at) {
                same_as_serde_json(&text[..at]);
            }
        }
    }
}
