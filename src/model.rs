//! Plain data shared by every layer. No IO, no clocks, no sled, no rumqttc.

use serde::{Deserialize, Serialize};

/// Position of a record in the replay log. Offsets are dense: the first record ever
/// appended is 0 and each append adds one. They never repeat, even after truncation.
pub(crate) type Offset = u64;

/// Most bytes of one stored entry (key plus value) outside the store's `meta` tree. sled
/// writes a whole leaf node, up to 17 entries, as one log item, and an item over 128 KiB
/// goes to a blob file that sled never fsyncs (DESIGN §4): 17 entries of 7 KiB stay below
/// it. The store refuses a commit with a larger entry; so that it never meets one, every
/// value is bounded where it is made: a result, a key's state and a dead letter by the
/// engine (the event that would make one larger is a dead letter), the worst case of each
/// pipeline's results by config validation, event IDs by `max_id_len`.
pub const MAX_ENTRY_BYTES: usize = 7 * 1024;

/// Most bytes of one `meta` value: `meta` holds a few values, and the progress record grows
/// with the number of pipelines (their definitions), which the config bounds, not a sender
/// (config validation checks the configured pipelines' worst case against it).
pub const MAX_META_BYTES: usize = 96 * 1024;

/// One accepted MQTT message, exactly as the replay log stores it.
///
/// `received_at_ms` is stamped once, at ingest, from the wall clock; replay reads it back
/// from the log, so the processor never consults a clock (invariant 3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub offset: Offset,
    pub received_at_ms: u64,
    pub topic: String,
    pub payload: Vec<u8>,
    pub qos: u8,
    pub retain: bool,
}

/// A bit in [`Record::qos`] that marks a stand-in for a message over `log.max_payload`:
/// instead of the payload the record holds a header (the original size and the limit, each a
/// `u64` LE, then a hash of the whole payload: [`TooLarge::encode`]) and then at most
/// [`TooLarge::PREFIX_MAX`] bytes of the payload. MQTT QoS is 0, 1 or 2, so no received
/// message has this bit: logs written before it existed read exactly as before, and the
/// frame format is unchanged.
pub(crate) const QOS_TOO_LARGE: u8 = 0x80;

/// What a stand-in record says about the message it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge<'a> {
    /// The payload's size as received, in bytes.
    pub size: u64,
    /// `log.max_payload` when it was received.
    pub limit: u64,
    /// FNV-1a (64-bit) of the whole payload; `None` in a stand-in written before it was kept
    /// (issue 26: two inputs with one prefix were then one dead letter and a duplicate).
    pub hash: Option<u64>,
    /// The start of the payload.
    pub prefix: &'a [u8],
}

impl TooLarge<'_> {
    /// Size and limit: the header of every stand-in.
    pub(crate) const HEADER_LEN: usize = 16;
    /// Set in the limit word of a stand-in whose header goes on with the hash. A limit is
    /// `log.max_payload`, at most a log segment (1 GiB), so a stand-in written before the
    /// hash never has this bit, and still reads as size, limit and prefix.
    const HASHED: u64 = 1 << 63;
    /// As much of the payload as a dead letter keeps.
    pub(crate) const PREFIX_MAX: usize = 1024;

    /// The stand-in payload for a `size`-byte `payload` refused under `limit`: its size, the
    /// limit and a hash of all of it, so the stand-in (whose bytes are the dead letter's
    /// identity) tells apart two payloads that share a prefix, then the prefix.
    pub(crate) fn encode(payload: &[u8], limit: u64) -> Vec<u8> {
        let prefix = &payload[..payload.len().min(Self::PREFIX_MAX)];
        let mut out = Vec::with_capacity(Self::HEADER_LEN + 8 + prefix.len());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&(limit | Self::HASHED).to_le_bytes());
        out.extend_from_slice(&fnv1a(payload).to_le_bytes());
        out.extend_from_slice(prefix);
        out
    }
}

