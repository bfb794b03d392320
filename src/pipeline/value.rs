//! Numbers and per-key aggregate state.
//!
//! Integers are exact: they are kept as `i64` and a sum that would overflow is refused (the
//! event becomes a dead letter with reason `overflow`), never wrapped. A non-integer value
//! (a JSON number with a fraction or exponent, or a delimited field such as `1.5`) is an
//! `f64`; once a key's sum or average has seen one, that key's aggregate is floating point
//! from then on. Floats must be finite and below 2^53 in magnitude, so an integer never
//! silently loses precision by passing through a float.
//!
//! `twa`, the time-weighted average, is the one aggregate that needs more than each value
//! and its time: the window it is in and the value in effect when that window began (see
//! [`Twa`]); the engine hands them over in an [`Extra`].

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
    /// `twa` alone.
    Twa(Box<Twa>),
    /// A list that includes `twa`: the list's running values, and the twa's.
    MultiTwa(Box<Multi>, Box<Twa>),
}

/// What a value brings besides its number and its event time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Extra {
    /// A store-and-forward value (Sparkplug `is_historical`): it goes into its window like
    /// any other, but never moves `last`, which is the current value.
    pub historical: bool,
    /// `twa`: the window `[start, end)` the state covers (`None` unwindowed), and the value
    /// in effect at its start, carried from before it, if one is known.
    pub span: Option<(u64, u64)>,
    pub carry: Option<f64>,
}

/// Most points a [`Twa`] keeps apart before it folds the older half into a sum: each is
/// ~20 bytes in the store, and a state must fit one entry (`MAX_ENTRY_BYTES`) beside its key.
pub(crate) const TWA_POINTS_MAX: usize = 128;

/// A time-weighted average over a stair-step function: each value holds from its time until
/// the next point's, and the average is the integral of the steps over the time they cover,
/// divided by that time.
///
/// - **Windowed**: the steps run from the window's start to its end. Before the first point
///   the value carried from before the window holds (if one is known: see the engine); the
///   last point holds until the end, as report by exception means (a value is sent only when
///   it changes). So the result of a closed window is exact; while the window is open, an
///   upsert assumes the latest value holds to its end.
/// - **Unwindowed**: the steps run from the first point to the latest, which weighs nothing
///   yet; with a single point the average is that point's value.
/// - A point without a value (a death of the metric's session, or a null) ends the step
///   before it: no interval runs across a death, and the time it covers is not counted.
/// - Points are kept sorted by time (a late or store-and-forward value goes where its time
///   puts it). At [`TWA_POINTS_MAX`] the older half is folded into a sum; a value older than
///   the folded part is then refused (`twa_folded`) rather than approximated.
///
/// Bounded: at most [`TWA_POINTS_MAX`] points and a fixed part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Twa {
    /// `[start, end)` of the window; `None` unwindowed.
    pub span: Option<(u64, u64)>,
    /// The value in effect at the window's start.
    pub carry: Option<f64>,
    pub folded: Option<Folded>,
    /// `(time, value)`, sorted by time, ties in arrival order; `None`: no value from then.
    pub points: Vec<(u64, Option<f64>)>,
}

/// The points before `to`, folded: their integral and covered time from `from` (the first
/// point's time), and the value in effect at `to`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Folded {
    pub from: u64,
    pub to: u64,
    pub area: f64,
    pub covered: u64,
    pub value: Option<f64>,
}

/// Integral and covered time of the steps `points` make from `(at, value)` up to `until`
/// (or up to the last point): each step from one point's time to the next.
fn steps(
    mut at: u64,
    mut value: Option<f64>,
    points: &[(u64, Option<f64>)],
    until: Option<u64>,
) -> (f64, u64, u64, Option<f64>) {
    let (mut area, mut covered) = (0.0, 0u64);
    let mut add = |v: Option<f64>, a: u64, b: u64| {
        if let (Some(v), true) = (v, b > a) {
            area += v * (b - a) as f64;
            covered = covered.saturating_add(b - a);
        }
    };
    for &(t, v) in points {
        add(value, at, t);
        at = at.max(t);
        value = v;
    }
    if let Some(end) = until {
        add(value, at, end);
        at = at.max(end);
    }
    (area, covered, at, value)
}

