//! Pipelines: parse, dedup, aggregate, window. Pure: this module never sees sled, rumqttc,
//! tokio, the file system or the clock. `Engine::apply(base, record)` is a function of the
//! last checkpoint and the record, so replay recomputes exactly what a crash lost
//! (invariant 3; guarded by `tests/it/model.rs`).

pub mod batch_ledger;
pub(crate) mod bound;
pub(crate) mod describe;
pub mod engine;
pub(crate) mod expr;
pub mod field;
pub(crate) mod filter;
mod filter_json;
pub(crate) mod json;
pub mod memory;
pub(crate) mod num;
pub(crate) mod parse;
pub(crate) mod refusal;
pub(crate) mod sketch;
pub mod sparkplug;
pub mod spec;
pub(crate) mod state_key;
pub mod time;
pub(crate) mod topic;
pub(crate) mod value;

pub use engine::{Batch, Checkpoint, Engine, Outcome, ReadError, ReadState};
pub use field::{Field, Format};
pub use num::Num;
pub use refusal::Refusal;
pub use spec::{Aggregate, AggregateSpec, Emit, PipelineSpec, WindowSpec};
pub use value::{Agg, KeyState};
