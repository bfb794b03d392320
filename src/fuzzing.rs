//! Entry points for coverage-guided fuzzing (issue 26, item 3): one function per decoder of
//! bytes a sender or the disk controls. Each takes `&[u8]` and must never panic, whatever
//! the bytes; where two readers of the same bytes must agree, it asserts that too (a
//! failed assertion is a finding like a panic). The fuzz targets in `fuzz/` call these and
//! nothing else, so they stay one line each; `tests/it/fuzz_corpus.rs` replays every
//! committed corpus file and every regression input through the same functions on stable
//! Rust, in every test run.
//!
//! | target | what it reads | who controls the bytes |
//! |---|---|---|
//! | [`json_payload`] | a JSON payload through the engine (fields, `where`, windows) | a sender |
//! | [`delimited_payload`] | a delimited payload through the engine | a sender |
//! | [`sparkplug`] | a Sparkplug B payload: the decoder, then the engine | a sender |
//! | [`filter`] | a `where` expression: parse, canonical text, evaluation | the config |
//! | [`config`] | a whole config file | the operator |
//! | [`log_segment`] | a log segment: frame scan, recovery, verify, reading | the disk |
//! | [`stored_value`] | one store entry of each tree, decoded and used | the disk |
//! | [`savepoint`] | a savepoint file: header, every entry, CRC | the disk (or a copy) |
//! | [`pipelines_json`] | the last run's pipelines, as a start reads them | the disk |
//! | [`data_files`] | the quarantine, generations and restore-marker files | the disk |
//!
//! Files are written below one directory per process in the temporary directory, removed
//! and made again on each call (the fuzzers run one process per job).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::model::Record;
use crate::pipeline::engine::Engine;
use crate::pipeline::memory::MemState;
use crate::pipeline::spec::PipelineSpec;

/// One entry point: any bytes, never a panic.
pub type Target = fn(&[u8]);

/// Every target, by name: what `fuzz/` builds and `tests/it/fuzz_corpus.rs` replays.
pub const TARGETS: &[(&str, Target)] = &[
    ("json_payload", json_payload),
    ("delimited_payload", delimited_payload),
    ("sparkplug", sparkplug),
    ("filter", filter),
    ("config", config),
    ("log_segment", log_segment),
    ("stored_value", stored_value),
    ("savepoint", savepoint),
    ("pipelines_json", pipelines_json),
    ("data_files", data_files),
];

fn spec(toml: &str) -> PipelineSpec {
    crate::config::pipeline_from_toml(toml).expect("the fuzzing pipelines are valid")
}

/// JSON pipelines that read every kind of field: pointers, templates over topic levels and
/// fields, event times, a `where` of every operator, windows (hopping, final), lists of
/// aggregates including the sketch and the time-weighted average.
fn json_specs() -> &'static [PipelineSpec] {
    static SPECS: OnceLock<Vec<PipelineSpec>> = OnceLock::new();
    SPECS.get_or_init(|| {
        vec![
            spec(
                "name = \"plain\"\ntopics = [\"f/#\"]\nformat = \"json\"\nevent_id = \"/id\"\n\
                 key = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\noutput_topic = \"o/{key}\"\n\
                 emit = \"changelog\"\nmax_keys = 50",
            ),
            spec(
                "name = \"rich\"\ntopics = [\"f/+/+\"]\nformat = \"json\"\n\
                 event_id = \"{/dev}-{/seq}\"\nkey = \"{topic[1]}:{/a/b/0}\"\nvalue = \"/m/~1x\"\n\
                 event_time = \"/ts\"\n\
                 where = '/st == \"run\" and not (/t < -40 or /t >= 1e3) or topic[2] != \"x\" and /ok == true'\n\
                 aggregate = [\"min\", \"max\", \"avg\", \"count\", \"stddev\", \"p95\", \"last\"]\n\
                 window = { size = \"1m\", slide = \"20s\", allowed_lateness = \"30s\" }\n\
                 emit = \"final\"\noutput_topic = \"r/{key}/{window_start}\"\nmax_keys = 50\n\
                 max_future = \"1h\"",
            ),
            spec(
                "name = \"last\"\ntopics = [\"#\"]\nformat = \"json\"\nevent_id = \"/id\"\n\
                 key = \"/k\"\nvalue = \"/v\"\nevent_time = \"/ts\"\naggregate = \"last\"\n\
                 window = { size = \"10s\", allowed_lateness = \"0s\" }\n\
                 output_topic = \"l/{key}\"\nmax_key_len = 8\nmax_id_len = 8",
            ),
        ]
    })
}

