//! Worlds whose ranks share memory through a group's POSIX shared-memory arena: here every rank
//! is a thread that maps the group itself (the mechanism is the same as with one process per
//! rank, which `python/tests/test_sim_processes.py` runs). A collective and GEMM +
//! reduce-scatter through it against their references, the group's name gone once every rank
//! joined, and the errors: a rank that never joins, a group name in use, a full arena, a peer
//! whose process ends (a child process here) while a rank waits for it, and a group whose
//! maker dies before it formed.

use commfuse_core::fused::gemm_rs::{check_elements_on, reference, GemmRsPath, PathChoice};
use commfuse_core::gemm::BLayout;
use commfuse_core::{Cmp, DType, OpKind, ReduceOp, Slot};
use commfuse_sim::collective::SimCollective;
use commfuse_sim::gemm_rs::{CallInputs, GemmRsConfig, GemmRsOperator};
use commfuse_sim::shared::Arena;
use commfuse_sim::{World, WorldConfig};
use half::bf16;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn name(what: &str) -> String {
    format!("rust-test-{what}-{}", std::process::id())
}

/// Runs `f` as every rank of a `p`-rank group, each on its own thread with its own mapping.
fn group<R: Send>(what: &str, p: usize, f: impl Fn(Arc<Arena>) -> R + Sync) -> Vec<R> {
    let name = name(what);
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..p)
            .map(|r| {
                let (f, name) = (&f, &name);
                s.spawn(move || {
                    let arena = Arena::open(name, r, p, 16 << 20, Duration::from_secs(10)).unwrap();
                    f(Arc::new(arena))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        !std::path::Path::new(&format!("/dev/shm/commfuse-{name}")).exists(),
        "the group's name outlived its joining"
    );
    out
}

#[test]
fn a_collective_through_shared_memory_matches_the_sum() {
    for p in [1, 3, 4] {
        let n = 7 * p + 2;
        let outs = group(&format!("ar{p}"), p, |arena| {
            let r = arena.rank();
            let world = World::shared(arena, WorldConfig::default()).unwrap();
            let op = SimCollective::<f32>::new(
                &world,
                OpKind::AllReduce,
                n,
                (None, ReduceOp::Sum, 0, 1),
            )
            .unwrap();
            let input: Vec<f32> = (0..n).map(|i| (i * (r + 1)) as f32).collect();
            let mut out = vec![f32::NAN; n];
            for _ in 0..2 {
                let done = std::sync::Mutex::new(&mut out);
                world
                    .run(|ctx| op.forward(ctx, &input, &mut done.lock().unwrap()))
                    .unwrap();
            }
            out
        });
        let factor: usize = (1..=p).sum();
        for out in outs {
            let want: Vec<f32> = (0..n).map(|i| (i * factor) as f32).collect();
            assert_eq!(out, want, "P={p}");
        }
    }
}

#[test]
fn gemm_reduce_scatter_through_shared_memory_matches_float64() {
    let p = 3;
    let config = GemmRsConfig {
        bias: true,
        timeout: Duration::from_secs(10),
        ..GemmRsConfig::new(20, 24, 16, BLayout::NK, DType::BF16, DType::BF16)
    };
    let CallInputs { a, b, bias } =
        CallInputs::<bf16, bf16>::random(p, (config.n, config.k), config.bias, &[20], 9);
    let paths = [
        GemmRsPath::Fused,
        GemmRsPath::Overlapped { pieces: 2 },
        GemmRsPath::Unfused,
    ];
    for (i, path) in paths.into_iter().enumerate() {
        let outs = group(&format!("rs{i}"), p, |arena| {
            let r = arena.rank();
            let config = GemmRsConfig {
                path: PathChoice::Always(path),
                ..config
            };
            let wc = GemmRsOperator::<bf16, bf16>::world_config(&config, p);
            let world = World::shared(arena, wc.unwrap()).unwrap();
            let op = GemmRsOperator::<bf16, bf16>::new(&world, config).unwrap();
            let rows = commfuse_core::op::chunk_range(20, p, r).len();
            let out = std::sync::Mutex::new(vec![bf16::NAN; rows * 24]);
            let operands = (a[0][r].as_slice(), b[0][r].as_slice(), bias[0].as_deref());
            world
                .run(|ctx| op.forward(ctx, 20, operands, &mut out.lock().unwrap()))
                .unwrap();
            out.into_inner().unwrap()
        });
        let shape = config.shape(p, 20).unwrap();
        let av: Vec<&[bf16]> = a[0].iter().map(Vec::as_slice).collect();
        let bv: Vec<&[bf16]> = b[0].iter().map(Vec::as_slice).collect();
        for (r, out) in outs.iter().enumerate() {
            let want = reference(&shape, r, &av, &bv, bias[0].as_deref());
            let check = check_elements_on(&shape, path, out.iter().map(|x| x.to_f64()), &want);
            assert!(check.passed(), "{path} rank {r}: {check}");
        }
    }
}

#[test]
fn a_segment_of_another_nonce_or_owner_is_refused() {
    // rank 0 made the group with nonce 1; a rank expecting nonce 2 refuses it
    let n = name("nonce");
    let maker = {
        let n = n.clone();
        std::thread::spawn(move || {
            Arena::open_with_nonce(&n, 0, 2, 1 << 20, Duration::from_millis(500), 1)
        })
    };
    let e = Arena::open_with_nonce(&n, 1, 2, 1 << 20, Duration::from_secs(5), 2)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("another nonce") && !e.contains('\n'), "{e}");
    assert!(maker.join().unwrap().is_err(), "rank 0 saw its peer leave");
    // the same nonce joins
    let n = name("same-nonce");
    let maker = {
        let n = n.clone();
        std::thread::spawn(move || {
            Arena::open_with_nonce(&n, 0, 2, 1 << 20, Duration::from_secs(5), 7)
        })
    };
    Arena::open_with_nonce(&n, 1, 2, 1 << 20, Duration::from_secs(5), 7).unwrap();
    maker.join().unwrap().unwrap();
    // a segment of another user (only root can make one here)
    // SAFETY: geteuid has no preconditions
    if unsafe { libc::geteuid() } == 0 {
        let n = name("foreign");
        let path = std::ffi::CString::new(format!("/commfuse-{n}")).unwrap();
        // SAFETY: a NUL-terminated name; the object is sized as rank 0 would (header + arena)
        // and handed to user 65534 ("nobody")
        unsafe {
            let fd = libc::shm_open(
                path.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            );
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, (4096 + (1 << 20)) as libc::off_t), 0);
            assert_eq!(libc::fchown(fd, 65534, 65534), 0);
            libc::close(fd);
        }
        let e = Arena::open(&n, 1, 2, 1 << 20, Duration::from_secs(2))
            .err()
            .unwrap()
            .to_string();
        // SAFETY: the name made above
        unsafe { libc::shm_unlink(path.as_ptr()) };
        assert!(e.contains("belongs to user 65534"), "{e}");
    }
}

