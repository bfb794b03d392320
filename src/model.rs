//! Plain data shared by every layer. No IO, no clocks, no sled, no rumqttc.

use serde::{Deserialize, Serialize};

/// Position of a record in the replay log. Offsets are dense: the first record ever
/// appended is 0 and each append adds one. They never repeat, even after truncation.
pub(crate) type Offset = u64;

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
/// instead of the payload the record holds [`TooLarge::HEADER_LEN`] bytes (the original
/// size and the limit, each a `u64` LE) and then at most [`TooLarge::PREFIX_MAX`] bytes of
/// the payload. MQTT QoS is 0, 1 or 2, so no received message has this bit: logs written
/// before it existed read exactly as before, and the frame format is unchanged.
pub(crate) const QOS_TOO_LARGE: u8 = 0x80;

/// What a stand-in record says about the message it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge<'a> {
    /// The payload's size as received, in bytes.
    pub size: u64,
    /// `log.max_payload` when it was received.
    pub limit: u64,
    /// The start of the payload.
    pub prefix: &'a [u8],
}

impl TooLarge<'_> {
    pub(crate) const HEADER_LEN: usize = 16;
    /// As much of the payload as a dead letter keeps.
    pub(crate) const PREFIX_MAX: usize = 1024;

    /// The stand-in payload for a `size`-byte `payload` refused under `limit`.
    pub(crate) fn encode(payload: &[u8], limit: u64) -> Vec<u8> {
        let prefix = &payload[..payload.len().min(Self::PREFIX_MAX)];
        let mut out = Vec::with_capacity(Self::HEADER_LEN + prefix.len());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&limit.to_le_bytes());
        out.extend_from_slice(prefix);
        out
    }
}

impl Record {
    /// The oversized message this record stands for, if it is a stand-in. A stand-in too
    /// short for its header (never written so) reads as size 0 rather than failing.
    pub fn too_large(&self) -> Option<TooLarge<'_>> {
        if self.qos & QOS_TOO_LARGE == 0 {
            return None;
        }
        let p = &self.payload;
        if p.len() < TooLarge::HEADER_LEN {
            return Some(TooLarge {
                size: 0,
                limit: 0,
                prefix: p,
            });
        }
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&p[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Some(TooLarge {
            size: word(0),
            limit: word(8),
            prefix: &p[TooLarge::HEADER_LEN..],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stand_in_keeps_size_limit_and_a_bounded_prefix() {
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
        assert_eq!(t.prefix, &payload[..TooLarge::PREFIX_MAX]);
        let plain = Record { qos: 1, ..rec };
        assert_eq!(plain.too_large(), None);
        let short = Record {
            qos: QOS_TOO_LARGE,
            payload: vec![1, 2],
            ..plain
        };
        assert_eq!(short.too_large().unwrap().size, 0);
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
