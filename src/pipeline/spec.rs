//! The typed definition of a pipeline, as validated from the config. Pure data.

use serde::{Deserialize, Serialize};

use super::expr::Expr;
use super::field::{Field, Format};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Aggregate {
    Sum,
    Count,
    Min,
    Max,
    Avg,
    Last,
    /// Population standard deviation.
    Stddev,
    /// Population variance.
    Variance,
    /// The quantile `permille / 1000` (1..=999), from a [`super::sketch::Sketch`].
    Percentile(u16),
    /// Time-weighted average: each value weighted by how long it held (see
    /// [`super::value::Twa`]). New variants go last: lists of aggregates are stored.
    Twa,
}

impl Aggregate {
    /// The name a config and an output use: `sum`, ..., `p95`, `p99.9`.
    pub fn name(self) -> String {
        match self {
            Aggregate::Sum => "sum".into(),
            Aggregate::Count => "count".into(),
            Aggregate::Min => "min".into(),
            Aggregate::Max => "max".into(),
            Aggregate::Avg => "avg".into(),
            Aggregate::Last => "last".into(),
            Aggregate::Stddev => "stddev".into(),
            Aggregate::Variance => "variance".into(),
            Aggregate::Twa => "twa".into(),
            Aggregate::Percentile(q) if q % 10 == 0 => format!("p{}", q / 10),
            Aggregate::Percentile(q) => format!("p{}.{}", q / 10, q % 10),
        }
    }

    /// Parse a name: the fixed ones, or `pNN` / `pNN.N` strictly between 0 and 100.
    pub fn parse(text: &str) -> Option<Aggregate> {
        let fixed = [
            Aggregate::Sum,
            Aggregate::Count,
            Aggregate::Min,
            Aggregate::Max,
            Aggregate::Avg,
            Aggregate::Last,
            Aggregate::Stddev,
            Aggregate::Variance,
            Aggregate::Twa,
        ];
        if let Some(a) = fixed.into_iter().find(|a| a.name() == text) {
            return Some(a);
        }
        let digits = text.strip_prefix('p')?;
        let (whole, tenth) = match digits.split_once('.') {
            Some((w, t)) if t.len() == 1 => (w, t),
            Some(_) => return None,
            None => (digits, "0"),
        };
        let ok = |d: &str| !d.is_empty() && d.len() <= 2 && d.bytes().all(|b| b.is_ascii_digit());
        if !ok(whole) || !ok(tenth) {
            return None;
        }
        let permille = whole.parse::<u16>().ok()? * 10 + tenth.parse::<u16>().ok()?;
        (1..=999)
            .contains(&permille)
            .then_some(Aggregate::Percentile(permille))
    }
}

/// One aggregate (the result's `value`), or a list (the result's `values`, one per name).
/// Serialized untagged, so the definition of a single-aggregate pipeline reads exactly as it
/// did before lists existed and its stored state keeps its meaning.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum AggregateSpec {
    One(Aggregate),
    List(Vec<Aggregate>),
}

impl AggregateSpec {
    /// Every aggregate named, in order.
    pub fn all(&self) -> &[Aggregate] {
        match self {
            AggregateSpec::One(a) => std::slice::from_ref(a),
            AggregateSpec::List(l) => l,
        }
    }

    /// Whether events need a value field: everything but a lone `count` does.
    pub(crate) fn needs_value(&self) -> bool {
        self.all().iter().any(|a| *a != Aggregate::Count)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Emit {
    /// One output per touched key (and window) per checkpoint: the latest version.
    Upsert,
    /// One output per applied event.
    Changelog,
    /// One output per window, when the watermark closes it (windowed pipelines only).
    Final,
}

/// Where a pipeline new to the store starts in the log (`start`). Only a pipeline with no
/// stored state starts; for one that has state the setting is ignored. Not part of the
/// definition: it says nothing about what stored state means.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Start {
    /// At the live position: only records that arrive after it was added (the default).
    #[default]
    Latest,
    /// The whole retained log first (a backfill, with its own dedup), then live records.
    Earliest,
}

/// An event-time window: tumbling, or hopping when `slide_ms` is set. `size_ms` is above
/// zero and a slide lies in `(0, size_ms)` with at most [`MAX_WINDOWS_PER_EVENT`] windows
/// covering any instant (config validation); any size and lateness is safe, since window
/// bounds are computed with checked arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSpec {
    pub size_ms: u64,
    pub allowed_lateness_ms: u64,
    /// Windows start every `slide_ms` (hopping); `None` is tumbling (a slide of `size_ms`).
    /// Left out of the definition when `None`, so a tumbling pipeline's stored state keeps
    /// the definition it had before hopping windows existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slide_ms: Option<u64>,
}

