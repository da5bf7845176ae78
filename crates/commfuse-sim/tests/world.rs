//! The simulator's programming model: signals, timeouts with diagnoses, aborts, barriers, and
//! oversubscription (more ranks than cores).

use commfuse_core::backend::BackendError;
use commfuse_core::error::AbortCause;
use commfuse_core::{Cmp, NotifyOp, Slot};
use commfuse_sim::{Barrier, BarrierKind, SymmetricBuffer, World, WorldConfig};
use std::time::{Duration, Instant};

fn world(size: usize, timeout_ms: u64) -> World {
    World::new(
        size,
        WorldConfig {
            timeout: Duration::from_millis(timeout_ms),
            ..WorldConfig::default()
        },
    )
    .unwrap()
}

#[test]
fn a_wait_nobody_answers_times_out_naming_rank_slot_and_values() {
    let w = world(3, 200);
    let started = Instant::now();
    let err = w
        .run(|ctx| {
            if ctx.rank() == 1 {
                // rank 2 adds 1, rank 1 waits for 2: never satisfied
                ctx.wait(Slot::new(4, 2), 2, Cmp::Ge, 2)?;
            }
            if ctx.rank() == 2 {
                ctx.notify(1, Slot::new(4, 2), 1, NotifyOp::Add)?;
            }
            Ok(())
        })
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3), "no hang");
    assert_eq!(
        err,
        BackendError::WaitTimeout {
            rank: 1,
            slot: Slot::new(4, 2),
            cmp: ">=",
            expected: 2,
            seen: 1,
            timeout_ms: 200,
            from: 2
        }
    );
    assert_eq!(
        err.to_string(),
        "timeout after 200 ms: rank 1 waits on slot (row 4, col 2) for >= 2 from rank 2 but sees 1"
    );
    // a failed world refuses further calls instead of running on half-signalled pads
    assert!(w.run(|_| Ok(())).is_err());
}

#[test]
fn one_failing_rank_aborts_the_waiting_others_quickly() {
    let w = world(4, 10_000);
    let started = Instant::now();
    let err = w
        .run(|ctx| {
            if ctx.rank() == 3 {
                return Err(BackendError::Unavailable("rank 3 failed".into()));
            }
            ctx.wait(Slot::new(0, 0), 1, Cmp::Ge, 3).map(|_| ())
        })
        .unwrap_err();
    assert_eq!(err, BackendError::Unavailable("rank 3 failed".into()));
    // the others' waits ended naming it
    assert_eq!(w.abort_cause(), Some(AbortCause::Failed { rank: 3 }));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the others did not wait out their timeout"
    );
}

#[test]
fn a_timeout_stops_the_others_naming_who_timed_out_waiting_for_whom() {
    // rank 2 waits for rank 1, which waits for rank 0, which never notifies: rank 2's wait
    // began first, so it times out first, and rank 1's wait ends because of it
    let w = world(3, 300);
    let ended = std::sync::Mutex::new(vec![None; 3]);
    let started = Instant::now();
    let _ = w.run(|ctx| {
        let r = ctx.rank();
        let e = match r {
            0 => return Ok(()),
            1 => {
                std::thread::sleep(Duration::from_millis(150));
                ctx.wait(Slot::new(0, 0), 1, Cmp::Ge, 0)
            }
            _ => ctx.wait(Slot::new(0, 1), 1, Cmp::Ge, 1),
        };
        ended.lock().unwrap()[r] = e.err();
        Ok(())
    });
    assert!(
        started.elapsed() < Duration::from_millis(420),
        "rank 1 waited out its timeout"
    );
    let ended = ended.into_inner().unwrap();
    let cause = AbortCause::TimedOut { rank: 2, from: 1 };
    assert_eq!(
        ended[1],
        Some(BackendError::Aborted {
            rank: 1,
            from: 0,
            cause
        })
    );
    assert_eq!(
        ended[1].as_ref().unwrap().to_string(),
        "rank 1 aborted its wait for rank 0 because rank 2 timed out waiting for rank 1"
    );
    assert!(matches!(
        ended[2],
        Some(BackendError::WaitTimeout {
            rank: 2,
            from: 1,
            ..
        })
    ));
    assert_eq!(w.abort_cause(), Some(cause));
}

#[test]
fn signals_to_missing_peers_or_slots_are_errors() {
    let w = world(2, 100);
    let err = w
        .run(|ctx| ctx.notify(5, Slot::new(0, 0), 1, NotifyOp::Set))
        .unwrap_err();
    assert!(
        err.to_string().contains("rank 5, which does not exist"),
        "{err}"
    );
    let w = world(2, 100);
    let err = w
        .run(|ctx| ctx.wait(Slot::new(999, 0), 1, Cmp::Eq, 1).map(|_| ()))
        .unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
}

#[test]
fn sixteen_ranks_on_two_cores_pass_a_thousand_barriers() {
    for kind in [BarrierKind::AllToAll, BarrierKind::Ring] {
        let w = world(16, 10_000);
        let barrier = Barrier::new(&w, kind).unwrap();
        let counters: Vec<_> = (0..16)
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect();
        w.run(|ctx| {
            for epoch in 1..=1000u64 {
                counters[ctx.rank()].store(epoch, std::sync::atomic::Ordering::Relaxed);
                barrier.wait(ctx)?;
                for c in &counters {
                    assert!(c.load(std::sync::atomic::Ordering::Relaxed) >= epoch);
                }
                barrier.wait(ctx)?;
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn symmetric_buffers_are_zeroed_and_shared_through_signals() {
    let w = world(4, 2000);
    let buf = SymmetricBuffer::<f32>::new(4, 64).unwrap();
    assert!((0..4).all(|r| buf.view(r).iter().all(|&x| x == 0.0)));
    w.run(|ctx| {
        let (r, p) = (ctx.rank(), ctx.world_size());
        let right = (r + 1) % p;
        let data = vec![r as f32 + 0.5; 16];
        // SAFETY: each rank writes a distinct 16-element range of its right neighbour, which
        // reads it only after the signal.
        unsafe { buf.store(right, 16 * r, &data) };
        ctx.notify(right, Slot::new(0, 0), 1, NotifyOp::Set)?;
        let left = (r + p - 1) % p;
        ctx.wait(Slot::new(0, 0), 1, Cmp::Eq, left)?;
        let mut got = vec![0f32; 16];
        // SAFETY: written by the left neighbour before its release notify, which we acquired
        unsafe { buf.load(r, 16 * left, &mut got) };
        assert!(got.iter().all(|&x| x == left as f32 + 0.5));
        Ok(())
    })
    .unwrap();
}

#[test]
fn worlds_outside_1_to_64_are_refused() {
    assert!(World::new(0, WorldConfig::default()).is_err());
    assert!(World::new(65, WorldConfig::default()).is_err());
    assert!(World::new(64, WorldConfig::default()).is_ok());
}
