//! The durable replay log (being written).