fn delimited_specs() -> &'static [PipelineSpec] {
    static SPECS: OnceLock<Vec<PipelineSpec>> = OnceLock::new();
    SPECS.get_or_init(|| {
        vec![
            spec(
                "name = \"d\"\ntopics = [\"f/#\"]\nformat = \"delimited\"\nevent_id = \"0\"\n\
                 key = \"1\"\nvalue = \"2\"\nevent_time = \"3\"\naggregate = [\"sum\", \"p50\", \"variance\"]\n\
                 where = '{2} > -900 and {1} != \"z\" or topic[1] == \"a\"'\n\
                 window = { size = \"100ms\", allowed_lateness = \"50ms\" }\nemit = \"changelog\"\n\
                 output_topic = \"d/{key}/{window_start}\"",
            ),
            spec(
                "name = \"e\"\ntopics = [\"f/#\"]\nformat = \"delimited\"\nseparator = \",\"\n\
                 event_id = \"{0}.{topic[1]}\"\nkey = \"{1}-{topic[0]}\"\nvalue = \"2\"\n\
                 aggregate = \"max\"\noutput_topic = \"e/{key}\"\nmax_keys = 20",
            ),
        ]
    })
}

fn sparkplug_specs() -> &'static [PipelineSpec] {
    static SPECS: OnceLock<Vec<PipelineSpec>> = OnceLock::new();
    SPECS.get_or_init(|| {
        vec![
            spec(
                "name = \"sp\"\ntopics = [\"spBv1.0/g/#\"]\nformat = \"sparkplug_b\"\n\
                 key = \"{edge_node}/{device}/{metric}\"\n\
                 aggregate = [\"twa\", \"min\", \"max\", \"count\", \"last\"]\n\
                 window = { size = \"1m\", allowed_lateness = \"5m\" }\n\
                 output_topic = \"sp/{key}\"\ndedup_window = \"1d\"\nmax_future = \"1d\"",
            ),
            spec(
                "name = \"sq\"\ntopics = [\"spBv1.0/#\"]\nformat = \"sparkplug_b\"\n\
                 key = \"{group}/{metric}\"\naggregate = \"sum\"\nmetrics = [\"a\", \"b/c\"]\n\
                 output_topic = \"sq/{key}\"",
            ),
        ]
    })
}

/// Split `data` at the first `0x00`: a topic (lossily UTF-8) and a payload; no `0x00`, a
/// fixed topic.
fn topic_and_payload<'a>(data: &'a [u8], default: &str) -> (String, &'a [u8]) {
    match data.iter().position(|&b| b == 0) {
        Some(i) if i <= 256 => (
            String::from_utf8_lossy(&data[..i]).into_owned(),
            &data[i + 1..],
        ),
        _ => (default.to_string(), data),
    }
}

/// Run `payload` through an engine over `specs` as the agent does: applied, applied again
/// (a redelivery), checkpointed into an in-memory store, applied once more as a later
/// record (state read back), flushed and checkpointed.
fn through_engine(specs: &[PipelineSpec], topic: &str, payload: &[u8]) {
    let mut engine = Engine::new(specs.to_vec(), Default::default());
    let mut store = MemState::default();
    let rec = |offset: u64, received_at_ms: u64| Record {
        offset,
        received_at_ms,
        topic: topic.to_string(),
        payload: payload.to_vec(),
        qos: 1,
        retain: false,
    };
    let base = 1_700_000_000_000;
    for (offset, at) in [(0, base), (1, base + 1)] {
        // An error is a store read failure, which an in-memory store never has.
        let _ = engine.apply(&store, &rec(offset, at));
    }
    store.commit(&engine.take_checkpoint());
    let _ = engine.apply(&store, &rec(2, base + 120_000));
    engine.flush_upserts();
    for (_, out) in engine.pending_outputs() {
        // Every result is JSON of a bounded size (invariant 7).
        let v: serde_json::Value = serde_json::from_slice(&out.payload).expect("a result is JSON");
        assert!(v.get("id").is_some(), "a result without an id: {v}");
    }
    store.commit(&engine.take_checkpoint());
}

/// A JSON payload (after an optional `topic\0` prefix) through JSON pipelines; and the
/// in-place reader against `serde_json::Value`, which it promises to read exactly alike.
pub fn json_payload(data: &[u8]) {
    let (topic, payload) = topic_and_payload(data, "f/a/b");
    if let Ok(text) = std::str::from_utf8(payload) {
        let ours = crate::pipeline::json::Json::parse(text);
        let theirs = serde_json::from_str::<serde_json::Value>(text);
        match (&ours, &theirs) {
            (Ok(a), Ok(b)) => assert_eq!(
                &crate::pipeline::json::to_value(a),
                b,
                "the in-place reader reads other JSON than serde_json"
            ),
            (Err(_), Err(_)) => {}
            _ => panic!(
                "the in-place reader and serde_json disagree on whether this is JSON: {:?} / {:?}",
                ours.as_ref().err(),
                theirs.as_ref().err()
            ),
        }
    }
    through_engine(json_specs(), &topic, payload);
}

