//! Payload → event fields, or the reason it is a dead letter.

use super::field::{Field, Format, TemplatePart};
use super::filter::Value as FilterValue;
use super::json::Json;
use super::num::{MAX_EXACT_FLOAT, Num};
use super::refusal::Refusal;
use super::spec::PipelineSpec;
use super::time::parse_rfc3339_ms;

/// The fields of one event, before dedup and aggregation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Parsed {
    pub event_id: String,
    pub key: String,
    /// `Int(1)` for `count` pipelines, which have no value field.
    pub value: Num,
    /// From the payload, or `None` when the pipeline has no event-time field.
    pub event_time_ms: Option<u64>,
}

fn refuse(reason: &'static str, detail: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        detail: detail.into(),
    }
}

/// A scalar pulled out of a payload, before it is given a role.
enum Scalar<'a> {
    Text(std::borrow::Cow<'a, str>),
    Json(&'a Json<'a>),
}

enum Doc<'a> {
    Json(Json<'a>),
    Fields(Vec<&'a str>),
}

/// An input: its payload, read once, and its topic (for `topic[N]`).
struct Src<'a> {
    doc: Doc<'a>,
    topic: &'a str,
}

/// The event in a payload received on `topic`; `Ok(None)` when the pipeline's `where`
/// filter does not match it (skipped, not a dead letter).
pub fn parse(spec: &PipelineSpec, topic: &str, payload: &[u8]) -> Result<Option<Parsed>, Refusal> {
    if payload.is_empty() {
        return Err(refuse("empty", "the payload is empty"));
    }
    let text = std::str::from_utf8(payload).map_err(|e| {
        refuse(
            "not_utf8",
            format!("payload is not UTF-8 (byte {})", e.valid_up_to()),
        )
    })?;
    let doc = match &spec.format {
        Format::Json => Doc::Json(
            Json::parse(text)
                .map_err(|e| refuse("not_json", format!("payload is not JSON: {e}")))?,
        ),
        Format::Delimited { separator } => Doc::Fields(
            text.trim_end_matches(['\r', '\n'])
                .split(separator.as_str())
                .collect(),
        ),
        // The engine reads these through `sparkplug`, never here.
        Format::SparkplugB => {
            return Err(refuse(
                "not_sparkplug",
                "a Sparkplug B payload read as text",
            ));
        }
    };
    let doc = Src { doc, topic };
    if let Some(filter) = &spec.filter {
        if !filter.eval(&mut |f| filter_value(&doc, f))? {
            return Ok(None);
        }
    }
    let event_id = text_of(&doc, &spec.event_id, spec.max_id_len)?;
    let key = text_of(&doc, &spec.key, spec.max_key_len)?;
    let value = match &spec.value {
        None => Num::Int(1),
        Some(f) => number_of(&doc, f)?,
    };
    let event_time_ms = match &spec.event_time {
        None => None,
        Some(f) => Some(time_of(&doc, f)?),
    };
    if event_id.is_empty() {
        return Err(refuse("empty_id", "the event ID is empty"));
    }
    if event_id.len() > spec.max_id_len {
        return Err(refuse(
            "id_too_long",
            format!(
                "the event ID is longer than {} bytes (max_id_len): {} bytes read",
                spec.max_id_len,
                event_id.len()
            ),
        ));
    }
    if event_id.chars().any(char::is_control) {
        return Err(refuse(
            "bad_event_id",
            "the event ID contains a control character",
        ));
    }
    Ok(Some(Parsed {
        event_id,
        key,
        value,
        event_time_ms,
    }))
}

/// A field's value for a filter comparison. Text (delimited fields, topic levels,
/// templates) stays untyped; JSON keeps its type.
fn filter_value(src: &Src<'_>, field: &Field) -> Result<FilterValue, Refusal> {
    Ok(match lookup(src, field, usize::MAX)? {
        Scalar::Text(t) => FilterValue::Text(t.into_owned()),
        Scalar::Json(Json::String(s)) => FilterValue::Str(s.to_string()),
        Scalar::Json(Json::Bool(b)) => FilterValue::Bool(*b),
        Scalar::Json(Json::Number(n)) => match n.as_i64() {
            Some(i) => FilterValue::Num(Num::Int(i)),
            None => FilterValue::Num(Num::Float(n.as_f64().unwrap_or(f64::NAN))),
        },
        Scalar::Json(other) => {
            return Err(refuse(
                "wrong_type",
                format!(
                    "{} is {}, which `where` cannot compare",
                    describe(field),
                    kind(other)
                ),
            ));
        }
    })
}

