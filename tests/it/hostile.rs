//! Hostile input (issue 10): no record may panic the engine, since replay would meet the
//! same panic on every restart, and whatever a record does must be recomputed exactly on
//! replay (invariant 3).
//!
//! Every format and every aggregate (alone and all in one list), unwindowed and with tiny,
//! ordinary and huge tumbling and hopping windows, in every emit mode, half of them behind a
//! `where` filter, meets records built from extremes: 0, negatives, the `i64`/`u64`
//! bounds, NaN and huge floats, event times near `u64::MAX`, times of receipt near 0 and
//! near `u64::MAX`, and IDs and keys of odd shapes. After each checkpoint, a fresh engine
//! started from the checkpoint before it applies the same records and must hand over the
//! same checkpoint, byte for byte.

use cairn::model::Record;
use cairn::pipeline::engine::{Checkpoint, Engine};
use cairn::pipeline::memory::MemState;
use cairn::pipeline::spec::PipelineSpec;
use cairn::pipeline::time::parse_rfc3339_ms;
use proptest::prelude::*;

/// TOML values of `aggregate`: every aggregate alone, and a list of all of them.
const AGGREGATES: [&str; 11] = [
    "\"sum\"",
    "\"count\"",
    "\"min\"",
    "\"max\"",
    "\"avg\"",
    "\"last\"",
    "\"stddev\"",
    "\"variance\"",
    "\"p50\"",
    "\"p99.9\"",
    r#"["count", "sum", "min", "max", "avg", "last", "stddev", "variance", "p1", "p95", "p99.9"]"#,
];

/// `(window table or "", max_future)`: no window; a 1 ms window with no lateness; an
/// ordinary one; one so large that its end overflows for any time in the second half of
/// the `u64` range.
/// Then hopping windows: an ordinary one, and a huge one with the most windows per event.
const WINDOWS: [&str; 6] = [
    "",
    r#"window = { size = "1ms" }"#,
    r#"window = { size = "1m", allowed_lateness = "30s" }"#,
    r#"window = { size = "200000000000d", allowed_lateness = "200000000000d" }"#,
    r#"window = { size = "1m", slide = "10s", allowed_lateness = "30s" }"#,
    r#"window = { size = "200000000000d", slide = "2000000000d" }"#,
];

/// Every format × aggregate × window, emit modes alternating. JSON pipelines read `j/#`
/// and keep the default `max_future`; delimited ones read `d/#` and allow a year.
fn specs() -> Vec<PipelineSpec> {
    let mut out = Vec::new();
    for (f, format) in ["json", "delimited"].iter().enumerate() {
        for (a, agg) in AGGREGATES.iter().enumerate() {
            for (w, window) in WINDOWS.iter().enumerate() {
                let (fields, topic, future) = if *format == "json" {
                    (["/id", "/k", "/v", "/ts"], "j/#", "")
                } else {
                    (["0", "1", "2", "3"], "d/#", "max_future = \"366d\"")
                };
                let value = if *agg == "\"count\"" {
                    String::new()
                } else {
                    format!("value = \"{}\"", fields[2])
                };
                let emit = match (a + w) % 3 {
                    0 => "changelog",
                    1 if !window.is_empty() => "final",
                    _ => "upsert",
                };
                // Every other pipeline filters on the value and the key (short-circuit
                // `or`, so a bad value behind a matching key is never compared).
                let filter = match ((a + w) % 2, *format) {
                    (1, "json") => r#"where = '/k == "x" or not (/v < 0) and /v != 7'"#,
                    (1, _) => r#"where = '{1} == "x" or not ({2} < 0) and {2} != 7'"#,
                    _ => "",
                };
                let output_topic = if window.is_empty() {
                    "o/{key}"
                } else {
                    "o/{key}/{window_start}"
                };
                let toml = format!(
                    r#"name = "p{f}{a}{w}"
topics = ["{topic}"]
format = "{format}"
event_id = "{}"
key = "{}"
{value}
event_time = "{}"
aggregate = {agg}
{filter}
{window}
output_topic = "{output_topic}"
emit = "{emit}"
max_keys = 8
{future}"#,
                    fields[0], fields[1], fields[3]
                );
                out.push(cairn::config::pipeline_from_toml(&toml).unwrap());
            }
        }
    }
    out
}