impl Twa {
    fn new(extra: &Extra) -> Twa {
        Twa {
            span: extra.span,
            carry: extra.span.and(extra.carry),
            folded: None,
            points: Vec::new(),
        }
    }

    /// Where the steps begin, and the value in effect there.
    fn origin(&self) -> (u64, Option<f64>) {
        match self.span {
            Some((start, _)) => (start, self.carry),
            None => {
                let first = self.folded.map(|f| f.from);
                (
                    first.or(self.points.first().map(|p| p.0)).unwrap_or(0),
                    None,
                )
            }
        }
    }

    /// With one more point (a value, or `None`: no value from `t`); `None` when `t` is older
    /// than the folded part.
    pub(crate) fn insert(&self, t: u64, v: Option<f64>) -> Option<Twa> {
        if self.folded.is_some_and(|f| t < f.to) {
            return None;
        }
        let mut next = self.clone();
        let at = next.points.partition_point(|p| p.0 <= t);
        next.points.insert(at, (t, v));
        if next.points.len() > TWA_POINTS_MAX {
            next.fold(TWA_POINTS_MAX / 2);
        }
        Some(next)
    }

    /// Fold the first `n` points into the sum (up to the time of the point after them).
    fn fold(&mut self, n: usize) {
        let to = self.points[n].0;
        let (at, value, from, area0, covered0) = match self.folded {
            Some(f) => (f.to, f.value, f.from, f.area, f.covered),
            None => (self.points[0].0, None, self.points[0].0, 0.0, 0),
        };
        let (area, covered, _, value) = steps(at, value, &self.points[..n], Some(to));
        self.folded = Some(Folded {
            from,
            to,
            area: area0 + area,
            covered: covered0.saturating_add(covered),
            value,
        });
        self.points.drain(..n);
    }

    /// The integral of the steps and the time they cover.
    fn totals(&self) -> (f64, u64) {
        let (mut at, mut value) = self.origin();
        let (mut area, mut covered) = (0.0, 0u64);
        if let Some(f) = self.folded {
            let (a, c, _, _) = steps(at, value, &[], Some(f.from));
            area = a + f.area;
            covered = c.saturating_add(f.covered);
            (at, value) = (f.to, f.value);
        }
        let (a, c, _, _) = steps(at, value, &self.points, self.span.map(|s| s.1));
        (area + a, covered.saturating_add(c))
    }

    /// The average, or `None` when no time is covered by a value (and, unwindowed, no
    /// point has one).
    pub(crate) fn average(&self) -> Option<f64> {
        let (area, covered) = self.totals();
        if covered > 0 {
            return Some(area / covered as f64);
        }
        match self.span {
            Some(_) => None,
            None => self.points.last().and_then(|p| p.1),
        }
    }

    /// The value in effect at the end: what the next window carries in.
    pub(crate) fn end_value(&self) -> Option<f64> {
        match self.points.last() {
            Some(p) => p.1,
            None => self.folded.map_or(self.carry, |f| f.value),
        }
    }

    /// With the value carried in at the start replaced.
    pub(crate) fn with_carry(&self, carry: Option<f64>) -> Twa {
        Twa {
            carry: self.span.and(carry),
            ..self.clone()
        }
    }

