//! Printing for the commands: one line at a time, terminal-safe text, payloads as JSON.

use std::io::Write;

use serde_json::json;

use super::failure::Failure;

fn out() -> std::io::StdoutLock<'static> {
    std::io::stdout().lock()
}

/// Print one line; a closed pipe (`| head`) ends the command quietly.
pub(crate) fn emit(line: &str) -> Result<(), Failure> {
    writeln!(out(), "{line}").map_err(|_| Failure::quiet())
}

/// `s` safe to print on a terminal, one line: control characters (an escape sequence in a
/// payload could rewrite the screen, a newline could fake a line) and the invisible
/// direction overrides are shown as escapes; a backslash is doubled so that an escape is
/// never ambiguous. Only the text output needs it: `--json` escapes for itself.
pub(crate) fn printable(s: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control()
                || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// JSON text (as `serde_json` writes it) safe to print on a terminal: `serde_json` escapes
/// C0 controls but writes DEL, the C1 controls (U+0080..U+009F; U+009B is a CSI to some
/// terminals) and the direction overrides as they are. They can only be inside strings, where
/// `\uXXXX` means the same character: a JSON reader gets the same document.
pub(crate) fn terminal_safe_json(json: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if matches!(c, '\u{7f}'..='\u{9f}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

/// Bytes as printable text (invalid UTF-8 shown as U+FFFD).
pub(crate) fn printable_bytes(b: &[u8]) -> String {
    printable(&String::from_utf8_lossy(b))
}

pub(crate) fn payload_json(payload: &[u8]) -> serde_json::Value {
    match std::str::from_utf8(payload) {
        Ok(s) => json!(s),
        Err(_) => json!({ "hex": payload.iter().map(|b| format!("{b:02x}")).collect::<String>() }),
    }
}

#[cfg(test)]
mod tests {
    use super::{printable, terminal_safe_json};

    #[test]
    fn terminal_safe_json_escapes_del_c1_and_overrides_and_reads_back_the_same() {
        let v = serde_json::json!({"name": "a\u{1b}[2J\u{7f}\u{9b}31m\u{202e}z", "n": 1});
        let text = terminal_safe_json(&v.to_string());
        assert!(
            !text.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{text:?}"
        );
        assert!(
            text.contains("\\u001b[2J\\u007f\\u009b31m\\u202ez"),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<serde_json::Value>(&text).unwrap(), v);
    }

    #[test]
    fn printable_escapes_control_and_direction_characters_and_backslashes() {
        assert_eq!(printable("plain text/é"), "plain text/é");
        assert_eq!(printable("a\nb\tc\rd"), "a\\nb\\tc\\rd");
        assert_eq!(printable("\u{1b}[2J"), "\\u{1b}[2J");
        assert_eq!(printable("\u{7f}\u{0}"), "\\u{7f}\\u{0}");
        assert_eq!(printable("x\u{202e}y"), "x\\u{202e}y");
        assert_eq!(printable("back\\slash"), "back\\\\slash");
        // Unambiguous: an escaped text never equals another text's escape.
        assert_ne!(printable("\\n"), printable("\n"));
    }
}
