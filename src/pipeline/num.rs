//! Numbers as the pipeline reads, compares and adds them: exact 64-bit integers, and floats
//! that stay finite and below 2^53 in magnitude (so an integer never silently loses precision
//! by passing through a float). A leaf: payload parsing, `where` filters and aggregates all
//! read it, and it reads none of them.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

/// Largest magnitude a float may have: beyond it, consecutive integers are not representable.
pub(crate) const MAX_EXACT_FLOAT: f64 = 9_007_199_254_740_992.0;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Num {
    Int(i64),
    Float(f64),
}

impl Num {
    pub fn as_f64(self) -> f64 {
        match self {
            Num::Int(i) => i as f64,
            Num::Float(f) => f,
        }
    }

    /// The value as a float that means exactly the same number, if there is one: an
    /// integer beyond 2^53 has none, and neither has a float outside the accepted range.
    fn exact_f64(self) -> Option<f64> {
        let f = self.as_f64();
        (f.is_finite() && f.abs() < MAX_EXACT_FLOAT).then_some(f)
    }

    /// `None` when the sum cannot be held: integer overflow, or a floating-point sum (or an
    /// integer entering one) outside the exact range, where precision would be lost silently.
    pub(crate) fn checked_add(self, other: Num) -> Option<Num> {
        match (self, other) {
            (Num::Int(a), Num::Int(b)) => a.checked_add(b).map(Num::Int),
            (a, b) => Num::Float(a.exact_f64()? + b.exact_f64()?)
                .exact_f64()
                .map(Num::Float),
        }
    }

    pub(crate) fn cmp_value(self, other: Num) -> Ordering {
        match (self, other) {
            (Num::Int(a), Num::Int(b)) => a.cmp(&b),
            (a, b) => a.as_f64().total_cmp(&b.as_f64()),
        }
    }

    pub(crate) fn to_json(self) -> serde_json::Value {
        match self {
            Num::Int(i) => serde_json::Value::from(i),
            Num::Float(f) => serde_json::Number::from_f64(f)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null),
        }
    }
}
