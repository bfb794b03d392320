//! `where` filters: a small boolean language over the fields of an input, parsed once when
//! the config is loaded and evaluated by the pure engine.
//!
//! ```text
//! expr    := or
//! or      := and ("or" and)*
//! and     := not ("and" not)*
//! not     := "not" not | "(" expr ")" | cmp
//! cmp     := operand ("==" | "!=" | "<" | "<=" | ">" | ">=") operand
//! operand := /json/pointer | {field} | topic[N] | "string" | number | true | false
//! ```
//!
//! `{field}` is anything `key` and `value` accept (`{/a b}`, `{2}` for a delimited position,
//! `{topic[1]}`); a bare `/pointer` ends at a space, a parenthesis or an operator.
//! `and` and `or` evaluate left to right and stop as soon as the answer is known, so
//! `/status == "running" and /temp > -40` skips a stopped machine even if it sends no
//! temperature.
//!
//! Bounded for hostile config: at most [`MAX_LEN`] bytes, and at most [`MAX_DEPTH`] levels
//! of `not` and parentheses, the only places the parser recurses; chains of `and` and `or`
//! are loops, and make one flat node each (see [`super::expr`]), so neither the parser nor
//! the evaluator recurses deeper than [`MAX_DEPTH`] levels whatever the filter.
//! [`parse_stored`] reads back the canonical text a tree prints, under the same depth bound
//! and a length bound ([`STORED_MAX_LEN`]) no canonical text of an accepted filter reaches.

use std::cmp::Ordering;

use super::expr::{CmpOp, Expr, Literal, Operand};
use super::field::{Field, Format};
use super::num::{MAX_EXACT_FLOAT, Num};
use super::refusal::Refusal;

/// Deepest nesting of `not` and parentheses: the parser recurses once per level.
pub(crate) const MAX_DEPTH: usize = 64;
/// Longest expression, in bytes.
pub(crate) const MAX_LEN: usize = 4096;
/// Longest canonical text [`parse_stored`] reads. The canonical text of a filter is at most
/// about 2.4 times its source (the worst is `/<1`, printed `{/} < 1`), so every filter the
/// config accepts reads back (`filter::tests::the_canonical_text_of_the_longest_filters_fits`).
pub(crate) const STORED_MAX_LEN: usize = 4 * MAX_LEN;

/// A value read from an input for a comparison.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Untyped text: a delimited field or a topic level. It compares as whatever the other
    /// side is (a number, a boolean or a string).
    Text(String),
    Str(String),
    Num(Num),
    Bool(bool),
}

/// A parse error at a byte offset of the expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    pub offset: usize,
    pub message: String,
}

impl SyntaxError {
    /// 0-based line and 1-based column (in characters) of the error within the expression.
    pub fn position(&self, text: &str) -> (usize, usize) {
        let before = &text[..self.offset.min(text.len())];
        let line = before.matches('\n').count();
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, col)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Field(Field),
    Lit(Literal),
    Op(CmpOp),
    And,
    Or,
    Not,
    Open,
    Close,
}

fn err<T>(offset: usize, message: impl Into<String>) -> Result<T, SyntaxError> {
    Err(SyntaxError {
        offset,
        message: message.into(),
    })
}

/// How the lexer reads a field: with the pipeline's format (config text), or as canonical
/// text, which names its kind by its shape (`{/a}` a pointer, `{2}` a position).
#[derive(Clone, Copy)]
enum Fields<'a> {
    Config(&'a Format),
    Stored,
}

impl Fields<'_> {
    fn parse(self, text: &str) -> Result<Field, String> {
        match self {
            Fields::Config(format) => Field::parse(text, format),
            // A pointer never reads as a position, nor a position as a pointer; a topic level
            // reads the same under both.
            Fields::Stored => Field::parse(text, &Format::Json).or_else(|_| {
                let any = Format::Delimited {
                    separator: "/".into(),
                };
                Field::parse(text, &any)
            }),
        }
    }
}

/// Parse a filter for a pipeline of the given format.
pub(crate) fn parse_filter(text: &str, format: &Format) -> Result<Expr, SyntaxError> {
    parse_with(text, Fields::Config(format), MAX_LEN)
}

