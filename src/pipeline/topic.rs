//! MQTT topic filters and topic-safe keys.

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

/// Escape a key so it is one topic level and one output-ID segment: `%`, `/`, `+`, `#`
/// become `%25`, `%2F`, `%2B`, `%23`. Injective, so two keys never share a topic.
pub fn escape_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            '+' => out.push_str("%2B"),
            '#' => out.push_str("%23"),
            c => out.push(c),
        }
    }
    out
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
    }
}