/// Text that is a JSON token (or deliberately not one) and a delimited field alike.
fn extreme_number() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-0".to_string()),
        Just("-1".to_string()),
        Just(i64::MAX.to_string()),
        Just(i64::MIN.to_string()),
        Just(u64::MAX.to_string()),
        Just((u64::MAX - 1).to_string()),
        Just("18446744073709551616".to_string()),
        Just("0.5".to_string()),
        Just("-0.0".to_string()),
        Just("1e300".to_string()),
        Just("-1e308".to_string()),
        Just("1e400".to_string()),
        Just("9007199254740991.0".to_string()),
        Just("9007199254740992.5".to_string()),
        Just("NaN".to_string()),
        Just("inf".to_string()),
        Just("-infinity".to_string()),
        Just("4.9e-324".to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|n| format!("{n:e}")),
        (-1000i64..1000).prop_map(|n| n.to_string()),
    ]
}

/// Mostly small values, so keys live long enough to meet the extremes above.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => extreme_number(),
        1 => prop_oneof![Just(i64::MAX), Just(i64::MIN), Just(1 << 53)].prop_map(|n| n.to_string()),
        2 => (-10i64..10).prop_map(|n| n.to_string()),
    ]
}

/// An event time: as written, or relative to the time of receipt (in ms, saturating).
#[derive(Debug, Clone)]
enum Time {
    Text(String),
    Relative(i64),
}

/// Event times: the number shapes above, times around the time of receipt (the ordinary
/// case, and just beyond `max_future`), and RFC 3339 at and beyond its edges.
fn event_time() -> impl Strategy<Value = Time> {
    prop_oneof![
        4 => (-200_000i64..700_000).prop_map(Time::Relative),
        2 => prop_oneof![Just(-1i64), Just(0), Just(600_000), Just(600_001), Just(i64::MAX)]
            .prop_map(Time::Relative),
        2 => time_text().prop_map(Time::Text),
    ]
}

fn time_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => extreme_number(),
        3 => (0u64..2_000_000).prop_map(|n| n.to_string()),
        1 => Just("\"2100-01-01T00:00:00Z\"".to_string()),
        1 => Just("\"9999-12-31T23:59:60.999999+00:00\"".to_string()),
        1 => Just("\"0000-01-01T00:00:00-23:59\"".to_string()),
        1 => Just("\"1970-01-01T00:00:00.000+23:59\"".to_string()),
        1 => Just("\"1970-01-01T00:00:00Z\"".to_string()),
        1 => "[0-9T:Z.+-]{0,30}".prop_map(|s| format!("\"{s}\"")),
    ]
}

/// IDs and keys: empty, long, reserved topic characters, placeholders, control
/// characters, non-ASCII, the separator.
fn odd_text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[ab]",
        4 => "[a-z]{2,8}",
        1 => Just(String::new()),
        1 => Just("$SYS".to_string()),
        1 => Just("{key}".to_string()),
        1 => Just("X{window_start}".to_string()),
        1 => Just("a/b+#%24".to_string()),
        1 => Just("nul\u{0}".to_string()),
        1 => Just("ключ ☃".to_string()),
        1 => (100usize..400).prop_map(|n| "k".repeat(n)),
        1 => any::<String>(),
    ]
}

#[derive(Debug, Clone)]
struct Event {
    id: String,
    key: String,
    value: String,
    time: Time,
    received_at_ms: u64,
}

fn received_at() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        (u64::MAX - 1_000_000..=u64::MAX),
        0u64..2_000_000,
        any::<u64>(),
    ]
}

fn event() -> impl Strategy<Value = Event> {
    (odd_text(), odd_text(), value(), event_time(), received_at()).prop_map(
        |(id, key, value, time, received_at_ms)| Event {
            id,
            key,
            value,
            time,
            received_at_ms,
        },
    )
}

#[derive(Debug, Clone)]
enum Step {
    /// The event, to both the JSON and the delimited pipelines.
    Event(Event),
    /// Arbitrary bytes to both.
    Raw(Vec<u8>, u64),
    Checkpoint,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => event().prop_map(Step::Event),
        1 => (proptest::collection::vec(any::<u8>(), 0..64), received_at())
            .prop_map(|(b, t)| Step::Raw(b, t)),
        2 => Just(Step::Checkpoint),
    ]
}

