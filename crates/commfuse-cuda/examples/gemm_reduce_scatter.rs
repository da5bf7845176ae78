//! GEMM + reduce-scatter on the GPUs of this machine, one host thread per GPU, on buffers the
//! program allocates itself: rank r holds A_r [M, K] and B_r [N, K] (bf16), and ends with rows
//! `chunk(r)` of Σ_r A_r·B_r. The result is checked against a float64 product on the host.
//!
//! ```text
//! cargo run --release -p commfuse-cuda --example gemm_reduce_scatter -- [M N K]
//! ```
//! (on the GPU machine: `LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64`). On a
//! machine without two GPUs it says so and exits.

use commfuse_core::gemm::BLayout;
use commfuse_core::DType;
use commfuse_cuda::gemm_rs::{GemmRsConfig, GemmRsRank};
use commfuse_cuda::sys::driver::{device_count, DeviceMemory, Gpu, Stream};
use half::bf16;
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let (m, n, k) = match args[..] {
        [m, n, k] => (m, n, k),
        [] => (1024, 1024, 512),
        _ => return Err("give M N K, or nothing".into()),
    };
    let world = match device_count() {
        Ok(count) if count >= 2 => count.min(8),
        Ok(count) => {
            println!("this machine has {count} GPU(s); the example needs 2");
            return Ok(());
        }
        Err(e) => {
            println!("no GPU here: {e}");
            return Ok(());
        }
    };

    // the group: one GPU per rank, every pair peer-enabled
    let gpus: Vec<Arc<Gpu>> = (0..world)
        .map(|d| Gpu::open(d).map(Arc::new))
        .collect::<Result<_, _>>()?;
    for a in &gpus {
        for b in &gpus {
            if a.ordinal != b.ordinal {
                a.enable_peer_access(b)?;
            }
        }
    }
    let config = GemmRsConfig::new(m, n, k, BLayout::NK, DType::BF16, DType::BF16);
    let ranks = GemmRsRank::create_group(&gpus, config)?;

    // every rank's operands: small integers, so that the sums are exact in bf16 and f32
    let value = |r: usize, i: usize, salt: usize| ((i * 7 + r * 3 + salt) % 5) as f32 - 2.0;
    let a: Vec<Vec<bf16>> = (0..world)
        .map(|r| (0..m * k).map(|i| bf16::from_f32(value(r, i, 0))).collect())
        .collect();
    let b: Vec<Vec<bf16>> = (0..world)
        .map(|r| {
            (0..n * k)
                .map(|i| bf16::from_f32(value(r, i, 1) / 8.0))
                .collect()
        })
        .collect();

    // one thread per rank: upload, call on the rank's own stream, wait, download its chunk
    let outputs = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut op| {
                let (a, b) = (&a, &b);
                s.spawn(move || -> Result<Vec<bf16>, commfuse_cuda::CudaError> {
                    let gpu = op.gpu().clone();
                    gpu.bind()?;
                    let r = op.rank();
                    let stream = Stream::new(&gpu)?;
                    let a_dev = DeviceMemory::zeroed(&gpu, 2 * m * k)?;
                    a_dev.upload(&gpu, &a[r])?;
                    let b_dev = DeviceMemory::zeroed(&gpu, 2 * n * k)?;
                    b_dev.upload(&gpu, &b[r])?;
                    let rows = op.chunk(m).len();
                    let out = DeviceMemory::zeroed(&gpu, 2 * rows.max(1) * n)?;
                    // SAFETY: the buffers live until the stream is synchronised below
                    unsafe {
                        op.forward(&stream, m, a_dev.addr(), b_dev.addr(), None, out.addr())?
                    };
                    stream.synchronize()?;
                    op.check()?;
                    let mut host = vec![bf16::ZERO; rows * n];
                    out.download(&gpu, &mut host)?;
                    Ok(host)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect::<Result<Vec<_>, _>>()
    })?;

    // check every element against the float64 sum of the ranks' products
    let mut wrong = 0;
    for (r, out) in outputs.iter().enumerate() {
        let rows = commfuse_core::op::chunk_range(m, world, r);
        for (i, row) in rows.clone().enumerate() {
            for j in 0..n {
                let want: f64 = (0..world)
                    .map(|q| {
                        (0..k)
                            .map(|kk| a[q][row * k + kk].to_f64() * b[q][j * k + kk].to_f64())
                            .sum::<f64>()
                    })
                    .sum();
                let got = out[i * n + j].to_f64();
                // bf16 keeps 8 significant bits: one rounding of each partial and of the sum
                if (got - want).abs() > (world as f64 + 1.0) * 2f64.powi(-8) * want.abs().max(1.0) {
                    wrong += 1;
                }
            }
        }
    }
    println!(
        "GEMM + reduce-scatter {m}×{n}×{k} (K per rank) on {world} GPUs: {} elements checked, {wrong} wrong",
        m * n
    );
    if wrong > 0 {
        return Err(format!("{wrong} elements differ from the float64 reference").into());
    }
    println!("OK");
    Ok(())
}