/// FNV-1a, 64-bit: written by hand so it never changes with a toolchain (the log and the
/// dedup ledger outlive builds).
pub(crate) fn fnv1a<'a>(bytes: impl IntoIterator<Item = &'a u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Record {
    /// The oversized message this record stands for, if it is a stand-in. A stand-in too
    /// short for its header (never written so) reads as size 0 rather than failing.
    pub fn too_large(&self) -> Option<TooLarge<'_>> {
        if self.qos & QOS_TOO_LARGE == 0 {
            return None;
        }
        let p = &self.payload;
        let word = |at: usize| {
            p.get(at..at + 8).map(|w| {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                u64::from_le_bytes(b)
            })
        };
        let (Some(size), Some(limit)) = (word(0), word(8)) else {
            return Some(TooLarge {
                size: 0,
                limit: 0,
                hash: None,
                prefix: p,
            });
        };
        let hashed = limit & TooLarge::HASHED != 0;
        let (hash, rest) = match word(TooLarge::HEADER_LEN) {
            Some(h) if hashed => (Some(h), TooLarge::HEADER_LEN + 8),
            _ => (None, TooLarge::HEADER_LEN),
        };
        Some(TooLarge {
            size,
            limit: limit & !TooLarge::HASHED,
            hash,
            prefix: &p[rest.min(p.len())..],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stand_in_keeps_size_limit_hash_and_a_bounded_prefix() {
        let payload = vec![b'x'; 5000];
        let rec = Record {
            offset: 1,
            received_at_ms: 2,
            topic: "in/a".into(),
            payload: TooLarge::encode(&payload, 4096),
            qos: 1 | QOS_TOO_LARGE,
            retain: false,
        };
        let t = rec.too_large().expect("a stand-in");
        assert_eq!((t.size, t.limit), (5000, 4096));
        assert_eq!(t.hash, Some(fnv1a(&payload)));
        assert_eq!(t.prefix, &payload[..TooLarge::PREFIX_MAX]);
        // Another tail behind the same prefix: another stand-in.
        let mut other = payload.clone();
        other[4999] = b'y';
        assert_ne!(TooLarge::encode(&other, 4096), rec.payload);
        let plain = Record { qos: 1, ..rec };
        assert_eq!(plain.too_large(), None);
        let short = Record {
            qos: QOS_TOO_LARGE,
            payload: vec![1, 2],
            ..plain
        };
        assert_eq!(short.too_large().unwrap().size, 0);
    }

    /// A stand-in the release before wrote (size, limit, prefix: no hash) reads as it did.
    #[test]
    fn a_stand_in_written_before_the_hash_still_decodes() {
        let mut old = Vec::new();
        old.extend_from_slice(&5000u64.to_le_bytes());
        old.extend_from_slice(&4096u64.to_le_bytes());
        old.extend_from_slice(b"xxxxxxxxxxxx");
        let rec = Record {
            offset: 1,
            received_at_ms: 2,
            topic: "in/a".into(),
            payload: old,
            qos: 1 | QOS_TOO_LARGE,
            retain: false,
        };
        let t = rec.too_large().unwrap();
        assert_eq!((t.size, t.limit, t.hash), (5000, 4096, None));
        assert_eq!(t.prefix, b"xxxxxxxxxxxx");
        // Even one whose prefix is shorter than a hash.
        let rec = Record {
            payload: rec.payload[..20].to_vec(),
            ..rec
        };
        assert_eq!(rec.too_large().unwrap().prefix, b"xxxx");
    }

    #[test]
    fn a_dead_letter_is_cut_to_fit_one_entry_only_when_it_would_not() {
        let letter = |topic: usize, detail: usize| DeadLetter {
            offset: 7,
            pipeline: "p".repeat(64),
            topic: "t".repeat(topic),
            reason: "wrong_type".into(),
            detail: "é".repeat(detail),
            received_at_ms: u64::MAX,
            payload: vec![0xff; 1024],
        };
        let fits = letter(2000, 1000);
        assert_eq!(fits.clone().fitted(128), fits, "kept whole when it fits");
        for (t, d) in [(65_535, 10), (10, 100_000), (65_535, 131_072)] {
            let cut = letter(t, d).fitted(128);
            let bytes = postcard::to_stdvec(&cut).unwrap().len();
            assert!(128 + bytes <= MAX_ENTRY_BYTES, "{t} {d}: {bytes}");
            assert!(cut.topic.ends_with(&format!("({t} bytes)")) || t < 512);
            assert!(cut.detail.ends_with(&format!("({} bytes)", 2 * d)) || d < 512);
        }
    }
}

// ---------------------------------------------------------------------------------------
// What a checkpoint records besides the trees, and what the engine hands the store. The
// store persists these with postcard, which encodes fields in declaration order: the order
// and types of their fields are the on-disk format.

/// Counters that live in the checkpoint, so replay recomputes them exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub applied: u64,
    pub duplicates: u64,
    pub dead_letters: u64,
    pub outputs: u64,
    /// Inputs the pipeline's `where` filter skipped.
    pub filtered: u64,
}

/// Per-pipeline progress, checkpointed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineProgress {
    pub name: String,
    /// Greatest event time applied; the watermark is this minus the allowed lateness.
    pub max_event_time_ms: u64,
    /// Windows starting before this were closed and evicted.
    pub evicted_below: u64,
    /// Live state entries (keys, or key-windows).
    pub keys: u64,
    pub dedup_entries: u64,
    pub counters: Counters,
    /// The definition that wrote this state (see [`crate::pipeline::engine::definition`]).
    pub definition: String,
    /// A new key's first version is `version_base + 1`. Zero, unless the pipeline was reset:
    /// then it is the highest version emitted before, so output IDs never repeat and a
    /// consumer keeping the highest version per key accepts the new values.
    pub version_base: u64,
    /// Highest version this pipeline ever gave a key.
    pub max_version: u64,
    /// Which lineage of state this is: a new one starts whenever the pipeline starts over
    /// from empty state where results of an earlier one may already have gone out (a reset, a
    /// store rebuilt from the log, a pipeline dropped and added again). Output IDs of
    /// generation 2 and later carry it (`name@2/key/version`), so a new generation never
    /// reuses an ID that went out with another payload. 0 and 1 both mean the first: IDs
    /// without a generation, as before generations existed.
    pub generation: u32,
    /// Set while a pipeline started with `start = "earliest"` works through the log that
    /// was there before it (issue 15): it takes no live record until it has caught up.
    /// Not in the progress record's postcard layout (the store keeps it under its own key,
    /// in the same transaction), so stores written before backfill read unchanged.
    #[serde(skip)]
    pub backfill: Option<Backfill>,
}