/// The records of one step, in log order.
fn records(step: &Step, next_offset: &mut u64) -> Vec<Record> {
    let mut out = Vec::new();
    let mut push = |topic: &str, payload: Vec<u8>, received_at_ms: u64| {
        out.push(Record {
            offset: *next_offset,
            received_at_ms,
            topic: topic.to_string(),
            payload,
            qos: 1,
            retain: false,
        });
        *next_offset += 1;
    };
    match step {
        Step::Event(e) => {
            let time = match &e.time {
                Time::Text(t) => t.clone(),
                Time::Relative(d) => e.received_at_ms.saturating_add_signed(*d).to_string(),
            };
            let json = format!(
                r#"{{"id":{},"k":{},"v":{},"ts":{}}}"#,
                serde_json::to_string(&e.id).unwrap(),
                serde_json::to_string(&e.key).unwrap(),
                e.value,
                time
            );
            push("j/x", json.into_bytes(), e.received_at_ms);
            let time = time.trim_matches('"');
            let text = format!("{}/{}/{}/{time}", e.id, e.key, e.value);
            push("d/x", text.into_bytes(), e.received_at_ms);
        }
        Step::Raw(bytes, t) => {
            push("j/x", bytes.clone(), *t);
            push("d/x", bytes.clone(), *t);
        }
        Step::Checkpoint => {}
    }
    out
}

/// What the store would report after a commit, as the agent feeds it back.
fn sync_ledger_sizes(engine: &mut Engine, mem: &MemState) {
    engine.set_dedup_entries(|name| {
        mem.progress
            .pipelines
            .iter()
            .find(|p| p.name == name)
            .map_or(0, |p| p.dedup_entries)
    });
}

/// Byte-for-byte comparison: `Debug` tells `-0.0` from `0.0`, where `PartialEq` does not.
fn same(a: &Checkpoint, b: &Checkpoint) -> bool {
    a == b && format!("{a:?}") == format!("{b:?}")
}

/// Applies `segment` to a fresh engine started from `before` and takes its checkpoint.
fn replay(specs: &[PipelineSpec], before: &MemState, segment: &[Record]) -> Checkpoint {
    let mut engine = Engine::new(specs.to_vec(), before.progress.clone());
    sync_ledger_sizes(&mut engine, before);
    for rec in segment {
        engine.apply(before, rec).unwrap();
    }
    engine.take_checkpoint()
}

fn check_outputs(cp: &Checkpoint) -> Result<(), TestCaseError> {
    for (_, o) in &cp.batch.outputs {
        prop_assert!(!o.topic.starts_with('$'), "reserved topic {}", o.topic);
        prop_assert!(o.topic.len() <= 65_535);
        prop_assert!(!o.topic.contains(['+', '#', '\0']), "topic {}", o.topic);
        let v: serde_json::Value = serde_json::from_slice(&o.payload).expect("JSON output");
        prop_assert_eq!(v["id"].as_str(), Some(o.id.as_str()));
    }
    for d in &cp.batch.dead_letters {
        prop_assert!(!d.reason.is_empty() && !d.detail.is_empty());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn no_record_panics_the_engine_and_replay_recomputes_every_checkpoint(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        let specs = specs();
        let mut engine = Engine::new(specs.clone(), Default::default());
        let mut mem = MemState::default();
        let mut offset = 0;
        let mut segment = Vec::new();
        let checkpoint = |engine: &mut Engine, mem: &mut MemState, segment: &mut Vec<Record>|
            -> Result<(), TestCaseError> {
            let cp = engine.take_checkpoint();
            check_outputs(&cp)?;
            let again = replay(&specs, mem, segment);
            prop_assert!(same(&cp, &again), "replay differs:\n{cp:?}\n{again:?}");
            // No event time beyond `max_future` ever reached the watermark.
            for (pp, spec) in cp.progress.pipelines.iter().zip(&specs) {
                let bound = cp.progress.log_clock_ms.saturating_add(spec.max_future_ms);
                prop_assert!(pp.max_event_time_ms <= bound, "{}: watermark poisoned", pp.name);
            }
            mem.commit(&cp);
            sync_ledger_sizes(engine, mem);
            segment.clear();
            Ok(())
        };
        for step in &steps {
            if let Step::Checkpoint = step {
                checkpoint(&mut engine, &mut mem, &mut segment)?;
                continue;
            }
            for rec in records(step, &mut offset) {
                engine.apply(&mem, &rec).unwrap();
                segment.push(rec);
            }
        }
        checkpoint(&mut engine, &mut mem, &mut segment)?;
        let applied: u64 = mem.progress.pipelines.iter().map(|p| p.counters.applied).sum();
        let dead: u64 = mem.progress.pipelines.iter().map(|p| p.counters.dead_letters).sum();
        let dups: u64 = mem.progress.pipelines.iter().map(|p| p.counters.duplicates).sum();
        let filtered: u64 = mem.progress.pipelines.iter().map(|p| p.counters.filtered).sum();
        // Every record reached every matching pipeline and was accounted for once.
        prop_assert_eq!(applied + dead + dups + filtered, offset * (specs.len() as u64 / 2));
    }

    #[test]
    fn rfc3339_parsing_never_panics(s in "[0-9T:Z.+ -]{0,34}|\\PC{0,34}") {
        let _ = parse_rfc3339_ms(&s);
    }
}

/// The field report's record, alone, through every pipeline: an event time of `u64::MAX - 1`
/// received at `u64::MAX - 1`, so `max_future` does not stop it before the window math.
#[test]
fn an_event_time_at_the_end_of_time_reaches_every_pipeline_without_a_panic() {
    let specs = specs();
    let mut engine = Engine::new(specs.clone(), Default::default());
    let mem = MemState::default();
    let step = Step::Event(Event {
        id: "E1".into(),
        key: "A".into(),
        value: "1".into(),
        time: Time::Text((u64::MAX - 1).to_string()),
        received_at_ms: u64::MAX - 1,
    });
    let mut offset = 0;
    let mut reasons = std::collections::BTreeSet::new();
    for rec in records(&step, &mut offset) {
        for o in engine.apply(&mem, &rec).unwrap() {
            reasons.insert(format!("{o:?}"));
        }
    }
    let cp = engine.take_checkpoint();
    // Unwindowed and 1 ms windows apply it; the 1-minute and the huge windows cannot end.
    assert!(
        reasons.contains("DeadLetter { reason: \"bad_event_time\" }"),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.starts_with("Applied")),
        "{reasons:?}"
    );
    assert!(!cp.batch.outputs.is_empty());
}

