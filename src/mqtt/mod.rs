//! MQTT (being written).