/// The scalar at `field`. A template stops growing once it is longer than `max_len` bytes
/// (the caller refuses it as too long), so repeated parts cannot build a huge string.
fn lookup<'a>(src: &'a Src<'a>, field: &Field, max_len: usize) -> Result<Scalar<'a>, Refusal> {
    if let Field::Topic(i) = field {
        return match src.topic.split('/').nth(*i) {
            Some(level) => Ok(Scalar::Text(level.into())),
            None => Err(refuse(
                "missing_field",
                format!("the topic `{}` has no level {i}", src.topic),
            )),
        };
    }
    match (&src.doc, field) {
        (Doc::Json(v), Field::Pointer(p)) => match pointer(v, p) {
            Some(Json::Null) | None => Err(refuse("missing_field", format!("no value at {p}"))),
            Some(x) => Ok(Scalar::Json(x)),
        },
        (Doc::Fields(f), Field::Index(i)) => match f.get(*i) {
            Some(s) => Ok(Scalar::Text((*s).into())),
            None => Err(refuse(
                "missing_field",
                format!("no field {i} (the payload has {})", f.len()),
            )),
        },
        (_, Field::Template(parts)) => {
            let mut out = String::new();
            for part in parts {
                if out.len() > max_len {
                    break;
                }
                match part {
                    TemplatePart::Literal(l) => out.push_str(l),
                    TemplatePart::Field(f) => {
                        out.push_str(&scalar_text(lookup(src, f, max_len)?, f)?)
                    }
                }
            }
            Ok(Scalar::Text(out.into()))
        }
        // Field::parse never pairs a pointer with delimited text or an index with JSON.
        _ => Err(refuse(
            "missing_field",
            "field kind does not fit the format",
        )),
    }
}

/// `serde_json`'s `Value::pointer(p)` (RFC 6901) on a [`Json`], without its two allocations
/// per token: a token is unescaped into a new string only when it holds a `~` (issue 16:
/// the three lookups of every input made six).
fn pointer<'v, 'a>(v: &'v Json<'a>, p: &str) -> Option<&'v Json<'a>> {
    if p.is_empty() {
        return Some(v);
    }
    let mut at = v;
    for token in p.strip_prefix('/')?.split('/') {
        let unescaped;
        let token = if token.contains('~') {
            unescaped = token.replace("~1", "/").replace("~0", "~");
            unescaped.as_str()
        } else {
            token
        };
        at = match at {
            Json::Object(_) => at.member(token)?,
            Json::Array(a) => a.get(array_index(token)?)?,
            _ => return None,
        };
    }
    Some(at)
}

/// An array index in a pointer: digits only, no leading zero (RFC 6901).
fn array_index(token: &str) -> Option<usize> {
    let digits = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
    if !digits || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    token.parse().ok()
}

fn scalar_text(s: Scalar<'_>, field: &Field) -> Result<String, Refusal> {
    match s {
        Scalar::Text(t) => Ok(t.into_owned()),
        Scalar::Json(Json::String(t)) => Ok(t.to_string()),
        Scalar::Json(Json::Number(n)) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        Scalar::Json(other) => Err(refuse(
            "wrong_type",
            format!(
                "{} is {}, expected a string or an integer",
                describe(field),
                kind(other)
            ),
        )),
    }
}

fn text_of(doc: &Src<'_>, field: &Field, max_len: usize) -> Result<String, Refusal> {
    scalar_text(lookup(doc, field, max_len)?, field)
}

