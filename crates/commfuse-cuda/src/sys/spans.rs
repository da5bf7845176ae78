//! Raw pointer arguments checked once: an operator called with bare device addresses (the
//! Python classes, which link no framework) checks that the bytes a call reads or writes from
//! each address lie in one allocation of the operator's GPU ([`check_device_span`]) at the
//! first call that passes that address, and remembers the pair.
//!
//! The check is a driver call (`cuPointerGetAttributes`, ~0.3–0.7 µs) per argument, on a call
//! path whose whole host time is a few µs: repeating it every call would cost more than the
//! call itself, so each argument keeps the last [`RECENT`] (address, bytes) pairs that passed
//! (a training loop passes the same few buffers again and again) and a call is checked again
//! only for an address, or a larger span of one, not among them. An allocator that hands out
//! sub-ranges of bigger blocks (PyTorch's caching allocator) is checked against the block: the
//! span must lie inside it. A block freed and replaced at the same address by a smaller one
//! passes unchecked while its pair is remembered: the check catches wrong arguments, not every
//! misuse of freed memory.

use crate::error::CudaError;
use crate::sys::driver::check_device_span;

/// How many passed (address, bytes) pairs each argument remembers.
pub const RECENT: usize = 4;

/// The spans that passed for each of an operator's `ARGS` pointer arguments, on GPU `ordinal`.
#[derive(Debug, Clone)]
pub struct CheckedSpans<const ARGS: usize> {
    ordinal: usize,
    /// `[argument][i]`: (address, bytes) that lay inside one allocation of the GPU; (0, 0)
    /// where unused (a request of 0 bytes is never looked up)
    recent: [[(u64, usize); RECENT]; ARGS],
    /// Per argument, the pair that the next one to pass replaces
    next: [usize; ARGS],
}

impl<const ARGS: usize> CheckedSpans<ARGS> {
    /// Nothing checked yet, for an operator of GPU `ordinal`.
    pub fn new(ordinal: usize) -> Self {
        CheckedSpans {
            ordinal,
            recent: [[(0, 0); RECENT]; ARGS],
            next: [0; ARGS],
        }
    }

    /// Whether `bytes` bytes from `addr` (pointer argument `arg`, called `what` in the error)
    /// lie in one allocation of the operator's GPU: a remembered pair of `arg` covering them,
    /// else the driver's answer ([`CudaError::OutOfBounds`] in one line, naming `what`, where it
    /// is and what its allocation holds). A span of no bytes touches nothing and passes.
    pub fn check(
        &mut self,
        arg: usize,
        what: &str,
        addr: u64,
        bytes: usize,
    ) -> Result<(), CudaError> {
        let ordinal = self.ordinal;
        self.check_with(arg, addr, bytes, || {
            check_device_span(what, addr, bytes, ordinal)
        })
    }

    /// [`CheckedSpans::check`] with `check` in place of the driver's.
    fn check_with(
        &mut self,
        arg: usize,
        addr: u64,
        bytes: usize,
        check: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let recent = &mut self.recent[arg];
        if recent.iter().any(|&(a, b)| a == addr && b >= bytes) {
            return Ok(());
        }
        check()?;
        recent[self.next[arg]] = (addr, bytes);
        self.next[arg] = (self.next[arg] + 1) % RECENT;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A fake driver: spans inside [0x1000, 0x1000 + 4096) pass; counts its calls.
    fn fake(calls: &Cell<usize>, addr: u64, bytes: usize) -> Result<(), CudaError> {
        calls.set(calls.get() + 1);
        match addr >= 0x1000 && addr + bytes as u64 <= 0x2000 {
            true => Ok(()),
            false => Err(CudaError::OutOfBounds(format!("{addr:#x}+{bytes}"))),
        }
    }

    #[test]
    fn a_span_is_asked_of_the_driver_once_then_remembered() {
        let calls = Cell::new(0);
        let mut spans = CheckedSpans::<2>::new(0);
        for _ in 0..3 {
            spans
                .check_with(0, 0x1000, 256, || fake(&calls, 0x1000, 256))
                .unwrap();
        }
        assert_eq!(calls.get(), 1);
        // a smaller span of the same address is covered; a larger one is asked again
        spans
            .check_with(0, 0x1000, 128, || fake(&calls, 0x1000, 128))
            .unwrap();
        assert_eq!(calls.get(), 1);
        spans
            .check_with(0, 0x1000, 1024, || fake(&calls, 0x1000, 1024))
            .unwrap();
        assert_eq!(calls.get(), 2);
        // another argument remembers its own
        spans
            .check_with(1, 0x1000, 256, || fake(&calls, 0x1000, 256))
            .unwrap();
        assert_eq!(calls.get(), 3);
    }

    #[test]
    fn a_span_that_fails_is_asked_again_at_every_call() {
        let calls = Cell::new(0);
        let mut spans = CheckedSpans::<1>::new(0);
        for i in 1..=3 {
            let e = spans
                .check_with(0, 0x1f00, 512, || fake(&calls, 0x1f00, 512))
                .unwrap_err();
            assert!(matches!(e, CudaError::OutOfBounds(_)));
            assert_eq!(calls.get(), i);
        }
    }

    #[test]
    fn each_argument_remembers_its_last_few_spans() {
        let calls = Cell::new(0);
        let mut spans = CheckedSpans::<1>::new(0);
        let addr = |i: usize| 0x1000 + 16 * i as u64;
        for i in 0..=RECENT {
            spans
                .check_with(0, addr(i), 16, || fake(&calls, addr(i), 16))
                .unwrap();
        }
        assert_eq!(calls.get(), RECENT + 1);
        // the last RECENT are remembered; the first was replaced
        for i in 1..=RECENT {
            spans
                .check_with(0, addr(i), 16, || fake(&calls, addr(i), 16))
                .unwrap();
        }
        assert_eq!(calls.get(), RECENT + 1);
        spans
            .check_with(0, addr(0), 16, || fake(&calls, addr(0), 16))
            .unwrap();
        assert_eq!(calls.get(), RECENT + 2);
    }

    #[test]
    fn an_empty_span_touches_nothing_and_passes() {
        let mut spans = CheckedSpans::<1>::new(0);
        spans
            .check_with(0, 0, 0, || panic!("no driver call for no bytes"))
            .unwrap();
    }
}
