//! What a simulated run allocates, counted before anything is: every operator constructor,
//! the world's signal pads and the harnesses around them (the command line, the Python
//! bindings) add up the bytes they are about to take with checked arithmetic and compare the
//! sum with the memory the OS says is available, so that a request too large for the machine
//! ends in one line ([`BackendError::TooLarge`]) instead of an aborted allocation.

use commfuse_core::backend::BackendError;
use commfuse_core::error::MEMORY_SHARE_PERCENT;

/// Bytes of memory the OS says are available (`MemAvailable` of /proc/meminfo), if it says.
pub fn available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes the float64 reference checks of the collectives hold at once: blocks of 1024 values
/// and their scales on each of up to 8 threads (`commfuse_core::reference::compare`).
pub const REFERENCE_BLOCK_BYTES: usize = 8 * 2 * 1024 * 8;

/// A tally of the bytes one thing (`what`, as the error names it) allocates: items added as
/// products of counts, lengths and element sizes, every product and sum checked, so that an
/// overflow is remembered rather than wrapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprint {
    what: String,
    /// None once a product or sum overflowed
    bytes: Option<u64>,
}

impl Footprint {
    /// Nothing yet, for `what` ("run gemm-rs 4096×4096×512 on 2 ranks").
    pub fn new(what: impl Into<String>) -> Footprint {
        Footprint {
            what: what.into(),
            bytes: Some(0),
        }
    }

    /// Adds the product of `factors` bytes (counts, lengths and the element size in bytes).
    pub fn item(self, factors: &[usize]) -> Footprint {
        let product = factors.iter().try_fold(1u64, |acc, &f| {
            u64::try_from(f).ok().and_then(|f| acc.checked_mul(f))
        });
        self.add_bytes(product)
    }

    /// Adds `bytes` (None: a count that overflowed).
    pub fn add_bytes(mut self, bytes: Option<u64>) -> Footprint {
        self.bytes = self.bytes.zip(bytes).and_then(|(a, b)| a.checked_add(b));
        self
    }

    /// Adds what `other` counts.
    pub fn and(self, other: &Footprint) -> Footprint {
        self.add_bytes(other.bytes)
    }

    /// The same bytes, for `what`.
    pub fn named(self, what: impl Into<String>) -> Footprint {
        Footprint {
            what: what.into(),
            ..self
        }
    }

    /// The bytes counted, or None when they overflowed 64 bits.
    pub fn bytes(&self) -> Option<u64> {
        self.bytes
    }

    pub fn what(&self) -> &str {
        &self.what
    }

    /// Refuses what overflowed, or needs more than [`MEMORY_SHARE_PERCENT`] of the memory
    /// available now (where the OS does not say, only an overflow is refused).
    pub fn check(&self) -> Result<(), BackendError> {
        self.check_within(available())
    }

    /// [`Footprint::check`] against `available` bytes (None: unknown).
    pub fn check_within(&self, available: Option<u64>) -> Result<(), BackendError> {
        let fits = match (self.bytes, available) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(bytes), Some(available)) => {
                bytes as u128 * 100 <= available as u128 * MEMORY_SHARE_PERCENT as u128
            }
        };
        if fits {
            Ok(())
        } else {
            Err(BackendError::TooLarge {
                what: self.what.clone(),
                needs: self.bytes,
                available,
            })
        }
    }

    /// [`Footprint::check`] of the overflow only: for memory that is already reserved (a
    /// group's shared arena), whose own allocator refuses what does not fit.
    pub fn check_overflow(&self) -> Result<(), BackendError> {
        self.check_within(None)
    }

    /// [`Footprint::check`] of memory this process allocates, or with `shared` of memory carved
    /// from a group's arena ([`Footprint::check_overflow`]).
    pub fn check_on(&self, shared: bool) -> Result<(), BackendError> {
        if shared {
            self.check_overflow()
        } else {
            self.check()
        }
    }
}

/// What an operator allocates: its symmetric buffers (carved from a group's shared arena on a
/// shared world) and the heap of its rank threads (schedule tables, per-call copies and the
/// GEMM's widened tiles).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorMemory {
    pub buffers: Footprint,
    pub heap: Footprint,
}

impl OperatorMemory {
    /// Both parts, under the buffers' name.
    pub fn total(&self) -> Footprint {
        self.buffers.clone().and(&self.heap)
    }

    /// What this process allocates for the operator: both parts, or on a shared world (`shared`)
    /// the heap only, the buffers lying in memory the group reserved (their count must still not
    /// overflow).
    pub fn in_process(&self, shared: bool) -> Result<Footprint, BackendError> {
        if shared {
            self.buffers.check_overflow()?;
            Ok(self.heap.clone())
        } else {
            Ok(self.total())
        }
    }

    /// The check an operator's constructor makes on a world (`shared` for a group's).
    pub fn check(&self, shared: bool) -> Result<(), BackendError> {
        self.in_process(shared)?.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_and_sums_are_checked() {
        let f = Footprint::new("x").item(&[2, 3, 4]).item(&[5]);
        assert_eq!(f.bytes(), Some(29));
        assert_eq!(f.clone().item(&[usize::MAX, 2]).bytes(), None);
        assert_eq!(f.clone().add_bytes(Some(u64::MAX)).bytes(), None);
        // an overflow stays an overflow
        assert_eq!(f.item(&[usize::MAX, 2]).item(&[1]).bytes(), None);
        assert_eq!(Footprint::new("y").item(&[]).bytes(), Some(1));
    }

    #[test]
    fn what_does_not_fit_is_refused_in_one_line_naming_both_sizes() {
        let f = Footprint::new("run all-reduce of 8 elements").item(&[1000]);
        f.check_within(Some(1112)).unwrap();
        f.check_within(None).unwrap();
        let err = f.check_within(Some(1000)).unwrap_err().to_string();
        assert_eq!(
            err,
            "run all-reduce of 8 elements needs 1000 B (1000 bytes), more than 90 % of the 1000 B (1000 bytes) of memory available"
        );
        let big = Footprint::new("a GEMM").item(&[1 << 40, 3]);
        let err = big.check_within(Some(24 << 30)).unwrap_err().to_string();
        assert!(
            err.starts_with("a GEMM needs 3.0 TiB (3298534883328 bytes), more than 90 % of the 24.0 GiB (25769803776 bytes)"),
            "{err}"
        );
        let over = Footprint::new("a GEMM").item(&[usize::MAX, 3]);
        let err = over.check_within(None).unwrap_err().to_string();
        assert_eq!(
            err,
            "a GEMM needs more bytes than 64 bits count (its size overflows)"
        );
        let err = over.check_within(Some(4096)).unwrap_err().to_string();
        assert!(
            err.ends_with("4.0 KiB (4096 bytes) of memory is available"),
            "{err}"
        );
        assert!(over.check_overflow().is_err() && big.check_overflow().is_ok());
        assert!(!err.contains('\n'));
    }

    #[test]
    fn the_os_says_how_much_is_available_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(available().is_some_and(|b| b > 0));
        }
    }
}