#[test]
fn joining_fails_in_one_line_without_hanging() {
    // rank 1 of a group rank 0 never makes
    let e = Arena::open(&name("nobody"), 1, 2, 1 << 20, Duration::from_millis(100))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("rank 1 waited") && !e.contains('\n'), "{e}");
    // rank 0 whose peer never joins: an error, and the name is removed all the same
    let lonely = name("lonely");
    let e = Arena::open(&lonely, 0, 2, 1 << 20, Duration::from_millis(100))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("0 waited") && e.contains("1 of 2 did, not rank 1"),
        "{e}"
    );
    assert!(!std::path::Path::new(&format!("/dev/shm/commfuse-{lonely}")).exists());
    let e = Arena::open("a/b", 0, 1, 1 << 20, Duration::from_millis(100))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("group name"), "{e}");
    // a full arena says so
    let arena = Arc::new(Arena::open(&name("small"), 0, 1, 4096, Duration::from_secs(1)).unwrap());
    let world = World::shared(arena.clone(), WorldConfig::default());
    let e = match world {
        Ok(w) => {
            SimCollective::<f32>::new(&w, OpKind::AllReduce, 1 << 20, (None, ReduceOp::Sum, 0, 1))
                .err()
                .unwrap()
                .to_string()
        }
        Err(e) => e.to_string(),
    };
    assert!(e.contains("shared memory is full"), "{e}");
}

