//! Frame format: `[len u32 LE][crc32 u32 LE over the 4 len bytes + body][body]`, where the
//! body is `postcard(Record)`. Pure functions over byte slices; no IO.
//!
//! The CRC covers the length bytes too, so a torn or flipped length cannot pair with a body
//! that happens to check out.

use crate::model::{Offset, Record};

/// Bytes before the body: length then CRC.
pub(crate) const HEADER_LEN: usize = 8;

/// Largest payload any configuration may allow (`LogOptions::max_payload` is capped here).
pub(crate) const MAX_PAYLOAD_LIMIT: u64 = 16 * 1024 * 1024;

/// Largest topic we store: the MQTT protocol limit for a UTF-8 string.
pub(crate) const MAX_TOPIC_LEN: u64 = 65_535;

/// Largest body a frame may declare. A length above this is never a frame we wrote, so the
/// scanner treats it as damage without reading further. Payload + topic + postcard overhead
/// (varints for offset, time, lengths; qos; retain) stays well inside the slack.
pub(crate) const MAX_BODY_LEN: u32 = (MAX_PAYLOAD_LIMIT + MAX_TOPIC_LEN + 64) as u32;

/// Set in the record's `qos` byte of the first frame each commit writes into a segment, and
/// only there: a frame with it, found after damage, was written by a later commit, which
/// began only after the damaged bytes were synced, so the damage is not a crash's doing (see
/// `scan::classify`). [`check`] hands records out without it; MQTT's QoS is 0..=2 and
/// [`crate::model::QOS_TOO_LARGE`] is 0x80.
pub(crate) const COMMIT_START: u8 = 0x40;

/// Why the bytes at some position are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// Fewer than [`HEADER_LEN`] bytes remain.
    ShortHeader { have: usize },
    /// The length field is zero: no frame we write is empty (zero-filled tails look like this).
    ZeroLength,
    /// The length field exceeds [`MAX_BODY_LEN`].
    TooLong { len: u32 },
    /// The declared body runs past the end of the available bytes.
    PastEnd { len: u32, have: usize },
    /// Length and body are present but the checksum does not match.
    CrcMismatch {
        len: u32,
        stored: u32,
        computed: u32,
    },
    /// The checksum matches but the body is not a `Record` (a bug, or a CRC collision).
    Decode { len: u32, reason: String },
}

impl FrameError {
    /// Whether the 4-byte length field was complete. A torn tail counts a dropped record
    /// only for frames whose length header made it to disk. (Only the tests ask now.)
    #[cfg(test)]
    pub(crate) fn length_complete(&self) -> bool {
        !matches!(self, FrameError::ShortHeader { have } if *have < 4)
    }

    /// Whether the frame's checksum matched (so the bytes are exactly what some writer
    /// wrote: never a torn write).
    pub(crate) fn crc_valid(&self) -> bool {
        matches!(self, FrameError::Decode { .. })
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::ShortHeader { have } => {
                write!(f, "only {have} of {HEADER_LEN} header bytes present")
            }
            FrameError::ZeroLength => write!(f, "zero length field (zero-filled bytes)"),
            FrameError::TooLong { len } => {
                write!(
                    f,
                    "length field {len} exceeds the frame limit {MAX_BODY_LEN}"
                )
            }
            FrameError::PastEnd { len, have } => write!(
                f,
                "length field {len} runs past the end of the file ({have} body bytes present)"
            ),
            FrameError::CrcMismatch {
                len,
                stored,
                computed,
            } => write!(
                f,
                "CRC mismatch over {len} body bytes: stored {stored:#010x}, computed {computed:#010x}"
            ),
            FrameError::Decode { len, reason } => {
                write!(
                    f,
                    "CRC matches but the {len}-byte body is not a record: {reason}"
                )
            }
        }
    }
}

fn checksum(len_bytes: &[u8], body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(len_bytes);
    h.update(body);
    h.finalize()
}

/// Encode one record as a frame. Panics only on a bug (a `Record` always serialises, and
/// callers bound the payload and topic before building it).
pub(crate) fn encode(record: &Record) -> Vec<u8> {
    // Room for the header, the two strings and ~30 bytes of varints, so the body is
    // serialised in place without reallocating.
    let mut buf = Vec::with_capacity(HEADER_LEN + record.topic.len() + record.payload.len() + 32);
    buf.resize(HEADER_LEN, 0);
    let mut buf =
        postcard::to_extend(record, buf).expect("a Record always serialises with postcard");
    let body_len = buf.len() - HEADER_LEN;
    assert!(
        body_len > 0 && body_len <= MAX_BODY_LEN as usize,
        "frame body of {body_len} bytes is outside 1..={MAX_BODY_LEN}: caller must bound payload and topic"
    );
    let len_bytes = (body_len as u32).to_le_bytes();
    buf[0..4].copy_from_slice(&len_bytes);
    let crc = checksum(&len_bytes, &buf[HEADER_LEN..]);
    buf[4..8].copy_from_slice(&crc.to_le_bytes());
    buf
}

