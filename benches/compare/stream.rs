//! The seeded stream every system, run and oracle of the comparison sees.

/// The stream's seed.
pub(crate) const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// Event `i` of the stream with `seed`: (key number, value). xorshift, so every system, run
/// and oracle sees the same stream.
pub(crate) fn event(seed: u64, i: u64, keys: u64) -> (u64, u64) {
    let mut s = seed ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D);
    let mut step = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    step();
    (step() % keys, step() % 1_000)
}

/// The JSON input of event `i` under `tag` (the tag keeps IDs of different runs apart).
pub(crate) fn payload(tag: &str, i: u64, key: u64, value: u64) -> String {
    format!(r#"{{"id":"{tag}-{i}","k":"k{key:06}","v":{value}}}"#)
}

/// The key number of a result's topic `<prefix>/out/k000123`.
pub(crate) fn key_of_topic(topic: &str) -> Option<usize> {
    topic.rsplit('/').next()?.strip_prefix('k')?.parse().ok()
}

/// Input `j` of the footprint's backlog: the stream's event `j`, except that every 50th
/// repeats the event 17 inputs before it (same ID, same payload): 2% duplicates.
pub(crate) fn backlog_event(j: u64) -> u64 {
    if j % 50 == 49 { j - 17 } else { j }
}