/// Where a backfilling pipeline stands in the log behind the live position. Checkpointed
/// with its state, so a crash resumes it without losing or repeating a record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backfill {
    /// The next log offset this pipeline takes. It joins live processing once this reaches
    /// the live `next_offset`; until then retention keeps the log from here on.
    pub next: Offset,
    /// Greatest `received_at_ms` of the records it took: its dedup clock until it joins,
    /// so duplicates inside the backfilled range are judged as they were received.
    pub clock_ms: u64,
}

/// Everything besides the trees that a checkpoint records.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// The first log offset not yet reflected in the checkpoint.
    pub next_offset: Offset,
    pub checkpoint_id: u64,
    /// Greatest `received_at_ms` seen: the clock the dedup window is measured with. It
    /// never goes back, even if the box's clock does.
    pub log_clock_ms: u64,
    /// Records read (matching a pipeline or not).
    pub records: u64,
    /// Records that matched no pipeline.
    pub unmatched: u64,
    /// Next outbox sequence number.
    pub outbox_seq: u64,
    /// The configured pipelines first, in config order (the engine indexes them by their
    /// position in the config), then dormant ones: stored but no longer configured. Dormant
    /// entries are kept so that a pipeline that comes back is compared with the definition
    /// that wrote its state, and so that their state can be reported and dropped.
    pub pipelines: Vec<PipelineProgress>,
}

/// One result bound for the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    /// `pipeline/key[/window_start]/version`, the key escaped: stable across replays.
    pub id: String,
    pub topic: String,
    pub payload: Vec<u8>,
    pub retain: bool,
    /// Emitted as an upsert: a newer output of the same key (and window) makes this one
    /// worthless, so the outbox need not send it if it has not gone yet.
    pub latest_only: bool,
}

/// A refused input, for a person to read (`cairn inspect dead-letters`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub offset: Offset,
    pub pipeline: String,
    pub topic: String,
    pub reason: String,
    pub detail: String,
    pub received_at_ms: u64,
    /// At most [`crate::pipeline::engine::DEAD_LETTER_PAYLOAD_MAX`] bytes of the payload.
    pub payload: Vec<u8>,
}

/// When a whole dead letter would not fit one stored entry, its topic and detail are cut to
/// these many bytes (a topic may be 64 KiB long, a detail may quote a sender's field; the
/// letter is for a person).
const DEAD_TOPIC_KEEP: usize = 512;
const DEAD_DETAIL_KEEP: usize = 1024;

/// Room for the store's key of a dead letter (its offset and pipeline name) when the engine
/// makes one: [`DeadLetter::fitted`] leaves it beside the value.
pub(crate) const DEAD_LETTER_KEY_ROOM: usize = 128;

impl DeadLetter {
    /// This letter as one stored entry beside a key of `key_len` bytes holds it: whole when
    /// it fits [`MAX_ENTRY_BYTES`], else with its topic and detail cut (deterministically, so
    /// replay stores the same). With the payload bounded by the engine
    /// (`DEAD_LETTER_PAYLOAD_MAX`) and names by the config, a cut letter always fits.
    pub fn fitted(mut self, key_len: usize) -> DeadLetter {
        let size = postcard::experimental::serialized_size(&self).unwrap_or(usize::MAX);
        if key_len.saturating_add(size) <= MAX_ENTRY_BYTES {
            return self;
        }
        self.topic = clip(&self.topic, DEAD_TOPIC_KEEP);
        self.detail = clip(&self.detail, DEAD_DETAIL_KEEP);
        self
    }
}

/// At most `max` bytes of `s`, cut at a character boundary, marked when cut.
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &s[..end], s.len())
}
