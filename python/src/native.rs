//! The C face of the GPU operators, for the dispatcher kernels of `commfuse.torch`
//! (`python/native/dispatch.cpp`): a steady-state call of a `torch.ops.commfuse` op goes from
//! PyTorch's dispatcher to the operator without entering Python.
//!
//! An operator class's `native()` gives three addresses: a counted reference to the operator's
//! state, the function that queues one call on it, and the function that drops the reference.
//! The dispatcher kernels keep the reference while a prepared call of theirs uses the operator,
//! so the operator outlives Python's cache entry for as long as they may call it.
//!
//! Every function returns 0 when the call was queued, 1 for a call that does not fit the
//! operator (a `ValueError` in Python) and 2 for a CUDA failure or a peer that never arrived
//! (a `RuntimeError`), with the one-line message written into the caller's buffer.

use crate::gpu::{
    ag_gemm_forward, collective_forward, gemm_rs_forward, lock, AgGemmState, CollectiveState,
    Failure, GemmCall, GemmRsState, Shared,
};
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// One call of a GEMM operator from C: device addresses, 0 where an operand is absent (no
/// bias, no gathered A); `stream` a `CUstream`.
#[repr(C)]
pub struct NativeGemmCall {
    pub m: u64,
    pub a: u64,
    pub b: u64,
    pub bias: u64,
    pub out: u64,
    pub gathered: u64,
    pub stream: u64,
}

/// One call of a collective from C: device addresses of its input and output, its stream.
#[repr(C)]
pub struct NativeCollectiveCall {
    pub input: u64,
    pub output: u64,
    pub stream: u64,
}

fn present(address: u64) -> Option<u64> {
    (address != 0).then_some(address)
}

/// Writes `text` into the caller's buffer of `capacity` bytes, cut to fit, ending in a NUL.
///
/// # Safety
/// `message` is null or points at `capacity` writable bytes.
unsafe fn write_message(text: &str, message: *mut c_char, capacity: usize) {
    if message.is_null() || capacity == 0 {
        return;
    }
    let mut len = text.len().min(capacity - 1);
    // a cut inside a character would leave invalid UTF-8 behind
    while !text.is_char_boundary(len) {
        len -= 1;
    }
    // SAFETY: the caller's buffer holds `capacity` > len bytes
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), message.cast::<u8>(), len);
        *message.add(len) = 0;
    }
}

/// Runs one call on the state behind `handle`, turning its outcome (a panic included: it must
/// not unwind into C++) into the code and message the module's documentation gives.
///
/// # Safety
/// `handle` is a reference that `native()` gave for a state of type `T` and that was not
/// released; `message` as in [`write_message`].
unsafe fn run<T>(
    handle: *const c_void,
    message: *mut c_char,
    capacity: usize,
    call: impl FnOnce(&mut T) -> Result<(), Failure>,
) -> c_int {
    // SAFETY: the handle is a live `Arc<Mutex<T>>` reference (the caller's promise)
    let shared = unsafe { &*handle.cast::<Mutex<T>>() };
    let outcome = catch_unwind(AssertUnwindSafe(|| call(&mut lock(shared))));
    let (code, text) = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(Failure::Value(text))) => (1, text),
        Ok(Err(Failure::Runtime(text))) => (2, text),
        Err(_) => (
            2,
            "commfuse: internal error: an operator call panicked".to_string(),
        ),
    };
    // SAFETY: as promised by the caller
    unsafe { write_message(&text, message, capacity) };
    code
}

unsafe extern "C" fn gemm_rs_call(
    handle: *const c_void,
    call: *const NativeGemmCall,
    message: *mut c_char,
    capacity: usize,
) -> c_int {
    // SAFETY: the dispatcher kernel passes a live call record and buffer
    let c = unsafe { &*call };
    let call = gemm_call(c);
    // SAFETY: a handle from `gemm_rs`
    unsafe {
        run(handle, message, capacity, |s: &mut GemmRsState| {
            gemm_rs_forward(s, &call)
        })
    }
}

unsafe extern "C" fn ag_gemm_call(
    handle: *const c_void,
    call: *const NativeGemmCall,
    message: *mut c_char,
    capacity: usize,
) -> c_int {
    // SAFETY: the dispatcher kernel passes a live call record and buffer
    let c = unsafe { &*call };
    let call = gemm_call(c);
    // SAFETY: a handle from `ag_gemm`
    unsafe {
        run(handle, message, capacity, |s: &mut AgGemmState| {
            ag_gemm_forward(s, &call)
        })
    }
}

