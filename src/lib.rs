//! # Cairn
//!
//! (architecture overview: filled in as modules land)

pub mod agent;
pub mod cli;
pub mod config;
pub mod failpoint;
pub mod fsio;
pub mod log;
pub mod model;
pub mod mqtt;
pub mod pipeline;
pub mod processor;
pub mod store;
pub mod verify;
