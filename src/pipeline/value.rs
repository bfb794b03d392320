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

use super::num::Num;
use super::sketch::Sketch;
use super::spec::{Aggregate, AggregateSpec};

/// The aggregate's running value. `Avg` keeps the exact sum; the average is computed on output.
/// Stored with postcard, which names a variant by its position: new variants go at the end,
/// so state written by an older build still reads as it did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    Variance(Moments),
    Stddev(Moments),
    Percentile {
        permille: u16,
        sketch: Sketch,
    },
    /// A list of aggregates in one result: each running value kept once, however many of the
    /// listed aggregates read it (`avg` and `sum` share the sum, all `pNN` one sketch).
    Multi(Box<Multi>),
}

/// Mean and sum of squared deviations, updated with Welford's method: numerically stable,
/// and the same sequence of IEEE operations on every replay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Moments {
    pub mean: f64,
    pub m2: f64,
}

impl Moments {
    fn of(x: Num) -> Moments {
        Moments {
            mean: x.as_f64(),
            m2: 0.0,
        }
    }

    /// With one more value, `n` counting it. `None` if the result is not finite.
    fn push(self, x: Num, n: u64) -> Option<Moments> {
        let x = x.as_f64();
        let delta = x - self.mean;
        let mean = self.mean + delta / n as f64;
        let m2 = self.m2 + delta * (x - mean);
        (mean.is_finite() && m2.is_finite()).then_some(Moments { mean, m2 })
    }

    /// Population variance over `n` values; never negative.
    fn variance(self, n: u64) -> f64 {
        (self.m2 / n as f64).max(0.0)
    }
}

/// The running values of a list of aggregates; `None` for those the list does not need.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Multi {
    /// The aggregates as listed: they name the output's `values`.
    pub aggregates: Vec<Aggregate>,
    pub sum: Option<Num>,
    pub min: Option<Num>,
    pub max: Option<Num>,
    pub last: Option<(Num, u64)>,
    pub moments: Option<Moments>,
    pub sketch: Option<Sketch>,
}

/// The stored state of one key (or one key's window).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyState {
    /// Rises by exactly one with every applied event.
    pub version: u64,
    /// Events applied.
    pub count: u64,
    pub agg: Agg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow;

fn min_of(a: Num, b: Num) -> Num {
    if b.cmp_value(a) == Ordering::Less {
        b
    } else {
        a
    }
}

fn max_of(a: Num, b: Num) -> Num {
    if b.cmp_value(a) == Ordering::Greater {
        b
    } else {
        a
    }
}

/// `Last`: the greater event time wins; on a tie the newer event.
fn last_of(old: (Num, u64), value: Num, time_ms: u64) -> (Num, u64) {
    if time_ms >= old.1 {
        (value, time_ms)
    } else {
        old
    }
}

fn float(f: f64) -> serde_json::Value {
    Num::Float(f).to_json()
}

impl KeyState {
    /// The state after the first event of a key.
    pub fn first(spec: &AggregateSpec, value: Num, time_ms: u64) -> KeyState {
        let agg = match spec {
            AggregateSpec::One(a) => match *a {
                Aggregate::Sum => Agg::Sum(value),
                Aggregate::Count => Agg::Count,
                Aggregate::Min => Agg::Min(value),
                Aggregate::Max => Agg::Max(value),
                Aggregate::Avg => Agg::Avg(value),
                Aggregate::Last => Agg::Last { value, time_ms },
                Aggregate::Variance => Agg::Variance(Moments::of(value)),
                Aggregate::Stddev => Agg::Stddev(Moments::of(value)),
                Aggregate::Percentile(permille) => Agg::Percentile {
                    permille,
                    sketch: Sketch::of(value.as_f64()),
                },
            },
            AggregateSpec::List(list) => {
                let has = |f: fn(&Aggregate) -> bool| list.iter().any(f);
                let if_has = |f: fn(&Aggregate) -> bool, v: Num| has(f).then_some(v);
                Agg::Multi(Box::new(Multi {
                    aggregates: list.clone(),
                    sum: if_has(|a| matches!(a, Aggregate::Sum | Aggregate::Avg), value),
                    min: if_has(|a| *a == Aggregate::Min, value),
                    max: if_has(|a| *a == Aggregate::Max, value),
                    last: has(|a| *a == Aggregate::Last).then_some((value, time_ms)),
                    moments: has(|a| matches!(a, Aggregate::Stddev | Aggregate::Variance))
                        .then(|| Moments::of(value)),
                    sketch: has(|a| matches!(a, Aggregate::Percentile(_)))
                        .then(|| Sketch::of(value.as_f64())),
                }))
            }
        };
        KeyState {
            version: 1,
            count: 1,
            agg,
        }
    }

