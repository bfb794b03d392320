//! The fuzz corpora on stable Rust (issue 26, item 3): every committed seed, corpus file
//! and regression input of `fuzz/` goes through the same `cairn::fuzzing` entry point its
//! fuzz target calls, in every test run, without nightly or cargo-fuzz. A finding of the
//! fuzzers is kept as a file under `fuzz/regressions/TARGET/` and stays fixed here.
//!
//! The seeds are made from real examples by the code that writes them in production (a
//! log the log wrote, a savepoint a store wrote, store entries, Sparkplug payloads encoded
//! with the schema, the example configs): `CAIRN_WRITE_SEEDS=1 cargo test --all-features
//! --test it fuzz_corpus::` writes them to `fuzz/seeds/`, and the test below fails when the
//! committed ones are missing or differ.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cairn::fuzzing::TARGETS;
use cairn::model::Record;
use cairn::pipeline::engine::Engine;
use cairn::pipeline::sparkplug::{Metric, Payload, Value};
use cairn::pipeline::spec::PipelineSpec;
use cairn::store::Store;
use prost::Message;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Every file under `fuzz/{seeds,corpus,regressions}/TARGET/`.
fn inputs(target: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for kind in ["seeds", "corpus", "regressions"] {
        let dir = fuzz_dir().join(kind).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            if path.is_file() {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_committed_fuzz_input_goes_through_its_target_without_a_panic() {
    let mut ran = BTreeMap::new();
    for (name, run) in TARGETS {
        let files = inputs(name);
        assert!(
            !files.is_empty(),
            "no seeds for fuzz target `{name}` under fuzz/seeds/{name}/: write them with \
             CAIRN_WRITE_SEEDS=1 cargo test --all-features --test it fuzz_corpus::"
        );
        for file in &files {
            let data = std::fs::read(file).unwrap();
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(
                outcome.is_ok(),
                "fuzz target `{name}` panics on {} (reproduce: cargo +nightly fuzz run {name} {})",
                file.display(),
                file.display()
            );
        }
        ran.insert(*name, files.len());
    }
    eprintln!("fuzz inputs replayed per target: {ran:?}");
}

/// Each target has its own fuzz target file, and `fuzz/Cargo.toml` builds it.
#[test]
fn every_fuzzing_entry_point_has_a_fuzz_target() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    for (name, _) in TARGETS {
        let file = fuzz_dir().join("fuzz_targets").join(format!("{name}.rs"));
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert!(
            text.contains(&format!("cairn::fuzzing::{name}(data)")),
            "{} does not call cairn::fuzzing::{name}",
            file.display()
        );
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] `{name}`"
        );
    }
}

/// The seeds made from today's examples (what `CAIRN_WRITE_SEEDS=1` writes) go through
/// their targets too: a format that changed since the seeds were committed is still
/// covered. The committed ones may lag (an example config edited since); they stay valid
/// inputs either way.
#[test]
fn seeds_made_from_todays_examples_go_through_their_targets() {
    let write = std::env::var_os("CAIRN_WRITE_SEEDS").is_some();
    for ((target, name), bytes) in seeds() {
        let run = TARGETS
            .iter()
            .find(|(t, _)| *t == target)
            .unwrap_or_else(|| panic!("no fuzz target `{target}`"))
            .1;
        let outcome = std::panic::catch_unwind(|| run(&bytes));
        assert!(
            outcome.is_ok(),
            "fuzz target `{target}` panics on seed `{name}`"
        );
        if write {
            let path = fuzz_dir()
                .join("seeds")
                .join(target)
                .join(format!("seed-{name}"));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, bytes).unwrap();
        }
    }
}