/// Most windows one event may land in (`ceil(size / slide)`): each is a state write.
pub(crate) const MAX_WINDOWS_PER_EVENT: u64 = 100;

impl WindowSpec {
    /// The slide; never 0, even in a hand-built spec, since it divides.
    pub fn slide(&self) -> u64 {
        self.slide_ms.unwrap_or(self.size_ms).max(1)
    }

    /// The smallest window start (a multiple of the slide) still open when the greatest
    /// event time applied is `max_event_time_ms`: a window closes once the watermark
    /// (`max_event_time_ms - allowed_lateness`) reaches its end. For tumbling windows this is
    /// the watermark rounded down to the size, as before hopping windows existed.
    pub fn open_from(&self, max_event_time_ms: u64) -> u64 {
        let watermark = max_event_time_ms.saturating_sub(self.allowed_lateness_ms);
        match watermark.checked_sub(self.size_ms) {
            None => 0,
            // Open: start + size > watermark, i.e. start > watermark - size. Never
            // overflows: the result is at most watermark - size + slide <= watermark.
            Some(x) => (x / self.slide() + 1) * self.slide(),
        }
    }
}

/// A validated pipeline definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineSpec {
    pub name: String,
    /// MQTT topic filters (`+` and `#` wildcards).
    pub topics: Vec<String>,
    pub format: Format,
    pub event_id: Field,
    pub key: Field,
    /// Absent only for `count`, which counts events.
    pub value: Option<Field>,
    /// Event time in ms since the epoch (a number, or an RFC 3339 string). Absent: the
    /// record's `received_at_ms` is the event time.
    pub event_time: Option<Field>,
    pub aggregate: AggregateSpec,
    pub window: Option<WindowSpec>,
    /// `where`: only inputs matching it are aggregated; the others are skipped and counted.
    pub filter: Option<Expr>,
    /// Event IDs are remembered this long, measured in record time.
    pub dedup_window_ms: u64,
    /// Output topic template; `{key}` (and `{window_start}` when windowed) are replaced.
    pub output_topic: String,
    pub retain: bool,
    pub emit: Emit,
    /// Where a new pipeline starts: the live position, or the retained log (backfill).
    pub start: Start,
    /// Longest key accepted, in bytes; longer keys are dead letters.
    pub max_key_len: usize,
    /// Most distinct keys (per window when windowed) held in state; an event for a new key
    /// beyond it is a dead letter with reason `key_limit`.
    pub max_keys: u64,
    /// Sparkplug B only: the metrics aggregated, by name; `None` takes every metric. Like
    /// `where`, a filter on inputs, not part of the definition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Vec<String>>,
    /// Longest event ID accepted, in bytes; longer IDs are dead letters (`id_too_long`).
    /// IDs are held in the dedup ledger, so this bounds every ledger value.
    pub max_id_len: usize,
    /// How far an event time may lie ahead of the record's time of receipt. An event further
    /// ahead is a dead letter (`future`): one bad clock must not move the watermark (which
    /// would make every later event `late`) nor pin a `last`.
    pub max_future_ms: u64,
    /// The sinks its results go to, by name (issue 29; the config fills in the default:
    /// `local`, or `uplink` with `[uplink]`). Where results go, not what they are: see
    /// [`Route`].
    #[serde(skip)]
    pub sinks: Route,
}

/// A pipeline's sinks. Where results go does not change what they are, so two pipelines
/// that differ only here are equal: the start plan compares the pipelines the last run
/// recorded (`pipelines.json`, which does not hold this) with the config's, and a change of
/// sinks must not settle the log tail first or start a new generation of output IDs.
#[derive(Debug, Clone, Default)]
pub struct Route(pub Vec<String>);

impl PartialEq for Route {
    fn eq(&self, _: &Route) -> bool {
        true
    }
}

impl Eq for Route {}

impl std::ops::Deref for Route {
    type Target = Vec<String>;
    fn deref(&self) -> &Vec<String> {
        &self.0
    }
}

impl std::ops::DerefMut for Route {
    fn deref_mut(&mut self) -> &mut Vec<String> {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregate_names_round_trip() {
        for name in [
            "sum", "count", "stddev", "variance", "twa", "p50", "p95", "p99.9", "p0.1", "p1",
        ] {
            assert_eq!(Aggregate::parse(name).unwrap().name(), name);
        }
        assert_eq!(Aggregate::parse("p99.9"), Some(Aggregate::Percentile(999)));
        assert_eq!(Aggregate::parse("p95.0"), Some(Aggregate::Percentile(950)));
        for bad in [
            "p0", "p100", "p", "p9.99", "p-1", "p.5", "p5.", "p+5", "median", "P50",
        ] {
            assert_eq!(Aggregate::parse(bad), None, "{bad}");
        }
    }
}