/// Read back the canonical text of a filter (`Expr`'s `Display`), as `pipelines.json` keeps
/// it: the format is not needed, since that text writes every field in a form of one kind.
pub(crate) fn parse_stored(text: &str) -> Result<Expr, SyntaxError> {
    parse_with(text, Fields::Stored, STORED_MAX_LEN)
}

fn parse_with(text: &str, fields: Fields<'_>, max_len: usize) -> Result<Expr, SyntaxError> {
    if text.len() > max_len {
        return err(0, format!("longer than {max_len} bytes"));
    }
    let toks = lex(text, fields)?;
    let mut p = Parser {
        toks,
        pos: 0,
        end: text.len(),
    };
    let e = p.or(0)?;
    match p.toks.get(p.pos) {
        None => Ok(e),
        Some((at, t)) => err(*at, format!("unexpected {}", describe(t))),
    }
}

fn describe(t: &Tok) -> &'static str {
    match t {
        Tok::Field(_) => "a field",
        Tok::Lit(_) => "a literal",
        Tok::Op(_) => "an operator",
        Tok::And => "`and`",
        Tok::Or => "`or`",
        Tok::Not => "`not`",
        Tok::Open => "`(`",
        Tok::Close => "`)`",
    }
}

/// A bare word ends at one of these.
fn ends_word(c: char) -> bool {
    c.is_whitespace() || "()=!<>\"".contains(c)
}

fn lex(text: &str, fields: Fields<'_>) -> Result<Vec<(usize, Tok)>, SyntaxError> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = text[i..].chars().next().expect("in bounds");
        if c.is_whitespace() {
            i += c.len_utf8();
            continue;
        }
        let start = i;
        let two = text.get(i..i + 2);
        let (tok, len) =
            match c {
                '(' => (Tok::Open, 1),
                ')' => (Tok::Close, 1),
                '=' if two == Some("==") => (Tok::Op(CmpOp::Eq), 2),
                '!' if two == Some("!=") => (Tok::Op(CmpOp::Ne), 2),
                '<' if two == Some("<=") => (Tok::Op(CmpOp::Le), 2),
                '>' if two == Some(">=") => (Tok::Op(CmpOp::Ge), 2),
                '<' => (Tok::Op(CmpOp::Lt), 1),
                '>' => (Tok::Op(CmpOp::Gt), 1),
                '=' => return err(i, "`=` compares nothing: write `==`"),
                '!' => return err(i, "`!` alone is not an operator: write `!=` or `not`"),
                '"' => {
                    let (s, len) = string(text, i)?;
                    (Tok::Lit(Literal::Str(s)), len)
                }
                '{' => {
                    let Some(close) = text[i..].find('}') else {
                        return err(i, "unclosed `{`");
                    };
                    let inner = &text[i + 1..i + close];
                    let f = fields.parse(inner).map_err(|m| SyntaxError {
                        offset: i + 1,
                        message: m,
                    })?;
                    (Tok::Field(f), close + 1)
                }
                '/' => {
                    if matches!(fields, Fields::Config(Format::Delimited { .. })) {
                        return err(
                            i,
                            "a JSON pointer needs format = \"json\"; a delimited field is `{2}`",
                        );
                    }
                    let len = text[i..].find(ends_word).unwrap_or(text.len() - i);
                    let f = fields.parse(&text[i..i + len]).map_err(|m| SyntaxError {
                        offset: i,
                        message: m,
                    })?;
                    (Tok::Field(f), len)
                }
                _ => {
                    let len = text[i..].find(ends_word).unwrap_or(text.len() - i);
                    let word = &text[i..i + len];
                    if len == 0 {
                        return err(i, format!("unexpected `{c}`"));
                    }
                    let tok = match word {
                    "and" => Tok::And,
                    "or" => Tok::Or,
                    "not" => Tok::Not,
                    "true" => Tok::Lit(Literal::Bool(true)),
                    "false" => Tok::Lit(Literal::Bool(false)),
                    w if w.starts_with("topic[") => Tok::Field(
                        fields.parse(w).map_err(|m| SyntaxError { offset: i, message: m })?,
                    ),
                    w => Tok::Lit(Literal::Num(number(w).ok_or_else(|| SyntaxError {
                        offset: i,
                        message: format!(
                            "`{w}` is not a field, a number, a string, true, false, and, or, not; \
                             strings are in double quotes, fields start with `/` or are in `{{}}`"
                        ),
                    })?)),
                };
                    (tok, len)
                }
            };
        out.push((start, tok));
        i += len;
    }
    Ok(out)
}

