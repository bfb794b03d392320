//! MQTT topic filters, topic-safe keys and output topics.

use super::refusal::Refusal;

/// The longest topic MQTT can carry (a 16-bit length prefix). A longer one would make the
/// broker drop the connection, and the outbox would send it again after every reconnect.
pub(crate) const MAX_TOPIC_LEN: usize = 65_535;

/// Room every result topic leaves for `[uplink] topic_prefix` (its longest value), so that
/// the prefixed topic still fits MQTT's limit whatever a sender put in the key: otherwise
/// the publish would be refused, the agent would stop, and replay would make the same
/// result again after every restart.
pub(crate) const TOPIC_PREFIX_ROOM: usize = 1024;

/// The longest topic a pipeline may publish a result to, before any uplink prefix.
pub(crate) const MAX_RESULT_TOPIC_LEN: usize = MAX_TOPIC_LEN - TOPIC_PREFIX_ROOM;

/// Does `topic` match the MQTT topic filter `filter` (`+` one level, `#` the rest)?
/// Topics starting with `$` are matched only by filters that start with `$` too
/// (MQTT 3.1.1 §4.7.2), so `#` never sees `$SYS/...`.
pub fn matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') != filter.starts_with('$') {
        return false;
    }
    let mut f = filter.split('/');
    let mut t = topic.split('/');
    loop {
        match (f.next(), t.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Escape a key so it is one topic level and one output-ID segment: `%`, `/`, `+`, `#`,
/// `$`, `{`, `}` become `%25`, `%2F`, `%2B`, `%23`, `%24`, `%7B`, `%7D`. `/+#` would split or
/// widen the topic, a leading `$` makes a topic the broker reserves (mosquitto accepts the
/// publish and drops it), and braces would read as placeholders of the template. Injective,
/// since every escape starts with `%` and `%` itself is escaped: two keys never share a topic.
pub(crate) fn escape_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            '+' => out.push_str("%2B"),
            '#' => out.push_str("%23"),
            '$' => out.push_str("%24"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

/// Fill an output topic template in one pass: `{key}` becomes `escaped_key`, and
/// `{window_start}` the window start when there is one. Substituted text is never scanned
/// again, so a value that spells a placeholder stays literal text. Any other `{...}` is
/// copied as written (config validation refuses such templates).
pub fn render(template: &str, escaped_key: &str, window_start: Option<u64>) -> String {
    let mut out = String::with_capacity(template.len() + escaped_key.len() + 20);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let from_brace = &rest[open..];
        let Some(close) = from_brace.find('}') else {
            out.push_str(from_brace);
            return out;
        };
        let placeholder = &from_brace[..=close];
        match (placeholder, window_start) {
            ("{key}", _) => out.push_str(escaped_key),
            ("{window_start}", Some(start)) => out.push_str(&start.to_string()),
            _ => out.push_str(placeholder),
        }
        rest = &from_brace[close + 1..];
    }
    out.push_str(rest);
    out
}

/// A topic a result may be published to: not reserved for the broker (`$...`, checked here
/// as well as on the template, so no key or template edit can reach one) and within MQTT's
/// length limit.
pub(crate) fn check_publish_topic(topic: &str) -> Result<(), Refusal> {
    if topic.starts_with('$') {
        return Err(Refusal {
            reason: "bad_topic",
            detail: "the output topic starts with `$`, which the broker reserves".into(),
        });
    }
    if topic.len() > MAX_RESULT_TOPIC_LEN {
        return Err(Refusal {
            reason: "topic_too_long",
            detail: format!(
                "the output topic is {} bytes; at most {MAX_RESULT_TOPIC_LEN} (MQTT allows \
                 {MAX_TOPIC_LEN}, less room for an uplink's topic_prefix)",
                topic.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_match_like_mqtt() {
        assert!(matches("payments/#", "payments/eu/1"));
        assert!(matches("payments/#", "payments"));
        assert!(matches("a/+/c", "a/b/c"));
        assert!(!matches("a/+/c", "a/b/d"));
        assert!(!matches("a/+", "a/b/c"));
        assert!(matches("#", "x/y"));
        assert!(!matches("#", "$SYS/broker"));
        assert!(matches("$SYS/#", "$SYS/broker"));
        assert!(!matches("a/b", "a/b/c"));
    }

    #[test]
    fn hostile_keys_escape_to_one_level() {
        assert_eq!(escape_key("a/b+c#d%e"), "a%2Fb%2Bc%23d%25e");
        assert_ne!(escape_key("a%2F"), escape_key("a/"));
        assert_eq!(escape_key("$SYS{key}"), "%24SYS%7Bkey%7D");
        assert_ne!(escape_key("%24"), escape_key("$"));
    }

    #[test]
    fn templates_are_filled_in_one_pass() {
        // A substituted value that spells a placeholder is not substituted again.
        assert_eq!(
            render("out/{key}/{window_start}", "{window_start}", Some(7)),
            "out/{window_start}/7"
        );
        assert_eq!(render("{window_start}-{key}", "{key}", Some(0)), "0-{key}");
        assert_eq!(render("a/{key}", "k", None), "a/k");
        assert_eq!(
            render("a/{key}/{window_start}", "k", None),
            "a/k/{window_start}"
        );
        assert_eq!(render("a/{unclosed", "k", None), "a/{unclosed");
    }

    #[test]
    fn reserved_and_oversized_topics_are_refused() {
        assert_eq!(
            check_publish_topic("$SYS/x").unwrap_err().reason,
            "bad_topic"
        );
        let long = "t".repeat(MAX_RESULT_TOPIC_LEN + 1);
        assert_eq!(
            check_publish_topic(&long).unwrap_err().reason,
            "topic_too_long"
        );
        assert!(check_publish_topic(&long[1..]).is_ok());
        // The longest prefix before the longest result topic still fits MQTT.
        assert_eq!(TOPIC_PREFIX_ROOM + MAX_RESULT_TOPIC_LEN, MAX_TOPIC_LEN);
    }
}
