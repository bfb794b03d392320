//! Names and topics as the config gives them: pipeline and client names, topic filters,
//! output topic templates.

use super::*;

/// Why `s` cannot go into a topic, if it holds a code point an MQTT receiver may refuse
/// ([`crate::text::mqtt_may_refuse`]): a broker that does drops the connection, and the same
/// publish or subscription would be sent again after every reconnect (issue 27).
pub(super) fn refusable(s: &str) -> Option<String> {
    let c = crate::text::first_refusable(s)?;
    let what = if c.is_control() {
        "a control character"
    } else {
        "a Unicode non-character"
    };
    Some(format!(
        "it contains U+{:04X}, {what}, which an MQTT receiver may refuse in a topic",
        u32::from(c)
    ))
}

/// `[A-Za-z0-9_-]{1,max}`.
pub(super) fn valid_name(s: &str, max: usize) -> bool {
    (1..=max).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// An MQTT topic filter (MQTT 3.1.1 §4.7): `#` only as the whole last level, `+` only as a
/// whole level.
pub(super) fn check_filter(f: &str) -> Result<(), String> {
    if f.is_empty() {
        return Err("it is empty and matches nothing".to_string());
    }
    if let Some(why) = refusable(f) {
        return Err(why);
    }
    if f.len() > MAX_TOPIC_LEN {
        return Err(format!("it is longer than {MAX_TOPIC_LEN} bytes"));
    }
    let levels: Vec<&str> = f.split('/').collect();
    for (i, level) in levels.iter().enumerate() {
        if level.contains('#') {
            if *level != "#" {
                return Err("`#` must be a whole level, e.g. \"a/#\"".to_string());
            }
            if i + 1 != levels.len() {
                return Err("`#` must be the last level".to_string());
            }
        }
        if level.contains('+') && *level != "+" {
            return Err("`+` must be a whole level, e.g. \"a/+/c\"".to_string());
        }
    }
    Ok(())
}

/// An output topic template: a publish topic (no wildcards) with `{key}` and, when
/// windowed, optionally `{window_start}`.
pub(super) fn check_output_topic(t: &str, windowed: bool) -> Result<(), String> {
    if t.is_empty() {
        return Err("an output topic cannot be empty".to_string());
    }
    if let Some(why) = refusable(t) {
        return Err(why);
    }
    if t.len() > MAX_RESULT_TOPIC_LEN {
        return Err(format!(
            "it is longer than {MAX_RESULT_TOPIC_LEN} bytes (MQTT's {MAX_TOPIC_LEN} less room \
             for an uplink's topic_prefix)"
        ));
    }
    if t.contains(['+', '#']) {
        return Err(
            "`+` and `#` are wildcards for subscribing; a published topic cannot contain them"
                .to_string(),
        );
    }
    if t.starts_with('$') {
        return Err("topics starting with `$` are reserved for the broker".to_string());
    }
    let mut has_key = false;
    let mut rest = t;
    while let Some(open) = rest.find(['{', '}']) {
        if rest.as_bytes()[open] == b'}' {
            return Err("unmatched `}`".to_string());
        }
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err("unclosed `{`".to_string());
        };
        match &after[..close] {
            "key" => has_key = true,
            "window_start" if windowed => {}
            "window_start" => {
                return Err("`{window_start}` needs a `window`".to_string());
            }
            other => {
                return Err(format!(
                    "unknown placeholder `{{{other}}}`: only {{key}} and {{window_start}} are replaced"
                ));
            }
        }
        rest = &after[close + 1..];
    }
    if !has_key {
        return Err(
            "must contain `{key}`: each key needs its own topic, or retained results overwrite each other"
                .to_string(),
        );
    }
    Ok(())
}
