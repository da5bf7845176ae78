//! Host-side waits that always end: a start barrier that any rank's thread can abort (so one
//! GPU thread failing before the start releases the others with its reason instead of leaving
//! them blocked), with a bound that names who waited for whom; and a bounded poll for GPU work
//! (stream and event queries) that `cuStreamSynchronize` cannot give.
//!
//! No GPU here: this module is plain threads, tested on any machine.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Why [`StartBarrier::wait`] returned without every rank arriving.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BarrierError {
    /// A rank gave up before arriving and said why.
    #[error("rank {rank} failed before the start barrier: {why}")]
    Aborted { rank: usize, why: String },
    /// The wait ran past its bound.
    #[error(
        "rank {waiter} waited {waited:?} at the start barrier for rank(s) {missing:?}, which never arrived"
    )]
    TimedOut {
        waiter: usize,
        waited: Duration,
        missing: Vec<usize>,
    },
}

impl BarrierError {
    /// Whether this error only reports another rank's failure (the first cause is elsewhere).
    pub fn is_secondary(&self) -> bool {
        matches!(self, BarrierError::Aborted { .. })
    }
}

struct BarrierState {
    /// `arrived[i]`: whether `ranks[i]` reached the barrier
    arrived: Vec<bool>,
    /// the first abort or timeout: every waiter, present and future, returns it
    failed: Option<BarrierError>,
}

/// A one-shot barrier for a fixed set of ranks: each either arrives ([`StartBarrier::wait`]) or
/// gives up ([`StartBarrier::abort`]); a wait returns `Ok` once every rank arrived, an error as
/// soon as any rank aborted, or an error naming the missing ranks after `timeout`.
pub struct StartBarrier {
    ranks: Vec<usize>,
    timeout: Duration,
    state: Mutex<BarrierState>,
    changed: Condvar,
}

impl StartBarrier {
    /// A barrier for `ranks` (each arrives once) whose waits last at most `timeout`.
    pub fn new(ranks: &[usize], timeout: Duration) -> StartBarrier {
        StartBarrier {
            ranks: ranks.to_vec(),
            timeout,
            state: Mutex::new(BarrierState {
                arrived: vec![false; ranks.len()],
                failed: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BarrierState> {
        // the state stays consistent under a panicking holder: every update is one assignment
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn index(&self, rank: usize) -> usize {
        self.ranks
            .iter()
            .position(|&r| r == rank)
            .unwrap_or_else(|| panic!("rank {rank} is not one of this barrier's {:?}", self.ranks))
    }

    /// Arrives as `rank` and waits for every other rank.
    pub fn wait(&self, rank: usize) -> Result<(), BarrierError> {
        let me = self.index(rank);
        let started = Instant::now();
        let mut state = self.lock();
        state.arrived[me] = true;
        self.changed.notify_all();
        loop {
            if let Some(e) = &state.failed {
                return Err(e.clone());
            }
            if state.arrived.iter().all(|&a| a) {
                return Ok(());
            }
            let waited = started.elapsed();
            if waited >= self.timeout {
                let missing = self
                    .ranks
                    .iter()
                    .zip(&state.arrived)
                    .filter(|(_, &a)| !a)
                    .map(|(&r, _)| r)
                    .collect();
                let e = BarrierError::TimedOut {
                    waiter: rank,
                    waited,
                    missing,
                };
                // the others would wait as long for the same ranks: release them now
                state.failed = Some(e.clone());
                self.changed.notify_all();
                return Err(e);
            }
            state = self
                .changed
                .wait_timeout(state, self.timeout - waited)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Gives up as `rank` because of `why`: every waiter returns [`BarrierError::Aborted`]
    /// now, and so does every later wait. After a successful release it changes nothing.
    pub fn abort(&self, rank: usize, why: impl std::fmt::Display) {
        let mut state = self.lock();
        if state.failed.is_none() && !state.arrived.iter().all(|&a| a) {
            state.failed = Some(BarrierError::Aborted {
                rank,
                why: why.to_string(),
            });
        }
        self.changed.notify_all();
    }
}

/// Calls `done` until it returns `Ok(true)` (then `Ok(true)`), an error (returned), or
/// `timeout` passes (then `Ok(false)`, after one last call). Sleeps between calls, from a few
/// microseconds up to a millisecond, so that short waits stay short and long ones stay cheap.
pub fn poll_until<E>(
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool, E>,
) -> Result<bool, E> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(5);
    loop {
        if done()? {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const LONG: Duration = Duration::from_secs(30);

    #[test]
    fn every_rank_arriving_releases_all() {
        let barrier = StartBarrier::new(&[0, 1, 2, 3], LONG);
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|r| {
                    let b = &barrier;
                    s.spawn(move || b.wait(r))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }

    #[test]
    fn a_rank_failing_before_it_arrives_releases_the_others_with_its_reason() {
        let barrier = StartBarrier::new(&[0, 1, 2], LONG);
        let started = Instant::now();
        let results: Vec<_> = std::thread::scope(|s| {
            let waiters: Vec<_> = [0, 2]
                .into_iter()
                .map(|r| {
                    let b = &barrier;
                    s.spawn(move || b.wait(r))
                })
                .collect();
            // rank 1 fails after the others are already waiting
            std::thread::sleep(Duration::from_millis(50));
            barrier.abort(1, "cuEventCreate failed");
            waiters.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(started.elapsed() < Duration::from_secs(5), "no hang");
        let want = BarrierError::Aborted {
            rank: 1,
            why: "cuEventCreate failed".into(),
        };
        assert_eq!(results, vec![Err(want.clone()), Err(want.clone())]);
        assert_eq!(
            want.to_string(),
            "rank 1 failed before the start barrier: cuEventCreate failed"
        );
        // a rank arriving late learns the same
        assert_eq!(barrier.wait(0), Err(want));
    }

    #[test]
    fn a_bounded_wait_names_the_waiter_and_the_missing_ranks() {
        let barrier = StartBarrier::new(&[3, 5, 7], Duration::from_millis(100));
        let started = Instant::now();
        let err = barrier.wait(5).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5), "no hang");
        match &err {
            BarrierError::TimedOut {
                waiter,
                waited,
                missing,
            } => {
                assert_eq!((*waiter, missing.as_slice()), (5, &[3, 7][..]));
                assert!(*waited >= Duration::from_millis(100));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(err.to_string().starts_with("rank 5 waited"), "{err}");
        assert!(err
            .to_string()
            .ends_with("for rank(s) [3, 7], which never arrived"));
        // the others need not wait out their own bound for the same missing ranks
        let again = Instant::now();
        assert_eq!(barrier.wait(3), Err(err));
        assert!(again.elapsed() < Duration::from_millis(50));
    }

    #[test]
    fn an_abort_after_the_release_changes_nothing() {
        let barrier = StartBarrier::new(&[0], LONG);
        barrier.wait(0).unwrap();
        barrier.abort(0, "late");
        assert_eq!(barrier.wait(0), Ok(()));
    }

    #[test]
    fn polling_ends_when_done_on_error_or_at_the_bound() {
        let calls = AtomicUsize::new(0);
        let done = poll_until::<()>(LONG, || Ok(calls.fetch_add(1, Ordering::Relaxed) == 3));
        assert_eq!((done, calls.load(Ordering::Relaxed)), (Ok(true), 4));
        assert_eq!(
            poll_until(LONG, || Err::<bool, _>("faulted")),
            Err("faulted")
        );
        let started = Instant::now();
        assert_eq!(
            poll_until::<()>(Duration::from_millis(30), || Ok(false)),
            Ok(false)
        );
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(30) && took < Duration::from_secs(5));
    }
}