unsafe extern "C" fn collective_call(
    handle: *const c_void,
    call: *const NativeCollectiveCall,
    message: *mut c_char,
    capacity: usize,
) -> c_int {
    // SAFETY: the dispatcher kernel passes a live call record and buffer
    let c = unsafe { &*call };
    // SAFETY: a handle from `collective`
    unsafe {
        run(handle, message, capacity, |s: &mut CollectiveState| {
            collective_forward(s, c.input, c.output, c.stream)
        })
    }
}

fn gemm_call(c: &NativeGemmCall) -> GemmCall {
    GemmCall {
        // an M past the address space is refused by the operator's range check
        m: usize::try_from(c.m).unwrap_or(usize::MAX),
        a: c.a,
        b: c.b,
        bias: present(c.bias),
        out: c.out,
        gathered: present(c.gathered),
        stream: c.stream,
    }
}

/// Drops a reference that `native()` gave.
///
/// # Safety
/// `handle` came from `native()` for a state of type `T` and is released once.
unsafe extern "C" fn release<T>(handle: *const c_void) {
    if !handle.is_null() {
        // SAFETY: the caller's promise: one `Arc::into_raw` reference, given back once
        drop(unsafe { Arc::from_raw(handle.cast::<Mutex<T>>()) });
    }
}

fn handle<T>(state: &Shared<T>, call: usize) -> (usize, usize, usize) {
    let reference = Arc::into_raw(Arc::clone(state)) as usize;
    (reference, call, release::<T> as *const () as usize)
}

/// `GpuGemmReduceScatter.native()`.
pub(crate) fn gemm_rs(state: &Shared<GemmRsState>) -> (usize, usize, usize) {
    handle(state, gemm_rs_call as *const () as usize)
}

/// `GpuAllGatherGemm.native()`.
pub(crate) fn ag_gemm(state: &Shared<AgGemmState>) -> (usize, usize, usize) {
    handle(state, ag_gemm_call as *const () as usize)
}

/// `GpuCollective.native()`.
pub(crate) fn collective(state: &Shared<CollectiveState>) -> (usize, usize, usize) {
    handle(state, collective_call as *const () as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_cut_to_the_buffer_on_a_character_boundary() {
        let mut buffer = [1 as c_char; 6];
        // SAFETY: a local buffer of its stated size
        unsafe { write_message("ab\u{e9}cd", buffer.as_mut_ptr(), 4) };
        let bytes: Vec<u8> = buffer.iter().map(|&c| c as u8).collect();
        // "ab" and then é's two bytes do not fit with the NUL: cut before é
        assert_eq!(&bytes[..3], b"ab\0");
    }

    #[test]
    fn a_failure_gives_its_code_and_message_and_a_panic_does_not_unwind() {
        let state: Shared<u32> = Arc::new(Mutex::new(7));
        let (reference, _, drop_fn) = handle(&state, 0);
        let mut buffer = [0 as c_char; 64];
        let text = |b: &[c_char]| {
            let bytes: Vec<u8> = b
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8(bytes).unwrap()
        };
        let ptr = reference as *const c_void;
        // SAFETY: a live reference of a Mutex<u32>, a local buffer
        unsafe {
            assert_eq!(
                run(ptr, buffer.as_mut_ptr(), 64, |v: &mut u32| {
                    *v += 1;
                    Ok(())
                }),
                0
            );
            assert_eq!(
                run(ptr, buffer.as_mut_ptr(), 64, |_: &mut u32| {
                    Err(Failure::Value("M = 0 is not a call".into()))
                }),
                1
            );
            assert_eq!(text(&buffer), "M = 0 is not a call");
            assert_eq!(
                run(
                    ptr,
                    buffer.as_mut_ptr(),
                    64,
                    |_: &mut u32| -> Result<(), Failure> { panic!("boom") }
                ),
                2
            );
            assert!(text(&buffer).contains("panicked"));
        }
        assert_eq!(*lock(&state), 8);
        assert_eq!(Arc::strong_count(&state), 2);
        // SAFETY: the reference `handle` gave, released once
        unsafe {
            let release: unsafe extern "C" fn(*const c_void) = std::mem::transmute(drop_fn);
            release(ptr);
        }
        assert_eq!(Arc::strong_count(&state), 1);
    }
}
