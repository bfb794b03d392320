//! The checkpoint store (being written).
