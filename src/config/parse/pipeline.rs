//! Stage 2 for `[[pipeline]]`: one function per key group, called in the order problems
//! are reported, so that one mistake is reported once and the rest still are.

use super::names::{check_filter, check_output_topic, refusable};
use super::*;
use crate::model::{MAX_ENTRY_BYTES, MAX_META_BYTES};
use crate::pipeline::bound::{max_key_len_within, worst_result_bytes};
use crate::pipeline::engine::progress_bytes;

impl Validator {
    pub(super) fn pipelines(&mut self, raw: Option<Vec<RawPipeline>>) -> Option<Vec<PipelineSpec>> {
        let raw = raw.unwrap_or_default();
        if raw.is_empty() {
            if !self.broken.contains("pipeline") {
                self.problem(
                    "pipeline",
                    "no pipeline: add at least one `[[pipeline]]` table, or there is nothing to do",
                );
            }
            return None;
        }
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut out = Vec::new();
        let mut ok = true;
        for (i, p) in raw.into_iter().enumerate() {
            match self.pipeline(i, p, &mut names) {
                Some(spec) => out.push(spec),
                None => ok = false,
            }
        }
        ok &= self.progress_fits(&out);
        ok.then_some(out)
    }

    /// The checkpoint's progress record holds a fixed part per pipeline and its definition;
    /// it must fit one `meta` value whatever the counters reach, or no checkpoint could be
    /// written (issue 26). Dormant pipelines add to it; the start checks those.
    fn progress_fits(&mut self, specs: &[PipelineSpec]) -> bool {
        let bytes = progress_bytes(specs);
        self.require("pipeline", bytes <= MAX_META_BYTES, || {
            format!(
                "the {} pipelines' progress record can take {bytes} bytes, more than the \
                 {MAX_META_BYTES} the store keeps in one record (each pipeline takes about 150 \
                 bytes, its name and its definition: format, fields, aggregates, window): \
                 configure fewer pipelines, or shorter names and field templates",
                specs.len()
            )
        })
    }

    /// A window's slide: `None` when it equals the size (tumbling, stored as before).
    fn slide(&mut self, key: &str, slide: u64, size: Option<u64>) -> Option<Option<u64>> {
        let size = size?;
        if slide == 0 || slide > size {
            self.problem(
                key,
                format!(
                    "must be longer than 0s and at most the window size {}, found {}",
                    format_duration_ms(size),
                    format_duration_ms(slide)
                ),
            );
            return None;
        }
        if size.div_ceil(slide) > MAX_WINDOWS_PER_EVENT {
            self.problem(
                key,
                format!(
                    "a {} window sliding every {} puts each event in {} windows; at most \
                     {MAX_WINDOWS_PER_EVENT} are allowed (each is a state write per event)",
                    format_duration_ms(size),
                    format_duration_ms(slide),
                    size.div_ceil(slide)
                ),
            );
            return None;
        }
        Some((slide != size).then_some(slide))
    }