fn number_of(doc: &Src<'_>, field: &Field) -> Result<Num, Refusal> {
    let n = match lookup(doc, field, usize::MAX)? {
        Scalar::Json(Json::Number(n)) => {
            if let Some(i) = n.as_i64() {
                Num::Int(i)
            } else if n.is_u64() {
                return Err(refuse(
                    "out_of_range",
                    format!("{n} does not fit a signed 64-bit integer"),
                ));
            } else {
                Num::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Scalar::Json(other) => {
            return Err(refuse(
                "wrong_type",
                format!("{} is {}, expected a number", describe(field), kind(other)),
            ));
        }
        Scalar::Text(t) => {
            let t = t.trim();
            if let Ok(i) = t.parse::<i64>() {
                Num::Int(i)
            } else if t
                .bytes()
                .all(|c| c.is_ascii_digit() || c == b'-' || c == b'+')
                && !t.is_empty()
            {
                return Err(refuse(
                    "out_of_range",
                    format!("{t} does not fit a signed 64-bit integer"),
                ));
            } else {
                match t.parse::<f64>() {
                    Ok(f)
                        if !t.eq_ignore_ascii_case("nan")
                            && !t.to_ascii_lowercase().contains("inf") =>
                    {
                        Num::Float(f)
                    }
                    _ => return Err(refuse("wrong_type", format!("`{t}` is not a number"))),
                }
            }
        }
    };
    if let Num::Float(f) = n {
        if !f.is_finite() || f.abs() >= MAX_EXACT_FLOAT {
            return Err(refuse(
                "out_of_range",
                format!("{f} is not a finite number below 2^53"),
            ));
        }
    }
    Ok(n)
}

fn time_of(doc: &Src<'_>, field: &Field) -> Result<u64, Refusal> {
    match lookup(doc, field, usize::MAX)? {
        Scalar::Json(Json::Number(n)) => n.as_u64().ok_or_else(|| {
            refuse(
                "bad_event_time",
                format!("{n} is not milliseconds since the epoch"),
            )
        }),
        Scalar::Json(Json::String(s)) => rfc3339_or_ms(s),
        Scalar::Text(t) => rfc3339_or_ms(&t),
        Scalar::Json(other) => Err(refuse(
            "bad_event_time",
            format!(
                "event time is {}, expected ms since the epoch or RFC 3339",
                kind(other)
            ),
        )),
    }
}

fn rfc3339_or_ms(s: &str) -> Result<u64, Refusal> {
    let s = s.trim();
    s.parse::<u64>()
        .ok()
        .or_else(|| parse_rfc3339_ms(s))
        .ok_or_else(|| {
            refuse(
                "bad_event_time",
                format!("`{s}` is neither ms since the epoch nor RFC 3339"),
            )
        })
}

fn describe(field: &Field) -> String {
    match field {
        Field::Pointer(p) => p.clone(),
        Field::Index(i) => format!("field {i}"),
        Field::Template(_) => "template field".into(),
        Field::Topic(i) => format!("topic[{i}]"),
        Field::Sparkplug(part) => format!("{{{}}}", part.name()),
    }
}

fn kind(v: &Json<'_>) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a non-integer number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_reads_what_serde_json_pointer_reads() {
        let text = r#"{"a": [10, 11, {"b": 1}], "": {"": 2, " ": 3}, "c/d": 4, "e~f": 5, "~1": 6,
                "0": {"00": 7}, "n": null, "s": "x", "s": "last"}"#;
        let doc: serde_json::Value = serde_json::from_str(text).unwrap();
        let ours = Json::parse(text).unwrap();
        let pointers = [
            "",
            "/",
            "//",
            "/ ",
            "/a",
            "/a/0",
            "/a/2/b",
            "/a/3",
            "/a/00",
            "/a/01",
            "/a/+1",
            "/a/-1",
            "/a/-",
            "/a/1e0",
            "/a/ 1",
            "/a/18446744073709551616",
            "/c~1d",
            "/e~0f",
            "/~01",
            "/~1",
            "/c/d",
            "/0/00",
            "/0/0",
            "/n",
            "/n/x",
            "/s",
            "/s/0",
            "/a/0/x",
            "a",
            "/a/",
            "/~2",
            "/~",
            "/é",
        ];
        for p in pointers {
            assert_eq!(
                pointer(&ours, p).map(super::super::json::to_value).as_ref(),
                doc.pointer(p),
                "pointer {p:?}"
            );
        }
    }
}
