//! Signal slots and what a step does with one: the address of a 64-bit counter on a rank's
//! signal pad ([`Slot`]), how a wait compares the counter with the value it expects ([`Cmp`]),
//! and how a notify changes a peer's counter ([`NotifyOp`]). Plans, the checker, the backends
//! and the errors that name a slot all speak of signals in these terms.

use std::fmt;

/// A signal slot: one 64-bit counter of a rank's signal pad.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Slot {
    pub row: u32,
    pub col: u32,
}

impl Slot {
    pub fn new(row: u32, col: u32) -> Self {
        Slot { row, col }
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(row {}, col {})", self.row, self.col)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Cmp {
    Eq,
    Ge,
}

impl Cmp {
    pub fn symbol(self) -> &'static str {
        match self {
            Cmp::Eq => "==",
            Cmp::Ge => ">=",
        }
    }

    pub fn holds(self, seen: u64, expected: u64) -> bool {
        match self {
            Cmp::Eq => seen == expected,
            Cmp::Ge => seen >= expected,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum NotifyOp {
    Set,
    Add,
}