#[test]
fn groups_of_no_rank_too_many_ranks_or_too_much_memory_are_refused_at_once() {
    let open = |rank, world, bytes| {
        let started = std::time::Instant::now();
        let e = Arena::open(&name("refused"), rank, world, bytes, Duration::from_secs(5))
            .err()
            .expect("refused")
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(1), "{e}: waited");
        assert!(!e.contains('\n'), "{e}");
        e
    };
    assert_eq!(open(0, 100, 1 << 20), "a group has 1 to 64 ranks, got 100");
    assert_eq!(open(0, 0, 1 << 20), "a group has 1 to 64 ranks, got 0");
    assert_eq!(
        open(2, 2, 1 << 20),
        "rank 2 is not a rank of a group of 2 (0 to 1)"
    );
    let e = open(0, 1, usize::MAX);
    assert!(
        e.starts_with("the shared memory of group ") && e.contains("overflows"),
        "{e}"
    );
}

/// The child's side of the tests below: rank `COMMFUSE_TEST_RANK` of a group of
/// `COMMFUSE_TEST_WORLD` ranks named `COMMFUSE_TEST_GROUP`, which joins (rank 0: waits up to
/// 20 s for the others to join) and then waits for a line on its standard input (or its end)
/// before it exits, never making a call.
#[test]
#[ignore = "run by the tests below as a rank of their group, in a child process"]
fn a_rank_in_a_child_process() {
    let name = std::env::var("COMMFUSE_TEST_GROUP").expect("started by a test below");
    let rank = std::env::var("COMMFUSE_TEST_RANK")
        .unwrap()
        .parse()
        .unwrap();
    let world = std::env::var("COMMFUSE_TEST_WORLD")
        .unwrap()
        .parse()
        .unwrap();
    let _arena = Arena::open(&name, rank, world, 1 << 20, Duration::from_secs(20)).unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Rank `rank` of the group `name` of `world` ranks in a child process
/// ([`a_rank_in_a_child_process`]).
fn child_rank(name: &str, rank: usize, world: usize) -> std::process::Child {
    use std::process::{Command, Stdio};
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "a_rank_in_a_child_process"])
        .args(["--test-threads=1"])
        .env("COMMFUSE_TEST_GROUP", name)
        .env("COMMFUSE_TEST_RANK", rank.to_string())
        .env("COMMFUSE_TEST_WORLD", world.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn a_wait_for_a_peer_whose_process_ended_stops_at_once_naming_it() {
    let n = name("child");
    let mut child = child_rank(&n, 1, 2);
    let arena = Arc::new(Arena::open(&n, 0, 2, 1 << 20, Duration::from_secs(20)).unwrap());
    let pid = u64::from(child.id());
    assert_eq!(arena.ended(1), None, "the child runs");
    assert_eq!(arena.ended(0), None, "this process is never seen ended");
    // the child ends: a zombie until it is reaped, then no process at all
    drop(child.stdin.take());
    let started = Instant::now();
    while arena.ended(1).is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the child did not end"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(arena.ended(1), Some(pid));
    // a call whose peer is gone stops long before its 20 s timeout, naming the peer
    let config = WorldConfig {
        timeout: Duration::from_secs(20),
        ..WorldConfig::default()
    };
    let world = World::shared(arena.clone(), config).unwrap();
    let op = SimCollective::<f32>::new(&world, OpKind::AllReduce, 8, (None, ReduceOp::Sum, 0, 1))
        .unwrap();
    let started = Instant::now();
    let e = world
        .run(|ctx| op.forward(ctx, &[1.0; 8], &mut [0.0; 8]))
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "{e}");
    assert_eq!(
        e.to_string(),
        format!("rank 0 stopped waiting for rank 1: the process of rank 1 (pid {pid}) has ended")
    );
    // the group is aborted with that cause
    assert_eq!(
        arena.abort_cause(),
        Some(commfuse_core::error::AbortCause::PeerGone { rank: 0, gone: 1 })
    );
    child.wait().unwrap();
    assert_eq!(arena.ended(1), Some(pid), "reaped, it is still ended");
}

