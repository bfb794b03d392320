//! The syntax tree of a `where` filter, and its canonical text. A leaf: the definition holds
//! it, the filter module parses and evaluates it, and it reads only fields and numbers.
//!
//! `and` and `or` hold their operands in a list, never a chain: `a and b and c` is one node of
//! three, so a filter of hundreds of terms is a shallow tree. Only parentheses and `not` nest,
//! and the parser bounds those (`filter::MAX_DEPTH`), so nothing that walks a tree (evaluation,
//! comparison, printing, dropping) recurses deeper than that bound.
//!
//! A tree is kept in `pipelines.json` as its canonical text (`Display`), which the filter
//! parser reads back into the same tree: text has no nesting for a JSON reader to refuse,
//! where the nested form stopped reading back at about 62 chained comparisons (issue 26).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::field::{Field, TemplatePart};
use super::num::Num;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Literal {
    Str(String),
    Num(Num),
    Bool(bool),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Operand {
    Field(Field),
    Literal(Literal),
}

/// A filter. Built through [`Expr::any`] and [`Expr::all`], an `Or` holds at least two
/// operands and none of them is an `Or` (likewise `And`), so one filter has one tree however
/// its text groups a chain: `a and b and c`, `(a and b) and c` and `a and (b and c)` are all
/// `And[a, b, c]`, and evaluate alike (left to right, stopping at the first answer).
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    Or(Vec<Expr>),
    And(Vec<Expr>),
    Not(Box<Expr>),
    Cmp(Operand, CmpOp, Operand),
}

// `Num` holds floats, so the derive cannot promise `Eq`; literals are never NaN (the parser
// accepts finite numbers only), so equality is an equivalence here.
impl Eq for Literal {}
impl Eq for Operand {}
impl Eq for Expr {}

impl Expr {
    /// `a or b or ...`: the operands of a nested `Or` are taken in, one operand is itself.
    pub(crate) fn any(parts: Vec<Expr>) -> Expr {
        Expr::join(parts, true)
    }

    /// `a and b and ...`, likewise.
    pub(crate) fn all(parts: Vec<Expr>) -> Expr {
        Expr::join(parts, false)
    }

    fn join(parts: Vec<Expr>, or: bool) -> Expr {
        let mut flat = Vec::with_capacity(parts.len());
        for p in parts {
            match (p, or) {
                (Expr::Or(inner), true) | (Expr::And(inner), false) => flat.extend(inner),
                (p, _) => flat.push(p),
            }
        }
        match flat.len() {
            1 => flat.pop().expect("one"),
            _ if or => Expr::Or(flat),
            _ => Expr::And(flat),
        }
    }
}

impl CmpOp {
    pub(crate) fn text(self) -> &'static str {
        match self {
            CmpOp::Eq => "==",
            CmpOp::Ne => "!=",
            CmpOp::Lt => "<",
            CmpOp::Le => "<=",
            CmpOp::Gt => ">",
            CmpOp::Ge => ">=",
        }
    }
}

/// A field as the filter parser reads it back: a pointer or a position in braces (`{/a b}`,
/// `{2}`), a topic level bare (`topic[1]`), a template as the bare word it came from
/// (`/a{/b}`: only a bare word starting with `/` or `topic[` makes one in a filter).
fn write_field(f: &mut fmt::Formatter<'_>, field: &Field) -> fmt::Result {
    match field {
        Field::Pointer(p) => write!(f, "{{{p}}}"),
        Field::Index(i) => write!(f, "{{{i}}}"),
        Field::Topic(i) => write!(f, "topic[{i}]"),
        Field::Sparkplug(part) => write!(f, "{{{}}}", part.name()),
        Field::Template(parts) => {
            for part in parts {
                match part {
                    TemplatePart::Literal(l) => f.write_str(l)?,
                    TemplatePart::Field(Field::Pointer(p)) => write!(f, "{{{p}}}")?,
                    TemplatePart::Field(Field::Index(i)) => write!(f, "{{{i}}}")?,
                    TemplatePart::Field(Field::Topic(i)) => write!(f, "{{topic[{i}]}}")?,
                    TemplatePart::Field(Field::Sparkplug(part)) => {
                        write!(f, "{{{}}}", part.name())?
                    }
                    // Field::parse never nests templates.
                    TemplatePart::Field(inner @ Field::Template(_)) => write_field(f, inner)?,
                }
            }
            Ok(())
        }
    }
}

impl fmt::Display for Literal {
    /// A string in double quotes with `"` and `\` escaped (the only escapes the parser
    /// knows); an integer as digits; a float in the shorter of Rust's two round-trip forms
    /// (`0.5`, `1e15`), each of which has a `.` or an exponent, so it reads back as a float.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Literal::Str(s) => {
                f.write_str("\"")?;
                for c in s.chars() {
                    if matches!(c, '"' | '\\') {
                        f.write_str("\\")?;
                    }
                    write!(f, "{c}")?;
                }
                f.write_str("\"")
            }
            Literal::Num(Num::Int(i)) => write!(f, "{i}"),
            Literal::Num(Num::Float(x)) => {
                let (plain, exp) = (format!("{x:?}"), format!("{x:e}"));
                f.write_str(if exp.len() < plain.len() {
                    &exp
                } else {
                    &plain
                })
            }
            Literal::Bool(b) => write!(f, "{b}"),
        }
    }
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operand::Field(field) => write_field(f, field),
            Operand::Literal(l) => l.fmt(f),
        }
    }
}

impl fmt::Display for Expr {
    /// The canonical text: operands of `and` and `or` joined by the word, parentheses only
    /// where precedence needs them (an `or` inside an `and` or a `not`, an `and` inside a
    /// `not`). The filter parser reads it back into an equal tree
    /// (`filter::tests::canonical_text_reads_back_as_the_same_tree`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let grouped = |f: &mut fmt::Formatter<'_>, e: &Expr, parens: bool| {
            if parens {
                write!(f, "({e})")
            } else {
                write!(f, "{e}")
            }
        };
        match self {
            Expr::Or(parts) | Expr::And(parts) => {
                let or = matches!(self, Expr::Or(_));
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(if or { " or " } else { " and " })?;
                    }
                    // A nested node of the same kind never occurs once built by `any`/`all`;
                    // grouped anyway, a hand-built one still reads back as what it means.
                    let parens = matches!(p, Expr::Or(_)) || (!or && matches!(p, Expr::And(_)));
                    grouped(f, p, parens)?;
                }
                Ok(())
            }
            Expr::Not(e) => {
                f.write_str("not ")?;
                grouped(f, e, matches!(**e, Expr::Or(_) | Expr::And(_)))
            }
            Expr::Cmp(l, op, r) => write!(f, "{l} {} {r}", op.text()),
        }
    }
}
