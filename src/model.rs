//! Plain data shared by every layer. No IO, no clocks, no sled, no rumqttc.

use serde::{Deserialize, Serialize};

/// Position of a record in the replay log. Offsets are dense: the first record ever
/// appended is 0 and each append adds one. They never repeat, even after truncation.
pub type Offset = u64;

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
