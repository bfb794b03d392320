//! MQTT topics as NATS subjects, one-to-one.
//!
//! Each topic level becomes one subject token; the levels' `/` become `.`. A NATS token
//! cannot hold `.` (the separator), `*` and `>` (wildcards) or white space, and cannot be
//! empty, while an MQTT level can hold any of them. So, within a level:
//!
//! | in the topic level | in the token |
//! | --- | --- |
//! | `%` | `%25` |
//! | `.` | `%2E` |
//! | `*` | `%2A` |
//! | `>` | `%3E` |
//! | a space, any other byte below `0x21`, and `0x7F` | `%` and two upper-case hex digits |
//! | an empty level | `%` alone |
//! | anything else (UTF-8 included) | itself |
//!
//! Every `%` in a token starts an escape, and an escape is either `%` alone (the whole token)
//! or `%` and two hex digits, so [`decode`] reads back exactly the topic [`encode`] was given
//! (`tests/it/dbsinks.rs` checks it over random topics).

/// The subject for `topic` under `prefix` (a subject of its own, given as written: it may be
/// empty).
pub fn subject(prefix: &str, topic: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + topic.len() + 8);
    if !prefix.is_empty() {
        out.push_str(prefix);
        out.push('.');
    }
    out.push_str(&encode(topic));
    out
}

/// The escaped form of `topic` as subject tokens (see the table above).
pub fn encode(topic: &str) -> String {
    let mut out = String::with_capacity(topic.len() + 8);
    for (i, level) in topic.split('/').enumerate() {
        if i > 0 {
            out.push('.');
        }
        if level.is_empty() {
            out.push('%');
            continue;
        }
        for c in level.chars() {
            match c {
                '%' | '.' | '*' | '>' | '\u{0}'..='\u{20}' | '\u{7f}' => {
                    out.push_str(&format!("%{:02X}", c as u32));
                }
                c => out.push(c),
            }
        }
    }
    out
}

/// The topic that [`encode`] turned into `tokens`; `None` if no topic encodes to it.
pub fn decode(tokens: &str) -> Option<String> {
    let mut out = String::with_capacity(tokens.len());
    for (i, token) in tokens.split('.').enumerate() {
        if i > 0 {
            out.push('/');
        }
        if token == "%" {
            continue;
        }
        if token.is_empty() {
            return None;
        }
        let mut rest = token;
        while let Some(at) = rest.find('%') {
            out.push_str(&rest[..at]);
            let hex = rest.get(at + 1..at + 3)?;
            if !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b))
            {
                return None;
            }
            let b = u8::from_str_radix(hex, 16).ok()?;
            if !matches!(b, b'%' | b'.' | b'*' | b'>' | 0..=0x20 | 0x7f) {
                return None;
            }
            out.push(char::from(b));
            rest = &rest[at + 3..];
        }
        if rest.contains(['*', '>', ' ']) {
            return None;
        }
        out.push_str(rest);
    }
    Some(out)
}

/// Whether the stream subject `filter` (with `*` and `>`) matches every subject under
/// `prefix` (the prefix and at least one token more).
pub fn covers(filter: &str, prefix: &str) -> bool {
    let f: Vec<&str> = filter.split('.').collect();
    let p: Vec<&str> = if prefix.is_empty() {
        Vec::new()
    } else {
        prefix.split('.').collect()
    };
    for (i, tok) in f.iter().enumerate() {
        if *tok == ">" {
            // `>` stands for one token or more: it covers the rest when at least the
            // prefix's remaining tokens and one more follow, which `prefix.>` always has.
            return i <= p.len();
        }
        match p.get(i) {
            Some(ptok) if *tok == "*" || tok == ptok => {}
            // Past the prefix a literal or `*` covers only some subjects.
            _ => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_become_tokens_and_the_special_characters_are_escaped() {
        assert_eq!(
            subject("site.box-17", "balances/acc 1"),
            "site.box-17.balances.acc%201"
        );
        assert_eq!(encode("a.b/*/>/%/"), "a%2Eb.%2A.%3E.%25.%");
        assert_eq!(encode("/x"), "%.x");
        assert_eq!(encode("é/\t"), "é.%09");
        assert_eq!(subject("", "x"), "x");
        for t in ["a.b/*/>/%/", "/x", "", "//", "é/\t", "%41"] {
            assert_eq!(decode(&encode(t)).as_deref(), Some(t), "{t:?}");
        }
        assert_eq!(
            decode("%41"),
            None,
            "an escape of a plain byte is no encoding"
        );
        assert_eq!(decode("a..b"), None);
    }

    #[test]
    fn a_stream_covers_the_prefix_only_with_a_tail_wildcard_at_or_before_it() {
        assert!(covers(">", "site.box"));
        assert!(covers("site.>", "site.box"));
        assert!(covers("site.box.>", "site.box"));
        assert!(covers("*.box.>", "site.box"));
        assert!(!covers("site.box.*", "site.box"));
        assert!(!covers("site.box", "site.box"));
        assert!(!covers("other.>", "site.box"));
        assert!(!covers("site.box.x.>", "site.box"));
        assert!(covers(">", ""));
        assert!(!covers("*", ""));
    }
}
