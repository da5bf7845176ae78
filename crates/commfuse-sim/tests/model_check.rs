//! Model-checked protocols. loom explores every interleaving (and the weak-memory outcomes the
//! C++ model allows) of small cases and flags a data race on an `UnsafeCell` the protocol was
//! supposed to order; shuttle runs larger worlds under random and PCT schedules.

use commfuse_core::{Cmp, NotifyOp};
use commfuse_sim::protocol::{self, Backoff, Pads, SignalWord, Stop};

/// The protocol's atomics, backoff and pads for one model checker: `$atomics` is its
/// `sync::atomic` module, `$yield` its yield function.
macro_rules! model_primitives {
    ($atomics:path, $yield:path) => {
        use atomics::{AtomicU64, Ordering};
        use $atomics as atomics;

        struct Word(AtomicU64);

        impl SignalWord for Word {
            fn load_acquire(&self) -> u64 {
                self.0.load(Ordering::Acquire)
            }
            fn store_release(&self, value: u64) {
                self.0.store(value, Ordering::Release)
            }
            fn add_release(&self, value: u64) {
                self.0.fetch_add(value, Ordering::Release);
            }
        }

        struct Yield;
        impl Backoff for Yield {
            fn pause(&mut self) -> Result<(), Stop> {
                $yield();
                Ok(())
            }
        }

        /// `world` pads of `rows × cols` zeroed slots.
        struct ModelPads {
            cols: u32,
            slots: Vec<Vec<Word>>,
        }

        impl ModelPads {
            fn new(world: usize, rows: u32, cols: u32) -> Self {
                ModelPads {
                    cols,
                    slots: (0..world)
                        .map(|_| (0..rows * cols).map(|_| Word(AtomicU64::new(0))).collect())
                        .collect(),
                }
            }
        }

        impl Pads for ModelPads {
            type Word = Word;
            fn slot(&self, rank: usize, row: u32, col: u32) -> &Word {
                &self.slots[rank][(row * self.cols + col) as usize]
            }
        }
    };
}