// ---------------------------------------------------------------------------------------
// Hostile keys against a real broker.

/// One changelog pipeline `p` over `in/#`, results to `out/{key}`; `extra` adds lines.
fn broker_pipeline(extra: &str) -> String {
    format!(
        "[[pipeline]]\nname = \"p\"\ntopics = [\"in/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
         value = \"/v\"\naggregate = \"sum\"\noutput_topic = \"out/{{key}}\"\n\
         emit = \"changelog\"\n{extra}\n"
    )
}

/// Issue 27: a key holding U+FFFF made a result topic mosquitto treats as malformed: it
/// dropped the agent, which reconnected and sent the same result again, for ever, and no
/// later result went out. Now the key is a dead letter (`bad_key`), the connection stays up
/// and the next result arrives.
#[test]
fn a_key_with_a_non_character_is_a_dead_letter_and_the_connection_stays_up() {
    use crate::support::agent::{AgentConfig, CairnProcess};
    use crate::support::{Broker, Collector, publish_all};
    use std::time::Duration;

    let broker = Broker::start();
    let cfg = AgentConfig::new(broker.port(), &broker_pipeline(""));
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    let out = Collector::start(broker.port(), "out/#");
    let input = |id: &str, key: &str| {
        let payload = format!(r#"{{"id":"{id}","k":"{key}","v":1}}"#);
        ("in/x".to_string(), payload.into_bytes(), false)
    };
    publish_all(
        broker.port(),
        &[
            input("e1", r"bad\uFFFF"),
            input("e2", r"\uFDD0"),
            input("e3", "good"),
        ],
    );
    assert!(
        out.wait_for_count(1, Duration::from_secs(20)),
        "the result after the hostile keys never arrived; broker log:\n{}\nagent:\n{}",
        broker.log(),
        agent.stderr_tail(30)
    );
    // Time for a reconnect loop to show, had the hostile topic gone out.
    std::thread::sleep(Duration::from_millis(500));
    let topics: Vec<String> = out.messages().into_iter().map(|m| m.topic).collect();
    assert_eq!(topics, ["out/good"]);
    assert_eq!(
        broker.connections(&cfg.client_id),
        1,
        "the agent was dropped and reconnected; broker log:\n{}",
        broker.log()
    );
    assert_eq!(agent.terminate().code(), Some(0));
    let dead = agent.inspect("dead-letters");
    let reasons: Vec<&str> = dead.iter().filter_map(|d| d["reason"].as_str()).collect();
    assert_eq!(reasons, ["bad_key", "bad_key"], "{dead:?}");
    assert!(
        dead.iter()
            .all(|d| d["detail"].as_str().unwrap().contains("non-character")),
        "{dead:?}"
    );
}

// ---------------------------------------------------------------------------------------
// What a sender makes must fit the store (issue 26).

/// An engine over a real store, for entries the store's bound would refuse.
struct Stored {
    _dir: tempfile::TempDir,
    store: cairn::store::Store,
    engine: Engine,
    offset: u64,
}

impl Stored {
    fn new(spec: PipelineSpec) -> Stored {
        let dir = tempfile::tempdir().unwrap();
        let store = cairn::store::Store::open(dir.path(), 1 << 20, cairn::fsio::real()).unwrap();
        let engine = Engine::new(vec![spec], Default::default());
        Stored {
            _dir: dir,
            store,
            engine,
            offset: 0,
        }
    }

    fn apply(&mut self, topic: &str, payload: &[u8]) -> Vec<String> {
        let rec = Record {
            offset: self.offset,
            received_at_ms: 1_000,
            topic: topic.into(),
            payload: payload.to_vec(),
            qos: 1,
            retain: false,
        };
        self.offset += 1;
        let outcomes = self.engine.apply(&self.store, &rec).unwrap();
        outcomes.iter().map(|o| format!("{o:?}")).collect()
    }

    /// Commit a checkpoint; it must be accepted (a refusal here is a crash loop: replay
    /// would make the same entry again).
    fn commit(&mut self) -> cairn::pipeline::engine::Checkpoint {
        let cp = self.engine.take_checkpoint();
        self.store
            .commit(&cp, 0)
            .expect("the store takes every entry the engine makes");
        cp
    }
}

fn json_pipeline(extra: &str) -> PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        "name = \"p\"\ntopics = [\"in/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\n\
         aggregate = \"sum\"\noutput_topic = \"out/{{key}}\"\nemit = \"changelog\"\n{extra}\n"
    ))
    .unwrap()
}

