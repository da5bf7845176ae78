//! Calls queued back to back on every GPU's stream with new inputs each, the way a training
//! step issues them: per call, each stream copies the call's input into place, poisons the
//! output, launches, and copies the output aside — no host synchronisation in between, so only
//! the plan's own signals keep one GPU's call from running into its peers' previous or next one.

use crate::backend::{GpuCall, Issue, Launcher};
use crate::driver::DeviceMemory;
use commfuse_core::backend::{check_queued_inputs, BackendError, HostBuffer};
use commfuse_core::Element;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Byte written over every output before each call: NaN in f32, bf16 and f16 alike.
const POISON_BYTE: u8 = 0xff;

/// Runs `inputs.len()` queued calls of `call` (see `PreparedCall::run_queued`).
pub(crate) fn run_queued<T: Element, L: Launcher>(
    call: &mut GpuCall<'_, T, L>,
    inputs: &[Vec<HostBuffer>],
) -> Result<Vec<Vec<HostBuffer>>, BackendError> {
    let backend = call.backend;
    let ranks = &backend.ranks;
    let (in_len, out_len) = (call.host.input[0].len(), call.host.output[0].len());
    check_queued_inputs(inputs, ranks.len(), T::DTYPE, in_len)?;
    let calls = inputs.len();
    if calls == 0 {
        return Ok(Vec::new());
    }
    let eb = std::mem::size_of::<T>();
    let (in_bytes, out_bytes) = (in_len * eb, out_len * eb);
    // every call's inputs side by side on each GPU, and room for every call's outputs
    let mut staged_in = Vec::with_capacity(ranks.len());
    let mut staged_out = Vec::with_capacity(ranks.len());
    for (r, rank) in ranks.iter().enumerate() {
        let host: Vec<T> = inputs
            .iter()
            .flat_map(|c| T::from_host(c[r].as_slice()).expect("dtype checked").iter())
            .copied()
            .collect();
        let mem = DeviceMemory::zeroed(&rank.gpu, calls * in_bytes)?;
        mem.upload(&rank.gpu, &host)?;
        staged_in.push(mem);
        staged_out.push(DeviceMemory::zeroed(&rank.gpu, calls * out_bytes)?);
    }
    let next_call: Vec<AtomicUsize> = ranks.iter().map(|_| AtomicUsize::new(0)).collect();
    let bufs: Vec<(u64, u64)> = call
        .bufs
        .iter()
        .map(|b| (b.input.addr(), b.output.addr()))
        .collect();
    let all: Vec<usize> = (0..ranks.len()).collect();
    call.run_wrapped(&all, calls, Issue::Launches, &|r, rank, launch| {
        let c = next_call[r].fetch_add(1, Ordering::Relaxed);
        let (input, output) = bufs[r];
        // SAFETY: staging and call buffers are sized above for `calls` calls and outlive the
        // batch (it synchronises every stream, or stops every GPU, before returning)
        unsafe {
            rank.stream
                .copy_async(input, staged_in[r].addr() + (c * in_bytes) as u64, in_bytes)?;
            rank.stream.fill_async(output, POISON_BYTE, out_bytes)?;
        }
        launch()?;
        // SAFETY: as above
        unsafe {
            rank.stream.copy_async(
                staged_out[r].addr() + (c * out_bytes) as u64,
                output,
                out_bytes,
            )?;
        }
        Ok(())
    })?;
    let mut outputs: Vec<Vec<HostBuffer>> = (0..calls).map(|_| Vec::new()).collect();
    for (r, rank) in ranks.iter().enumerate() {
        let mut host = vec![T::from_f32(0.0); calls * out_len];
        staged_out[r].download(&rank.gpu, &mut host)?;
        for (c, out) in outputs.iter_mut().enumerate() {
            out.push(T::into_host_buffer(
                host[c * out_len..(c + 1) * out_len].to_vec(),
            ));
        }
    }
    Ok(outputs)
}
