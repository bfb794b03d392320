//! A `where` filter in `pipelines.json`, the record of the pipelines the last run used, which
//! the start-up settle depends on (issue 26).
//!
//! Written as its canonical text (a JSON string), read back with
//! [`super::filter::parse_stored`]: a string has no nesting, so a filter of any length the
//! config accepts reads back. The release before wrote the tree as serde's nested form
//! (`{"And": [{"And": [...]}, ...]}`), two JSON levels per chained comparison, and
//! `serde_json` refuses past 128 levels: from about 62 comparisons on, the file no longer read
//! back and the settle was skipped. That form is still read, by [`legacy`], without
//! recursion: the filter's JSON value is taken whole (`serde_json` skips over a value with a
//! loop, not a recursion, so no depth limit applies) and walked with an explicit stack.
//!
//! Only JSON reads a filter this way (the record is JSON); the format of every other part of
//! a definition is unchanged.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use super::expr::{CmpOp, Expr, Operand};
use super::filter::{MAX_DEPTH, parse_stored};

impl Serialize for Expr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Expr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Expr, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        let text = raw.get();
        if text.starts_with('"') {
            let source: String = serde_json::from_str(text).map_err(D::Error::custom)?;
            parse_stored(&source).map_err(|e| {
                D::Error::custom(format!(
                    "filter `{source}`: at byte {}: {}",
                    e.offset, e.message
                ))
            })
        } else {
            legacy(text).map_err(|e| D::Error::custom(format!("filter (nested form): {e}")))
        }
    }
}

/// A node the walk has opened and not yet closed.
enum Open {
    /// `{"Or": [` or `{"And": [`, with the operands read so far (at most two).
    Join { or: bool, parts: Vec<Expr> },
    /// `{"Not": `.
    Not,
}

/// Deepest tree [`legacy`] builds: every `Not`, and every join inside one of the other kind,
/// is a level (a chain of one kind flattens into one node). The release before wrote at
/// most about twice [`MAX_DEPTH`] such levels (its parser counted `not` and parentheses,
/// and `a or b and c` nests without one); beyond that a file is damaged, and is refused
/// before it builds a tree too deep to drop. What is built must then read back from its
/// canonical text, so a tree from the nested form is one the parser could have made.
const LEGACY_MAX_DEPTH: usize = 2 * MAX_DEPTH + 2;

/// The level a node opened inside `parent` adds (see [`LEGACY_MAX_DEPTH`]).
fn level(parent: Option<&Open>, node: &Open) -> usize {
    match (parent, node) {
        (Some(Open::Join { or: a, .. }), Open::Join { or: b, .. }) if a == b => 0,
        _ => 1,
    }
}

/// Read the nested form the release before wrote: `{"Or": [a, b]}`, `{"And": [a, b]}`,
/// `{"Not": a}` and `{"Cmp": [left, "Op", right]}`, with whitespace anywhere JSON allows it.
/// A comparison is shallow (its operands nest a few levels at most), so it is read with
/// `serde_json`; everything above it with a loop and a stack of [`Open`] nodes. The result is
/// the tree the parser builds from the same filter text (chains flattened, see [`Expr::all`]).
pub(crate) fn legacy(text: &str) -> Result<Expr, String> {
    let mut r = Reader { text, at: 0 };
    // Each open node with the depth of the tree down to it.
    let mut stack: Vec<(Open, usize)> = Vec::new();
    let open = |stack: &mut Vec<(Open, usize)>, node: Open, at: usize| {
        let (parent, depth) = stack.last().map_or((None, 0), |(o, d)| (Some(o), *d));
        let depth = depth + level(parent, &node);
        if depth > LEGACY_MAX_DEPTH {
            return Err(format!(
                "nested deeper than {LEGACY_MAX_DEPTH} levels at byte {at}"
            ));
        }
        stack.push((node, depth));
        Ok(())
    };
    loop {
        // At the start of a node: open it, or read it whole if it is a comparison.
        r.expect(b'{')?;
        let tag = r.string()?;
        r.expect(b':')?;
        let mut e = match tag.as_str() {
            "Or" | "And" => {
                r.expect(b'[')?;
                let parts = Vec::with_capacity(2);
                let node = Open::Join {
                    or: tag == "Or",
                    parts,
                };
                open(&mut stack, node, r.at)?;
                continue;
            }
            "Not" => {
                open(&mut stack, Open::Not, r.at)?;
                continue;
            }
            "Cmp" => {
                let value = r.value()?;
                let (l, op, rt): (Operand, CmpOp, Operand) = serde_json::from_str(value)
                    .map_err(|e| format!("a comparison before byte {}: {e}", r.at))?;
                r.expect(b'}')?;
                Expr::Cmp(l, op, rt)
            }
            other => return Err(format!("unknown node `{other}` before byte {}", r.at)),
        };
        // Close every node this one completes, up to a join still waiting for its second
        // operand, or to the end.
        loop {
            match stack.pop() {
                None => {
                    r.skip_ws();
                    if r.at != text.len() {
                        return Err(format!("unexpected text at byte {}", r.at));
                    }
                    // Only a tree the parser could have made: its canonical text reads back.
                    let canonical = e.to_string();
                    return match parse_stored(&canonical) {
                        Ok(back) if back == e => Ok(e),
                        Ok(_) => Err(format!("`{canonical}` reads back as another filter")),
                        Err(err) => Err(format!("`{canonical}`: {}", err.message)),
                    };
                }
                Some((Open::Not, _)) => {
                    r.expect(b'}')?;
                    e = Expr::Not(Box::new(e));
                }
                Some((Open::Join { or, mut parts }, depth)) => {
                    parts.push(e);
                    if parts.len() < 2 {
                        r.expect(b',')?;
                        stack.push((Open::Join { or, parts }, depth));
                        break;
                    }
                    r.expect(b']')?;
                    r.expect(b'}')?;
                    e = if or {
                        Expr::any(parts)
                    } else {
                        Expr::all(parts)
                    };
                }
            }
        }
    }
}