/// A key of 1,024 bytes that topic escaping triples (allowed before this release with
/// `max_key_len = 1024`), or a long output topic, made an outbox entry over the store's
/// bound: every checkpoint failed, and after a crash so did every start. The engine now
/// refuses such an event as a dead letter before any state changes, and the checkpoint
/// commits.
#[test]
fn a_result_too_large_for_the_store_is_a_dead_letter_not_a_failed_checkpoint() {
    // A spec the config no longer accepts (validation refuses it), as an older config made.
    let mut spec = json_pipeline("");
    spec.max_key_len = 1024;
    let mut s = Stored::new(spec.clone());
    let key = "/".repeat(1024);
    let out = s.apply(
        "in/a",
        format!(r#"{{"id":"e1","k":"{key}","v":1}}"#).as_bytes(),
    );
    assert_eq!(out, ["DeadLetter { reason: \"result_too_large\" }"]);
    // The largest keys that fit still make results.
    let fits = "/".repeat(600);
    let out = s.apply(
        "in/a",
        format!(r#"{{"id":"e2","k":"{fits}","v":1}}"#).as_bytes(),
    );
    assert!(out[0].starts_with("Applied"), "{out:?}");
    let cp = s.commit();
    assert_eq!(cp.batch.dead_letters[0].reason, "result_too_large");
    assert!(
        cp.batch.dead_letters[0].detail.contains("max_key_len"),
        "{}",
        cp.batch.dead_letters[0].detail
    );
    assert_eq!(cp.batch.outputs.len(), 1);

    // A long template and a short key.
    let mut spec = json_pipeline("");
    spec.output_topic = format!("out/{}/{{key}}", "t".repeat(7000));
    let mut s = Stored::new(spec);
    let out = s.apply("in/a", br#"{"id":"e1","k":"a","v":1}"#);
    assert_eq!(out, ["DeadLetter { reason: \"result_too_large\" }"]);
    s.commit();
}

/// Keys of every length up to 1,024 bytes made of one character each: those topic escaping
/// triples, those JSON escaping doubles, a multi-byte one, a plain one.
fn feed_keys(s: &mut Stored) -> Vec<String> {
    let mut outcomes = Vec::new();
    for (i, len) in [1usize, 300, 400, 500, 600, 700, 1024]
        .into_iter()
        .enumerate()
    {
        for (j, unit) in ["/", "\"", "\\", "%", "é", "a"].into_iter().enumerate() {
            let key = unit.repeat((len / unit.len()).max(1));
            let payload = serde_json::json!({
                "id": format!("e{i}-{j}"), "k": key, "v": -1.2345678901234567e-300
            });
            outcomes.extend(s.apply("in/a", payload.to_string().as_bytes()));
        }
    }
    outcomes
}

/// Whether a result fits is decided from the key and the definition alone: a replay from
/// the same checkpoint refuses exactly the same events, and the store never meets a result
/// it refuses, whatever the key's characters, for every aggregate list and window.
#[test]
fn every_result_the_engine_makes_fits_the_store_and_replay_decides_the_same() {
    let aggregates = [
        "\"sum\"",
        r#"["count", "sum", "min", "max", "avg", "last", "stddev", "variance", "p1", "p95", "p99.9"]"#,
    ];
    let windows = ["", "window = { size = \"1ms\" }"];
    for agg in aggregates {
        for window in windows {
            let topic = if window.is_empty() {
                "out/{key}/{key}"
            } else {
                "o/{key}/{window_start}"
            };
            let mut spec = cairn::config::pipeline_from_toml(&format!(
                "name = \"{}\"\ntopics = [\"in/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
                 value = \"/v\"\naggregate = {agg}\noutput_topic = \"{topic}\"\n\
                 emit = \"changelog\"\n{window}\n",
                "n".repeat(64)
            ))
            .unwrap();
            spec.max_key_len = 1024;
            let mut s = Stored::new(spec.clone());
            let outcomes = feed_keys(&mut s);
            let cp = s.commit();
            let refused = outcomes
                .iter()
                .filter(|o| o.contains("result_too_large"))
                .count();
            let applied = outcomes.iter().filter(|o| o.starts_with("Applied")).count();
            let other: Vec<_> = outcomes
                .iter()
                .filter(|o| !o.starts_with("Applied") && !o.contains("result_too_large"))
                .collect();
            assert!(other.is_empty(), "{other:?}");
            assert!(
                refused > 0 && applied > 0,
                "{agg} {window}: {refused} {applied}"
            );
            // Replay: the same records from the same (empty) checkpoint decide the same.
            let mut again = Stored::new(spec);
            assert_eq!(feed_keys(&mut again), outcomes);
            assert_eq!(again.commit().batch, cp.batch);
        }
    }
}

/// A dead letter holds the sender's topic (up to 64 KiB) and a detail that may quote a
/// sender's field; the engine cuts them where it makes the letter, so it fits one entry.
#[test]
fn a_dead_letter_from_a_huge_topic_and_field_fits_the_store() {
    let spec = cairn::config::pipeline_from_toml(
        "name = \"d\"\ntopics = [\"#\"]\nformat = \"delimited\"\nevent_id = \"0\"\nkey = \"1\"\n\
         value = \"2\"\naggregate = \"sum\"\noutput_topic = \"out/{key}\"\n",
    )
    .unwrap();
    let mut s = Stored::new(spec);
    let topic = format!("in/{}", "t".repeat(65_000));
    let field = "x".repeat(200_000);
    let out = s.apply(&topic, format!("e1/k/{field}").as_bytes());
    assert_eq!(out, ["DeadLetter { reason: \"wrong_type\" }"]);
    let cp = s.commit();
    let letter = &cp.batch.dead_letters[0];
    assert!(
        letter.topic.len() < 1024 && letter.detail.len() < 2048,
        "cut where made"
    );
    assert!(letter.topic.ends_with(&format!("({} bytes)", topic.len())));
}

/// A key's state must fit beside its key too: a sketch of many buckets under a long key is
/// refused (`state_too_large`) before it changes, and what the engine keeps, the store takes.
#[test]
fn a_state_too_large_for_the_store_is_a_dead_letter() {
    let mut spec = json_pipeline("");
    spec.aggregate =
        cairn::pipeline::AggregateSpec::One(cairn::pipeline::Aggregate::Percentile(500));
    spec.max_key_len = 600;
    let mut s = Stored::new(spec);
    let key = "k".repeat(600);
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    // Values spread over many buckets (powers of two apart, with a mantissa step).
    for i in 0..600u64 {
        let v = (1u64 << (i % 50)) as f64 * (1.0 + (i / 50) as f64 / 128.0);
        let out = s.apply(
            "in/a",
            format!(r#"{{"id":"e{i}","k":"{key}","v":{v}}}"#).as_bytes(),
        );
        *reasons
            .entry(out[0].split(' ').next().unwrap().to_string())
            .or_default() += 1;
        if i % 100 == 99 {
            s.commit();
        }
    }
    s.commit();
    assert!(reasons.contains_key("Applied"), "{reasons:?}");
}

/// Issue 26: with `max_key_len = 1024` one key of slashes made a result too large for the
/// store; results leave before their checkpoint, so it went out, but after a kill the replay
/// stored it again and every start failed. Now the config is refused and names the largest
/// `max_key_len` that fits; at that length, the worst key survives a kill and a restart.
#[test]
fn the_longest_key_the_config_allows_survives_a_kill_and_a_restart() {
    use crate::support::agent::{AgentConfig, CairnProcess};
    use crate::support::{Broker, Collector, publish_all};
    use std::time::Duration;

    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), &broker_pipeline("max_key_len = 1024"));
    // No checkpoint before the kill: the restart's replay makes the result again.
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    let mut agent = CairnProcess::new(&cfg);
    let (status, out, _) = agent.command(&["validate"]);
    let len = if status.success() {
        1024 // a build that accepts it: the crash loop below
    } else {
        assert!(out.contains("pipeline[0].max_key_len"), "{out}");
        let at_most = out
            .split("lower max_key_len to at most ")
            .nth(1)
            .expect("a fit");
        at_most[..at_most.find(|c: char| !c.is_ascii_digit()).unwrap()]
            .parse()
            .unwrap()
    };
    cfg.pipelines = broker_pipeline(&format!("max_key_len = {len}"));
    agent.rewrite_config(&cfg);
    agent.start_connected();
    let results = Collector::start(broker.port(), "out/#");
    let payload = serde_json::json!({"id": "e1", "k": "/".repeat(len), "v": 1});
    publish_all(
        broker.port(),
        &[("in/x".into(), payload.to_string().into_bytes(), false)],
    );
    assert!(
        results.wait_for_count(1, Duration::from_secs(20)),
        "no result; agent:\n{}",
        agent.stderr_tail(30)
    );
    agent.kill();
    agent.start();
    agent.wait_connected(Duration::from_secs(20));
    // The replayed result goes out again under its ID, and the agent stays up.
    assert!(
        results.wait_for_count(2, Duration::from_secs(20)),
        "{}",
        agent.stderr_tail(30)
    );
    let seen = results.messages();
    assert_eq!(seen[0], seen[1], "the same result, byte for byte");
    assert!(
        !agent.run_stderr().contains("ERROR"),
        "{}",
        agent.run_stderr()
    );
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(30)
    );
    agent.start_connected();
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(30)
    );
}