/// A delimited payload (after an optional `topic\0` prefix) through delimited pipelines.
pub fn delimited_payload(data: &[u8]) {
    let (topic, payload) = topic_and_payload(data, "f/a");
    through_engine(delimited_specs(), &topic, payload);
}

/// A Sparkplug B payload (after an optional `topic\0` prefix): the decoder alone, then the
/// engine's Sparkplug pipelines on the topic given (and on an NBIRTH and an NDATA topic,
/// so that sessions see it).
pub fn sparkplug(data: &[u8]) {
    let (topic, payload) = topic_and_payload(data, "spBv1.0/g/NDATA/n1");
    let _ = crate::pipeline::sparkplug::proto::decode(payload);
    for topic in [
        topic.as_str(),
        "spBv1.0/g/NBIRTH/n1",
        "spBv1.0/g/DDATA/n1/d1",
    ] {
        through_engine(sparkplug_specs(), topic, payload);
    }
}

/// A `where` expression, as the config gives it for each format: parsed; if accepted, its
/// canonical text reads back (as `pipelines.json` keeps it) into the same tree, through
/// the JSON form too; and it is evaluated against fields derived from the bytes.
pub fn filter(data: &[u8]) {
    use crate::pipeline::field::Format;
    use crate::pipeline::filter::{Value, parse_filter, parse_stored};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = parse_stored(text);
    let formats = [
        Format::Json,
        Format::Delimited {
            separator: "/".into(),
        },
        Format::SparkplugB,
    ];
    for format in &formats {
        let Ok(expr) = parse_filter(text, format) else {
            continue;
        };
        let canonical = expr.to_string();
        let back = parse_stored(&canonical).unwrap_or_else(|e| {
            panic!("the canonical text `{canonical}` of `{text}` does not read back: {e:?}")
        });
        assert_eq!(back, expr, "`{canonical}` reads back as another filter");
        let json = serde_json::to_string(&expr).expect("a filter serialises");
        let again: crate::pipeline::expr::Expr =
            serde_json::from_str(&json).expect("a filter's JSON form reads back");
        assert_eq!(again, expr);
        // Fields answer by the length of their text: a number, a string, a boolean,
        // untyped text, or missing, so every comparison path is taken.
        let mut get = |f: &crate::pipeline::field::Field| {
            let n = format!("{f:?}").len();
            Ok(match n % 5 {
                0 => Value::Num(crate::pipeline::num::Num::Int(n as i64 - 40)),
                1 => Value::Str(text.chars().take(n % 7).collect()),
                2 => Value::Bool(n % 2 == 0),
                3 => Value::Text(format!("{}", n as f64 / 3.0)),
                _ => Value::Num(crate::pipeline::num::Num::Float(n as f64 * 0.5)),
            })
        };
        let _ = expr.eval(&mut get);
    }
}

/// A config file: parsed and validated; if accepted, its summary, its reload plan against
/// itself, and every pipeline through `pipelines.json` and back unchanged (the start's
/// settle compares what it reads back with the config: issue 26, finding 4).
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = crate::config::parse_str(text, Path::new("fuzz.toml")) else {
        return;
    };
    let _ = crate::config::summary(&cfg);
    let _ = crate::config::reload::plan(&cfg, &cfg);
    let json = serde_json::to_vec_pretty(&cfg.pipelines).expect("pipelines serialise");
    let back: Vec<PipelineSpec> = serde_json::from_slice(&json).unwrap_or_else(|e| {
        panic!("pipelines the config accepts do not read back from pipelines.json: {e}")
    });
    assert!(
        back == cfg.pipelines,
        "pipelines read back from pipelines.json differ from the config's"
    );
    let _ = crate::pipeline::engine::progress_bytes(&cfg.pipelines);
    for p in &cfg.pipelines {
        let _ = crate::pipeline::engine::definition(p);
    }
}

/// This process's scratch directory, emptied.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cairn-fuzz-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory in $TMPDIR");
    dir
}