    /// A list of aggregates: not empty, each known, none twice.
    fn aggregate_list(&mut self, key: &str, list: Vec<String>) -> Option<AggregateSpec> {
        if list.is_empty() || list.len() > MAX_AGGREGATES {
            self.problem(
                key,
                format!(
                    "must list 1 to {MAX_AGGREGATES} aggregates, found {}",
                    list.len()
                ),
            );
            return None;
        }
        let mut out: Vec<Aggregate> = Vec::with_capacity(list.len());
        let mut ok = true;
        for (j, a) in list.iter().enumerate() {
            let at = format!("{key}[{j}]");
            match Aggregate::parse(a) {
                Some(agg) if out.contains(&agg) => {
                    self.problem(&at, format!("`{a}` is listed twice"));
                    ok = false;
                }
                Some(agg) => out.push(agg),
                None => {
                    self.problem(
                        &at,
                        format!("`{a}` is not an aggregate: expected {AGGREGATE_NAMES}"),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(AggregateSpec::List(out))
    }

    /// One `[[pipeline]]` table, checked key group by key group in the order the problems
    /// are reported; every group is checked even when an earlier one failed.
    fn pipeline(
        &mut self,
        i: usize,
        r: RawPipeline,
        names: &mut HashMap<String, usize>,
    ) -> Option<PipelineSpec> {
        let p = format!("pipeline[{i}]");
        let name = self.pipeline_name(&p, i, r.name, names);
        let topics = self.pipeline_topics(&p, r.topics);
        let format = self.pipeline_format(&p, r.format, r.separator);
        let aggregate = self.pipeline_aggregate(&p, r.aggregate);
        let filter = self.pipeline_filter(&p, r.filter, format.as_ref());
        let fields = self.pipeline_fields(
            &p,
            RawFields {
                event_id: r.event_id,
                key: r.key,
                value: r.value,
                event_time: r.event_time,
            },
            format.as_ref(),
            aggregate.as_ref(),
        );
        let window = self.pipeline_window(&p, r.window);
        let metrics = self.sparkplug_pipeline(&p, format.as_ref(), &aggregate, &window, r.metrics);
        let dedup_window_ms = self.dedup_window(&p, r.dedup_window);
        let output_topic = self.output_topic(&p, r.output_topic, &window);
        let emit = self.emit(&p, r.emit.as_deref(), &window);
        let start = self.start(&p, r.start.as_deref());
        let limits =
            self.pipeline_limits(&p, r.max_key_len, r.max_keys, r.max_id_len, r.max_future);
        let sinks_ok = self.require(
            &format!("{p}.sinks"),
            r.sinks.as_ref().is_none_or(|s| !s.is_empty()),
            || "is empty: name at least one sink, or leave the key out for the default".into(),
        );

        format.as_ref()?;
        sinks_ok.then_some(())?;
        let spec = PipelineSpec {
            name: name?,
            topics: topics?,
            format: format?,
            event_id: fields.event_id??,
            key: fields.key??,
            value: fields.value?,
            event_time: fields.event_time?,
            aggregate: aggregate?,
            window: window?,
            filter: filter?,
            dedup_window_ms: dedup_window_ms?,
            output_topic: output_topic?,
            retain: r.retain.unwrap_or(true),
            emit: emit?,
            start: start?,
            max_key_len: usize::try_from(limits.max_key_len?).ok()?,
            max_keys: u64::try_from(limits.max_keys?).ok()?,
            max_id_len: usize::try_from(limits.max_id_len?).ok()?,
            max_future_ms: limits.max_future_ms?,
            metrics: metrics?,
            // Checked against the sinks, and the default filled in, once all are read.
            sinks: crate::pipeline::spec::Route(r.sinks.unwrap_or_default()),
        };
        self.results_fit(&p, &spec).then_some(spec)
    }

    /// Every result of the pipeline fits one stored entry, whatever key a sender picks: else
    /// the worst key would make a result the store refuses, and after a crash replay would
    /// make it again on every start (issue 26). The engine refuses such an event too; this
    /// says at load time which keys to change.
    fn results_fit(&mut self, p: &str, spec: &PipelineSpec) -> bool {
        let bytes = worst_result_bytes(spec);
        if bytes <= MAX_ENTRY_BYTES {
            return true;
        }
        let aggregates = spec.aggregate.all().len();
        let why = format!(
            "a result of this pipeline can take {bytes} bytes in the store, more than the \
             {MAX_ENTRY_BYTES} one stored entry holds: a key of max_key_len = {} bytes, each of \
             which topic escaping triples, goes into output_topic ({} bytes, {} `{{key}}`), the \
             output ID and the JSON body, beside {aggregates} aggregate value(s)",
            spec.max_key_len,
            spec.output_topic.len(),
            spec.output_topic.matches("{key}").count(),
        );
        match max_key_len_within(spec, MAX_ENTRY_BYTES) {
            Some(fits) => self.problem(
                &format!("{p}.max_key_len"),
                format!("{why}; lower max_key_len to at most {fits}, or shorten output_topic"),
            ),
            None => self.problem(
                &format!("{p}.output_topic"),
                format!("{why}; shorten output_topic, or list fewer aggregates"),
            ),
        }
        false
    }

    /// The name: valid, and not used by an earlier pipeline (`names` remembers them).
    fn pipeline_name(
        &mut self,
        p: &str,
        i: usize,
        raw: Option<String>,
        names: &mut HashMap<String, usize>,
    ) -> Option<String> {
        let key = format!("{p}.name");
        match raw {
            None => {
                self.missing(&key, "output IDs and state are keyed by the pipeline name");
                None
            }
            Some(name) if !valid_name(&name, MAX_PIPELINE_NAME_LEN) => {
                self.problem(
                    &key,
                    format!(
                        "`{name}` is not a valid pipeline name: use 1 to {MAX_PIPELINE_NAME_LEN} \
                         of A-Z a-z 0-9 _ - (it is part of every output ID)"
                    ),
                );
                None
            }
            Some(name) => match names.get(&name) {
                Some(&first) => {
                    self.problem(
                        &key,
                        format!(
                            "duplicate pipeline name `{name}`, also used by pipeline[{first}]: \
                             output IDs and state are keyed by it"
                        ),
                    );
                    None
                }
                None => {
                    names.insert(name.clone(), i);
                    Some(name)
                }
            },
        }
    }

    /// The topic filters: at least one, each valid, none twice.
    fn pipeline_topics(&mut self, p: &str, raw: Option<Vec<String>>) -> Option<Vec<String>> {
        match raw {
            None => {
                self.missing(
                    &format!("{p}.topics"),
                    "the MQTT topic filters this pipeline consumes",
                );
                None
            }
            Some(t) if t.is_empty() => {
                self.problem(
                    &format!("{p}.topics"),
                    "is empty: list at least one topic filter, e.g. [\"payments/#\"]",
                );
                None
            }
            Some(topics) => {
                let mut ok = true;
                for (j, t) in topics.iter().enumerate() {
                    let key = format!("{p}.topics[{j}]");
                    if let Err(e) = check_filter(t) {
                        self.problem(&key, format!("`{t}` is not a valid topic filter: {e}"));
                        ok = false;
                    } else if topics[..j].contains(t) {
                        self.problem(&key, format!("`{t}` is listed twice"));
                        ok = false;
                    }
                }
                ok.then_some(topics)
            }
        }
    }

    /// The payload format, and the separator that only `delimited` takes.
    fn pipeline_format(
        &mut self,
        p: &str,
        format: Option<String>,
        separator: Option<String>,
    ) -> Option<Format> {
        match (format.as_deref().unwrap_or("json"), separator) {
            ("json", None) => Some(Format::Json),
            ("json", Some(_)) => {
                self.problem(
                    &format!("{p}.separator"),
                    "only applies to format = \"delimited\"; remove it for JSON",
                );
                None
            }
            ("sparkplug_b", None) => Some(Format::SparkplugB),
            ("sparkplug_b", Some(_)) => {
                self.problem(
                    &format!("{p}.separator"),
                    "only applies to format = \"delimited\"; remove it for Sparkplug B",
                );
                None
            }
            ("delimited", separator) => {
                let separator = separator.unwrap_or_else(|| "/".to_string());
                if separator.is_empty() {
                    self.problem(
                        &format!("{p}.separator"),
                        "is empty: give the text between fields, e.g. \"/\"",
                    );
                    None
                } else {
                    Some(Format::Delimited { separator })
                }
            }
            (other, _) => {
                self.problem(
                    &format!("{p}.format"),
                    format!(
                        "`{other}` is not a format: expected \"json\", \"delimited\" or \
                         \"sparkplug_b\""
                    ),
                );
                None
            }
        }
    }

    /// One aggregate or a list of them.
    fn pipeline_aggregate(&mut self, p: &str, raw: Option<RawAggregate>) -> Option<AggregateSpec> {
        let key = format!("{p}.aggregate");
        match raw {
            None => {
                self.missing(&key, AGGREGATE_NAMES);
                None
            }
            Some(RawAggregate::One(a)) => match Aggregate::parse(&a) {
                Some(agg) => Some(AggregateSpec::One(agg)),
                None => {
                    self.problem(
                        &key,
                        format!("`{a}` is not an aggregate: expected {AGGREGATE_NAMES}"),
                    );
                    None
                }
            },
            Some(RawAggregate::List(list)) => self.aggregate_list(&key, list),
        }
    }

    /// The `where` filter, read with the pipeline's format (skipped without a valid one).
    /// `Some(None)`: absent; `None`: rejected.
    fn pipeline_filter(
        &mut self,
        p: &str,
        raw: Option<String>,
        format: Option<&Format>,
    ) -> Option<Option<Expr>> {
        match (raw, format) {
            (None, _) => Some(None),
            (Some(_), None) => None,
            (Some(text), Some(format)) => match parse_filter(&text, format) {
                Ok(e) => Some(Some(e)),
                Err(e) => {
                    // The position within the expression: TOML drops the newline after an
                    // opening `'''`, so a file line could be off by one.
                    let at = match e.position(&text) {
                        (0, col) => format!("column {col}"),
                        (line, col) => format!("line {}, column {col}", line + 1),
                    };
                    self.problem(
                        &format!("{p}.where"),
                        format!("{at} of the filter: {}", e.message),
                    );
                    None
                }
            },
        }
    }

    /// What only Sparkplug B pipelines have, and what they may not have (issue 31): the
    /// `metrics` list (returned), and `twa`, which needs the sessions' last values and
    /// tumbling windows (a window's carried-in value is the one before its start).
    fn sparkplug_pipeline(
        &mut self,
        p: &str,
        format: Option<&Format>,
        aggregate: &Option<AggregateSpec>,
        window: &Option<Option<WindowSpec>>,
        metrics: Option<Vec<String>>,
    ) -> Option<Option<Vec<String>>> {
        use crate::pipeline::sparkplug::session::MAX_NAME_BYTES;
        let sparkplug = format == Some(&Format::SparkplugB);
        let twa = aggregate
            .as_ref()
            .is_some_and(|a| a.all().contains(&Aggregate::Twa));
        let mut ok = true;
        if twa && format.is_some() && !sparkplug {
            self.problem(
                &format!("{p}.aggregate"),
                "twa weighs each value by how long it held, from the value before each \
                 window: it needs format = \"sparkplug_b\", whose sessions keep that value",
            );
            ok = false;
        }
        if twa && matches!(window, Some(Some(w)) if w.slide_ms.is_some()) {
            self.problem(
                &format!("{p}.window.slide"),
                "twa takes tumbling windows (or none): a window's carried-in value is the \
                 one before its start",
            );
            ok = false;
        }
        let Some(list) = metrics else {
            return ok.then_some(None);
        };
        let key = format!("{p}.metrics");
        if format.is_some() && !sparkplug {
            self.problem(&key, "only applies to format = \"sparkplug_b\"");
            return None;
        }
        if list.is_empty() || list.len() > MAX_METRICS_LISTED {
            self.problem(
                &key,
                format!(
                    "must list 1 to {MAX_METRICS_LISTED} metric names, found {}; leave it out \
                     to take every metric",
                    list.len()
                ),
            );
            return None;
        }
        for (j, m) in list.iter().enumerate() {
            let at = format!("{key}[{j}]");
            if m.is_empty() || m.len() > MAX_NAME_BYTES {
                self.problem(
                    &at,
                    format!(
                        "a metric name is 1 to {MAX_NAME_BYTES} bytes, found {}",
                        m.len()
                    ),
                );
                ok = false;
            } else if list[..j].contains(m) {
                self.problem(&at, format!("`{m}` is listed twice"));
                ok = false;
            }
        }
        ok.then_some(Some(list))
    }

    /// One field, read with the pipeline's format; without a valid format it is skipped.
    /// `Some(None)`: absent; `None`: rejected (or unreadable without a format).
    fn field(
        &mut self,
        p: &str,
        name: &str,
        text: Option<String>,
        format: Option<&Format>,
    ) -> Option<Option<Field>> {
        let Some(text) = text else {
            return Some(None);
        };
        let format = format?;
        match Field::parse(&text, format) {
            Ok(Field::Template(parts)) if ["key", "event_id"].contains(&name) => {
                // A key's literal parts go into every result topic as they are. An event ID's
                // are held to the same rule, so that no identity the config spells holds a
                // code point a receiver may refuse (IDs are shown and sent on too).
                let bad = parts.iter().find_map(|part| match part {
                    TemplatePart::Literal(l) => refusable(l),
                    TemplatePart::Field(_) => None,
                });
                match bad {
                    Some(why) => {
                        self.problem(
                            &format!("{p}.{name}"),
                            format!("`{}`: {why}", text.escape_debug()),
                        );
                        None
                    }
                    None => Some(Some(Field::Template(parts))),
                }
            }
            Ok(f) => Some(Some(f)),
            Err(e) => {
                self.problem(&format!("{p}.{name}"), e);
                None
            }
        }
    }

    /// The fields an event is read through: `event_id` and `key` required, `value` exactly
    /// when the aggregate reads one, `event_time` optional.
    fn pipeline_fields(
        &mut self,
        p: &str,
        raw: RawFields,
        format: Option<&Format>,
        aggregate: Option<&AggregateSpec>,
    ) -> Fields {
        if format == Some(&Format::SparkplugB) {
            return self.sparkplug_fields(p, raw);
        }
        let event_id_present = raw.event_id.is_some();
        let key_present = raw.key.is_some();
        let value_present = raw.value.is_some();
        let event_id = self.field(p, "event_id", raw.event_id, format);
        let key = self.field(p, "key", raw.key, format);
        let value = self.field(p, "value", raw.value, format);
        let event_time = self.field(p, "event_time", raw.event_time, format);
        if !event_id_present {
            self.missing(
                &format!("{p}.event_id"),
                "events are deduplicated by it (broker redeliveries and repeated publishes); \
                 a JSON pointer such as \"/id\", or a template such as \"{/device}-{/seq}\"",
            );
        }
        if !key_present {
            self.missing(
                &format!("{p}.key"),
                "the field whose value names the aggregate, e.g. \"/account\"",
            );
        }
        let needs_value = aggregate.map(AggregateSpec::needs_value);
        let value = match (needs_value, value_present) {
            (Some(false), true) => {
                self.problem(
                    &format!("{p}.value"),
                    "count counts events and reads no value: remove `value`, or use another aggregate",
                );
                None
            }
            (Some(true), false) => {
                let agg = aggregate.map(aggregate_text).unwrap_or_default();
                self.missing(
                    &format!("{p}.value"),
                    &format!("`{agg}` needs the field to aggregate, e.g. \"/amount\""),
                );
                None
            }
            (_, false) => Some(None),
            (_, true) => value,
        };
        Fields {
            event_id,
            key,
            value,
            event_time,
        }
    }

    /// A Sparkplug B pipeline's fields: the key template alone. The event ID, the value and
    /// the event time come from each metric (`pipeline::sparkplug`), so naming them is a
    /// mistake worth a problem. The event ID is left an empty template: never read.
    fn sparkplug_fields(&mut self, p: &str, raw: RawFields) -> Fields {
        let why = [
            (
                "event_id",
                raw.event_id.is_some(),
                "a metric value's event ID is built from its node, device, bdSeq, seq, name \
                 and timestamp",
            ),
            (
                "value",
                raw.value.is_some(),
                "the value is the metric's number",
            ),
            (
                "event_time",
                raw.event_time.is_some(),
                "the event time is the metric's timestamp",
            ),
        ];
        let mut ok = true;
        for (name, present, why) in why {
            if present {
                self.problem(
                    &format!("{p}.{name}"),
                    format!("not used with format = \"sparkplug_b\" ({why}): remove it"),
                );
                ok = false;
            }
        }
        let key = match raw.key {
            None => {
                self.missing(
                    &format!("{p}.key"),
                    "a template over {group}, {edge_node}, {device} and {metric}, e.g. \
                     \"{edge_node}/{device}/{metric}\"",
                );
                None
            }
            some => self.field(p, "key", some, Some(&Format::SparkplugB)),
        };
        let done = ok.then_some(());
        Fields {
            event_id: done.map(|()| Some(Field::Template(Vec::new()))),
            key,
            value: done.map(|()| None),
            event_time: done.map(|()| None),
        }
    }

    /// The optional window: a size, a lateness and a slide. `Some(None)`: no window.
    fn pipeline_window(&mut self, p: &str, raw: Option<RawWindow>) -> Option<Option<WindowSpec>> {
        let Some(w) = raw else {
            return Some(None);
        };
        let k = |key: &str| format!("{p}.window.{key}");
        let size = match w.size {
            None => {
                self.missing(
                    &k("size"),
                    "the length of each tumbling window, e.g. \"1m\"",
                );
                None
            }
            some => self.duration(&k("size"), some),
        };
        let lateness = self.duration(&k("allowed_lateness"), w.allowed_lateness);
        let slide = match w.slide {
            None => Some(None),
            some => self
                .duration(&k("slide"), some)
                .and_then(|slide| self.slide(&k("slide"), slide, size)),
        };
        // No `?` before here: it would skip the checks above, hiding their problems.
        Some(Some(WindowSpec {
            size_ms: size?,
            allowed_lateness_ms: lateness?,
            slide_ms: slide?,
        }))
    }

    fn dedup_window(&mut self, p: &str, raw: Option<DurationText>) -> Option<u64> {
        let key = format!("{p}.dedup_window");
        self.duration(&key, raw)
    }

    /// The output topic template; `{window_start}` only with a window.
    fn output_topic(
        &mut self,
        p: &str,
        raw: Option<String>,
        window: &Option<Option<WindowSpec>>,
    ) -> Option<String> {
        let key = format!("{p}.output_topic");
        let Some(t) = raw else {
            self.missing(
                &key,
                "the topic results are published to, with `{key}`, e.g. \"balances/{key}\"",
            );
            return None;
        };
        // Whether `{window_start}` is allowed depends on a valid window; if the window
        // itself is broken, it was reported already.
        let windowed = matches!(window, Some(Some(_)) | None);
        match check_output_topic(&t, windowed) {
            Ok(()) => Some(t),
            Err(e) => {
                self.problem(&key, format!("`{t}`: {e}"));
                None
            }
        }
    }

    /// The emit mode; `final` only with a window.
    fn emit(
        &mut self,
        p: &str,
        raw: Option<&str>,
        window: &Option<Option<WindowSpec>>,
    ) -> Option<Emit> {
        let key = format!("{p}.emit");
        match raw {
            None | Some("upsert") => Some(Emit::Upsert),
            Some("changelog") => Some(Emit::Changelog),
            // Whether there is a window is known only if `window` itself is valid.
            Some("final") if matches!(window, Some(None)) => {
                self.problem(
                    &key,
                    "\"final\" emits a result when its window closes: it needs a `window`",
                );
                None
            }
            Some("final") => Some(Emit::Final),
            Some(other) => {
                self.problem(
                    &key,
                    format!(
                        "`{other}` is not an emit mode: expected \"upsert\", \"changelog\" or \"final\""
                    ),
                );
                None
            }
        }
    }

    /// Where a new pipeline starts: `latest` (the default) or `earliest` (a backfill).
    fn start(&mut self, p: &str, raw: Option<&str>) -> Option<Start> {
        match raw {
            None | Some("latest") => Some(Start::Latest),
            Some("earliest") => Some(Start::Earliest),
            Some(other) => {
                let why = format!("`{other}` is not a start: expected \"latest\" or \"earliest\"");
                self.problem(&format!("{p}.start"), why);
                None
            }
        }
    }

    /// The per-pipeline bounds on keys, IDs and event times (invariant 7).
    fn pipeline_limits(
        &mut self,
        p: &str,
        max_key_len: Option<i64>,
        max_keys: Option<i64>,
        max_id_len: Option<i64>,
        max_future: Option<DurationText>,
    ) -> Limits {
        let max_key_len = self.int(&format!("{p}.max_key_len"), max_key_len);
        let max_keys = self.int(&format!("{p}.max_keys"), max_keys);
        let max_id_len = self.int(&format!("{p}.max_id_len"), max_id_len);
        let max_future_ms = self.duration(&format!("{p}.max_future"), max_future);
        Limits {
            max_key_len,
            max_keys,
            max_id_len,
            max_future_ms,
        }
    }
}

/// Most metric names a Sparkplug B pipeline's `metrics` may list: the list is part of the
/// pipeline as `pipelines.json` keeps it, and each record checks it.
const MAX_METRICS_LISTED: usize = 1000;

/// A pipeline's field texts, before they are read with its format.
struct RawFields {
    event_id: Option<String>,
    key: Option<String>,
    value: Option<String>,
    event_time: Option<String>,
}

/// A pipeline's fields: `Some(None)` absent, `None` rejected (see [`Validator::field`]);
/// `value` is already checked against the aggregate.
struct Fields {
    event_id: Option<Option<Field>>,
    key: Option<Option<Field>>,
    value: Option<Option<Field>>,
    event_time: Option<Option<Field>>,
}

/// A pipeline's bounds, each `None` after a problem.
struct Limits {
    max_key_len: Option<i64>,
    max_keys: Option<i64>,
    max_id_len: Option<i64>,
    max_future_ms: Option<u64>,
}