    /// The state after one more event. Pure; refuses overflow of the sum, the count, the
    /// version, the moments or a sketch bucket rather than wrapping or panicking.
    pub fn apply(&self, value: Num, time_ms: u64) -> Result<KeyState, Overflow> {
        let count = self.count.checked_add(1).ok_or(Overflow)?;
        let add = |s: Num| s.checked_add(value).ok_or(Overflow);
        let agg = match &self.agg {
            Agg::Sum(s) => Agg::Sum(add(*s)?),
            Agg::Avg(s) => Agg::Avg(add(*s)?),
            Agg::Count => Agg::Count,
            Agg::Min(m) => Agg::Min(min_of(*m, value)),
            Agg::Max(m) => Agg::Max(max_of(*m, value)),
            Agg::Last {
                value: v,
                time_ms: t,
            } => {
                let (value, time_ms) = last_of((*v, *t), value, time_ms);
                Agg::Last { value, time_ms }
            }
            Agg::Variance(m) => Agg::Variance(m.push(value, count).ok_or(Overflow)?),
            Agg::Stddev(m) => Agg::Stddev(m.push(value, count).ok_or(Overflow)?),
            Agg::Percentile { permille, sketch } => Agg::Percentile {
                permille: *permille,
                sketch: sketch.insert(value.as_f64()).ok_or(Overflow)?,
            },
            Agg::Multi(m) => Agg::Multi(Box::new(Multi {
                aggregates: m.aggregates.clone(),
                sum: m.sum.map(add).transpose()?,
                min: m.min.map(|x| min_of(x, value)),
                max: m.max.map(|x| max_of(x, value)),
                last: m.last.map(|l| last_of(l, value, time_ms)),
                moments: match m.moments {
                    Some(mo) => Some(mo.push(value, count).ok_or(Overflow)?),
                    None => None,
                },
                sketch: match &m.sketch {
                    Some(s) => Some(s.insert(value.as_f64()).ok_or(Overflow)?),
                    None => None,
                },
            })),
        };
        Ok(KeyState {
            version: self.version.checked_add(1).ok_or(Overflow)?,
            count,
            agg,
        })
    }

    /// The value a consumer sees: one number, or for a list an object with one entry per
    /// listed aggregate (`{"min": .., "p95": ..}`).
    pub fn value_json(&self) -> serde_json::Value {
        let n = self.count;
        match &self.agg {
            Agg::Sum(v) | Agg::Min(v) | Agg::Max(v) | Agg::Last { value: v, .. } => v.to_json(),
            Agg::Count => serde_json::Value::from(n),
            Agg::Avg(s) => float(s.as_f64() / n as f64),
            Agg::Variance(m) => float(m.variance(n)),
            Agg::Stddev(m) => float(m.variance(n).sqrt()),
            Agg::Percentile { permille, sketch } => quantile_json(sketch, *permille),
            Agg::Multi(m) => {
                let mut out = serde_json::Map::new();
                for a in &m.aggregates {
                    let v = match *a {
                        Aggregate::Count => serde_json::Value::from(n),
                        Aggregate::Sum => opt_json(m.sum),
                        Aggregate::Avg => m
                            .sum
                            .map_or(serde_json::Value::Null, |s| float(s.as_f64() / n as f64)),
                        Aggregate::Min => opt_json(m.min),
                        Aggregate::Max => opt_json(m.max),
                        Aggregate::Last => opt_json(m.last.map(|l| l.0)),
                        Aggregate::Variance => m
                            .moments
                            .map_or(serde_json::Value::Null, |mo| float(mo.variance(n))),
                        Aggregate::Stddev => m
                            .moments
                            .map_or(serde_json::Value::Null, |mo| float(mo.variance(n).sqrt())),
                        Aggregate::Percentile(q) => m
                            .sketch
                            .as_ref()
                            .map_or(serde_json::Value::Null, |s| quantile_json(s, q)),
                    };
                    out.insert(a.name(), v);
                }
                serde_json::Value::Object(out)
            }
        }
    }

    /// At least the bytes this state takes in the store (postcard), without encoding it:
    /// every varint at its longest (a count 10 bytes, a sketch bucket 15), every optional
    /// part of a list counted. Close enough that only a state near the entry bound needs
    /// its exact size (`engine::check_state_size`).
    pub(crate) fn stored_bound(&self) -> usize {
        let sketch = |s: &Sketch| 3 + s.buckets() * 15;
        // version and count, the variant
        21 + match &self.agg {
            Agg::Percentile { sketch: s, .. } => 3 + sketch(s),
            Agg::Multi(m) => {
                // the list (a variant and a u16 each), three numbers, `last`, the moments
                4 + m.aggregates.len() * 4
                    + 3 * 12
                    + 22
                    + 17
                    + 1
                    + m.sketch.as_ref().map_or(0, sketch)
            }
            // a number and a time, or two floats, at most
            _ => 24,
        }
    }

    /// Whether the output carries `values` (a list of aggregates) instead of `value`.
    pub(crate) fn is_multi(&self) -> bool {
        matches!(self.agg, Agg::Multi(_))
    }
}

fn opt_json(v: Option<Num>) -> serde_json::Value {
    v.map_or(serde_json::Value::Null, Num::to_json)
}