/// A log segment as the disk may leave it. The first byte chooses how the rest is read:
/// even, as the file's bytes; odd, as bodies that each get a valid header (length and CRC),
/// so that the record decoding behind the checksum is reached: `[len u16 LE][body]...`.
/// A `\nSEG\n` in the rest starts a second segment. Then the frames are walked in memory,
/// the directory is verified (`cairn verify`), opened as a start opens it (torn tail
/// truncated, damage refused), read to the end, appended to and read again.
pub fn log_segment(data: &[u8]) {
    use crate::log::{Log, LogOptions, frame};
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = if mode % 2 == 0 {
        rest.to_vec()
    } else {
        framed_bodies(rest)
    };
    let mut pos = 0;
    while pos < bytes.len() {
        match frame::check(&bytes[pos..]) {
            Ok((_, n)) => pos += n,
            Err(_) => break,
        }
    }
    let dir = scratch("log");
    let cut = bytes.windows(5).position(|w| w == b"\nSEG\n");
    let (first, second) = match cut {
        Some(i) => (&bytes[..i], Some(&bytes[i + 5..])),
        None => (&bytes[..], None),
    };
    std::fs::write(dir.join(format!("{:020}.log", 0)), first).expect("write a segment");
    if let Some(second) = second {
        let at = u64::from(mode / 2 % 4);
        std::fs::write(dir.join(format!("{at:020}.log")), second).expect("write a segment");
    }
    let _ = crate::log::verify_dir(&dir);
    if let Ok(mut r) = crate::log::read_dir(&dir, 0) {
        for rec in r.by_ref().take(1000) {
            if rec.is_err() {
                break;
            }
        }
    }
    let opts = LogOptions {
        dir: dir.clone(),
        segment_size: 4096,
        max_size: 1 << 20,
        max_payload: 1024,
    };
    let sync: crate::fsio::Durability = std::sync::Arc::new(NoSync);
    let Ok((mut log, _)) = Log::open(opts, sync) else {
        return;
    };
    let next = log.next_offset();
    let read_all = |log: &Log| -> Vec<u64> {
        let mut offsets = Vec::new();
        if let Ok(r) = log.read_from(log.first_offset()) {
            for rec in r.take(1000) {
                match rec {
                    Ok(rec) => offsets.push(rec.offset),
                    Err(_) => break,
                }
            }
        }
        offsets
    };
    let before = read_all(&log);
    // What a start opens, it can read whole and append to: offsets consecutive, and the
    // next record lands at the end.
    assert!(
        before.windows(2).all(|w| w[1] == w[0] + 1),
        "an opened log reads back with holes: {before:?}"
    );
    if log.append(1, "t", b"x", 1, false).is_ok() && log.commit().is_ok() {
        let after = read_all(&log);
        if before.len() < 1000 {
            assert_eq!(after.last(), Some(&next), "the appended record is not last");
        }
    }
}

/// `[len u16 LE][body]...` → frames with valid headers (see [`log_segment`]).
fn framed_bodies(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let body = &rest[2..2 + len];
        rest = &rest[2 + len..];
        let len_bytes = (len as u32).to_le_bytes();
        let mut h = crc32fast::Hasher::new();
        h.update(&len_bytes);
        h.update(body);
        out.extend_from_slice(&len_bytes);
        out.extend_from_slice(&h.finalize().to_le_bytes());
        out.extend_from_slice(body);
    }
    out.extend_from_slice(rest);
    out
}

/// Scratch files need no fsync.
#[derive(Debug)]
struct NoSync;

impl crate::fsio::SyncSeam for NoSync {
    fn sync_file(
        &self,
        _: crate::fsio::SyncKind,
        _: &std::fs::File,
        _: &Path,
        _: bool,
    ) -> std::io::Result<()> {
        Ok(())
    }
    fn sync_dir(&self, _: &Path) -> std::io::Result<()> {
        Ok(())
    }
}

/// One store entry: `[tree][key len][key][value]`, decoded as the store decodes that tree
/// (see `store/fuzz.rs`); a key state that decodes is then used as the engine uses one:
/// its result rendered, two more values applied.
pub fn stored_value(data: &[u8]) {
    let [tree, klen, rest @ ..] = data else {
        return;
    };
    let k = usize::from(*klen).min(rest.len());
    let (key, value) = rest.split_at(k);
    if let Ok(Some(st)) = crate::store::fuzz::stored_entry(*tree, key, value) {
        use crate::pipeline::num::Num;
        let _ = st.value_json();
        let next = [
            Num::Int(i64::from(*klen) - 100),
            Num::Float(f64::from(*tree) / 7.0),
        ];
        let mut cur = st;
        for (i, n) in next.into_iter().enumerate() {
            match cur.apply(n, 1_700_000_000_000 + i as u64) {
                Ok(s) => {
                    let _ = s.value_json();
                    cur = s;
                }
                Err(_) => break,
            }
        }
    }
}