type Seeds = BTreeMap<(&'static str, String), Vec<u8>>;

fn seeds() -> Seeds {
    let mut s = Seeds::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        s.insert((target, name.to_string()), bytes);
    };
    // Payloads: the examples of docs/pipelines.md and the fuzzing pipelines' fields.
    for (name, p) in [
        ("plain", &b"{\"id\": \"e1\", \"k\": \"A\", \"v\": 10}"[..]),
        (
            "rich",
            b"f/m1/y\0{\"dev\": \"d1\", \"seq\": 7, \"a\": {\"b\": [\"x\"]}, \"m\": {\"/x\": 2.5}, \
              \"ts\": 1700000000123, \"st\": \"run\", \"t\": 21.5, \"ok\": true}",
        ),
        ("escapes", b"{\"id\": \"e\\u0041\\n\", \"k\": \"\\\"q\\\"\", \"v\": -1e300}"),
        ("late", b"{\"id\": \"e2\", \"k\": \"A\", \"v\": 1, \"ts\": \"2023-11-14T22:13:20Z\"}"),
        ("extreme", b"{\"id\": 1, \"k\": 2, \"v\": 18446744073709551615, \"ts\": 18446744073709551615}"),
    ] {
        add("json_payload", name, p.to_vec());
    }
    for (name, p) in [
        ("plain", &b"E2/A/35000/1700000000000"[..]),
        ("comma", b"f/b\0E3,K,-7.25"),
        ("short", b"E4"),
        ("binary", &[0xff, 0xfe, b'/', 0x80]),
    ] {
        add("delimited_payload", name, p.to_vec());
    }
    for (name, topic, payload) in sparkplug_examples() {
        let mut b = topic.as_bytes().to_vec();
        b.push(0);
        b.extend_from_slice(&payload);
        add("sparkplug", name, b);
    }
    // Filters: docs/pipelines.md's, and one of every operator.
    for (name, f) in [
        ("docs", "/status == \"running\" and /temp > -40"),
        (
            "all",
            "topic[1] == \"run\" and not ({2} <= -950 or ({2} < -899 and {2} >= -950)) or /b != true",
        ),
        ("float", "/x >= 1.5e3 and /y < -0.25 or /z == \"a\\\"b\""),
        ("allow-list", &allow_list(70)),
    ] {
        add("filter", name, f.as_bytes().to_vec());
    }
    // Configs: the shipped ones.
    for (name, path) in [
        ("example", "config/cairn.toml"),
        ("systemd", "systemd/cairn.toml"),
    ] {
        let text = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap();
        add("config", name, text);
    }
    add("config", "rich", rich_config().into_bytes());
    // pipelines.json as a start writes it, and the two written by older releases.
    let cfg = cairn::config::parse_str(&rich_config(), Path::new("rich.toml")).unwrap();
    add(
        "pipelines_json",
        "rich",
        serde_json::to_vec_pretty(&cfg.pipelines).unwrap(),
    );
    for old in [
        "pipelines_before_text_filters.json",
        "pipelines_before_text_filters_deep.json",
    ] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/pipeline/testdata")
            .join(old);
        add("pipelines_json", old, std::fs::read(path).unwrap());
    }
    // The data directory's small files.
    add(
        "data_files",
        "quarantine",
        [
            &[0u8][..],
            br#"{"version":1,"entries":[{"offset":3,"attempts":2,"topic":"t/a","panic":"boom"}]}"#,
        ]
        .concat(),
    );
    add(
        "data_files",
        "generations",
        b"\x01# Generations of output IDs, per pipeline\nsums 2\nwindows 1\n".to_vec(),
    );
    add(
        "data_files",
        "restored",
        b"\x02checkpoint 7 at offset 50\n".to_vec(),
    );
    // A log, a store and a savepoint as Cairn writes them.
    let dir = tempfile::tempdir().unwrap();
    let (segment, bodies) = real_log(dir.path());
    add("log_segment", "segment", [&[0u8][..], &segment].concat());
    add("log_segment", "bodies", [&[1u8][..], &bodies].concat());
    let mut torn = segment.clone();
    torn.truncate(segment.len() - 5);
    add("log_segment", "torn", [&[0u8][..], &torn].concat());
    let savepoint = real_savepoint(dir.path());
    add("savepoint", "file", [&[0u8][..], &savepoint].concat());
    let body = &savepoint[52..savepoint.len() - 12];
    add("savepoint", "body", [&[1u8][..], body].concat());
    for (i, (tree, key, value)) in entries(body).into_iter().enumerate() {
        // `cairn::fuzzing::stored_value`'s selectors, by the savepoint's tree numbers.
        let selector = [0u8, 3, 4, 5, 6, 7, 8][usize::from(tree).min(6)];
        let key = &key[..key.len().min(255)];
        let bytes = [&[selector, key.len() as u8][..], key, &value].concat();
        add("stored_value", &format!("{tree}-{i}"), bytes);
    }
    s
}