/// A double-quoted string starting at `i`, with `\"` and `\\` escapes; its value and length.
fn string(text: &str, i: usize) -> Result<(String, usize), SyntaxError> {
    let mut out = String::new();
    let mut chars = text[i + 1..].char_indices();
    while let Some((j, c)) = chars.next() {
        match c {
            '"' => return Ok((out, j + 2)),
            '\\' => match chars.next() {
                Some((_, e @ ('"' | '\\'))) => out.push(e),
                _ => return err(i + 1 + j, "only `\\\"` and `\\\\` are escapes in a string"),
            },
            c => out.push(c),
        }
    }
    err(i, "unclosed string: it needs a closing `\"`")
}

/// A number literal: an integer, or a finite float below 2^53 like every value.
fn number(w: &str) -> Option<Num> {
    if let Ok(i) = w.parse::<i64>() {
        return Some(Num::Int(i));
    }
    let ok_chars = w
        .bytes()
        .all(|c| c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E'));
    let f = w.parse::<f64>().ok()?;
    (ok_chars && f.is_finite() && f.abs() < MAX_EXACT_FLOAT).then_some(Num::Float(f))
}

struct Parser {
    toks: Vec<(usize, Tok)>,
    pos: usize,
    end: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|(_, t)| t)
    }

    fn at(&self) -> usize {
        self.toks.get(self.pos).map_or(self.end, |(o, _)| *o)
    }

    /// `a or b or ...`: a loop, not a recursion, and one flat node (see [`Expr::any`]).
    fn or(&mut self, depth: usize) -> Result<Expr, SyntaxError> {
        let mut parts = vec![self.and(depth)?];
        while self.peek() == Some(&Tok::Or) {
            self.pos += 1;
            parts.push(self.and(depth)?);
        }
        Ok(Expr::any(parts))
    }

    fn and(&mut self, depth: usize) -> Result<Expr, SyntaxError> {
        let mut parts = vec![self.not(depth)?];
        while self.peek() == Some(&Tok::And) {
            self.pos += 1;
            parts.push(self.not(depth)?);
        }
        Ok(Expr::all(parts))
    }

    fn not(&mut self, depth: usize) -> Result<Expr, SyntaxError> {
        if depth >= MAX_DEPTH {
            return err(self.at(), format!("nested deeper than {MAX_DEPTH} levels"));
        }
        match self.peek() {
            Some(Tok::Not) => {
                self.pos += 1;
                Ok(Expr::Not(Box::new(self.not(depth + 1)?)))
            }
            Some(Tok::Open) => {
                self.pos += 1;
                let e = self.or(depth + 1)?;
                if self.peek() != Some(&Tok::Close) {
                    return err(self.at(), "expected `)` to close the `(`");
                }
                self.pos += 1;
                Ok(e)
            }
            _ => self.cmp(),
        }
    }

    fn operand(&mut self) -> Result<Operand, SyntaxError> {
        let at = self.at();
        let o = match self.toks.get(self.pos).map(|(_, t)| t.clone()) {
            Some(Tok::Field(f)) => Operand::Field(f),
            Some(Tok::Lit(l)) => Operand::Literal(l),
            Some(t) => {
                return err(
                    at,
                    format!("expected a field or a literal, found {}", describe(&t)),
                );
            }
            None => {
                return err(
                    at,
                    "the expression ends here: expected a field or a literal",
                );
            }
        };
        self.pos += 1;
        Ok(o)
    }

    fn cmp(&mut self) -> Result<Expr, SyntaxError> {
        let start = self.at();
        let left = self.operand()?;
        let op = match self.peek() {
            Some(Tok::Op(op)) => *op,
            _ => {
                return err(self.at(), "expected a comparison: ==, !=, <, <=, > or >=");
            }
        };
        self.pos += 1;
        let right = self.operand()?;
        if let (Operand::Literal(_), Operand::Literal(_)) = (&left, &right) {
            return err(start, "compares two literals: one side must be a field");
        }
        let ordering = !matches!(op, CmpOp::Eq | CmpOp::Ne);
        if ordering
            && [&left, &right]
                .iter()
                .any(|o| matches!(o, Operand::Literal(Literal::Bool(_))))
        {
            return err(start, "true and false can only be compared with == or !=");
        }
        Ok(Expr::Cmp(left, op, right))
    }
}

