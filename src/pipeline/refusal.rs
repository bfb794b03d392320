//! Why an input cannot be applied: a stable reason word and a detail for a person. A leaf,
//! shared by payload parsing, `where` evaluation, topics and the engine, which all refuse.

/// Why a payload was refused. `reason` is a stable, greppable word; `detail` says more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub detail: String,
}