/// Issue 26: a stand-in for an input over `log.max_payload` kept its first KiB, and a dead
/// letter's identity hashed only what was kept: two different oversized inputs with one
/// prefix were one dead letter and a duplicate. The stand-in now carries the size and a
/// hash of the whole payload.
#[test]
fn two_oversized_inputs_with_one_prefix_are_two_dead_letters() {
    use crate::support::agent::{AgentConfig, CairnProcess};
    use crate::support::{Broker, publish_all, wait_until};
    use std::time::Duration;

    let broker = Broker::start();
    let cfg = AgentConfig::new(broker.port(), &broker_pipeline(""));
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    let big = |tail: u8| {
        let mut p = vec![b'{'; 2048];
        p.extend(std::iter::repeat_n(tail, 100 * 1024));
        ("in/x".to_string(), p, false)
    };
    // Two different payloads behind one prefix, then the first again (a real duplicate).
    publish_all(broker.port(), &[big(b'a'), big(b'b'), big(b'a')]);
    assert!(wait_until(Duration::from_secs(20), || agent
        .run_stderr()
        .contains("too_large")
        || agent.checkpointed_offset().is_some_and(|o| o >= 3)));
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(30)
    );
    let dead = agent.inspect("dead-letters");
    let reasons: Vec<&str> = dead.iter().filter_map(|d| d["reason"].as_str()).collect();
    assert_eq!(reasons, ["too_large", "too_large"], "{dead:?}");
    let status = agent.command(&["status", "--json"]).1;
    assert!(status.contains("\"duplicates\":1"), "{status}");
}
