//! Shared helpers for sluice-core's integration tests.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::collections::HashMap;
use std::num::NonZeroU32;

use sluice_core::{CellRef, Ledger};

/// A ledger over a plain map: what a store holds, without a store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapLedger(pub HashMap<u64, u64>);

impl Ledger for MapLedger {
    fn read(&mut self, at: CellRef<'_>) -> u64 {
        self.0.get(&at.cell).copied().unwrap_or(0)
    }
    fn write(&mut self, at: CellRef<'_>, value: u64) {
        self.0.insert(at.cell, value);
    }
}

/// A non-zero number of seconds.
pub fn secs(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// A non-zero count (milliseconds, units).
pub fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}