/// A cursor over JSON text, for the few tokens the nested form has between comparisons.
struct Reader<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Reader<'a> {
    fn skip_ws(&mut self) {
        let b = self.text.as_bytes();
        while self.at < b.len() && matches!(b[self.at], b' ' | b'\t' | b'\n' | b'\r') {
            self.at += 1;
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        self.skip_ws();
        if self.text.as_bytes().get(self.at) == Some(&c) {
            self.at += 1;
            Ok(())
        } else {
            Err(format!("expected `{}` at byte {}", c as char, self.at))
        }
    }

    /// The end of the string that starts at `from` (its opening quote), past the closing one.
    fn string_end(&self, from: usize) -> Result<usize, String> {
        let b = self.text.as_bytes();
        let mut i = from + 1;
        while i < b.len() {
            match b[i] {
                b'\\' => i += 2,
                b'"' => return Ok(i + 1),
                _ => i += 1,
            }
        }
        Err(format!("unclosed string at byte {from}"))
    }

    /// A JSON string, unescaped.
    fn string(&mut self) -> Result<String, String> {
        self.skip_ws();
        if self.text.as_bytes().get(self.at) != Some(&b'"') {
            return Err(format!("expected a string at byte {}", self.at));
        }
        let end = self.string_end(self.at)?;
        let s = serde_json::from_str(&self.text[self.at..end]).map_err(|e| e.to_string())?;
        self.at = end;
        Ok(s)
    }

    /// The text of the JSON value here (brackets balanced, strings skipped), a loop.
    fn value(&mut self) -> Result<&'a str, String> {
        self.skip_ws();
        let b = self.text.as_bytes();
        let start = self.at;
        let mut depth = 0usize;
        let mut i = start;
        while i < b.len() {
            match b[i] {
                b'"' => {
                    i = self.string_end(i)?;
                    if depth == 0 {
                        break;
                    }
                    continue;
                }
                b'[' | b'{' => depth += 1,
                b']' | b'}' if depth == 0 => break,
                b']' | b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        i += 1;
                        break;
                    }
                }
                b',' if depth == 0 => break,
                _ => {}
            }
            i += 1;
        }
        if depth != 0 || i == start {
            return Err(format!("unfinished value at byte {start}"));
        }
        self.at = i;
        Ok(&self.text[start..i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::spec::PipelineSpec;

    /// The pipelines the fixtures were written from, by the release before filters were
    /// kept as text (`serde_json::to_vec_pretty(&cfg.pipelines)`, the deep one compacted).
    fn spec(filter: &str, delimited: bool) -> PipelineSpec {
        let (format, f) = if delimited {
            (
                "format = \"delimited\"\nseparator = \";\"\n",
                ["{0}-x", "1", "2"],
            )
        } else {
            ("", ["{/id}-x", "/k", "/v"])
        };
        crate::config::pipeline_from_toml(&format!(
            "name = \"old\"\ntopics = [\"in/#\"]\n{format}event_id = \"{}\"\nkey = \"{}\"\n\
             value = \"{}\"\naggregate = [\"sum\", \"p95\"]\noutput_topic = \"s/{{key}}\"\n\
             window = {{ size = \"1m\", slide = \"30s\" }}\nwhere = '''{filter}'''\n",
            f[0], f[1], f[2]
        ))
        .unwrap()
    }

    const SMALL: &str = r#"/a == 1 and (/b != "x\"y\\" or not {/c d} < 2.5) and topic[1] == true or not (not /e >= -3 and /f <= 1e-7) or /g/0 > 9007199254740991 or /x{/y} == "é""#;

    fn deep_text() -> String {
        let terms: Vec<String> = (0..150).map(|i| format!("/dev != \"d{i}\"")).collect();
        terms.join(" and ")
    }

    #[test]
    fn the_nested_form_of_the_release_before_still_reads() {
        let text = include_str!("testdata/pipelines_before_text_filters.json");
        let specs: Vec<PipelineSpec> = serde_json::from_str(text).unwrap();
        let want = vec![
            spec(SMALL, false),
            spec(r#"{2} >= 10 and topic[1] == "m7" or {3} == true"#, true),
        ];
        assert_eq!(specs, want);
        // A record that release could write but not read back (150 chained comparisons,
        // 300 JSON levels): read now, and equal to what the config gives.
        let text = include_str!("testdata/pipelines_before_text_filters_deep.json");
        assert!(text.len() < 20_000 && text.matches("\"And\"").count() == 149);
        let specs: Vec<PipelineSpec> = serde_json::from_str(text).unwrap();
        assert_eq!(specs, vec![spec(&deep_text(), false)]);
    }

    /// Issue 26: from about 62 chained comparisons the record of the last run no longer read
    /// back, and the start-up settle was skipped. Now every filter the config accepts does.
    #[test]
    fn a_long_where_reads_back_from_the_record_of_the_last_run() {
        let long = (0..300)
            .map(|i| format!("/d!={i}"))
            .collect::<Vec<_>>()
            .join(" or ");
        let mut nested = "/x == 0".to_string();
        for level in 1..crate::pipeline::filter::MAX_DEPTH {
            let word = if level % 2 == 0 { "and" } else { "or" };
            nested = format!("/x == {level} {word} ({nested})");
        }
        let specs = vec![
            spec(&deep_text(), false),
            spec(&long, false),
            spec(&nested, false),
            spec(SMALL, false),
        ];
        let text = serde_json::to_vec_pretty(&specs).unwrap();
        let back: Vec<PipelineSpec> = serde_json::from_slice(&text).unwrap();
        assert_eq!(back, specs);
        // Kept as text: no nesting for a JSON reader to count.
        let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
        assert!(v[0]["filter"].is_string(), "{}", v[0]["filter"]);
    }

    #[test]
    fn a_damaged_filter_is_an_error_not_a_panic() {
        for bad in [
            r#""/a == ""#,
            r#"{"And": [{"Cmp": [{"Field": {"Pointer": "/a"}}, "Eq", {"Literal": {"Num": {"Int": 1}}}]}]}"#,
            r#"{"Xor": []}"#,
            r#"{"Not": {"Cmp": [1, "Eq"]}}"#,
            r#"{"Or": [{"Not": "#,
            "[]",
            "7",
        ] {
            assert!(serde_json::from_str::<Expr>(bad).is_err(), "{bad}");
        }
        // Deeper than any release wrote: refused before a tree too deep to drop is built.
        let cmp = r#"{"Cmp": [{"Field": {"Pointer": "/a"}}, "Eq", {"Literal": {"Bool": true}}]}"#;
        let nots = |n: usize| format!("{}{cmp}{}", r#"{"Not": "#.repeat(n), "}".repeat(n));
        let e: Expr = serde_json::from_str(&nots(MAX_DEPTH - 1)).unwrap();
        assert_eq!(
            e.to_string(),
            format!("{}{{/a}} == true", "not ".repeat(MAX_DEPTH - 1))
        );
        for n in [MAX_DEPTH + 1, LEGACY_MAX_DEPTH + 1, 100_000] {
            let err = serde_json::from_str::<Expr>(&nots(n)).unwrap_err();
            assert!(err.to_string().contains("nested deeper"), "{n}: {err}");
        }
    }
}
