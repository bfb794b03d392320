//! Text a sender controls, on its way into a topic or a journal line.
//!
//! MQTT (3.1.1 §1.5.3, 5.0 §1.5.4) lets a receiver treat a packet as malformed and close the
//! connection when a string holds U+0000, a C0 or C1 control (U+0001..U+001F,
//! U+007F..U+009F) or a Unicode non-character (U+FDD0..U+FDEF and the last two code points
//! of every plane, U+FFFE/U+FFFF ... U+10FFFE/U+10FFFF). mosquitto does: a result topic with
//! one of them gets the agent disconnected, and the outbox would send it again on every
//! reconnect (issue 27). [`mqtt_may_refuse`] names those code points, for the checks where a
//! topic is made (keys, config text). [`Shown`] prints a string for a journal line with
//! them, and the line breaks they include, escaped, so a topic cannot forge a line.

use std::fmt;

/// Whether an MQTT receiver may refuse a string holding `c` (see the module docs).
pub fn mqtt_may_refuse(c: char) -> bool {
    let u = u32::from(c);
    c.is_control() || (0xFDD0..=0xFDEF).contains(&u) || (u & 0xFFFE) == 0xFFFE
}

/// The first code point of `s` an MQTT receiver may refuse, if any.
pub fn first_refusable(s: &str) -> Option<char> {
    s.chars().find(|&c| mqtt_may_refuse(c))
}

/// `s` for a journal line: every code point [`mqtt_may_refuse`] names, and the Unicode line
/// and paragraph separators, written as `\u{XXXX}`; a backslash as `\\`, so the escaped
/// form never reads as another string's. Everything else as it is.
pub struct Shown<'a>(pub &'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(|c: char| needs_escape(c)) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().expect("found above");
            if c == '\\' {
                f.write_str("\\\\")?;
            } else {
                write!(f, "\\u{{{:04X}}}", u32::from(c))?;
            }
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

fn needs_escape(c: char) -> bool {
    c == '\\' || c == '\u{2028}' || c == '\u{2029}' || mqtt_may_refuse(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_every_non_character_are_refusable_and_nothing_else() {
        for c in ['\0', '\u{1}', '\n', '\u{1F}', '\u{7F}', '\u{80}', '\u{9F}'] {
            assert!(mqtt_may_refuse(c), "{:X}", u32::from(c));
        }
        for u in
            (0xFDD0..=0xFDEF).chain((0..=0x10).flat_map(|p| [p << 16 | 0xFFFE, p << 16 | 0xFFFF]))
        {
            let c = char::from_u32(u).unwrap();
            assert!(mqtt_may_refuse(c), "{u:X}");
        }
        let refusable = (0..=0x10FFFF)
            .filter_map(char::from_u32)
            .filter(|&c| mqtt_may_refuse(c))
            .count();
        assert_eq!(
            refusable,
            65 + 32 + 34,
            "C0+DEL+C1, FDD0..FDEF, two per plane"
        );
        for c in [
            ' ',
            'a',
            'é',
            '\u{A0}',
            '\u{FDCF}',
            '\u{FDF0}',
            '\u{FFFD}',
            '\u{1F600}',
        ] {
            assert!(!mqtt_may_refuse(c), "{:X}", u32::from(c));
        }
        assert_eq!(first_refusable("ab\u{FFFF}c\n"), Some('\u{FFFF}'));
        assert_eq!(first_refusable("plain/topic"), None);
    }

    #[test]
    fn a_shown_string_has_no_line_break_and_reads_back_one_to_one() {
        let s = "a\nb\r\u{2028}c\\u{000A}\u{FFFF}é";
        let shown = Shown(s).to_string();
        assert_eq!(shown, "a\\u{000A}b\\u{000D}\\u{2028}c\\\\u{000A}\\u{FFFF}é");
        assert!(!shown.contains('\n') && !shown.contains('\r'));
        assert_eq!(Shown("plain").to_string(), "plain");
        assert_ne!(Shown("\n").to_string(), Shown("\\u{000A}").to_string());
    }
}
