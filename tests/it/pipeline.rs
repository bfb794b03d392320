//! The pure pipeline engine over an in-memory checkpoint: parsing, dead letters, dedup,
//! windows and output IDs. No disk, no broker.
//!
//! Why ~900 lines: one test per engine rule (parsing, each dead-letter reason, dedup,
//! windows, IDs, the README's worked example); the tests are the list of rules.

use cairn::model::Record;
use cairn::pipeline::engine::{Engine, Outcome};
use cairn::pipeline::field::{Field, Format};
use cairn::pipeline::memory::MemState;
use cairn::pipeline::spec::*;

fn json_spec(aggregate: Aggregate) -> PipelineSpec {
    let mut spec = cairn::config::pipeline_from_toml(
        r#"name = "balances"
topics = ["payments/#"]
event_id = "/id"
key = "/account"
value = "/amount"
aggregate = "sum"
output_topic = "balances/{key}"
max_key_len = 32
max_keys = 3"#,
    )
    .unwrap();
    spec.aggregate = AggregateSpec::One(aggregate);
    spec
}

struct Harness {
    engine: Engine,
    mem: MemState,
    offset: u64,
}

impl Harness {
    fn new(specs: Vec<PipelineSpec>) -> Harness {
        Harness {
            engine: Engine::new(specs, Default::default()),
            mem: MemState::default(),
            offset: 0,
        }
    }
    fn feed_at(&mut self, payload: &[u8], received_at_ms: u64) -> Vec<Outcome> {
        let rec = Record {
            offset: self.offset,
            received_at_ms,
            topic: "payments/eu".into(),
            payload: payload.to_vec(),
            qos: 1,
            retain: false,
        };
        self.offset += 1;
        self.engine.apply(&self.mem, &rec).unwrap()
    }
    fn feed(&mut self, payload: &str) -> Vec<Outcome> {
        let t = 1_000 + self.offset;
        self.feed_at(payload.as_bytes(), t)
    }
    fn checkpoint(&mut self) {
        let cp = self.engine.take_checkpoint();
        self.mem.commit(&cp);
        let mem = &self.mem;
        self.engine.set_dedup_entries(|name| {
            mem.progress
                .pipelines
                .iter()
                .find(|p| p.name == name)
                .map_or(0, |p| p.dedup_entries)
        });
    }
    fn value(&self, key: &str) -> Option<serde_json::Value> {
        self.mem
            .state
            .get(&("balances".to_string(), key.as_bytes().to_vec()))
            .map(|s| s.value_json())
    }
}

fn dead(reason: &'static str) -> Vec<Outcome> {
    vec![Outcome::DeadLetter { reason }]
}