fn wrong(detail: String) -> Refusal {
    Refusal {
        reason: "wrong_type",
        detail,
    }
}

impl Expr {
    /// Whether an input matches; `get` reads a field (refusing a missing one). A comparison
    /// of values of different types is a refusal (`wrong_type`), never silently false.
    pub(crate) fn eval(
        &self,
        get: &mut dyn FnMut(&Field) -> Result<Value, Refusal>,
    ) -> Result<bool, Refusal> {
        match self {
            Expr::Or(parts) => {
                for p in parts {
                    if p.eval(get)? {
                        return Ok(true);
                    }
                }
                Ok(false)
            }
            Expr::And(parts) => {
                for p in parts {
                    if !p.eval(get)? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
            Expr::Not(a) => Ok(!a.eval(get)?),
            Expr::Cmp(l, op, r) => {
                let read =
                    |o: &Operand, get: &mut dyn FnMut(&Field) -> Result<Value, Refusal>| match o {
                        Operand::Field(f) => get(f),
                        Operand::Literal(Literal::Str(s)) => Ok(Value::Str(s.clone())),
                        Operand::Literal(Literal::Num(n)) => Ok(Value::Num(*n)),
                        Operand::Literal(Literal::Bool(b)) => Ok(Value::Bool(*b)),
                    };
                let (a, b) = (read(l, get)?, read(r, get)?);
                Ok(match (compare(&a, &b)?, op) {
                    (Compared::Unordered { equal }, CmpOp::Eq) => equal,
                    (Compared::Unordered { equal }, CmpOp::Ne) => !equal,
                    (Compared::Unordered { .. }, _) => {
                        return Err(wrong("true and false have no order".into()));
                    }
                    (Compared::Ordered(o), CmpOp::Eq) => o == Ordering::Equal,
                    (Compared::Ordered(o), CmpOp::Ne) => o != Ordering::Equal,
                    (Compared::Ordered(o), CmpOp::Lt) => o == Ordering::Less,
                    (Compared::Ordered(o), CmpOp::Le) => o != Ordering::Greater,
                    (Compared::Ordered(o), CmpOp::Gt) => o == Ordering::Greater,
                    (Compared::Ordered(o), CmpOp::Ge) => o != Ordering::Less,
                })
            }
        }
    }
}

/// Text taken as a number, for comparison with a number.
fn text_num(t: &str) -> Result<Num, Refusal> {
    number(t.trim()).ok_or_else(|| wrong(format!("`{t}` is not a number")))
}

/// How two values of one type compare: an order, or for booleans equality only. Text takes
/// the type of the other side.
enum Compared {
    Ordered(Ordering),
    Unordered { equal: bool },
}

fn text_bool(t: &str) -> Result<bool, Refusal> {
    match t.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        other => Err(wrong(format!("`{other}` is not true or false"))),
    }
}

fn compare(a: &Value, b: &Value) -> Result<Compared, Refusal> {
    use Value::*;
    let ordered = Compared::Ordered;
    Ok(match (a, b) {
        (Num(x), Num(y)) => ordered(x.cmp_value(*y)),
        (Str(x) | Text(x), Str(y) | Text(y)) => ordered(x.as_str().cmp(y.as_str())),
        (Text(t), Num(y)) => ordered(text_num(t)?.cmp_value(*y)),
        (Num(x), Text(t)) => ordered(x.cmp_value(text_num(t)?)),
        (Bool(x), Bool(y)) => Compared::Unordered { equal: x == y },
        (Text(t), Bool(y)) | (Bool(y), Text(t)) => Compared::Unordered {
            equal: text_bool(t)? == *y,
        },
        (x, y) => {
            return Err(wrong(format!(
                "cannot compare {} with {}",
                kind(x),
                kind(y)
            )));
        }
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Text(_) => "text",
        Value::Str(_) => "a string",
        Value::Num(_) => "a number",
        Value::Bool(_) => "a boolean",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Result<Expr, SyntaxError> {
        parse_filter(text, &Format::Json)
    }

    /// Evaluate over a map of fields given as values.
    fn eval(e: &Expr, fields: &[(&str, Value)]) -> Result<bool, &'static str> {
        e.eval(&mut |f| {
            let name = match f {
                Field::Pointer(p) => p.clone(),
                Field::Index(i) => i.to_string(),
                Field::Topic(i) => format!("topic[{i}]"),
                Field::Sparkplug(part) => part.name().into(),
                Field::Template(_) => "template".into(),
            };
            fields
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
                .ok_or(Refusal {
                    reason: "missing_field",
                    detail: name,
                })
        })
        .map_err(|r| r.reason)
    }

    #[test]
    fn precedence_is_not_then_and_then_or() {
        let e = json("/a == 1 or /b == 2 and not /c == 3").unwrap();
        let n = |i| Value::Num(Num::Int(i));
        assert_eq!(
            eval(&e, &[("/a", n(1))]),
            Ok(true),
            "or stops at a true left side"
        );
        assert_eq!(
            eval(&e, &[("/a", n(0)), ("/b", n(1))]),
            Ok(false),
            "and stops too"
        );
        assert_eq!(
            eval(&e, &[("/a", n(0)), ("/b", n(2)), ("/c", n(4))]),
            Ok(true)
        );
        let e = json("(/a == 1 or /b == 2) and not (/c == 3)").unwrap();
        assert_eq!(
            eval(&e, &[("/a", n(1)), ("/b", n(0)), ("/c", n(3))]),
            Ok(false)
        );
    }

    #[test]
    fn comparisons_by_type() {
        let e = json(r#"/status == "running" and /temp > -40 and /ok != false"#).unwrap();
        let good = [
            ("/status", Value::Str("running".into())),
            ("/temp", Value::Num(Num::Float(-39.5))),
            ("/ok", Value::Bool(true)),
        ];
        assert_eq!(eval(&e, &good), Ok(true));
        let mut cold = good.clone();
        cold[1].1 = Value::Num(Num::Int(-40));
        assert_eq!(eval(&e, &cold), Ok(false));
        // A string where a number is compared: a dead letter, not false.
        let mut odd = good.clone();
        odd[1].1 = Value::Str("-3".into());
        assert_eq!(eval(&e, &odd), Err("wrong_type"));
        assert_eq!(eval(&e, &good[..1]), Err("missing_field"));
        // Untyped text (delimited fields, topic levels) takes the other side's type.
        let d = parse_filter(
            "{2} >= 10 and topic[1] == \"m7\" and {3} == true",
            &Format::Delimited {
                separator: "/".into(),
            },
        )
        .unwrap();
        let t = |s: &str| Value::Text(s.into());
        let f = |a, b, c| [("2", t(a)), ("topic[1]", t(b)), ("3", t(c))];
        assert_eq!(eval(&d, &f("10", "m7", "true")), Ok(true));
        assert_eq!(eval(&d, &f("9.5", "m7", "true")), Ok(false));
        assert_eq!(eval(&d, &f("ten", "m7", "true")), Err("wrong_type"));
        assert_eq!(eval(&d, &f("10", "m7", "yes")), Err("wrong_type"));
        let b = json("/ok < true");
        assert!(b.is_err());
        let b = json("/a < /b").unwrap();
        let bools = [("/a", Value::Bool(true)), ("/b", Value::Bool(false))];
        assert_eq!(eval(&b, &bools), Err("wrong_type"));
    }

    #[test]
    fn syntax_errors_say_where() {
        let cases = [
            ("/a = 1", 4, "write `==`"),
            ("/a == 1 and", 12, "the expression ends here"),
            ("(/a == 1", 9, "expected `)`"),
            ("/a == \"x", 7, "unclosed string"),
            ("/a == 1 or\n  /b ~ 2", 6, "`~` is not a field"),
            ("/a == 1 or /b 2", 15, "expected a comparison"),
            ("1 == 2", 1, "one side must be a field"),
            ("/a == 1 /b", 9, "unexpected a field"),
            ("/a == running", 7, "not a field, a number"),
            ("topic[x] == 1", 1, "not a topic level"),
        ];
        for (text, col, has) in cases {
            let e = json(text).unwrap_err();
            assert_eq!(e.position(text).1, col, "{text}: {e:?}");
            assert!(e.message.contains(has), "{text}: {}", e.message);
        }
        assert_eq!(
            json("/a == 1 or\n  /b ~ 2")
                .unwrap_err()
                .position("/a == 1 or\n  /b ~ 2")
                .0,
            1
        );
        let deep = format!("{}/a == 1{}", "(".repeat(100), ")".repeat(100));
        assert!(json(&deep).unwrap_err().message.contains("nested deeper"));
        let deep = format!("{}/a == 1", "not ".repeat(100));
        assert!(json(&deep).unwrap_err().message.contains("nested deeper"));
    }

    /// Source texts of filters: comparisons of every operand form, joined by `and`, `or`,
    /// `not` and parentheses, with redundant parentheses and spacing as people write them.
    fn filter_text(delimited: bool) -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let field = if delimited {
            prop_oneof![
                (0..40usize).prop_map(|i| format!("{{{i}}}")),
                (0..9usize).prop_map(|i| format!("topic[{i}]")),
                (0..9usize).prop_map(|i| format!("{{topic[{i}]}}")),
                (0..9usize, 0..9usize).prop_map(|(a, b)| format!("topic[{a}]{{{b}}}")),
            ]
            .boxed()
        } else {
            prop_oneof![
                "/[a-z~0-9]{0,4}".prop_filter("a valid pointer", |p| {
                    Field::parse(p, &Format::Json).is_ok()
                }),
                "[a-z \"()=<]{0,4}".prop_map(|s| format!("{{/{s}}}")),
                (0..9usize).prop_map(|i| format!("topic[{i}]")),
                "[a-z]{1,3}".prop_map(|s| format!("/{s}{{/{s}}}-x")),
            ]
            .boxed()
        };
        let literal = prop_oneof![
            any::<i64>().prop_map(|i| i.to_string()),
            (-9.0e15f64..9.0e15).prop_map(|f| format!("{f}")),
            (-1.0f64..1.0).prop_map(|f| format!("{f:e}")),
            "[a-zé\"\\\\ ()]{0,5}"
                .prop_map(|s| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))),
        ];
        let op = prop_oneof![
            Just("=="),
            Just("!="),
            Just("<"),
            Just("<="),
            Just(">"),
            Just(">=")
        ];
        let cmp = prop_oneof![
            (field.clone(), op.clone(), literal.clone())
                .prop_map(|(f, o, l)| format!("{f} {o} {l}")),
            (literal, op, field.clone()).prop_map(|(l, o, f)| format!("{l}{o}{f}")),
            (
                field.clone(),
                prop_oneof![Just("=="), Just("!=")],
                any::<bool>()
            )
                .prop_map(|(f, o, b)| format!("{f} {o} {b}")),
            (field.clone(), field).prop_map(|(a, b)| format!("{a} < {b}")),
        ];
        cmp.prop_recursive(6, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 2..6).prop_map(|v| v.join(" and ")),
                proptest::collection::vec(inner.clone(), 2..6).prop_map(|v| v.join(" or ")),
                inner.clone().prop_map(|e| format!("({e})")),
                inner.clone().prop_map(|e| format!("not ({e})")),
                inner.clone().prop_map(|e| format!("not {e}")),
                (inner.clone(), inner).prop_map(|(a, b)| format!("({a})and({b})")),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// What `pipelines.json` keeps of a filter (its canonical text) reads back as the
        /// tree the config gave, for both formats, and prints the same text again.
        #[test]
        fn canonical_text_reads_back_as_the_same_tree(
            text in filter_text(false),
            delimited in filter_text(true),
        ) {
            let sep = Format::Delimited { separator: ";".into() };
            for (text, format) in [(text, Format::Json), (delimited, sep)] {
                let e = match parse_filter(&text, &format) {
                    Ok(e) => e,
                    // Beyond the length or depth bound: not a filter to keep.
                    Err(err) if err.message.contains("longer") || err.message.contains("nested") => continue,
                    Err(err) => panic!("{text}: {err:?}"),
                };
                let canonical = e.to_string();
                let back = parse_stored(&canonical);
                proptest::prop_assert_eq!(back.as_ref(), Ok(&e), "{} -> {}", text, canonical);
                proptest::prop_assert_eq!(back.unwrap().to_string(), canonical);
            }
        }
    }

