//! Model-checked protocols. loom explores every interleaving (and the weak-memory outcomes the
//! C++ model allows) of small cases and flags a data race on an `UnsafeCell` the protocol was
//! supposed to order; shuttle runs larger worlds under random and PCT schedules.

use commfuse_core::{Cmp, NotifyOp};
use commfuse_sim::ll_chunks::{ll_all_gather, ll_reduce_scatter, LlChunks};
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

        /// Every rank's LL lines, `lines` zeroed words each.
        struct LlModelLines(Vec<Vec<Word>>);
        impl LlModelLines {
            fn new(world: usize, lines: usize) -> Self {
                LlModelLines(
                    (0..world)
                        .map(|_| (0..lines).map(|_| Word(AtomicU64::new(0))).collect())
                        .collect(),
                )
            }
        }
        impl protocol::LlLines for LlModelLines {
            type Word = Word;
            fn line(&self, rank: usize, index: usize) -> &Word {
                &self.0[rank][index]
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

    /// An LL all-reduce, two ranks, two elements, three calls back to back with new inputs:
    /// every interleaving gives both ranks every call's sum — no line of a call is overwritten
    /// by a later call before its reader has it (the parity buffers), none read stale.
    fn ll_keeps_back_to_back_calls_apart(all_reduce: LlAllReduce, lines_per_rank: usize) {
        model(move || {
            let (world, len, calls) = (2usize, 2usize, 3u32);
            let lines = Arc::new(LlModelLines::new(world, lines_per_rank));
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

    /// GEMM + reduce-scatter's overlapped ring (the schedule of `commfuse_core::fused::ring_rs`,
    /// partial products stood in by known values, one column) as its simulator and GPU paths
    /// run it: per piece, wait for the running sum's flag (== the call), add, hand it on (data,
    /// then a release flag) or keep it; alternate calls in alternate sets; calls of M < P end
    /// with a done per link. `sets` = 2 is the protocol; 1 leaves out what keeps a fast sender's
    /// next call from overwriting a sum not yet read. Panics ("the ring broke") on a wrong sum,
    /// or on a wait that never ends (a flag overwritten by a later call before it was seen).
    fn ring_calls(world: usize, groups: usize, ms: &'static [usize], sets: u64) {
        use commfuse_core::fused::gemm_rs::GemmRsShape;
        use commfuse_core::fused::ring_rs::{RingSchedule, RingTarget};
        use commfuse_core::gemm::BLayout;
        use commfuse_core::DType;
        let max_m = *ms.iter().max().unwrap();
        let schedule = move |m: usize| {
            let shape =
                GemmRsShape::new(world, m, 1, 8, BLayout::NK, DType::BF16, DType::F32).unwrap();
            RingSchedule::within(shape, max_m, 2)
                .in_groups(groups)
                .unwrap()
        };
        let layout = schedule(max_m);
        // per rank: receive buffers (f64 bits, relaxed: only the flags order them) and flags
        let receive = Arc::new(
            (0..world)
                .map(|_| {
                    (0..layout.receive_len())
                        .map(|_| AtomicU64::new(0))
                        .collect()
                })
                .collect::<Vec<Vec<AtomicU64>>>(),
        );
        let flags = Arc::new(
            (0..world)
                .map(|_| {
                    (0..layout.flag_words())
                        .map(|_| Word(AtomicU64::new(0)))
                        .collect()
                })
                .collect::<Vec<Vec<Word>>>(),
        );
        let partial =
            |rank: usize, call: usize, row: usize| (1 + rank * 7 + call * 100 + row * 1000) as f64;
        let wait = |word: &Word, value: u64, cmp: Cmp| {
            for _ in 0..20_000 {
                let seen = word.load_acquire();
                if (cmp == Cmp::Eq && seen == value) || (cmp == Cmp::Ge && seen >= value) {
                    return;
                }
                shuttle::thread::yield_now();
            }
            panic!("the ring broke: a wait for {value} never ended");
        };
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (receive, flags) = (receive.clone(), flags.clone());
                shuttle::thread::spawn(move || {
                    for (c, &m) in ms.iter().enumerate() {
                        let call = c as u64 + 1;
                        let s = schedule(m);
                        let set = (call % sets) as usize;
                        for g in s.pieces_of(rank) {
                            let mut sums: Vec<f64> =
                                g.rows.clone().map(|i| partial(rank, c, i)).collect();
                            if let Some(prev) = g.add {
                                wait(
                                    &flags[rank][s.flag_index(set, prev, g.piece)],
                                    call,
                                    Cmp::Eq,
                                );
                                let at = s.receive_offset(set, prev) + g.within.start;
                                for (j, x) in sums.iter_mut().enumerate() {
                                    *x += f64::from_bits(
                                        receive[rank][at + j].load(Ordering::Relaxed),
                                    );
                                }
                            }
                            match g.target {
                                RingTarget::Send { step } => {
                                    let to = s.receiver(rank, step);
                                    let at = s.receive_offset(set, step) + g.within.start;
                                    for (j, x) in sums.iter().enumerate() {
                                        receive[to][at + j].store(x.to_bits(), Ordering::Relaxed);
                                    }
                                    flags[to][s.flag_index(set, step, g.piece)].store_release(call);
                                }
                                RingTarget::Output => {
                                    for (j, x) in sums.iter().enumerate() {
                                        let row = g.rows.start + j;
                                        let want: f64 =
                                            (0..world).map(|r| partial(r, c, row)).sum();
                                        assert_eq!(
                                            *x, want,
                                            "the ring broke: call {call} rank {rank} row {row}: wrong sum"
                                        );
                                    }
                                }
                            }
                        }
                        if s.ends_with_done() {
                            for link in s.links() {
                                flags[s.sender_on(rank, link)][s.done_index(link)]
                                    .store_release(call);
                            }
                            for link in s.links() {
                                wait(&flags[rank][s.done_index(link)], call, Cmp::Ge);
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    /// The flat ring and the 2D ring over NUMA groups, back-to-back calls with M ≥ P and M < P
    /// (the done handshake on both links), under random and PCT schedules.
    #[test]
    fn the_gemm_rs_ring_keeps_back_to_back_calls_apart() {
        static MS: [usize; 4] = [5, 1, 4, 6];
        for (world, groups) in [(2, 1), (3, 1), (4, 2), (6, 3), (6, 2)] {
            shuttle::check_random(move || ring_calls(world, groups, &MS, 2), 100);
            shuttle::check_pct(move || ring_calls(world, groups, &MS, 2), 100, 3);
        }
    }

    /// The check can fail: with one set of receive buffers a fast sender's next call overwrites
    /// a running sum (or its flag) its receiver has yet to read.
    #[test]
    #[should_panic(expected = "the ring broke")]
    fn a_ring_with_one_set_of_buffers_is_caught() {
        static MS: [usize; 4] = [4, 4, 4, 4];
        shuttle::check_pct(|| ring_calls(4, 2, &MS, 1), 1000, 3);
    }

    /// A wait that gives up after many polls: a line overwritten by a later call before its
    /// reader saw it never shows the awaited call.
    struct Bounded(u32);
    impl Backoff for Bounded {
        fn pause(&mut self) -> Result<(), Stop> {
            self.0 += 1;
            if self.0 > 50_000 {
                return Err(Stop::Timeout);
            }
            shuttle::thread::yield_now();
            Ok(())
        }
    }

    /// The LL reduce-scatter (`gather` false) or all-gather over chunks
    /// (`commfuse_sim::ll_chunks`, the GPU kernel's two modes): three calls back to back on
    /// every rank with new inputs, every output element checked. Panics ("the LL calls broke")
    /// on a wrong element or on a wait that never ends.
    fn ll_chunked_calls(layout: LlChunks, gather: bool) {
        let (world, len) = (layout.world, layout.len);
        let lines = Arc::new(LlModelLines::new(world, layout.buffer_lines()));
        // small integers: every sum exact
        let value = |rank: usize, seq: u32, i: usize| {
            (1 + rank * 10 + seq as usize * 100 + i * 1000) as f32
        };
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let lines = lines.clone();
                shuttle::thread::spawn(move || {
                    let mine = layout.chunk(rank);
                    let mut backoff = Bounded(0);
                    for seq in 1..=3u32 {
                        let broke =
                            |e| panic!("the LL calls broke: rank {rank}, call {seq}: {e:?}");
                        // the all-gather's input is the rank's chunk, its output all `len`
                        // elements (each from its chunk's owner); the reduce-scatter's the reverse
                        let (input, want): (Vec<f32>, Vec<f32>) = if gather {
                            let owner = |i| (0..world).find(|&q| layout.chunk(q).contains(&i));
                            (
                                mine.clone().map(|i| value(rank, seq, i)).collect(),
                                (0..len).map(|i| value(owner(i).unwrap(), seq, i)).collect(),
                            )
                        } else {
                            (
                                (0..len).map(|i| value(rank, seq, i)).collect(),
                                mine.clone()
                                    .map(|i| (0..world).map(|r| value(r, seq, i)).sum())
                                    .collect(),
                            )
                        };
                        let call = if gather {
                            ll_all_gather
                        } else {
                            ll_reduce_scatter
                        };
                        let mut out = vec![f32::NAN; want.len()];
                        call(
                            lines.as_ref(),
                            layout,
                            (rank, seq),
                            &input,
                            &mut out,
                            &mut backoff,
                        )
                        .unwrap_or_else(broke);
                        for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                            assert_eq!(
                                got, want,
                                "the LL calls broke: rank {rank}, call {seq}, output element {i}"
                            );
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    /// Both modes at sizes with empty chunks (fewer elements than ranks) and without, under
    /// random and PCT schedules.
    #[test]
    fn ll_reduce_scatter_and_all_gather_keep_back_to_back_calls_apart() {
        for (world, len) in [(2, 1), (3, 1), (3, 2), (4, 3), (2, 4), (3, 5)] {
            for gather in [false, true] {
                let layout = LlChunks::new(world, len);
                shuttle::check_random(move || ll_chunked_calls(layout, gather), 100);
                shuttle::check_pct(move || ll_chunked_calls(layout, gather), 100, 3);
            }
        }
    }

    /// The check can fail: with an empty chunk sending nothing, the rank that receives nothing
    /// from it runs ahead and overwrites a half its late peer still reads (all-gather of 1
    /// element over 2 ranks).
    #[test]
    #[should_panic(expected = "the LL calls broke")]
    fn an_all_gather_whose_empty_chunk_sends_nothing_is_caught() {
        let layout = LlChunks::new(2, 1).without_padding();
        shuttle::check_pct(move || ll_chunked_calls(layout, true), 1000, 3);
    }

    /// As above for the reduce-scatter of 2 elements over 3 ranks (rank 2's chunk empty).
    #[test]
    #[should_panic(expected = "the LL calls broke")]
    fn a_reduce_scatter_whose_empty_chunk_sends_nothing_is_caught() {
        let layout = LlChunks::new(3, 2).without_padding();
        shuttle::check_pct(move || ll_chunked_calls(layout, false), 1000, 3);
    }
}