/// The length field of a header (first 4 bytes of `bytes`, which must hold at least 4).
pub(crate) fn declared_len(bytes: &[u8]) -> u32 {
    u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Check the frame at the start of `bytes` (which may hold more after it) and decode it.
/// Returns the record and the frame's total length.
pub fn check(bytes: &[u8]) -> Result<(Record, usize), FrameError> {
    check_marked(bytes).map(|(record, n, _)| (record, n))
}

/// As [`check`], also saying whether the frame is the first a commit wrote into its segment
/// ([`COMMIT_START`], which the record handed out no longer carries).
pub(crate) fn check_marked(bytes: &[u8]) -> Result<(Record, usize, bool), FrameError> {
    let len = checked_len(bytes)?;
    let body = &bytes[HEADER_LEN..HEADER_LEN + len as usize];
    match postcard::take_from_bytes::<Record>(body) {
        Ok((mut record, [])) => {
            let start = record.qos & COMMIT_START != 0;
            record.qos &= !COMMIT_START;
            Ok((record, HEADER_LEN + len as usize, start))
        }
        Ok((_, rest)) => Err(FrameError::Decode {
            len,
            reason: format!("{} trailing bytes after the record", rest.len()),
        }),
        Err(e) => Err(FrameError::Decode {
            len,
            reason: e.to_string(),
        }),
    }
}

/// Structural and CRC check without decoding: returns the body length when the frame at
/// the start of `bytes` is exactly what a writer produced.
pub(crate) fn checked_len(bytes: &[u8]) -> Result<u32, FrameError> {
    if bytes.len() < HEADER_LEN {
        return Err(FrameError::ShortHeader { have: bytes.len() });
    }
    let len = declared_len(bytes);
    if len == 0 {
        return Err(FrameError::ZeroLength);
    }
    if len > MAX_BODY_LEN {
        return Err(FrameError::TooLong { len });
    }
    let have = bytes.len() - HEADER_LEN;
    if (len as usize) > have {
        return Err(FrameError::PastEnd { len, have });
    }
    let stored = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let computed = checksum(&bytes[0..4], &bytes[HEADER_LEN..HEADER_LEN + len as usize]);
    if stored != computed {
        return Err(FrameError::CrcMismatch {
            len,
            stored,
            computed,
        });
    }
    Ok(len)
}

/// The record offset at the start of a body (postcard writes it first, as a varint), if the
/// bytes hold a complete varint. Used to reject resync candidates cheaply before a CRC.
pub(crate) fn body_offset_prefix(body: &[u8]) -> Option<Offset> {
    let mut value: u64 = 0;
    for (i, b) in body.iter().take(10).enumerate() {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// Assert that `buf` is a sequence of valid frames (the check right before writing).
/// Returns how many frames it holds.
pub(crate) fn assert_frames(buf: &[u8]) -> u64 {
    let mut pos = 0;
    let mut frames = 0;
    while pos < buf.len() {
        let len = match checked_len(&buf[pos..]) {
            Ok(len) => len,
            Err(e) => panic!("frame built in memory fails its own check at byte {pos}: {e}"),
        };
        pos += HEADER_LEN + len as usize;
        frames += 1;
    }
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(offset: Offset, payload: Vec<u8>) -> Record {
        Record {
            offset,
            received_at_ms: 1_700_000_000_000,
            topic: "payments/eu".to_string(),
            payload,
            qos: 1,
            retain: false,
        }
    }

    #[test]
    fn a_frame_roundtrips_and_reports_its_length() {
        for payload in [vec![], vec![7u8; 1], vec![0xAB; 70_000]] {
            let r = rec(123_456_789, payload);
            let mut bytes = encode(&r);
            let frame_len = bytes.len();
            bytes.extend_from_slice(&[1, 2, 3]); // trailing bytes belong to the next frame
            let (back, n) = check(&bytes).expect("valid frame");
            assert_eq!(back, r);
            assert_eq!(n, frame_len);
            assert_eq!(assert_frames(&bytes[..frame_len]), 1);
        }
    }

    #[test]
    fn a_flipped_bit_anywhere_is_a_crc_mismatch_or_bad_length() {
        let bytes = encode(&rec(5, b"hello".to_vec()));
        for i in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = bytes.clone();
                bad[i] ^= bit;
                let err = check(&bad).expect_err("flip must be detected");
                if i >= 4 {
                    assert!(matches!(err, FrameError::CrcMismatch { .. }), "{i}: {err}");
                }
            }
        }
    }

    #[test]
    fn short_frames_are_reported_with_whether_the_length_was_complete() {
        let bytes = encode(&rec(1, b"abc".to_vec()));
        for cut in 0..bytes.len() {
            let err = check(&bytes[..cut]).expect_err("short");
            match cut {
                0..=7 => {
                    assert_eq!(err, FrameError::ShortHeader { have: cut });
                    assert_eq!(err.length_complete(), cut >= 4);
                }
                _ => assert!(matches!(err, FrameError::PastEnd { .. })),
            }
        }
    }

    #[test]
    fn zero_fill_is_a_zero_length_not_a_frame() {
        assert_eq!(check(&[0u8; 64]), Err(FrameError::ZeroLength));
        assert_eq!(checked_len(&[0u8; 8]), Err(FrameError::ZeroLength));
    }

    #[test]
    fn an_absurd_length_is_rejected_without_reading_a_body() {
        let mut bytes = encode(&rec(1, vec![]));
        bytes[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(check(&bytes), Err(FrameError::TooLong { len: u32::MAX }));
    }

    #[test]
    fn a_crc_valid_body_that_is_not_a_record_is_a_decode_error() {
        let body = [0xFFu8; 3]; // an unterminated varint
        let len = (body.len() as u32).to_le_bytes();
        let mut bytes = len.to_vec();
        bytes.extend_from_slice(&checksum(&len, &body).to_le_bytes());
        bytes.extend_from_slice(&body);
        let err = check(&bytes).expect_err("not a record");
        assert!(err.crc_valid());
    }

    #[test]
    fn the_offset_is_readable_from_the_body_prefix() {
        let bytes = encode(&rec(300_000, vec![]));
        assert_eq!(body_offset_prefix(&bytes[HEADER_LEN..]), Some(300_000));
        assert_eq!(body_offset_prefix(&[0x80, 0x80]), None);
    }
}