mod loom_checks {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    model_primitives!(loom::sync::atomic, loom::thread::yield_now);

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(f);
    }

    /// Data written before a release notify is visible after the acquire wait that sees it.
    #[test]
    fn notify_then_wait_publishes_data() {
        for op in [NotifyOp::Set, NotifyOp::Add] {
            model(move || {
                let flag = Arc::new(Word(AtomicU64::new(0)));
                let data = Arc::new(UnsafeCell::new(0u64));
                let (f2, d2) = (flag.clone(), data.clone());
                let producer = loom::thread::spawn(move || {
                    d2.with_mut(|p| unsafe { *p = 42 });
                    protocol::notify(&*f2, 1, op);
                });
                protocol::wait(&*flag, 1, Cmp::Ge, &mut Yield).unwrap();
                assert_eq!(data.with(|p| unsafe { *p }), 42);
                producer.join().unwrap();
            });
        }
    }

    /// The check can fail: with a relaxed store as "notify", loom finds the reader racing with
    /// the writer.
    #[test]
    #[should_panic(expected = "Causality violation")]
    fn a_relaxed_notify_is_caught() {
        struct Relaxed(AtomicU64);
        impl SignalWord for Relaxed {
            fn load_acquire(&self) -> u64 {
                self.0.load(Ordering::Acquire)
            }
            fn store_release(&self, value: u64) {
                self.0.store(value, Ordering::Relaxed)
            }
            fn add_release(&self, value: u64) {
                self.0.fetch_add(value, Ordering::Relaxed);
            }
        }
        model(|| {
            let flag = Arc::new(Relaxed(AtomicU64::new(0)));
            let data = Arc::new(UnsafeCell::new(0u64));
            let (f2, d2) = (flag.clone(), data.clone());
            let producer = loom::thread::spawn(move || {
                d2.with_mut(|p| unsafe { *p = 42 });
                protocol::notify(&*f2, 1, NotifyOp::Set);
            });
            protocol::wait(&*flag, 1, Cmp::Ge, &mut Yield).unwrap();
            let _ = data.with(|p| unsafe { *p });
            producer.join().unwrap();
        });
    }

    /// One LL all-reduce's protocol: (lines, (world, rank, seq), input, output, backoff).
    type LlAllReduce = fn(
        &LlModelLines,
        (usize, usize, u32),
        &[f32],
        &mut [f32],
        &mut Yield,
    ) -> Result<(), protocol::LlStuck>;

    struct LlModelLines(Vec<Vec<Word>>);
    impl protocol::LlLines for LlModelLines {
        type Word = Word;
        fn line(&self, rank: usize, index: usize) -> &Word {
            &self.0[rank][index]
        }
    }

    /// An LL all-reduce, two ranks, two elements, three calls back to back with new inputs:
    /// every interleaving gives both ranks every call's sum — no line of a call is overwritten
    /// by a later call before its reader has it (the parity buffers), none read stale.
    fn ll_keeps_back_to_back_calls_apart(all_reduce: LlAllReduce, lines_per_rank: usize) {
        model(move || {
            let (world, len, calls) = (2usize, 2usize, 3u32);
            let lines = Arc::new(LlModelLines(
                (0..world)
                    .map(|_| {
                        (0..lines_per_rank)
                            .map(|_| Word(AtomicU64::new(0)))
                            .collect()
                    })
                    .collect(),
            ));
            let value =
                |rank: usize, seq: u32, i: usize| (rank * 10 + seq as usize * 100 + i) as f32;
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let lines = lines.clone();
                    loom::thread::spawn(move || {
                        for seq in 1..=calls {
                            let input: Vec<f32> = (0..len).map(|i| value(rank, seq, i)).collect();
                            let mut out = vec![0.0; len];
                            all_reduce(&lines, (world, rank, seq), &input, &mut out, &mut Yield)
                                .unwrap();
                            for (i, o) in out.iter().enumerate() {
                                assert_eq!(*o, value(0, seq, i) + value(1, seq, i));
                            }
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        });
    }

    #[test]
    fn ll_one_shot_keeps_back_to_back_calls_apart() {
        ll_keeps_back_to_back_calls_apart(protocol::ll_one_shot_all_reduce, 2 * 2 * 2);
    }

    #[test]
    fn ll_two_shot_keeps_back_to_back_calls_apart() {
        ll_keeps_back_to_back_calls_apart(
            protocol::ll_two_shot_all_reduce,
            protocol::ll_two_shot_lines(2, 2),
        );
    }

    /// Two ranks, two barrier epochs: what a rank writes before the barrier its peer reads after
    /// it, and the peer's read in epoch 1 is ordered before the rewrite in epoch 2.
    fn barrier_orders_accesses(ring: bool) {
        model(move || {
            let pads = Arc::new(ModelPads::new(2, 2, 2));
            let cells = Arc::new([UnsafeCell::new(0u64), UnsafeCell::new(0u64)]);
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (pads, cells) = (pads.clone(), cells.clone());
                    loom::thread::spawn(move || {
                        for epoch in 1..=2u64 {
                            cells[rank].with_mut(|p| unsafe { *p = epoch });
                            if ring {
                                protocol::ring_barrier(
                                    &*pads,
                                    2,
                                    rank,
                                    0,
                                    2 * epoch - 1,
                                    &mut Yield,
                                )
                                .unwrap();
                            } else {
                                protocol::all_to_all_barrier(
                                    &*pads,
                                    2,
                                    rank,
                                    0,
                                    2 * epoch - 1,
                                    &mut Yield,
                                )
                                .unwrap();
                            }
                            assert_eq!(cells[1 - rank].with(|p| unsafe { *p }), epoch);
                            // second barrier of the epoch: nobody rewrites before both have read
                            if ring {
                                protocol::ring_barrier(&*pads, 2, rank, 0, 2 * epoch, &mut Yield)
                                    .unwrap();
                            } else {
                                protocol::all_to_all_barrier(
                                    &*pads,
                                    2,
                                    rank,
                                    0,
                                    2 * epoch,
                                    &mut Yield,
                                )
                                .unwrap();
                            }
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        });
    }

    #[test]
    fn all_to_all_barrier_orders_accesses() {
        barrier_orders_accesses(false);
    }

    #[test]
    fn ring_barrier_orders_accesses() {
        barrier_orders_accesses(true);
    }
}

mod shuttle_checks {
    use super::*;
    use shuttle::sync::Arc;
    model_primitives!(shuttle::sync::atomic, shuttle::thread::yield_now);

    /// No rank leaves barrier epoch e before every rank has entered it, for several epochs in
    /// a row and no reset in between.
    fn no_early_exit(world: usize, ring: bool) {
        let epochs = 3u64;
        let pads = Arc::new(ModelPads::new(world, 2, world as u32));
        let arrivals = Arc::new((0..world).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (pads, arrivals) = (pads.clone(), arrivals.clone());
                shuttle::thread::spawn(move || {
                    for epoch in 1..=epochs {
                        arrivals[rank].store(epoch, Ordering::SeqCst);
                        if ring {
                            protocol::ring_barrier(&*pads, world, rank, 0, epoch, &mut Yield).unwrap();
                        } else {
                            protocol::all_to_all_barrier(&*pads, world, rank, 0, epoch, &mut Yield).unwrap();
                        }
                        for (q, a) in arrivals.iter().enumerate() {
                            let seen = a.load(Ordering::SeqCst);
                            assert!(seen >= epoch, "rank {rank} left epoch {epoch} before rank {q} arrived (it is at {seen})");
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn all_to_all_barrier_random_schedules() {
        for world in [2, 3, 4] {
            shuttle::check_random(move || no_early_exit(world, false), 300);
            shuttle::check_pct(move || no_early_exit(world, false), 300, 3);
        }
    }

    #[test]
    fn ring_barrier_random_schedules() {
        for world in [2, 3, 4, 5] {
            shuttle::check_random(move || no_early_exit(world, true), 300);
            shuttle::check_pct(move || no_early_exit(world, true), 300, 3);
        }
    }

    /// The check itself can fail: a "barrier" that only signals and never waits is caught.
    #[test]
    #[should_panic(expected = "before rank")]
    fn a_barrier_without_waits_is_caught() {
        shuttle::check_random(
            || {
                let world = 3;
                let arrivals = Arc::new((0..world).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
                let handles: Vec<_> = (0..world)
                    .map(|rank| {
                        let arrivals = arrivals.clone();
                        shuttle::thread::spawn(move || {
                            arrivals[rank].store(1, Ordering::SeqCst);
                            for (q, a) in arrivals.iter().enumerate() {
                                assert!(
                                    a.load(Ordering::SeqCst) >= 1,
                                    "rank {rank} left before rank {q} arrived"
                                );
                            }
                        })
                    })
                    .collect();
                for h in handles {
                    h.join().unwrap();
                }
            },
            200,
        );
    }
}
