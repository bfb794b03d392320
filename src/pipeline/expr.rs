//! The syntax tree of a `where` filter. A leaf: the definition holds it, the filter module
//! parses and evaluates it, and it reads only fields and numbers.

use serde::{Deserialize, Serialize};

use super::field::Field;
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Expr {
    Or(Box<Expr>, Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Not(Box<Expr>),
    Cmp(Operand, CmpOp, Operand),
}

// `Num` holds floats, so the derive cannot promise `Eq`; literals are never NaN (the parser
// accepts finite numbers only), so equality is an equivalence here.
impl Eq for Literal {}
impl Eq for Operand {}
impl Eq for Expr {}
