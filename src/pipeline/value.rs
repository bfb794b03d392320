//! Numbers and per-key aggregate state.
//!
//! Integers are exact: they are kept as `i64` and a sum that would overflow is refused (the
//! event becomes a dead letter with reason `overflow`), never wrapped. A non-integer value
//! (a JSON number with a fraction or exponent, or a delimited field such as `1.5`) is an
//! `f64`; once a key's sum or average has seen one, that key's aggregate is floating point
//! from then on. Floats must be finite and below 2^53 in magnitude, so an integer never
//! silently loses precision by passing through a float.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use super::spec::Aggregate;

/// Largest magnitude a float may have: beyond it, consecutive integers are not representable.
pub const MAX_EXACT_FLOAT: f64 = 9_007_199_254_740_992.0;

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
    pub fn checked_add(self, other: Num) -> Option<Num> {
        match (self, other) {
            (Num::Int(a), Num::Int(b)) => a.checked_add(b).map(Num::Int),
            (a, b) => Num::Float(a.exact_f64()? + b.exact_f64()?)
                .exact_f64()
                .map(Num::Float),
        }
    }

    pub fn cmp_value(self, other: Num) -> Ordering {
        match (self, other) {
            (Num::Int(a), Num::Int(b)) => a.cmp(&b),
            (a, b) => a.as_f64().total_cmp(&b.as_f64()),
        }
    }

    pub fn to_json(self) -> serde_json::Value {
        match self {
            Num::Int(i) => serde_json::Value::from(i),
            Num::Float(f) => serde_json::Number::from_f64(f)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null),
        }
    }
}

/// The aggregate's running value. `Avg` keeps the exact sum; the average is computed on output.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Agg {
    Sum(Num),
    Count,
    Min(Num),
    Max(Num),
    Avg(Num),
    /// The value of the event with the greatest event time; on a tie, the later in the log.
    Last {
        value: Num,
        time_ms: u64,
    },
}

/// The stored state of one key (or one key's window).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KeyState {
    /// Rises by exactly one with every applied event.
    pub version: u64,
    /// Events applied.
    pub count: u64,
    pub agg: Agg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow;

impl KeyState {
    /// The state after the first event of a key.
    pub fn first(aggregate: Aggregate, value: Num, time_ms: u64) -> KeyState {
        let agg = match aggregate {
            Aggregate::Sum => Agg::Sum(value),
            Aggregate::Count => Agg::Count,
            Aggregate::Min => Agg::Min(value),
            Aggregate::Max => Agg::Max(value),
            Aggregate::Avg => Agg::Avg(value),
            Aggregate::Last => Agg::Last { value, time_ms },
        };
        KeyState {
            version: 1,
            count: 1,
            agg,
        }
    }

    /// The state after one more event. Pure; refuses overflow of the sum, the count or the
    /// version rather than wrapping or panicking.
    pub fn apply(&self, value: Num, time_ms: u64) -> Result<KeyState, Overflow> {
        let agg = match self.agg {
            Agg::Sum(s) => Agg::Sum(s.checked_add(value).ok_or(Overflow)?),
            Agg::Avg(s) => Agg::Avg(s.checked_add(value).ok_or(Overflow)?),
            Agg::Count => Agg::Count,
            Agg::Min(m) => Agg::Min(if value.cmp_value(m) == Ordering::Less {
                value
            } else {
                m
            }),
            Agg::Max(m) => Agg::Max(if value.cmp_value(m) == Ordering::Greater {
                value
            } else {
                m
            }),
            Agg::Last {
                value: v,
                time_ms: t,
            } => {
                if time_ms >= t {
                    Agg::Last { value, time_ms }
                } else {
                    Agg::Last {
                        value: v,
                        time_ms: t,
                    }
                }
            }
        };
        Ok(KeyState {
            version: self.version.checked_add(1).ok_or(Overflow)?,
            count: self.count.checked_add(1).ok_or(Overflow)?,
            agg,
        })
    }

