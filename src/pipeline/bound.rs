//! What one result takes in the store, at most: the engine refuses an event whose result
//! would not fit one stored entry ([`crate::model::MAX_ENTRY_BYTES`]), and config validation
//! refuses a pipeline whose worst key would make such a result (issue 26).
//!
//! A result is stored as an outbox chunk entry: an 8-byte key, and a postcard list of
//! `(seq, Output)`. A result that is large enough to matter is alone in its chunk (chunks are
//! cut at 4 KiB, `store::outbox`), so the entry is the chunk key, the list and sequence
//! headers, and the output's ID, topic and JSON body. The key appears in all three: escaped
//! for topics (`/` becomes `%2F`, three bytes for one) in the topic, once per `{key}` in the
//! template, and in the ID; in the body raw (JSON-escaped: `"` becomes `\"`) and inside the
//! ID (JSON-escaped again). So the costliest byte of a key is one that topic escaping triples:
//! `3k + 7` bytes for `k` placeholders, against `k + 5` for a quote and `k + 3` for any other.
//!
//! Every number in a result is counted at its longest (a `u64` is 20 digits, a JSON float at
//! most 24 characters, a generation 10), so whether a result fits depends only on the
//! definition, the key and the topic, never on the values: replay decides the same.

use super::spec::{AggregateSpec, PipelineSpec};

/// The chunk key (8), the list's length (1), the sequence number (10), three string lengths
/// (3 each) and two booleans of one outbox entry that holds a single result.
const ENTRY_OVERHEAD: usize = 8 + 1 + 10 + 3 * 3 + 2;
/// An ID is `pipeline[@generation]/key[/window_start]/version`: besides the name and the key,
/// `@` and 10 digits, two `/` and a version of 20 digits; with a window, `/` and its start.
const ID_EXTRA: usize = 1 + 10 + 2 + 20;
const ID_WINDOW: usize = 1 + 20;
/// The longest number a result body holds: `u64` and `i64` take 20 characters, a float as
/// serde_json writes it at most 24 (`-2.2250738585072014e-308`).
const NUMBER: usize = 24;
/// A body's field names, quotes, colons, commas and braces
/// (`{"count":,"generation":,"id":"","key":"","pipeline":"","values":,"version":}`, 76
/// characters), and its integers other than the value (count and version: 20 digits each;
/// the generation: 10).
const BODY_FIXED: usize = 76 + 2 * 20 + 10;
/// With a window: `,"window_end":,"window_start":` and two numbers of 20 digits.
const BODY_WINDOW: usize = 30 + 2 * 20;
/// One member of a list's `values`: `"variance":NUMBER,` (the longest name has 8 letters).
const VALUE_MEMBER: usize = 1 + 8 + 2 + NUMBER + 1;

/// The bytes of a key's text in the three places a result carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyBytes {
    /// Escaped for a topic level: in the topic (per `{key}`) and the ID.
    pub escaped: usize,
    /// The escaped key as a JSON string's content: the ID in the body.
    pub escaped_json: usize,
    /// The key as a JSON string's content: the body's `key`.
    pub json: usize,
}

impl KeyBytes {
    /// The bytes of `key`, whose topic-escaped form is `escaped`.
    pub(crate) fn of(key: &str, escaped: &str) -> KeyBytes {
        KeyBytes {
            escaped: escaped.len(),
            escaped_json: json_len(escaped),
            json: json_len(key),
        }
    }

    /// At least what any key of at most `len` bytes takes: every byte one that topic escaping
    /// triples, the costliest (see the module docs).
    pub(crate) fn worst(len: usize) -> KeyBytes {
        KeyBytes {
            escaped: len.saturating_mul(3),
            escaped_json: len.saturating_mul(3),
            json: len,
        }
    }
}

/// The length of `s` inside a JSON string as serde_json writes it: `"` and `\` and the
/// short escapes take two bytes, other controls six (`\u0000`); everything else as it is.
pub(crate) fn json_len(s: &str) -> usize {
    s.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum()
}

/// Most bytes one result of `spec`, with a topic of `topic_len` bytes and a key of `key`
/// bytes, takes as a stored entry.
pub(crate) fn result_bytes(spec: &PipelineSpec, topic_len: usize, key: KeyBytes) -> usize {
    let name = spec.name.len();
    let name_json = json_len(&spec.name);
    let value = match &spec.aggregate {
        AggregateSpec::One(_) => NUMBER,
        AggregateSpec::List(list) => 2 + list.len().saturating_mul(VALUE_MEMBER),
    };
    let (id_extra, body_fixed) = match spec.window {
        Some(_) => (ID_EXTRA + ID_WINDOW, BODY_FIXED + BODY_WINDOW),
        None => (ID_EXTRA, BODY_FIXED),
    };
    let id = name + id_extra + key.escaped;
    let body =
        body_fixed + (name_json + id_extra + key.escaped_json) + key.json + name_json + value;
    [ENTRY_OVERHEAD, id, topic_len, body]
        .into_iter()
        .fold(0usize, usize::saturating_add)
}

/// The longest topic the template makes for a key of `key_escaped` bytes: each `{key}` is the
/// key, each `{window_start}` at most 20 digits (config validation allows no other
/// placeholder).
fn topic_bytes(template: &str, key_escaped: usize) -> usize {
    let keys = template.matches("{key}").count();
    let starts = template.matches("{window_start}").count();
    let literal = template.len() - keys * "{key}".len() - starts * "{window_start}".len();
    literal
        .saturating_add(keys.saturating_mul(key_escaped))
        .saturating_add(starts * 20)
}

/// Most bytes any result of `spec` takes as a stored entry: its worst key of `max_key_len`
/// bytes, in the longest topic its template makes.
pub(crate) fn worst_result_bytes(spec: &PipelineSpec) -> usize {
    let key = KeyBytes::worst(spec.max_key_len);
    result_bytes(spec, topic_bytes(&spec.output_topic, key.escaped), key)
}

/// The largest `max_key_len` with which every result of `spec` fits `limit`, if any does.
pub(crate) fn max_key_len_within(spec: &PipelineSpec, limit: usize) -> Option<usize> {
    let at = |len: usize| {
        let mut s = spec.clone();
        s.max_key_len = len;
        worst_result_bytes(&s)
    };
    if at(1) > limit {
        return None;
    }
    // The cost grows by the same amount with each byte of key: solve the line.
    let (base, step) = (at(0), at(1) - at(0));
    Some((limit - base) / step.max(1))
}