/// A `where` allow-list of `n` devices: from about 62 it outgrew the JSON reader's depth
/// limit in the nested form (issue 26, finding 4).
fn allow_list(n: usize) -> String {
    (0..n)
        .map(|i| format!("/dev == \"d{i}\""))
        .collect::<Vec<_>>()
        .join(" or ")
}

fn rich_config() -> String {
    format!(
        r#"[mqtt]
host = "127.0.0.1"
port = 1883
client_id = "cairn-fuzz"

[storage]
data_dir = "./data"

[[pipeline]]
name = "rich"
topics = ["f/+/+"]
format = "json"
event_id = "{{/dev}}-{{/seq}}"
key = "{{topic[1]}}:{{/a/b/0}}"
value = "/m/~1x"
event_time = "/ts"
where = '{}'
aggregate = ["min", "max", "avg", "count", "stddev", "p95", "last"]
window = {{ size = "1m", slide = "20s", allowed_lateness = "30s" }}
emit = "final"
output_topic = "r/{{key}}/{{window_start}}"

[[pipeline]]
name = "d"
topics = ["m/#"]
format = "delimited"
separator = ","
event_id = "0"
key = "{{topic[1]}}"
value = "1"
aggregate = "sum"
emit = "changelog"
start = "earliest"
output_topic = "d/{{key}}"
retain = false

[[pipeline]]
name = "sp"
topics = ["spBv1.0/g/#"]
format = "sparkplug_b"
key = "{{edge_node}}/{{device}}/{{metric}}"
metrics = ["temp"]
aggregate = "twa"
window = {{ size = "1m", allowed_lateness = "5m" }}
output_topic = "sp/{{key}}"
"#,
        allow_list(70)
    )
}

fn metric(name: Option<&str>, alias: u64, value: Value) -> Metric {
    Metric {
        name: name.map(String::from),
        alias: Some(alias),
        timestamp: Some(1_700_000_000_000),
        datatype: Some(match value {
            Value::Double(_) => 10,
            Value::Boolean(_) => 11,
            _ => 4,
        }),
        value: Some(value),
        ..Default::default()
    }
}

/// An edge node's NBIRTH (with `bdSeq`), an NDATA by alias, a DBIRTH and an NDEATH.
fn sparkplug_examples() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let payload = |seq: Option<u64>, metrics: Vec<Metric>| {
        Payload {
            timestamp: Some(1_700_000_000_000),
            metrics,
            seq,
            uuid: None,
        }
        .encode_to_vec()
    };
    let bd = |v| metric(Some("bdSeq"), 0, Value::Long(v));
    vec![
        (
            "nbirth",
            "spBv1.0/g/NBIRTH/n1",
            payload(
                Some(0),
                vec![
                    bd(3),
                    metric(Some("temp"), 1, Value::Double(21.5)),
                    metric(Some("a"), 2, Value::Long(7)),
                    metric(Some("b/c"), 3, Value::Boolean(true)),
                ],
            ),
        ),
        (
            "ndata",
            "spBv1.0/g/NDATA/n1",
            payload(
                Some(1),
                vec![
                    metric(None, 1, Value::Double(22.0)),
                    metric(None, 2, Value::Long(9)),
                ],
            ),
        ),
        (
            "dbirth",
            "spBv1.0/g/DBIRTH/n1/d1",
            payload(Some(2), vec![metric(Some("temp"), 4, Value::Float(3.5))]),
        ),
        ("ndeath", "spBv1.0/g/NDEATH/n1", payload(None, vec![bd(3)])),
    ]
}