/// Kills a child that made the group `name` of `world` ranks as its rank 0 once the group is
/// set up, while it waits for the others to join (`before` has run); returns its pid.
fn kill_maker_while_it_waits(name: &str, world: usize, before: impl FnOnce()) -> u64 {
    let mut maker = child_rank(name, 0, world);
    let object = format!("/dev/shm/commfuse-{name}");
    let started = Instant::now();
    // the header starts with the magic, written once rank 0's process is recorded there
    let magic = 0x636f_6d6d_6675_7365u64.to_le_bytes();
    while std::fs::read(&object).map_or(true, |b| !b.starts_with(&magic)) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no group set up"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    before();
    maker.kill().unwrap();
    maker.wait().unwrap();
    u64::from(maker.id())
}

#[test]
fn a_group_whose_maker_died_before_it_formed_leaves_no_name_behind() {
    // a rank that comes later refuses it at once, naming rank 0, and removes its name
    let n = name("maker-died");
    let object = format!("/dev/shm/commfuse-{n}");
    let pid = kill_maker_while_it_waits(&n, 2, || ());
    assert!(std::path::Path::new(&object).exists(), "the name is left");
    let started = Instant::now();
    let e = Arena::open(&n, 1, 2, 1 << 20, Duration::from_secs(20))
        .err()
        .unwrap()
        .to_string();
    assert!(started.elapsed() < Duration::from_secs(2), "{e}");
    assert_eq!(
        e,
        format!("rank 1 found /commfuse-{n} made by rank 0, whose process (pid {pid}) has ended before the group formed (the name is removed: start the group again)")
    );
    assert!(!std::path::Path::new(&object).exists());
    // a new rank 0 under the same name replaces what a dead one left
    kill_maker_while_it_waits(&n, 2, || ());
    let arena = Arena::open(&n, 0, 1, 1 << 20, Duration::from_secs(5)).unwrap();
    assert_eq!(arena.world(), 1);
    assert!(
        !std::path::Path::new(&object).exists(),
        "a formed group's name goes"
    );
}

#[test]
fn ranks_that_joined_stop_naming_the_rank_that_never_did() {
    // rank 1 joins a group of 3 and waits in a call; rank 2 never comes, so rank 0 gives up
    // joining after 300 ms, and rank 1's wait (of a 20 s timeout) stops with it
    let n = name("never-joined");
    let maker = {
        let n = n.clone();
        std::thread::spawn(move || Arena::open(&n, 0, 3, 1 << 20, Duration::from_millis(300)))
    };
    let arena = Arc::new(Arena::open(&n, 1, 3, 1 << 20, Duration::from_secs(5)).unwrap());
    let config = WorldConfig {
        timeout: Duration::from_secs(20),
        ..WorldConfig::default()
    };
    let world = World::shared(arena, config).unwrap();
    let op = SimCollective::<f32>::new(&world, OpKind::AllReduce, 8, (None, ReduceOp::Sum, 0, 1))
        .unwrap();
    let started = Instant::now();
    let e = world
        .run(|ctx| op.forward(ctx, &[1.0; 8], &mut [0.0; 8]))
        .unwrap_err()
        .to_string();
    assert!(started.elapsed() < Duration::from_secs(5), "{e}");
    assert!(
        e.starts_with("rank 1 aborted its wait for rank ")
            && e.ends_with(" because rank 2 did not join the group (seen by rank 0)"),
        "{e}"
    );
    let e = maker.join().unwrap().err().unwrap().to_string();
    assert!(e.ends_with(": 2 of 3 did, not rank 2"), "{e}");
    assert!(!std::path::Path::new(&format!("/dev/shm/commfuse-{n}")).exists());
}

#[test]
fn a_rank_that_finds_the_maker_gone_stops_the_ranks_that_joined() {
    // rank 1 joins while rank 0 (a child) waits for rank 2, and waits for rank 2's notify;
    // rank 0 dies; rank 2 comes, finds the group's maker gone, and rank 1's wait (of a 20 s
    // timeout) stops at once, naming rank 0
    let n = name("joined-then-maker-died");
    let joined = std::sync::Mutex::new(None);
    let maker = kill_maker_while_it_waits(&n, 3, || {
        let arena = Arena::open(&n, 1, 3, 1 << 20, Duration::from_secs(5)).unwrap();
        *joined.lock().unwrap() = Some(Arc::new(arena));
    });
    let arena = joined.into_inner().unwrap().unwrap();
    let config = WorldConfig {
        timeout: Duration::from_secs(20),
        ..WorldConfig::default()
    };
    let world = World::shared(arena, config).unwrap();
    let late = {
        let n = n.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            Arena::open(&n, 2, 3, 1 << 20, Duration::from_secs(5))
        })
    };
    let started = Instant::now();
    let e = world
        .run(|ctx| ctx.wait(Slot::new(0, 2), 1, Cmp::Ge, 2).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(started.elapsed() < Duration::from_secs(5), "{e}");
    assert_eq!(
        e,
        "rank 1 aborted its wait for rank 2 because the process of rank 0 has ended (seen by rank 2)"
    );
    let e = late.join().unwrap().err().unwrap().to_string();
    assert!(
        e.contains(&format!("process (pid {maker}) has ended")),
        "{e}"
    );
    assert!(!std::path::Path::new(&format!("/dev/shm/commfuse-{n}")).exists());
}

