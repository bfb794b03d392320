//! Pipelines: parse, dedup, aggregate, window. Pure: no IO, no clock.
pub mod spec;