/// A savepoint file. The first byte chooses: even, the rest is the file; odd, the rest is
/// the entries, framed with a valid header, end marker and CRC (so that the checks of each
/// entry behind the checksums are reached). Then what `cairn savepoint list`, `verify` and
/// `restore` read before anything is built.
pub fn savepoint(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = if mode % 2 == 0 {
        rest.to_vec()
    } else {
        crate::store::fuzz::frame_savepoint(rest)
    };
    let dir = scratch("savepoint");
    let file = dir.join(crate::store::fuzz::savepoint_name());
    std::fs::write(&file, &bytes).expect("write a savepoint");
    let _ = crate::store::read_savepoint_header(&file);
    let _ = crate::store::verify_savepoint(&file);
    let _ = crate::store::list_savepoints(&dir);
    let _ = crate::store::fuzz::check_savepoint(&file);
}

/// `pipelines.json` as a start reads it ([`crate::processor::last_run`]); if it reads, the
/// pipelines are written back and read again unchanged, and a start plan is decided over
/// them (as the last run's pipelines, and as the config's).
pub fn pipelines_json(data: &[u8]) {
    let dir = scratch("pipelines");
    std::fs::write(dir.join(crate::processor::last_run::FILE_NAME), data).expect("write");
    let crate::processor::last_run::LastRun::Ran(specs) = crate::processor::last_run::read(&dir)
    else {
        return;
    };
    let json = serde_json::to_vec_pretty(&specs).expect("pipelines serialise");
    let back: Vec<PipelineSpec> = serde_json::from_slice(&json)
        .unwrap_or_else(|e| panic!("pipelines read from pipelines.json do not read back: {e}"));
    assert!(back == specs, "pipelines.json does not read back unchanged");
    for s in &specs {
        let _ = crate::pipeline::engine::definition(s);
    }
    decide_over(specs);
}

/// A start plan over `specs` read back: as the last run's pipelines against an empty
/// config and against themselves, and as the config against an empty store.
fn decide_over(specs: Vec<PipelineSpec>) {
    use crate::processor::generations::Generations;
    use crate::processor::last_run::LastRun;
    use crate::processor::plan::{Found, decide};
    let found = |last_run| Found {
        progress: Default::default(),
        with_data: Vec::new(),
        generations: Generations::in_memory(),
        last_run,
        restored: None,
    };
    let ran = found(LastRun::Ran(specs.clone()));
    let _ = decide(&ran, &[], &[]);
    let _ = decide(&ran, &specs, &[]);
    let _ = decide(&found(LastRun::Unknown), &specs, &[]);
}

/// The small files of the data directory. The first byte chooses which the rest is:
/// `quarantine` (opened as a start opens it: moved aside if unreadable), `generations`
/// (loaded; new generations counted on it, saved, loaded again alike), or the
/// savepoint-restore marker.
pub fn data_files(data: &[u8]) {
    use crate::processor::{generations, quarantine, restored};
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let dir = scratch("data");
    let sync: crate::fsio::Durability = std::sync::Arc::new(NoSync);
    match which % 3 {
        0 => {
            std::fs::write(dir.join(quarantine::FILE_NAME), rest).expect("write");
            if let Ok(mut q) = quarantine::Quarantine::open(&dir, sync) {
                let _ = q.exhausted(3);
                let _ = q.entry(3);
                let _ = q.record_attempt(3, "t/\u{0}x", &"p".repeat(2000));
                let _ = q.prune_below(2);
                let _ = quarantine::Quarantine::open(&dir, std::sync::Arc::new(NoSync))
                    .expect("a quarantine file it wrote opens");
            }
        }
        1 => {
            let path = dir.join(generations::FILE_NAME);
            std::fs::write(&path, rest).expect("write");
            if let Ok(mut g) = generations::Generations::load(&path) {
                let text = String::from_utf8_lossy(rest);
                // Names as the config allows them (`[A-Za-z0-9_-]`).
                let names: Vec<&str> = text
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
                    .filter(|n| !n.is_empty())
                    .take(8)
                    .collect();
                for name in &names {
                    let n = g.start_new(name, 0);
                    assert!(n >= 1 && g.highest(name) == Some(n));
                }
                g.save(&sync).expect("save");
                let again = generations::Generations::load(&path)
                    .expect("a generations file it wrote loads");
                for name in &names {
                    assert_eq!(again.highest(name), g.highest(name));
                }
            }
        }
        _ => {
            std::fs::write(dir.join(restored::FILE_NAME), rest).expect("write");
            let _ = restored::read(&dir);
        }
    }
}