    /// `and`/`or` chains are one flat node however they are grouped, so a long filter is a
    /// shallow tree, and equal filters are equal trees.
    #[test]
    fn chains_make_one_flat_node_whatever_the_grouping() {
        let flat = json("/a == 1 and /b == 2 and /c == 3").unwrap();
        assert!(matches!(&flat, Expr::And(p) if p.len() == 3), "{flat:?}");
        assert_eq!(json("(/a == 1 and /b == 2) and /c == 3").unwrap(), flat);
        assert_eq!(json("/a == 1 and (/b == 2 and (/c == 3))").unwrap(), flat);
        let mixed = json("/a == 1 or /b == 2 and /c == 3").unwrap();
        assert_eq!(mixed.to_string(), "{/a} == 1 or {/b} == 2 and {/c} == 3");
        let grouped = json("(/a == 1 or /b == 2) and not (/c == 3 or /d == 4)").unwrap();
        assert_eq!(
            grouped.to_string(),
            "({/a} == 1 or {/b} == 2) and not ({/c} == 3 or {/d} == 4)"
        );
        assert_eq!(parse_stored(&grouped.to_string()).unwrap(), grouped);
    }

    /// Hundreds of terms and the deepest nesting the config accepts read back from their
    /// canonical text, and neither parsing nor evaluating them recurses per term.
    #[test]
    fn long_and_deep_filters_read_back() {
        let terms: Vec<String> = (0..300).map(|i| format!("/d!={i}")).collect();
        let long = terms.join(" or ");
        assert!(long.len() <= MAX_LEN, "{}", long.len());
        let e = json(&long).unwrap();
        assert!(matches!(&e, Expr::Or(p) if p.len() == 300));
        assert_eq!(parse_stored(&e.to_string()).unwrap(), e);
        let n = |i| Value::Num(Num::Int(i));
        assert_eq!(eval(&e, &[("/d", n(7))]), Ok(true));

        // MAX_DEPTH - 1 levels of parentheses, alternating `and` and `or` so none flattens.
        let mut deep = "/x == 0".to_string();
        for level in 1..MAX_DEPTH {
            let word = if level % 2 == 0 { "and" } else { "or" };
            deep = format!("/x == {level} {word} ({deep})");
        }
        let e = json(&deep).unwrap();
        let back = parse_stored(&e.to_string()).unwrap();
        assert_eq!(back, e);
        let top = MAX_DEPTH as i64 - 1; // the outermost level is an `or`
        assert_eq!(eval(&e, &[("/x", n(top))]), Ok(true));
        assert_eq!(eval(&e, &[("/x", n(top - 1))]), Ok(false));
        // One level more is refused with a clear error, in config text and stored text alike.
        let deeper = format!("/x == 99 or ({deep})");
        assert!(json(&deeper).unwrap_err().message.contains("nested deeper"));
        let mut stored = deep.replace("/x", "{/x}");
        stored = format!("{{/x}} == 99 or ({stored})");
        assert!(
            parse_stored(&stored)
                .unwrap_err()
                .message
                .contains("nested deeper")
        );
    }

    /// The longest filters the config accepts, of the shapes whose canonical text grows the
    /// most, still read back from it.
    #[test]
    fn the_canonical_text_of_the_longest_filters_fits() {
        for unit in ["/<1", "/<9e15", "/==true", "not /<1", "(/<1)", "topic[1]<1"] {
            let n = (MAX_LEN + 4) / (unit.len() + 4);
            let text = vec![unit; n].join(" or ");
            assert!(text.len() <= MAX_LEN);
            let e = json(&text).unwrap();
            let canonical = e.to_string();
            assert!(
                canonical.len() <= STORED_MAX_LEN,
                "{unit}: {} bytes",
                canonical.len()
            );
            assert_eq!(parse_stored(&canonical).unwrap(), e);
        }
        assert!(
            json(&"/<1 or ".repeat(600))
                .unwrap_err()
                .message
                .contains("longer")
        );
    }
}