fn quantile_json(s: &Sketch, permille: u16) -> serde_json::Value {
    s.quantile(permille).map_or(serde_json::Value::Null, float)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::num::MAX_EXACT_FLOAT;

    #[test]
    fn integer_sum_is_exact_and_refuses_overflow() {
        let s = KeyState::first(
            &AggregateSpec::One(Aggregate::Sum),
            Num::Int(i64::MAX - 1),
            0,
        );
        let s = s.apply(Num::Int(1), 0).unwrap();
        assert_eq!(s.agg, Agg::Sum(Num::Int(i64::MAX)));
        assert_eq!(s.apply(Num::Int(1), 0), Err(Overflow));
        assert_eq!(s.version, 2);
    }

    #[test]
    fn each_aggregate_folds() {
        let vals = [Num::Int(5), Num::Int(-3), Num::Int(9)];
        let fold = |a| {
            let mut s = KeyState::first(&AggregateSpec::One(a), vals[0], 10);
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
        let s = KeyState::first(&AggregateSpec::One(Aggregate::Last), Num::Int(1), 100);
        let s = s.apply(Num::Int(2), 50).unwrap();
        assert_eq!(s.value_json(), serde_json::json!(1));
        let s = s.apply(Num::Int(3), 100).unwrap();
        assert_eq!(s.value_json(), serde_json::json!(3));
    }

    #[test]
    fn a_float_sum_outside_the_exact_range_is_refused_not_rounded() {
        let big = Num::Float(MAX_EXACT_FLOAT - 1.0);
        let s = KeyState::first(&AggregateSpec::One(Aggregate::Sum), big, 0);
        assert_eq!(s.apply(Num::Float(1.0), 0), Err(Overflow));
        assert_eq!(
            s.apply(Num::Int(-1), 0).unwrap().value_json(),
            9_007_199_254_740_990.0
        );
        // An integer too large to be exact as a float cannot enter a floating-point sum.
        let s = KeyState::first(&AggregateSpec::One(Aggregate::Avg), Num::Int(i64::MAX), 0);
        assert_eq!(s.apply(Num::Float(0.5), 0), Err(Overflow));
        assert_eq!(s.apply(Num::Int(-1), 0).unwrap().count, 2);
    }

    #[test]
    fn the_version_and_count_refuse_to_wrap() {
        let mut s = KeyState::first(&AggregateSpec::One(Aggregate::Max), Num::Int(1), 0);
        s.version = u64::MAX;
        assert_eq!(s.apply(Num::Int(2), 0), Err(Overflow));
        s.version = 1;
        s.count = u64::MAX;
        assert_eq!(s.apply(Num::Int(2), 0), Err(Overflow));
    }

    #[test]
    fn a_float_turns_the_sum_into_floating_point() {
        let s = KeyState::first(&AggregateSpec::One(Aggregate::Sum), Num::Int(1), 0);
        let s = s.apply(Num::Float(0.5), 0).unwrap();
        assert_eq!(s.value_json(), serde_json::json!(1.5));
    }

    #[test]
    fn single_aggregate_state_encodes_as_before_lists_existed() {
        // Bytes a store written before issue 15 holds: version 1, count 1, Sum(Int(5)).
        let s = KeyState::first(&AggregateSpec::One(Aggregate::Sum), Num::Int(5), 0);
        assert_eq!(postcard::to_stdvec(&s).unwrap(), [1, 1, 0, 0, 10]);
        let last = KeyState::first(&AggregateSpec::One(Aggregate::Last), Num::Int(-1), 3);
        assert_eq!(postcard::to_stdvec(&last).unwrap(), [1, 1, 5, 0, 1, 3]);
        let back: KeyState = postcard::from_bytes(&[1, 1, 0, 0, 10]).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_full_list_state_stays_a_few_kib_in_the_store() {
        let all = AggregateSpec::List(vec![
            Aggregate::Min,
            Aggregate::Max,
            Aggregate::Avg,
            Aggregate::Stddev,
            Aggregate::Last,
            Aggregate::Percentile(500),
            Aggregate::Percentile(999),
        ]);
        let mut s = KeyState::first(&all, Num::Float(1e-12), 0);
        let mut x = 1e-12;
        while x < 1e15 {
            s = s.apply(Num::Float(x), 0).unwrap();
            s = s.apply(Num::Float(-x), 0).unwrap();
            x *= 1.01;
        }
        let bytes = postcard::to_stdvec(&s).unwrap().len();
        assert!(bytes < 4 * 1024, "{bytes} bytes");
        let back: KeyState = postcard::from_bytes(&postcard::to_stdvec(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn moments_refuse_what_is_not_finite() {
        let spec = AggregateSpec::One(Aggregate::Variance);
        let s = KeyState::first(&spec, Num::Float(-MAX_EXACT_FLOAT + 1.0), 0);
        let mut s = s.apply(Num::Float(MAX_EXACT_FLOAT - 1.0), 0).unwrap();
        // 2^53 apart: the variance is about 2^104, still finite; a poisoned mean is refused.
        assert!(s.value_json().as_f64().unwrap() > 1e31);
        s.agg = Agg::Variance(Moments {
            mean: f64::MAX,
            m2: f64::MAX,
        });
        assert_eq!(s.apply(Num::Float(-1.0), 0), Err(Overflow));
    }
}