    fn stored_bound(&self) -> usize {
        // span, carry, folded, the list's length, then each point: a time and an optional f64.
        22 + 10 + 48 + 5 + self.points.len() * 20
    }
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

/// `Last`: the greater event time wins; on a tie the newer event. A historical value never
/// replaces it.
fn last_of(old: (Num, u64), value: Num, time_ms: u64, extra: &Extra) -> (Num, u64) {
    if time_ms >= old.1 && !extra.historical {
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
        KeyState::first_with(spec, value, time_ms, &Extra::default())
            .expect("a first point is never older than a fold")
    }

    /// [`KeyState::first`], with what else the value brings.
    pub(crate) fn first_with(
        spec: &AggregateSpec,
        value: Num,
        time_ms: u64,
        extra: &Extra,
    ) -> Result<KeyState, Overflow> {
        let twa = || {
            Twa::new(extra)
                .insert(time_ms, Some(value.as_f64()))
                .map(Box::new)
                .ok_or(Overflow)
        };
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
                Aggregate::Twa => Agg::Twa(twa()?),
            },
            AggregateSpec::List(list) => {
                let has = |f: fn(&Aggregate) -> bool| list.iter().any(f);
                let if_has = |f: fn(&Aggregate) -> bool, v: Num| has(f).then_some(v);
                let multi = Box::new(Multi {
                    aggregates: list.clone(),
                    sum: if_has(|a| matches!(a, Aggregate::Sum | Aggregate::Avg), value),
                    min: if_has(|a| *a == Aggregate::Min, value),
                    max: if_has(|a| *a == Aggregate::Max, value),
                    last: has(|a| *a == Aggregate::Last).then_some((value, time_ms)),
                    moments: has(|a| matches!(a, Aggregate::Stddev | Aggregate::Variance))
                        .then(|| Moments::of(value)),
                    sketch: has(|a| matches!(a, Aggregate::Percentile(_)))
                        .then(|| Sketch::of(value.as_f64())),
                });
                if has(|a| *a == Aggregate::Twa) {
                    Agg::MultiTwa(multi, twa()?)
                } else {
                    Agg::Multi(multi)
                }
            }
        };
        Ok(KeyState {
            version: 1,
            count: 1,
            agg,
        })
    }

    /// The state after one more event. Pure; refuses overflow of the sum, the count, the
    /// version, the moments or a sketch bucket rather than wrapping or panicking.
    pub fn apply(&self, value: Num, time_ms: u64) -> Result<KeyState, Overflow> {
        self.apply_with(value, time_ms, &Extra::default())
    }

    /// [`KeyState::apply`], with what else the value brings. A twa point older than its
    /// folded part is refused as an overflow is (the engine says which).
    pub(crate) fn apply_with(
        &self,
        value: Num,
        time_ms: u64,
        extra: &Extra,
    ) -> Result<KeyState, Overflow> {
        let count = self.count.checked_add(1).ok_or(Overflow)?;
        let add = |s: Num| s.checked_add(value).ok_or(Overflow);
        let twa = |t: &Twa| {
            t.insert(time_ms, Some(value.as_f64()))
                .map(Box::new)
                .ok_or(Overflow)
        };
        let multi = |m: &Multi| -> Result<Box<Multi>, Overflow> {
            Ok(Box::new(Multi {
                aggregates: m.aggregates.clone(),
                sum: m.sum.map(add).transpose()?,
                min: m.min.map(|x| min_of(x, value)),
                max: m.max.map(|x| max_of(x, value)),
                last: m.last.map(|l| last_of(l, value, time_ms, extra)),
                moments: match m.moments {
                    Some(mo) => Some(mo.push(value, count).ok_or(Overflow)?),
                    None => None,
                },
                sketch: match &m.sketch {
                    Some(s) => Some(s.insert(value.as_f64()).ok_or(Overflow)?),
                    None => None,
                },
            }))
        };
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
                let (value, time_ms) = last_of((*v, *t), value, time_ms, extra);
                Agg::Last { value, time_ms }
            }
            Agg::Variance(m) => Agg::Variance(m.push(value, count).ok_or(Overflow)?),
            Agg::Stddev(m) => Agg::Stddev(m.push(value, count).ok_or(Overflow)?),
            Agg::Percentile { permille, sketch } => Agg::Percentile {
                permille: *permille,
                sketch: sketch.insert(value.as_f64()).ok_or(Overflow)?,
            },
            Agg::Multi(m) => Agg::Multi(multi(m)?),
            Agg::Twa(t) => Agg::Twa(twa(t)?),
            Agg::MultiTwa(m, t) => Agg::MultiTwa(multi(m)?, twa(t)?),
        };
        Ok(KeyState {
            version: self.version.checked_add(1).ok_or(Overflow)?,
            count,
            agg,
        })
    }

    /// The twa part of this state, if it has one.
    pub(crate) fn twa(&self) -> Option<&Twa> {
        match &self.agg {
            Agg::Twa(t) | Agg::MultiTwa(_, t) => Some(t),
            _ => None,
        }
    }

    /// This state with its twa replaced (a cut, a new carry): a new version with the same
    /// count. `None` when it has no twa or nothing changed.
    pub(crate) fn with_twa(&self, f: impl FnOnce(&Twa) -> Option<Twa>) -> Option<KeyState> {
        let new = f(self.twa()?)?;
        if Some(&new) == self.twa() {
            return None;
        }
        let agg = match &self.agg {
            Agg::Twa(_) => Agg::Twa(Box::new(new)),
            Agg::MultiTwa(m, _) => Agg::MultiTwa(m.clone(), Box::new(new)),
            _ => return None,
        };
        Some(KeyState {
            version: self.version.checked_add(1)?,
            count: self.count,
            agg,
        })
    }

    /// The value a consumer sees: one number, or for a list an object with one entry per
    /// listed aggregate (`{"min": .., "p95": ..}`).
    pub fn value_json(&self) -> serde_json::Value {
        let n = self.count;
        let twa_json = |t: Option<&Twa>| {
            t.and_then(Twa::average)
                .map_or(serde_json::Value::Null, float)
        };
        match &self.agg {
            Agg::Sum(v) | Agg::Min(v) | Agg::Max(v) | Agg::Last { value: v, .. } => v.to_json(),
            Agg::Count => serde_json::Value::from(n),
            Agg::Avg(s) => float(s.as_f64() / n as f64),
            Agg::Variance(m) => float(m.variance(n)),
            Agg::Stddev(m) => float(m.variance(n).sqrt()),
            Agg::Percentile { permille, sketch } => quantile_json(sketch, *permille),
            Agg::Twa(t) => twa_json(Some(t)),
            Agg::Multi(m) | Agg::MultiTwa(m, _) => {
                let twa = self.twa();
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
                        Aggregate::Twa => twa_json(twa),
                    };
                    out.insert(a.name(), v);
                }
                serde_json::Value::Object(out)
            }
        }
    }

    /// At least the bytes this state takes in the store (postcard), without encoding it:
    /// a sketch exactly (it keeps its size), every other varint at its longest (a count 10
    /// bytes), every optional part of a list counted. Close enough that only a state near
    /// the entry bound needs its exact size (`engine::check_state_size`).
    pub(crate) fn stored_bound(&self) -> usize {
        let sketch = |s: &Sketch| s.stored_len();
        // version and count, the variant
        let multi = |m: &Multi| {
            4 + m.aggregates.len() * 4 + 3 * 12 + 22 + 17 + 1 + m.sketch.as_ref().map_or(0, sketch)
        };
        21 + match &self.agg {
            Agg::Percentile { sketch: s, .. } => 3 + sketch(s),
            Agg::Twa(t) => t.stored_bound(),
            Agg::MultiTwa(m, t) => multi(m) + t.stored_bound(),
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
        matches!(self.agg, Agg::Multi(_) | Agg::MultiTwa(..))
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

    /// A sketch counts its exact size in `stored_bound`, with no room to spare: every state
    /// that holds one must still never take more in the store than its bound says (the
    /// checkpoint weighs rows by it, and `check_state_size` trusts it below the entry bound).
    #[test]
    fn a_state_with_a_sketch_is_never_larger_in_the_store_than_its_bound() {
        let specs = [
            AggregateSpec::One(Aggregate::Percentile(990)),
            AggregateSpec::List(vec![
                Aggregate::Sum,
                Aggregate::Count,
                Aggregate::Min,
                Aggregate::Max,
                Aggregate::Avg,
                Aggregate::Variance,
                Aggregate::Last,
                Aggregate::Percentile(1),
                Aggregate::Percentile(999),
            ]),
        ];
        for spec in &specs {
            let mut s = KeyState::first(spec, Num::Int(-1_000_000_007), u64::MAX / 2);
            let mut x = 1e-300_f64;
            for i in 0..3000u64 {
                let v = match i % 4 {
                    0 => Num::Float(x),
                    1 => Num::Float(-x),
                    2 => Num::Int(i as i64 * 1_000_003),
                    _ => Num::Float(0.0),
                };
                s = s.apply(v, u64::MAX / 2 + i).unwrap();
                // Floats a sum takes: below 2^53.
                x = if x > 1e15 { 1e-300 } else { x * 1.6 };
                let bytes = postcard::to_stdvec(&s).unwrap().len();
                assert!(bytes <= s.stored_bound(), "{spec:?} at {i}: {bytes} bytes");
            }
        }
    }

    /// The window [1000, 2000): 4 carried in until 1100, then 10 until 1400, 2 until 1500,
    /// no value (a death) until 1700, 6 to the end. By hand: 4*100 + 10*300 + 2*100 + 6*300
    /// = 5400 over 800 ms covered = 6.75, exactly.
    #[test]
    fn twa_is_the_stair_step_integral_over_the_covered_time() {
        let extra = Extra {
            historical: false,
            span: Some((1000, 2000)),
            carry: Some(4.0),
        };
        let spec = AggregateSpec::One(Aggregate::Twa);
        let s = KeyState::first_with(&spec, Num::Int(10), 1100, &extra).unwrap();
        // Out of order on purpose: the 6 arrives before the 2 and the death.
        let s = s.apply_with(Num::Int(6), 1700, &extra).unwrap();
        let s = s.apply_with(Num::Int(2), 1400, &extra).unwrap();
        let s = s.with_twa(|t| t.insert(1500, None)).unwrap();
        assert_eq!(s.value_json(), serde_json::json!(6.75));
        assert_eq!(
            (s.count, s.version),
            (3, 4),
            "a cut is a version, not an event"
        );
        assert_eq!(s.twa().unwrap().end_value(), Some(6.0));
        // Without a carried value, the steps start at the first point: 5400 - 400 over 700.
        let s = s.with_twa(|t| Some(t.with_carry(None))).unwrap();
        let v = s.value_json().as_f64().unwrap();
        assert_eq!(v, 5000.0 / 700.0);
    }

    #[test]
    fn twa_unwindowed_runs_from_the_first_to_the_latest_point() {
        let spec = AggregateSpec::List(vec![Aggregate::Twa, Aggregate::Count]);
        let s = KeyState::first(&spec, Num::Int(3), 100);
        assert_eq!(s.value_json(), serde_json::json!({"twa": 3.0, "count": 1}));
        let s = s.apply(Num::Float(1.5), 400).unwrap();
        let s = s.apply(Num::Int(100), 500).unwrap();
        // 3 for 300 ms, 1.5 for 100 ms; the latest point weighs nothing yet.
        assert_eq!(
            s.value_json()["twa"],
            serde_json::json!((900.0 + 150.0) / 400.0)
        );
    }

    #[test]
    fn twa_folds_its_older_points_and_stays_exact_and_bounded() {
        let extra = Extra {
            historical: false,
            span: Some((0, 1_000_000)),
            carry: None,
        };
        let spec = AggregateSpec::One(Aggregate::Twa);
        let mut s = KeyState::first_with(&spec, Num::Int(0), 0, &extra).unwrap();
        // Values 0, 1, 2, ... each held 1000 ms; the last (999) holds to the end.
        for i in 1..1000i64 {
            s = s.apply_with(Num::Int(i), i as u64 * 1000, &extra).unwrap();
            assert!(s.twa().unwrap().points.len() <= TWA_POINTS_MAX);
        }
        let want = (0..1000).map(|i| i as f64 * 1000.0).sum::<f64>() / 1_000_000.0;
        assert_eq!(s.value_json(), serde_json::json!(want));
        let bytes = postcard::to_stdvec(&s).unwrap().len();
        assert!(bytes <= s.stored_bound() && bytes < 4096, "{bytes}");
        // A point older than the folded part is refused, not approximated.
        let folded = s.twa().unwrap().folded.unwrap();
        assert!(s.apply_with(Num::Int(1), folded.to - 1, &extra).is_err());
        assert!(s.apply_with(Num::Int(1), folded.to, &extra).is_ok());
    }

    #[test]
    fn a_historical_value_never_moves_last() {
        let spec = AggregateSpec::List(vec![Aggregate::Last, Aggregate::Max]);
        let s = KeyState::first(&spec, Num::Int(5), 100);
        let old = Extra {
            historical: true,
            ..Extra::default()
        };
        let s = s.apply_with(Num::Int(9), 200, &old).unwrap();
        assert_eq!(s.value_json(), serde_json::json!({"last": 5, "max": 9}));
        let s = s.apply(Num::Int(7), 300).unwrap();
        assert_eq!(s.value_json(), serde_json::json!({"last": 7, "max": 9}));
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