/// A segment the log wrote with a few records, and their bodies as
/// `cairn::fuzzing::log_segment`'s odd mode reads them (`[len u16 LE][body]`).
fn real_log(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    let log_dir = dir.join("log");
    let (mut log, _) = cairn::log::Log::open(
        cairn::log::LogOptions {
            dir: log_dir.clone(),
            segment_size: 1 << 20,
            max_size: 1 << 24,
            max_payload: 1 << 16,
        },
        cairn::fsio::real(),
    )
    .unwrap();
    let records: [(&str, &[u8]); 3] = [
        ("f/a", b"{\"id\": \"e1\", \"k\": \"A\", \"v\": 10}"),
        ("m/M1", b"E1,5"),
        ("spBv1.0/g/NDATA/n1", &[0x08, 0x01]),
    ];
    for (i, (topic, payload)) in records.iter().enumerate() {
        log.append(1_700_000_000_000 + i as u64, topic, payload, 1, false)
            .unwrap();
    }
    log.commit().unwrap();
    drop(log);
    let segment = std::fs::read(log_dir.join(format!("{:020}.log", 0))).unwrap();
    let mut bodies = Vec::new();
    let mut pos = 0;
    while pos + 8 <= segment.len() {
        let len = u32::from_le_bytes(segment[pos..pos + 4].try_into().unwrap()) as usize;
        bodies.extend_from_slice(&(len as u16).to_le_bytes());
        bodies.extend_from_slice(&segment[pos + 8..pos + 8 + len]);
        pos += 8 + len;
    }
    (segment, bodies)
}

fn spec(toml: &str) -> PipelineSpec {
    cairn::config::pipeline_from_toml(toml).unwrap()
}

/// A store with state, ledger, outbox, dead letters and Sparkplug sessions, written out as
/// a savepoint.
fn real_savepoint(dir: &Path) -> Vec<u8> {
    let specs = vec![
        spec(
            "name = \"sums\"\ntopics = [\"f/#\"]\nformat = \"json\"\nevent_id = \"/id\"\n\
             key = \"/k\"\nvalue = \"/v\"\naggregate = [\"sum\", \"p90\", \"stddev\", \"last\"]\n\
             emit = \"changelog\"\noutput_topic = \"s/{key}\"",
        ),
        spec(
            "name = \"sp\"\ntopics = [\"spBv1.0/g/#\"]\nformat = \"sparkplug_b\"\n\
             key = \"{edge_node}/{metric}\"\naggregate = \"twa\"\n\
             window = { size = \"1m\", allowed_lateness = \"5m\" }\noutput_topic = \"sp/{key}\"",
        ),
    ];
    let store = Store::open(&dir.join("store"), 1 << 20, cairn::fsio::real()).unwrap();
    let mut engine = Engine::new(specs, store.progress().unwrap());
    let mut records: Vec<(String, Vec<u8>)> = vec![
        (
            "f/a".into(),
            b"{\"id\": \"e1\", \"k\": \"A\", \"v\": 10}".to_vec(),
        ),
        (
            "f/a".into(),
            b"{\"id\": \"e2\", \"k\": \"A\", \"v\": 2.5}".to_vec(),
        ),
        ("f/a".into(), b"not json".to_vec()),
    ];
    for (_, topic, payload) in sparkplug_examples() {
        records.push((topic.into(), payload));
    }
    for (i, (topic, payload)) in records.into_iter().enumerate() {
        let rec = Record {
            offset: i as u64,
            received_at_ms: 1_700_000_000_000 + i as u64,
            topic,
            payload,
            qos: 1,
            retain: false,
        };
        engine.apply(&store, &rec).unwrap();
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    let info = store
        .write_savepoint(&dir.join("savepoints"), &cairn::fsio::real())
        .unwrap();
    let mut file = std::fs::read(info.path).unwrap();
    // The header's time of writing is the wall clock's: zero it (header CRC and file CRC
    // made again) so that the seed is the same on every run.
    file[40..48].fill(0);
    let crc = crc32fast::hash(&file[..48]);
    file[48..52].copy_from_slice(&crc.to_le_bytes());
    let end = file.len() - 4;
    let crc = crc32fast::hash(&file[..end]);
    file[end..].copy_from_slice(&crc.to_le_bytes());
    file
}

/// A savepoint body's entries: (tree, key, value).
fn entries(mut body: &[u8]) -> Vec<(u8, Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    while body.len() >= 9 {
        let k = u32::from_le_bytes(body[1..5].try_into().unwrap()) as usize;
        let v = u32::from_le_bytes(body[5..9].try_into().unwrap()) as usize;
        out.push((
            body[0],
            body[9..9 + k].to_vec(),
            body[9 + k..9 + k + v].to_vec(),
        ));
        body = &body[9 + k + v..];
    }
    out
}