#[test]
fn bad_payloads_of_every_kind_become_dead_letters_and_processing_goes_on() {
    let mut h = Harness::new(vec![json_spec(Aggregate::Sum)]);
    assert_eq!(h.feed("not json"), dead("not_json"));
    assert_eq!(h.feed(r#"{"id":"E1","amount":5}"#), dead("missing_field"));
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":"5"}"#),
        dead("wrong_type")
    );
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":true}"#),
        dead("wrong_type")
    );
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":null}"#),
        dead("missing_field")
    );
    assert_eq!(
        h.feed(r#"{"id":"E1","account":{"x":1},"amount":1}"#),
        dead("wrong_type")
    );
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":18446744073709551615}"#),
        dead("out_of_range")
    );
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":1e300}"#),
        dead("out_of_range")
    );
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":123456789012345678901234567890}"#),
        dead("out_of_range")
    );
    assert_eq!(h.feed(""), dead("empty"));
    assert_eq!(h.feed_at(&[0xff, 0x00, 0xc3, 0x28], 1), dead("not_utf8"));
    let long = format!(r#"{{"id":"E1","account":"{}","amount":1}}"#, "k".repeat(33));
    assert_eq!(h.feed(&long), dead("key_too_long"));
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"","amount":1}"#),
        dead("bad_key")
    );
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"a\u0000b","amount":1}"#),
        dead("bad_key")
    );
    // Issue 27: code points an MQTT receiver may refuse in a topic, as JSON escapes and raw.
    for key in [
        r"a\uFFFF",
        r"\uFFFE",
        r"x\uFDD0",
        r"\uFDEF",
        r"\uD83F\uDFFF",
        r"\u0085",
        r"\u007F",
        "\u{FFFF}",
        "a\u{10FFFF}",
        "\u{9F}",
    ] {
        let payload = format!(r#"{{"id":"E1","account":"{key}","amount":1}}"#);
        assert_eq!(h.feed(&payload), dead("bad_key"), "{key}");
    }
    // Next to them, what a receiver must accept is a key.
    let mut spec = json_spec(Aggregate::Sum);
    spec.max_keys = 10;
    let mut ok = Harness::new(vec![spec]);
    for (i, key) in ["\u{FDCF}", "\u{FFFD}", "\u{A0}", "\u{1F600}", r"\uFDF0"]
        .iter()
        .enumerate()
    {
        let payload = format!(r#"{{"id":"ok{i}","account":"{key}","amount":1}}"#);
        assert!(
            matches!(ok.feed(&payload)[..], [Outcome::Applied { .. }]),
            "{key}"
        );
    }
    assert_eq!(
        h.feed(r#"{"id":"","account":"A","amount":1}"#),
        dead("empty_id")
    );
    // ...and the next good event is applied as if nothing happened.
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":5}"#),
        vec![Outcome::Applied {
            key: "A".into(),
            version: 1
        }]
    );
    h.checkpoint();
    assert_eq!(h.value("A"), Some(serde_json::json!(5)));
    assert_eq!(h.mem.dead.len(), 25);
    let reasons: Vec<_> = h.mem.dead.values().map(|d| d.reason.as_str()).collect();
    assert!(reasons.contains(&"not_utf8"));
    let non_character = h
        .mem
        .dead
        .values()
        .find(|d| d.detail.contains("U+FFFF"))
        .unwrap();
    assert!(
        non_character.detail.contains("non-character") && non_character.detail.contains("MQTT"),
        "{}",
        non_character.detail
    );
    assert!(h.mem.dead.values().all(|d| !d.detail.is_empty()));
}

#[test]
fn integer_overflow_is_a_dead_letter_not_a_wrap() {
    let mut h = Harness::new(vec![json_spec(Aggregate::Sum)]);
    h.feed(&format!(
        r#"{{"id":"E1","account":"A","amount":{}}}"#,
        i64::MAX
    ));
    assert_eq!(
        h.feed(r#"{"id":"E2","account":"A","amount":1}"#),
        dead("overflow")
    );
    h.checkpoint();
    assert_eq!(h.value("A"), Some(serde_json::json!(i64::MAX)));
}

#[test]
fn the_key_limit_refuses_new_keys_but_updates_old_ones() {
    let mut h = Harness::new(vec![json_spec(Aggregate::Count)]);
    for (i, k) in ["A", "B", "C"].iter().enumerate() {
        h.feed(&format!(r#"{{"id":"E{i}","account":"{k}","amount":1}}"#));
    }
    assert_eq!(
        h.feed(r#"{"id":"E9","account":"D","amount":1}"#),
        dead("key_limit")
    );
    assert_eq!(
        h.feed(r#"{"id":"E10","account":"A","amount":1}"#),
        vec![Outcome::Applied {
            key: "A".into(),
            version: 2
        }]
    );
}

#[test]
fn event_id_templates_and_delimited_payloads() {
    let f = Format::Delimited {
        separator: "/".into(),
    };
    let mut spec = json_spec(Aggregate::Sum);
    spec.format = f.clone();
    spec.event_id = Field::parse("{0}-{1}", &f).unwrap();
    spec.key = Field::parse("1", &f).unwrap();
    spec.value = Some(Field::parse("2", &f).unwrap());
    let mut h = Harness::new(vec![spec]);
    h.feed("E2/A/35000");
    assert_eq!(h.feed("E2/A/35000"), vec![Outcome::Duplicate]);
    h.feed("E2/B/1"); // a different template value: E2-B
    assert_eq!(h.feed("E3/A/x"), dead("wrong_type"));
    assert_eq!(h.feed("E3/A"), dead("missing_field"));
    assert_eq!(h.feed("E3/A/99999999999999999999"), dead("out_of_range"));
    assert_eq!(
        h.feed("E4/A/2.5"),
        vec![Outcome::Applied {
            key: "A".into(),
            version: 2
        }]
    );
    h.checkpoint();
    assert_eq!(h.value("A"), Some(serde_json::json!(35002.5)));
    assert_eq!(h.value("B"), Some(serde_json::json!(1)));
}

#[test]
fn hostile_keys_are_escaped_in_topics_and_ids() {
    let mut h = Harness::new(vec![json_spec(Aggregate::Sum)]);
    h.feed(r##"{"id":"E1","account":"a/+#%","amount":1}"##);
    h.checkpoint();
    let out = h.mem.outbox.values().next().unwrap();
    assert_eq!(out.topic, "balances/a%2F%2B%23%25");
    assert_eq!(out.id, "balances/a%2F%2B%23%25/1");
    let v: serde_json::Value = serde_json::from_slice(&out.payload).unwrap();
    assert_eq!(v["key"], "a/+#%");
}

#[test]
fn the_dedup_window_is_measured_in_record_time() {
    let mut spec = json_spec(Aggregate::Sum);
    spec.dedup_window_ms = 1_000;
    let mut h = Harness::new(vec![spec]);
    let e = br#"{"id":"E1","account":"A","amount":5}"#;
    h.feed_at(e, 10_000);
    assert_eq!(h.feed_at(e, 10_999), vec![Outcome::Duplicate]);
    // The box's clock jumping back does not reopen the window: the log clock never goes back.
    assert_eq!(h.feed_at(e, 5_000), vec![Outcome::Duplicate]);
    h.checkpoint();
    assert_eq!(
        h.feed_at(e, 11_000),
        vec![Outcome::Applied {
            key: "A".into(),
            version: 2
        }]
    );
    // Expired entries are pruned at the next checkpoint, and only expired ones.
    h.feed_at(br#"{"id":"E2","account":"A","amount":1}"#, 11_500);
    h.checkpoint();
    assert_eq!(h.mem.dedup.len(), 2);
    h.feed_at(br#"{"id":"E3","account":"A","amount":1}"#, 12_200);
    h.checkpoint();
    let ids: Vec<_> = h.mem.dedup.keys().map(|(_, id)| id.as_str()).collect();
    assert_eq!(ids, ["E2", "E3"]);
    assert_eq!(h.engine.progress().pipelines[0].dedup_entries, 2);
}

/// The outbox after a checkpoint: each result's ID and JSON payload, in outbox order.
fn outbox_json(h: &Harness) -> Vec<(String, serde_json::Value)> {
    h.mem
        .outbox
        .values()
        .map(|o| (o.id.clone(), serde_json::from_slice(&o.payload).unwrap()))
        .collect()
}

/// A sum over one-minute event-time windows (`/ts`) with 30 s of allowed lateness.
fn minute_windows(emit: Emit) -> PipelineSpec {
    let mut spec = json_spec(Aggregate::Sum);
    spec.event_time = Some(Field::parse("/ts", &Format::Json).unwrap());
    spec.window = Some(WindowSpec {
        size_ms: 60_000,
        allowed_lateness_ms: 30_000,
        slide_ms: None,
    });
    spec.output_topic = "balances/{key}/{window_start}".into();
    spec.emit = emit;
    spec
}

#[test]
fn late_events_within_lateness_update_their_window_beyond_it_are_dead_letters() {
    let mut h = Harness::new(vec![minute_windows(Emit::Changelog)]);
    let ev = |id: &str, amount: i64, ts: &str| {
        format!(r#"{{"id":"{id}","account":"A","amount":{amount},"ts":{ts}}}"#)
    };
    h.feed(&ev("E1", 1, "0"));
    h.feed(&ev("E2", 2, "\"1970-01-01T00:01:10Z\"")); // window 60000, watermark 40000
    // Window 0 is still open (watermark 40000 < 60000): the late event updates it.
    assert_eq!(
        h.feed(&ev("E3", 4, "59999")),
        vec![Outcome::Applied {
            key: "A".into(),
            version: 2
        }]
    );
    h.feed(&ev("E4", 8, "95000")); // watermark 65000 closes window 0
    assert_eq!(h.feed(&ev("E5", 16, "1000")), dead("late"));
    assert_eq!(
        h.feed(&ev("E6", 1, "\"yesterday\"")),
        dead("bad_event_time")
    );
    h.checkpoint();
    let outs = outbox_json(&h);
    let ids: Vec<&str> = outs.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "balances/A/0/1",
            "balances/A/60000/1",
            "balances/A/0/2",
            "balances/A/60000/2"
        ]
    );
    let last = &outs[2].1;
    assert_eq!(
        (
            last["value"].as_i64(),
            last["window_start"].as_u64(),
            last["window_end"].as_u64()
        ),
        (Some(5), Some(0), Some(60_000))
    );
    // The closed window was evicted from state; the open one is there.
    assert_eq!(h.mem.state.len(), 1);
}

#[test]
fn an_upsert_window_closed_before_its_flush_is_still_emitted_with_its_last_state() {
    // The engine no longer keeps its own copy of a waiting upsert's state: the flush reads
    // the batch's, and an eviction must hand the state over before the batch forgets it.
    let mut h = Harness::new(vec![minute_windows(Emit::Upsert)]);
    let ev = |id: &str, amount: i64, ts: u64| {
        format!(r#"{{"id":"{id}","account":"A","amount":{amount},"ts":{ts}}}"#)
    };
    h.feed(&ev("E1", 1, 0));
    h.feed(&ev("E2", 2, 30_000));
    // Watermark 65000 closes window 0 with both its events still waiting as one upsert.
    h.feed(&ev("E3", 4, 95_000));
    assert_eq!(h.mem.state.len(), 0, "nothing committed yet");
    h.checkpoint();
    let outs = outbox_json(&h);
    let ids: Vec<&str> = outs.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["balances/A/0/2", "balances/A/60000/1"]);
    assert_eq!(outs[0].1["value"].as_i64(), Some(3));
    assert_eq!(outs[1].1["value"].as_i64(), Some(4));
    // Window 0 was evicted from state; the open one is there.
    assert_eq!(h.mem.state.len(), 1);
}

#[test]
fn upsert_emits_one_output_per_touched_key_per_checkpoint() {
    let mut h = Harness::new(vec![json_spec(Aggregate::Sum)]);
    for i in 0..5 {
        h.feed(&format!(r#"{{"id":"E{i}","account":"A","amount":10}}"#));
    }
    h.feed(r#"{"id":"E9","account":"B","amount":1}"#);
    h.checkpoint();
    let ids: Vec<_> = h.mem.outbox.values().map(|o| o.id.as_str()).collect();
    assert_eq!(ids, ["balances/A/5", "balances/B/1"]);
}

#[test]
fn the_same_bad_payload_twice_is_one_dead_letter_and_one_duplicate() {
    let mut h = Harness::new(vec![json_spec(Aggregate::Sum)]);
    assert_eq!(h.feed("garbage"), dead("not_json"));
    // A broker redelivery after a crash, or the same bad message published again.
    assert_eq!(h.feed("garbage"), vec![Outcome::Duplicate]);
    // A corrected message is accepted, even under an ID a refused copy carried.
    let bad = r#"{"id":"E1","account":"A","amount":"x"}"#;
    assert_eq!(h.feed(bad), dead("wrong_type"));
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":1}"#),
        vec![Outcome::Applied {
            key: "A".into(),
            version: 1
        }]
    );
    h.checkpoint();
    assert_eq!(h.mem.dead.len(), 2);
    assert_eq!(h.engine.progress().pipelines[0].counters.duplicates, 1);
}

fn windowed_spec(aggregate: &str, output_topic: &str) -> PipelineSpec {
    let value = if aggregate == "count" {
        ""
    } else {
        "value = \"/amount\"\n"
    };
    cairn::config::pipeline_from_toml(&format!(
        r#"name = "balances"
topics = ["payments/#"]
event_id = "/id"
key = "/account"
{value}event_time = "/ts"
aggregate = "{aggregate}"
window = {{ size = "1m", allowed_lateness = "30s" }}
output_topic = "{output_topic}"
emit = "changelog""#
    ))
    .unwrap()
}

fn applied(key: &str, version: u64) -> Vec<Outcome> {
    vec![Outcome::Applied {
        key: key.into(),
        version,
    }]
}

/// 2026-11-30T11:22:00Z, a whole minute.
const NOW: u64 = 1_796_037_720_000;
/// 2100-01-01T00:00:00Z.
const YEAR_2100: u64 = 4_102_444_800_000;

#[test]
fn an_event_time_near_u64_max_is_a_dead_letter_not_a_crash_loop() {
    let mut h = Harness::new(vec![windowed_spec("sum", "balances/{key}/{window_start}")]);
    let ev = |id: &str, ts: u64| format!(r#"{{"id":"{id}","account":"A","amount":1,"ts":{ts}}}"#);
    // The field report: one record dated u64::MAX - 1. Before the fix, `start + size`
    // overflowed while emitting it, and replay met the same panic on every restart.
    assert_eq!(
        h.feed_at(ev("E1", u64::MAX - 1).as_bytes(), NOW),
        dead("future")
    );
    // A box whose own clock says u64::MAX (no event-time field needed for that: the time of
    // receipt is the event time): its window cannot end, so it is refused too.
    assert_eq!(
        h.feed_at(ev("E2", u64::MAX - 1).as_bytes(), u64::MAX),
        dead("bad_event_time")
    );
    assert_eq!(h.feed_at(ev("E3", NOW).as_bytes(), NOW), applied("A", 1));
    h.checkpoint();
    let d: Vec<_> = h.mem.dead.values().map(|d| d.detail.clone()).collect();
    assert!(d[1].contains("ends beyond"), "{d:?}");
    assert_eq!(h.mem.outbox.len(), 1);
}

#[test]
fn one_event_from_2100_does_not_make_every_later_event_late() {
    let mut h = Harness::new(vec![windowed_spec("sum", "balances/{key}/{window_start}")]);
    let ev = |id: &str, ts: u64| format!(r#"{{"id":"{id}","account":"A","amount":1,"ts":{ts}}}"#);
    assert_eq!(
        h.feed_at(ev("E1", YEAR_2100).as_bytes(), NOW),
        dead("future")
    );
    assert_eq!(h.feed_at(ev("E2", NOW).as_bytes(), NOW), applied("A", 1));
    assert_eq!(
        h.feed_at(ev("E3", NOW + 60_000).as_bytes(), NOW + 1),
        applied("A", 1)
    );
    // Within max_future (10 minutes by default) is fine: device clocks drift.
    assert_eq!(
        h.feed_at(ev("E4", NOW + 600_000).as_bytes(), NOW + 2),
        applied("A", 1)
    );
    assert_eq!(
        h.engine.progress().pipelines[0].max_event_time_ms,
        NOW + 600_000
    );
    h.checkpoint();
    let future = h.mem.dead.values().next().unwrap();
    assert_eq!(future.reason, "future");
    assert!(
        future.detail.contains(&YEAR_2100.to_string()) && future.detail.contains(&NOW.to_string()),
        "{}",
        future.detail
    );
}

#[test]
fn one_event_from_2100_does_not_pin_last() {
    let mut spec = json_spec(Aggregate::Last);
    spec.event_time = Some(Field::parse("/ts", &Format::Json).unwrap());
    let mut h = Harness::new(vec![spec]);
    let ev = |id: &str, v: i64, ts: u64| {
        format!(r#"{{"id":"{id}","account":"A","amount":{v},"ts":{ts}}}"#)
    };
    assert_eq!(h.feed_at(ev("E1", 1, NOW).as_bytes(), NOW), applied("A", 1));
    assert_eq!(
        h.feed_at(ev("E2", 99, YEAR_2100).as_bytes(), NOW),
        dead("future")
    );
    assert_eq!(
        h.feed_at(ev("E3", 3, NOW + 1_000).as_bytes(), NOW + 1_000),
        applied("A", 2)
    );
    h.checkpoint();
    assert_eq!(h.value("A"), Some(serde_json::json!(3)));
}

#[test]
fn max_future_is_a_validated_pipeline_key() {
    let base = r#"name = "p"
topics = ["t/#"]
event_id = "/id"
key = "/k"
aggregate = "count"
output_topic = "o/{key}""#;
    let spec = cairn::config::pipeline_from_toml(&format!("{base}\nmax_future = \"1s\"")).unwrap();
    assert_eq!(spec.max_future_ms, 1_000);
    let err = cairn::config::pipeline_from_toml(&format!("{base}\nmax_future = \"400d\""))
        .unwrap_err()
        .to_string();
    assert!(err.contains("pipeline[0].max_future"), "{err}");
    let err = cairn::config::pipeline_from_toml(&format!("{base}\nmax_id_len = 0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("pipeline[0].max_id_len"), "{err}");
    let spec = cairn::config::pipeline_from_toml(base).unwrap();
    assert_eq!((spec.max_future_ms, spec.max_id_len), (600_000, 256));
}

#[test]
fn event_ids_longer_than_max_id_len_are_dead_letters_even_from_templates() {
    let mut spec = json_spec(Aggregate::Sum);
    spec.max_id_len = 16;
    let mut h = Harness::new(vec![spec.clone()]);
    let ev = |id: &str| format!(r#"{{"id":"{id}","account":"A","amount":1}}"#);
    assert_eq!(h.feed(&ev(&"i".repeat(16))), applied("A", 1));
    assert_eq!(h.feed(&ev(&"i".repeat(17))), dead("id_too_long"));
    // The field report: a 200 KB ID once became a sled value over the blob threshold.
    assert_eq!(h.feed(&ev(&"i".repeat(200_000))), dead("id_too_long"));

    // A template stops growing once it is over the limit.
    spec.event_id = Field::parse("{/id}{/id}{/id}{/id}", &Format::Json).unwrap();
    let mut h = Harness::new(vec![spec]);
    assert_eq!(h.feed(&ev("abcd")), applied("A", 1));
    assert_eq!(h.feed(&ev("abcde")), dead("id_too_long"));
    h.checkpoint();
    let d = h.mem.dead.values().next().unwrap();
    assert!(d.detail.contains("max_id_len"), "{}", d.detail);
}

#[test]
fn a_key_spelling_a_placeholder_does_not_share_a_topic_with_its_substitution() {
    let mut h = Harness::new(vec![windowed_spec("count", "w/{key}")]);
    let ev = |id: &str, key: &str| format!(r#"{{"id":"{id}","account":"{key}","ts":{NOW}}}"#);
    h.feed_at(ev("E1", "X{window_start}").as_bytes(), NOW);
    h.feed_at(ev("E2", &format!("X{NOW}")).as_bytes(), NOW);
    h.feed_at(ev("E3", "{key}").as_bytes(), NOW);
    h.checkpoint();
    let topics: Vec<_> = h.mem.outbox.values().map(|o| o.topic.as_str()).collect();
    assert_eq!(
        topics,
        ["w/X%7Bwindow_start%7D", "w/X1796037720000", "w/%7Bkey%7D"]
    );
}

#[test]
fn a_key_starting_with_dollar_never_reaches_a_dollar_topic() {
    let mut spec = json_spec(Aggregate::Sum);
    spec.output_topic = "{key}".into();
    let mut h = Harness::new(vec![spec.clone()]);
    h.feed(r#"{"id":"E1","account":"$SYS","amount":1}"#);
    h.checkpoint();
    let out = h.mem.outbox.values().next().unwrap();
    assert_eq!(out.topic, "%24SYS");
    assert_eq!(out.id, "balances/%24SYS/1");

    // A template that starts with `$` is refused by the config; one built by hand meets the
    // check at apply time instead of a broker that drops the result silently.
    spec.output_topic = "$x/{key}".into();
    let mut h = Harness::new(vec![spec]);
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"A","amount":1}"#),
        dead("bad_topic")
    );
    let base = r#"name = "p"
topics = ["t/#"]
event_id = "/id"
key = "/k"
aggregate = "count"
output_topic = "$x/{key}""#;
    assert!(cairn::config::pipeline_from_toml(base).is_err());
}

#[test]
fn a_topic_over_the_mqtt_limit_is_a_dead_letter_not_a_disconnect() {
    let mut spec = json_spec(Aggregate::Sum);
    spec.max_key_len = 1_024;
    spec.output_topic = format!("{}/{{key}}", "t".repeat(64_000));
    let mut h = Harness::new(vec![spec]);
    let long = format!(
        r#"{{"id":"E2","account":"{}","amount":1}}"#,
        "/".repeat(300)
    );
    assert_eq!(h.feed(&long), dead("topic_too_long"));
    // Under MQTT's limit, such a topic still makes a result too large for one stored entry
    // (issue 26; config validation refuses the template): a dead letter as well.
    assert_eq!(
        h.feed(r#"{"id":"E1","account":"short","amount":1}"#),
        dead("result_too_large")
    );
    h.checkpoint();
    assert!(h.mem.outbox.is_empty());
    assert!(h.mem.dead.values().all(|d| d.detail.len() < 1024));
}

/// Issue 15.1: a list of aggregates gives one result with `values`, one entry per name.
#[test]
fn a_list_of_aggregates_gives_one_result_with_every_value() {
    let spec = cairn::config::pipeline_from_toml(
        r#"name = "telemetry"
topics = ["payments/#"]
event_id = "/id"
key = "/account"
value = "/amount"
aggregate = ["min", "max", "avg", "count", "sum", "last", "stddev", "variance", "p50", "p95", "p99.9"]
output_topic = "t/{key}""#,
    )
    .unwrap();
    let mut h = Harness::new(vec![spec]);
    for (i, v) in [2, 4, 4, 4, 5, 5, 7, 9].iter().enumerate() {
        let e = format!(r#"{{"id":"E{i}","account":"A","amount":{v}}}"#);
        assert_eq!(h.feed(&e), applied("A", i as u64 + 1));
    }
    h.checkpoint();
    assert_eq!(h.mem.outbox.len(), 1, "one result per key and checkpoint");
    let out = h.mem.outbox.values().next().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.payload).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "id": "telemetry/A/8", "pipeline": "telemetry", "key": "A", "version": 8,
            "count": 8,
            "values": {
                "min": 2, "max": 9, "avg": 5.0, "count": 8, "sum": 40, "last": 9,
                "stddev": 2.0, "variance": 4.0, "p50": 4.0, "p95": 9.0, "p99.9": 9.0,
            },
        })
    );
    assert!(v.get("value").is_none());
}

/// A single aggregate keeps today's payload exactly: `value`, no `values`.
#[test]
fn a_single_aggregate_payload_is_unchanged() {
    let mut h = Harness::new(vec![json_spec(Aggregate::Sum)]);
    h.feed(r#"{"id":"E1","account":"A","amount":5}"#);
    h.checkpoint();
    let out = h.mem.outbox.values().next().unwrap();
    assert_eq!(
        String::from_utf8(out.payload.clone()).unwrap(),
        r#"{"count":1,"id":"balances/A/1","key":"A","pipeline":"balances","value":5,"version":1}"#
    );
}

#[test]
fn stddev_variance_and_percentiles_alone() {
    let run = |agg: Aggregate| {
        let mut h = Harness::new(vec![json_spec(agg)]);
        for (i, v) in [1.5, 2.5, -3.0, 10.0].iter().enumerate() {
            h.feed(&format!(r#"{{"id":"E{i}","account":"A","amount":{v}}}"#));
        }
        h.checkpoint();
        h.value("A").unwrap().as_f64().unwrap()
    };
    let mean = (1.5 + 2.5 - 3.0 + 10.0) / 4.0;
    let var = [1.5f64, 2.5, -3.0, 10.0]
        .iter()
        .map(|x| (x - mean) * (x - mean))
        .sum::<f64>()
        / 4.0;
    assert!((run(Aggregate::Variance) - var).abs() < 1e-12);
    assert!((run(Aggregate::Stddev) - var.sqrt()).abs() < 1e-12);
    assert_eq!(run(Aggregate::Percentile(500)), 1.5);
    assert_eq!(run(Aggregate::Percentile(10)), -3.0);
    let p99 = run(Aggregate::Percentile(990));
    assert!((10.0 * (1.0 - 1.0 / 128.0)..=10.0).contains(&p99));
}

/// Issue 15.2: inputs the filter skips are counted, not dead letters; inputs whose
/// compared fields are missing or of the wrong type are dead letters.
#[test]
fn where_skips_and_counts_non_matching_inputs() {
    let spec = cairn::config::pipeline_from_toml(
        r#"name = "balances"
topics = ["payments/#"]
event_id = "/id"
key = "/account"
value = "/amount"
aggregate = "sum"
where = '/status == "running" and /amount > -40 and topic[1] != "test"'
output_topic = "t/{key}""#,
    )
    .unwrap();
    let mut h = Harness::new(vec![spec]);
    let ev = |id: &str, status: &str, amount: &str| {
        format!(r#"{{"id":"{id}","account":"A","status":{status},"amount":{amount}}}"#)
    };
    assert_eq!(h.feed(&ev("E1", r#""running""#, "5")), applied("A", 1));
    assert_eq!(h.feed(&ev("E2", r#""idle""#, "7")), vec![Outcome::Filtered]);
    // `and` stops at the first false: an idle machine need not send a number.
    assert_eq!(
        h.feed(&ev("E3", r#""idle""#, r#""n/a""#)),
        vec![Outcome::Filtered]
    );
    assert_eq!(
        h.feed(&ev("E4", r#""running""#, "-40")),
        vec![Outcome::Filtered]
    );
    assert_eq!(
        h.feed(&ev("E5", r#""running""#, r#""5""#)),
        dead("wrong_type")
    );
    assert_eq!(h.feed(&ev("E6", "1", "5")), dead("wrong_type"));
    assert_eq!(
        h.feed(r#"{"id":"E7","account":"A","amount":5}"#),
        dead("missing_field")
    );
    // A filtered input leaves no dedup entry: the same ID may still come in running.
    assert_eq!(h.feed(&ev("E2", r#""running""#, "1")), applied("A", 2));
    h.checkpoint();
    let c = &h.mem.progress.pipelines[0].counters;
    assert_eq!((c.applied, c.filtered, c.dead_letters), (2, 3, 3));
    assert_eq!(h.value("A"), Some(serde_json::json!(6)));
}

/// Issue 15.3: keys and event IDs from topic levels, alone or mixed with fields.
#[test]
fn keys_and_event_ids_from_topic_levels() {
    let spec = cairn::config::pipeline_from_toml(
        r#"name = "balances"
topics = ["payments/#"]
event_id = "{topic[1]}-{/seq}"
key = "{/site}/{topic[1]}"
value = "/amount"
aggregate = "sum"
output_topic = "t/{key}""#,
    )
    .unwrap();
    let mut h = Harness::new(vec![spec]);
    // The harness publishes on `payments/eu`.
    let r = h.feed(r#"{"seq":1,"site":"s1","amount":5}"#);
    assert_eq!(r, applied("s1/eu", 1));
    assert_eq!(
        h.feed(r#"{"seq":1,"site":"s1","amount":5}"#),
        vec![Outcome::Duplicate]
    );
    assert_eq!(
        h.feed(r#"{"seq":2,"site":"s1","amount":5}"#),
        applied("s1/eu", 2)
    );
    h.checkpoint();
    let out = h.mem.outbox.values().next().unwrap();
    assert_eq!(out.topic, "t/s1%2Feu");
    let spec = cairn::config::pipeline_from_toml(
        r#"name = "lvl"
topics = ["payments/#"]
event_id = "{topic[5]}"
key = "{topic[0]}"
aggregate = "count"
output_topic = "t/{key}""#,
    )
    .unwrap();
    let mut h = Harness::new(vec![spec]);
    assert_eq!(h.feed("{}"), dead("missing_field"));
}

fn hopping(emit: &str) -> PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        r#"name = "balances"
topics = ["payments/#"]
event_id = "/id"
key = "/account"
value = "/amount"
event_time = "/ts"
aggregate = "sum"
window = {{ size = "30s", slide = "10s", allowed_lateness = "5s" }}
output_topic = "t/{{key}}/{{window_start}}"
emit = "{emit}""#
    ))
    .unwrap()
}

fn ev_at(id: &str, amount: i64, ts: u64) -> Vec<u8> {
    format!(r#"{{"id":"{id}","account":"A","amount":{amount},"ts":{ts}}}"#).into_bytes()
}

/// Issue 15.4: an event lands in every window covering it; windows close one by one.
#[test]
fn hopping_windows_take_each_event_in_every_window_covering_it() {
    let mut h = Harness::new(vec![hopping("changelog")]);
    // 25s is covered by the windows starting at 0s, 10s and 20s.
    assert_eq!(
        h.feed_at(&ev_at("E1", 1, NOW + 25_000), NOW),
        applied("A", 1)
    );
    assert_eq!(h.engine.progress().pipelines[0].keys, 3);
    // 35s: windows at 10s, 20s, 30s. The one at 10s now holds both.
    assert_eq!(
        h.feed_at(&ev_at("E2", 2, NOW + 35_000), NOW),
        applied("A", 1)
    );
    // Watermark 45s - 5s = 40s: the window [0s, 30s) closed, [10s, 40s) closes too.
    assert_eq!(
        h.feed_at(&ev_at("E3", 4, NOW + 45_000), NOW),
        applied("A", 1)
    );
    // 29s: its windows at 0s and 10s are closed, 20s (E1, E2, E3) is open: applied there.
    assert_eq!(
        h.feed_at(&ev_at("E4", 8, NOW + 29_000), NOW),
        applied("A", 4)
    );
    // 5s: only window 0s, closed: late.
    assert_eq!(h.feed_at(&ev_at("E5", 16, NOW + 5_000), NOW), dead("late"));
    h.checkpoint();
    let mut sums: Vec<(u64, i64)> = h
        .mem
        .state
        .iter()
        .map(|((_, k), st)| {
            let start = u64::from_be_bytes(k[..8].try_into().unwrap());
            ((start - NOW) / 1000, st.value_json().as_i64().unwrap())
        })
        .collect();
    sums.sort();
    assert_eq!(sums, [(20, 1 + 2 + 4 + 8), (30, 2 + 4), (40, 4)]);
    let p = &h.mem.progress.pipelines[0];
    assert_eq!(p.keys, 3);
    assert_eq!(p.evicted_below, NOW + 20_000);
    // Changelog: one output per window per event: 3 + 3 + 3 + 1.
    assert_eq!(h.mem.outbox.len(), 10);
}

/// Issue 15.5: one result per window when the watermark passes its end plus the allowed
/// lateness, never again; inputs after that are `late`.
#[test]
fn final_emit_publishes_each_window_once_when_it_closes() {
    let mut h = Harness::new(vec![hopping("final")]);
    h.feed_at(&ev_at("E1", 1, NOW + 25_000), NOW);
    h.feed_at(&ev_at("E2", 2, NOW + 28_000), NOW);
    h.checkpoint();
    assert!(h.mem.outbox.is_empty(), "nothing closed yet");
    // Watermark 40s: windows [0s, 30s) and [10s, 40s) close.
    h.feed_at(&ev_at("E3", 4, NOW + 45_000), NOW);
    h.checkpoint();
    let outs: Vec<serde_json::Value> = h
        .mem
        .outbox
        .values()
        .map(|o| serde_json::from_slice(&o.payload).unwrap())
        .collect();
    assert_eq!(outs.len(), 2);
    assert_eq!(outs[0]["window_start"], NOW);
    assert_eq!(outs[0]["window_end"], NOW + 30_000);
    assert_eq!(outs[0]["value"], 3);
    assert_eq!(outs[1]["window_start"], NOW + 10_000);
    assert_eq!(outs[1]["id"], format!("balances/A/{}/2", NOW + 10_000));
    let topics: Vec<&str> = h.mem.outbox.values().map(|o| o.topic.as_str()).collect();
    assert_eq!(topics[0], format!("t/A/{NOW}"));
    // A late input to a closed window is a dead letter and changes no result.
    assert_eq!(h.feed_at(&ev_at("E4", 8, NOW + 9_000), NOW), dead("late"));
    h.feed_at(&ev_at("E5", 1, NOW + 100_000), NOW);
    h.checkpoint();
    let starts: Vec<u64> = h
        .mem
        .outbox
        .values()
        .map(|o| {
            serde_json::from_slice::<serde_json::Value>(&o.payload).unwrap()["window_start"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(
        starts,
        [NOW, NOW + 10_000, NOW + 20_000, NOW + 30_000, NOW + 40_000]
    );
}

#[test]
fn window_slide_and_final_emit_are_validated() {
    let base = |window: &str, emit: &str| {
        cairn::config::pipeline_from_toml(&format!(
            r#"name = "p"
topics = ["a/#"]
event_id = "/id"
key = "/k"
aggregate = "count"
{window}
output_topic = "p/{{key}}"
emit = "{emit}""#
        ))
    };
    let err = |w: &str, e: &str| base(w, e).unwrap_err().to_string();
    assert!(err("", "final").contains("needs a `window`"));
    assert!(
        err(r#"window = { size = "1m", slide = "2m" }"#, "upsert")
            .contains("at most the window size")
    );
    assert!(err(r#"window = { size = "1m", slide = "0s" }"#, "upsert").contains("longer than 0s"));
    assert!(err(r#"window = { size = "1h", slide = "1s" }"#, "upsert").contains("3600 windows"));
    let same = base(r#"window = { size = "1m", slide = "1m" }"#, "final").unwrap();
    assert_eq!(
        same.window.unwrap().slide_ms,
        None,
        "a slide equal to the size is tumbling"
    );
    assert_eq!(same.emit, Emit::Final);
    // A tumbling window keeps its definition, so existing state stays valid.
    assert!(!cairn::pipeline::engine::definition(&same).contains("slide"));
}

/// The README's worked example (issue 15's machine-telemetry job), exactly as documented.
#[test]
fn the_readme_machine_telemetry_example() {
    let spec = cairn::config::pipeline_from_toml(
        r#"name = "machines"
topics = ["plant/+/telemetry"]
event_id = "{topic[1]}-{/seq}"
key = "{topic[1]}"
value = "/temp"
event_time = "/ts"
where = '/status == "running" and /temp > -40'
aggregate = ["min", "max", "avg", "count", "stddev", "p95"]
window = { size = "1m", allowed_lateness = "30s" }
output_topic = "machines/{key}/{window_start}"
emit = "final"
retain = false"#,
    )
    .unwrap();
    let mut engine = Engine::new(vec![spec], Default::default());
    let mut mem = MemState::default();
    let inputs = [
        r#"{"seq":1,"ts":"2026-11-30T12:00:05Z","status":"running","temp":61.5}"#,
        r#"{"seq":2,"ts":"2026-11-30T12:00:20Z","status":"running","temp":64.0}"#,
        r#"{"seq":3,"ts":"2026-11-30T12:00:35Z","status":"idle","temp":20.0}"#,
        r#"{"seq":2,"ts":"2026-11-30T12:00:20Z","status":"running","temp":64.0}"#,
        r#"{"seq":4,"ts":"2026-11-30T12:00:50Z","status":"running","temp":70.5}"#,
        r#"{"seq":5,"ts":"2026-11-30T12:01:31Z","status":"running","temp":66.0}"#,
    ];
    let mut outcomes = Vec::new();
    for (i, p) in inputs.iter().enumerate() {
        let rec = Record {
            offset: i as u64,
            received_at_ms: 1_796_040_100_000,
            topic: "plant/m7/telemetry".into(),
            payload: p.as_bytes().to_vec(),
            qos: 1,
            retain: false,
        };
        outcomes.extend(engine.apply(&mem, &rec).unwrap());
    }
    assert_eq!(outcomes[2], Outcome::Filtered);
    assert_eq!(outcomes[3], Outcome::Duplicate);
    let cp = engine.take_checkpoint();
    mem.commit(&cp);
    let outs: Vec<_> = mem.outbox.values().collect();
    assert_eq!(outs.len(), 1, "only the closed minute has a result");
    assert_eq!(outs[0].topic, "machines/m7/1796040000000");
    assert_eq!(
        String::from_utf8(outs[0].payload.clone()).unwrap(),
        r#"{"count":3,"id":"machines/m7/1796040000000/3","key":"m7","pipeline":"machines","values":{"avg":65.33333333333333,"count":3,"max":70.5,"min":61.5,"p95":70.5,"stddev":3.7932688922470157},"version":3,"window_end":1796040060000,"window_start":1796040000000}"#
    );
}