    /// The value a consumer sees.
    pub fn value_json(&self) -> serde_json::Value {
        match self.agg {
            Agg::Sum(n) | Agg::Min(n) | Agg::Max(n) | Agg::Last { value: n, .. } => n.to_json(),
            Agg::Count => serde_json::Value::from(self.count),
            Agg::Avg(s) => Num::Float(s.as_f64() / self.count as f64).to_json(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_sum_is_exact_and_refuses_overflow() {
        let s = KeyState::first(Aggregate::Sum, Num::Int(i64::MAX - 1), 0);
        let s = s.apply(Num::Int(1), 0).unwrap();
        assert_eq!(s.agg, Agg::Sum(Num::Int(i64::MAX)));
        assert_eq!(s.apply(Num::Int(1), 0), Err(Overflow));
        assert_eq!(s.version, 2);
    }

    #[test]
    fn each_aggregate_folds() {
        let vals = [Num::Int(5), Num::Int(-3), Num::Int(9)];
        let fold = |a| {
            let mut s = KeyState::first(a, vals[0], 10);
            for (i, v) in vals[1..].iter().enumerate() {
                s = s.apply(*v, 10 + i as u64).unwrap();
            }
            s
        };
        assert_eq!(fold(Aggregate::Sum).value_json(), serde_json::json!(11));
        assert_eq!(fold(Aggregate::Count).value_json(), serde_json::json!(3));
        assert_eq!(fold(Aggregate::Min).value_json(), serde_json::json!(-3));
        assert_eq!(fold(Aggregate::Max).value_json(), serde_json::json!(9));
        assert_eq!(fold(Aggregate::Last).value_json(), serde_json::json!(9));
        let avg = fold(Aggregate::Avg).value_json().as_f64().unwrap();
        assert!((avg - 11.0 / 3.0).abs() < 1e-12);
        assert_eq!(fold(Aggregate::Sum).version, 3);
    }

    #[test]
    fn last_keeps_the_latest_event_time_not_the_latest_arrival() {
        let s = KeyState::first(Aggregate::Last, Num::Int(1), 100);
        let s = s.apply(Num::Int(2), 50).unwrap();
        assert_eq!(s.value_json(), serde_json::json!(1));
        let s = s.apply(Num::Int(3), 100).unwrap();
        assert_eq!(s.value_json(), serde_json::json!(3));
    }

    #[test]
    fn a_float_sum_outside_the_exact_range_is_refused_not_rounded() {
        let big = Num::Float(MAX_EXACT_FLOAT - 1.0);
        let s = KeyState::first(Aggregate::Sum, big, 0);
        assert_eq!(s.apply(Num::Float(1.0), 0), Err(Overflow));
        assert_eq!(
            s.apply(Num::Int(-1), 0).unwrap().value_json(),
            9_007_199_254_740_990.0
        );
        // An integer too large to be exact as a float cannot enter a floating-point sum.
        let s = KeyState::first(Aggregate::Avg, Num::Int(i64::MAX), 0);
        assert_eq!(s.apply(Num::Float(0.5), 0), Err(Overflow));
        assert_eq!(s.apply(Num::Int(-1), 0).unwrap().count, 2);
    }

    #[test]
    fn the_version_and_count_refuse_to_wrap() {
        let mut s = KeyState::first(Aggregate::Max, Num::Int(1), 0);
        s.version = u64::MAX;
        assert_eq!(s.apply(Num::Int(2), 0), Err(Overflow));
        s.version = 1;
        s.count = u64::MAX;
        assert_eq!(s.apply(Num::Int(2), 0), Err(Overflow));
    }

    #[test]
    fn a_float_turns_the_sum_into_floating_point() {
        let s = KeyState::first(Aggregate::Sum, Num::Int(1), 0);
        let s = s.apply(Num::Float(0.5), 0).unwrap();
        assert_eq!(s.value_json(), serde_json::json!(1.5));
    }
}