/// An object of the group's name with `size` zero bytes, as a rank 0 that ended between
/// creating it and recording itself leaves: empty (before sizing it) or a header's worth
/// (sized, not yet recorded).
fn empty_object(name: &str, size: usize) {
    let path = std::ffi::CString::new(format!("/commfuse-{name}")).unwrap();
    // SAFETY: a NUL-terminated name; the descriptor is ours to size and close
    unsafe {
        let fd = libc::shm_open(
            path.as_ptr(),
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
            0o600,
        );
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, size as libc::off_t), 0);
        libc::close(fd);
    }
}

/// Objects of `size` zero bytes left under two names ([`empty_object`]): a fresh one may be a
/// rank 0 between creating and recording itself in it, or one killed there whose surviving
/// ranks form a new group of the name at once: rank 0 of the new group gives it until it is
/// old enough to tell, then replaces it; and once old, a rank that gave up waiting removes it.
fn left_object_is_replaced_once_old(maker: &str, joiner: &str, size: usize) {
    empty_object(maker, size);
    empty_object(joiner, size);
    let started = Instant::now();
    Arena::open(maker, 0, 1, 1 << 20, Duration::from_secs(1)).unwrap();
    let waited = started.elapsed();
    assert!(
        (Duration::from_millis(900)..Duration::from_secs(3)).contains(&waited),
        "rank 0 waited {waited:?} for the object of {size} bytes to age"
    );
    let e = Arena::open(joiner, 1, 2, 1 << 20, Duration::from_millis(100))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.ends_with("(one left there by a rank 0 that ended was removed)"),
        "{e}"
    );
}

/// The same for an object sized to its header (4096 bytes) that names no rank 0: its maker
/// ended between sizing it and recording itself.
#[test]
fn an_unrecorded_object_left_under_the_name_is_replaced_once_it_is_old() {
    let (maker, joiner) = (name("unrecorded-maker"), name("unrecorded-joiner"));
    left_object_is_replaced_once_old(&maker, &joiner, 4096);
    for n in [maker, joiner] {
        assert!(!std::path::Path::new(&format!("/dev/shm/commfuse-{n}")).exists());
    }
}

#[test]
fn an_empty_object_left_under_the_name_is_replaced_once_it_is_old() {
    let (maker, joiner, live) = (
        name("empty-maker"),
        name("empty-joiner"),
        name("empty-live"),
    );
    left_object_is_replaced_once_old(&maker, &joiner, 0);
    // a forming group's object, its rank 0 alive, is no one else's to take: a second rank 0 of
    // the name is refused at once
    std::thread::scope(|s| {
        let forming = s.spawn(|| Arena::open(&live, 0, 2, 1 << 20, Duration::from_millis(1500)));
        // until its rank 0 has sized it past its header (4096 bytes), which it does right
        // after creating it and recording itself there
        let object = format!("/dev/shm/commfuse-{live}");
        let waiting = Instant::now();
        while std::fs::metadata(&object).map_or(true, |m| m.len() <= 4096) {
            assert!(
                waiting.elapsed() < Duration::from_secs(5),
                "{object} never set up"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let started = Instant::now();
        let e = Arena::open(&live, 0, 2, 1 << 20, Duration::from_secs(1))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("a group of that name exists"), "{e}");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        assert!(forming.join().unwrap().is_err(), "rank 1 never joined");
    });
    for n in [maker, joiner, live] {
        assert!(!std::path::Path::new(&format!("/dev/shm/commfuse-{n}")).exists());
    }
}
