//! The low-latency all-reduce on the simulator: P = 1..9, uneven lengths, three calls back to
//! back with new inputs and nothing synchronised between them (the two parities' buffers and
//! the sequence numbers are what keep them apart), every rank's result equal bit for bit to the
//! f32 sum in rank order; a peer that never arrives ends in a diagnosed error.

use commfuse_sim::ll::{LlCollective, LlShots, SimLl};
use commfuse_sim::{World, WorldConfig};
use std::sync::Mutex;
use std::time::Duration;

fn inputs(p: usize, len: usize, call: usize) -> Vec<Vec<f32>> {
    (0..p)
        .map(|r| {
            (0..len)
                .map(|i| ((i * 7 + r * 13 + call * 29) % 97) as f32 / 8.0 - 6.0)
                .collect()
        })
        .collect()
}

#[test]
fn every_rank_gets_the_sum_in_rank_order_back_to_back() {
    for (p, shots) in (1..=9).flat_map(|p| [(p, LlShots::One), (p, LlShots::Two)]) {
        for len in [1, 7, 1000 + p] {
            let world = World::new(p, WorldConfig::default()).unwrap();
            let op = SimLl::new(&world, LlCollective::AllReduce(shots), len).unwrap();
            let calls: Vec<_> = (0..3).map(|c| inputs(p, len, c)).collect();
            let outs: Vec<Mutex<Vec<Vec<f32>>>> = (0..p)
                .map(|_| Mutex::new(vec![vec![f32::NAN; len]; 3]))
                .collect();
            world
                .run(|ctx| {
                    let r = ctx.rank();
                    let mut outs = outs[r].lock().unwrap();
                    for (c, xs) in calls.iter().enumerate() {
                        op.forward(ctx, &xs[r], &mut outs[c])?;
                    }
                    Ok(())
                })
                .unwrap();
            for (c, xs) in calls.iter().enumerate() {
                let want: Vec<f32> = (0..len)
                    .map(|i| xs.iter().fold(0.0f32, |s, x| s + x[i]))
                    .collect();
                for (r, o) in outs.iter().enumerate() {
                    assert_eq!(
                        o.lock().unwrap()[c],
                        want,
                        "P={p} len={len} call {c} rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_peer_that_never_arrives_ends_in_a_diagnosed_error() {
    let config = WorldConfig {
        timeout: Duration::from_millis(200),
        ..WorldConfig::default()
    };
    let world = World::new(2, config).unwrap();
    let op = SimLl::new(&world, LlCollective::AllReduce(LlShots::One), 4).unwrap();
    let err = world
        .run(|ctx| {
            if ctx.rank() == 1 {
                return Ok(());
            }
            op.forward(ctx, &[1.0; 4], &mut [0.0; 4])
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 0 waits for rank 1's line 0")
            && err.contains("carry call 1, sees call 0"),
        "{err}"
    );
    let e = SimLl::new(
        &world,
        LlCollective::AllReduce(LlShots::Two),
        SimLl::MAX_LEN + 1,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("up to"), "{e}");
}
