//! The only module that touches the CUDA driver: contexts, device memory, host-mapped memory,
//! streams, events, modules and launches, each as a small owning type. Everything above it is
//! safe code over these types (cudarc's own layering: sys → result → safe).
//!
//! Memory comes from plain `cuMemAlloc`, never the stream-ordered pool: peers cannot touch pool
//! memory even with peer access enabled (a peer's store into it dies with
//! CUDA_ERROR_ILLEGAL_ADDRESS, seen on H200). Device addresses cross into kernels as
//! plain `u64`s.

use crate::backend::plan_table::ErrorRecord;
use crate::error::CudaError;
use crate::sys::host_sync;
use bytemuck::Pod;
use commfuse_core::DType;
use cudarc::driver::{result, sys, DriverError};
use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::Duration;

fn drv<T>(call: &'static str, r: Result<T, DriverError>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    })
}

fn check(call: &'static str, rc: sys::CUresult) -> Result<(), CudaError> {
    drv(call, rc.result())
}

/// Number of GPUs, after checking that the driver library exists (cudarc panics without it).
pub fn device_count() -> Result<usize, CudaError> {
    // SAFETY: only tries to dlopen libcuda
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "no CUDA driver (libcuda.so) on this machine".into(),
        ));
    }
    drv("cuInit", result::init())?;
    Ok(drv("cuDeviceGetCount", result::device::get_count())? as usize)
}

/// One GPU and its primary context.
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    pub sm_count: u32,
    ctx: sys::CUcontext,
    /// The handle's own reference on the context (the device is `ctx_ref.dev`)
    ctx_ref: ContextRef,
}

// SAFETY: a primary context may be made current on any thread.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::Unavailable(format!(
                "GPU {ordinal} does not exist: this machine has {count} GPU{}",
                if count == 1 { "" } else { "s" }
            )));
        }
        let dev = drv("cuDeviceGet", result::device::get(ordinal as i32))?;
        // released on drop, also if a query below fails
        let (ctx_ref, ctx) = ContextRef::of_device(dev)?;
        let name = drv("cuDeviceGetName", result::device::get_name(dev))?;
        // SAFETY: valid device and attribute
        let sm_count = drv("cuDeviceGetAttribute", unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        })? as u32;
        let gpu = Gpu {
            ordinal,
            name,
            sm_count,
            ctx,
            ctx_ref,
        };
        gpu.bind()?;
        Ok(gpu)
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: ctx is a retained primary context
        drv("cuCtxSetCurrent", unsafe {
            result::ctx::set_current(self.ctx)
        })
    }

    /// Lets this GPU's kernels load from and store to `peer`'s memory.
    pub fn enable_peer_access(&self, peer: &Gpu) -> Result<(), CudaError> {
        let mut can = 0;
        // SAFETY: out-parameter and valid devices
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.ctx_ref.dev, peer.ctx_ref.dev)
        })?;
        if can == 0 {
            return Err(CudaError::Unavailable(format!(
                "GPU {} cannot access GPU {} as a peer",
                self.ordinal, peer.ordinal
            )));
        }
        self.bind()?;
        // SAFETY: both contexts are live
        let rc = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) };
        if rc == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", rc)
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        drv("cuCtxSynchronize", result::ctx::synchronize())
    }

    /// The raw context, for driver calls that name two contexts (peer copies).
    pub fn raw_ctx(&self) -> sys::CUcontext {
        self.ctx
    }
}

/// A reference on a GPU's primary context, held by the [`Gpu`] handle and by everything made
/// in it (device memory, streams, events, graphs, modules, IPC mappings): releasing a primary
/// context's last reference destroys it, and a stream destroyed or memory freed after that would hand the driver a
/// handle of a context that no longer exists. With a reference each, the context outlives all
/// of them, whatever order they and the [`Gpu`] are dropped in. Declared as the owner's last
/// field, so that it is released after the owner's own `Drop` has run.
struct ContextRef {
    dev: sys::CUdevice,
}

impl ContextRef {
    /// A reference on `dev`'s primary context, and the context.
    fn of_device(dev: sys::CUdevice) -> Result<(ContextRef, sys::CUcontext), CudaError> {
        // SAFETY: dev is a valid device; balanced by the release in drop
        let ctx = drv("cuDevicePrimaryCtxRetain", unsafe {
            result::primary_ctx::retain(dev)
        })?;
        Ok((ContextRef { dev }, ctx))
    }

    /// Another reference on `gpu`'s context.
    fn retain(gpu: &Gpu) -> Result<ContextRef, CudaError> {
        gpu.ctx_ref.another()
    }

    /// Another reference on the same context.
    fn another(&self) -> Result<ContextRef, CudaError> {
        Self::of_device(self.dev).map(|(r, _)| r)
    }
}

impl Drop for ContextRef {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain`
        unsafe {
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

/// The GPUs `devices` (rank r on the r-th), peer access enabled between every pair. Each GPU
/// once: the fused operators' GEMMs fill a GPU, so ranks sharing one could never meet.
pub fn open_group(devices: &[usize]) -> Result<Vec<std::sync::Arc<Gpu>>, CudaError> {
    one_rank_per_gpu(devices).map_err(CudaError::Unavailable)?;
    let gpus: Vec<std::sync::Arc<Gpu>> = devices
        .iter()
        .map(|&d| Gpu::open(d).map(std::sync::Arc::new))
        .collect::<Result<_, _>>()?;
    for a in &gpus {
        for b in &gpus {
            if a.ordinal != b.ordinal {
                a.enable_peer_access(b)?;
            }
        }
    }
    Ok(gpus)
}

/// Refuses a device named twice, naming it.
fn one_rank_per_gpu(devices: &[usize]) -> Result<(), String> {
    match devices
        .iter()
        .enumerate()
        .find(|(i, d)| devices[..*i].contains(d))
    {
        Some((_, d)) => Err(format!(
            "device {d} is listed twice: the GEMM operators take one rank per GPU"
        )),
        None => Ok(()),
    }
}

/// Device memory from `cuMemAlloc`, zeroed, freed on drop.
pub struct DeviceMemory {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: sys::CUcontext,
    _ctx_ref: ContextRef,
}

// SAFETY: a device address is valid from any thread that binds the owning context.
unsafe impl Send for DeviceMemory {}
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    pub fn zeroed(gpu: &Gpu, bytes: usize) -> Result<DeviceMemory, CudaError> {
        gpu.bind()?;
        let ctx_ref = ContextRef::retain(gpu)?;
        let alloc = bytes.max(16);
        // SAFETY: context bound; size non-zero
        let ptr =
            drv("cuMemAlloc", unsafe { result::malloc_sync(alloc) }).map_err(|e| match e {
                CudaError::Driver { message, .. } if message.contains("OUT_OF_MEMORY") => {
                    CudaError::Unavailable(format!(
                        "GPU {} is out of memory allocating {bytes} bytes",
                        gpu.ordinal
                    ))
                }
                other => other,
            })?;
        // owned from here on: freed on drop, also if clearing it fails
        let mem = DeviceMemory {
            ptr,
            bytes,
            ctx: gpu.ctx,
            _ctx_ref: ctx_ref,
        };
        mem.fill(gpu, 0)?;
        Ok(mem)
    }

    /// Sets every byte to `value` (synchronously): zeroes new memory, poisons outputs before a
    /// checked run.
    pub fn fill(&self, gpu: &Gpu, value: u8) -> Result<(), CudaError> {
        gpu.bind()?;
        // SAFETY: the whole allocation, context bound
        drv("cuMemsetD8", unsafe {
            result::memset_d8_sync(self.ptr, value, self.bytes.max(16))
        })?;
        legacy_stream_finished()
    }

    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Bytes this allocation holds.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `src` to the start of this memory (synchronously); an `src` larger than the
    /// allocation is an error.
    ///
    /// Only `Copy`, not `Pod`: reading a value's bytes cannot make an invalid value, and callers
    /// outside this crate's ownership pass generic `T: Copy` slices.
    pub fn upload<T: bytemuck::NoUninit>(&self, gpu: &Gpu, src: &[T]) -> Result<(), CudaError> {
        fits("upload", std::mem::size_of_val(src), self.bytes)?;
        gpu.bind()?;
        // SAFETY: in bounds (checked above), context bound
        drv("cuMemcpyHtoD", unsafe {
            result::memcpy_htod_sync(self.ptr, src)
        })?;
        legacy_stream_finished()
    }

    /// Copies the start of this memory into `dst` (synchronously); a `dst` larger than the
    /// allocation is an error. `Pod`: any bytes the GPU left there must be a valid `T`.
    pub fn download<T: Pod>(&self, gpu: &Gpu, dst: &mut [T]) -> Result<(), CudaError> {
        self.download_at(gpu, 0, dst)
    }

    /// Copies the bytes from `offset` on into `dst` (synchronously); a range past the
    /// allocation's end is an error.
    pub fn download_at<T: Pod>(
        &self,
        gpu: &Gpu,
        offset: usize,
        dst: &mut [T],
    ) -> Result<(), CudaError> {
        fits_at("download", std::mem::size_of_val(dst), offset, self.bytes)?;
        gpu.bind()?;
        // SAFETY: in bounds (checked above), context bound, every bit pattern is a valid T
        drv("cuMemcpyDtoH", unsafe {
            result::memcpy_dtoh_sync(dst, self.ptr + offset as u64)
        })
    }
}

/// Waits until the legacy default stream has run what was queued on it. The "synchronous"
/// `cuMemsetD8` (on device memory) and `cuMemcpyHtoD` (from pageable memory) return before the
/// device has written: they are ordered on the legacy stream only, and every stream of ours is
/// non-blocking, so a kernel queued next on one of them could run before the write lands (and
/// the write then overwrite its output). `fill` and `upload` promise finished writes.
fn legacy_stream_finished() -> Result<(), CudaError> {
    // SAFETY: the null stream is the bound context's legacy default stream
    drv("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(std::ptr::null_mut()).result()
    })
}

/// The device allocation that holds an address, as the driver knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// The GPU whose memory it is
    pub ordinal: usize,
    /// Where the allocation starts
    pub base: u64,
    /// Its size in bytes
    pub bytes: usize,
}

/// The allocation holding `addr`, or None where the driver knows none: a host pointer, freed
/// memory, a made-up address. One driver call (`cuPointerGetAttributes`), which needs no bound
/// context and reports an address it does not know as such instead of failing.
pub fn allocation_of(addr: u64) -> Result<Option<Allocation>, CudaError> {
    let mut ordinal: i32 = -1;
    let mut base: sys::CUdeviceptr = 0;
    let mut bytes: usize = 0;
    let mut attributes = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data = [
        (&mut ordinal as *mut i32).cast::<c_void>(),
        (&mut base as *mut sys::CUdeviceptr).cast::<c_void>(),
        (&mut bytes as *mut usize).cast::<c_void>(),
    ];
    // SAFETY: three attributes, each with an out-pointer of its type (int, CUdeviceptr, size_t)
    check("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(
            attributes.len() as u32,
            attributes.as_mut_ptr(),
            data.as_mut_ptr(),
            addr,
        )
    })?;
    if ordinal < 0 || bytes == 0 || addr < base {
        return Ok(None);
    }
    Ok(Some(Allocation {
        ordinal: ordinal as usize,
        base,
        bytes,
    }))
}

/// Whether `bytes` bytes from `addr` lie in one allocation of GPU `ordinal` (the driver's
/// view, [`allocation_of`]); else a one-line [`CudaError::OutOfBounds`] naming `what`, where
/// it is and what its allocation holds.
pub fn check_device_span(
    what: &str,
    addr: u64,
    bytes: usize,
    ordinal: usize,
) -> Result<(), CudaError> {
    let wrong = |why: String| Err(CudaError::OutOfBounds(format!("{what} ({addr:#x}) {why}")));
    if addr == 0 {
        return wrong("is a null pointer".into());
    }
    match allocation_of(addr)? {
        None => wrong("is not device memory".into()),
        Some(a) if a.ordinal != ordinal => wrong(format!(
            "is memory of GPU {}, and this operator runs on GPU {ordinal}",
            a.ordinal
        )),
        Some(a) => {
            // (the driver's range holds addr; saturating all the same: a bad answer fails the
            // check instead of wrapping)
            let left = a.bytes.saturating_sub((addr - a.base) as usize);
            if bytes > left {
                wrong(format!(
                    "needs {bytes} bytes, but its allocation ({} bytes from {:#x}) holds {left} from there",
                    a.bytes, a.base
                ))
            } else {
                Ok(())
            }
        }
    }
}

/// [`fits`] for `bytes` from `offset` on.
fn fits_at(what: &str, bytes: usize, offset: usize, capacity: usize) -> Result<(), CudaError> {
    if offset == 0 {
        return fits(what, bytes, capacity);
    }
    if offset.saturating_add(bytes) > capacity {
        return Err(CudaError::OutOfBounds(format!(
            "{what} of {bytes} bytes at offset {offset} runs past a device allocation of {capacity} bytes"
        )));
    }
    Ok(())
}

/// A host copy of `bytes` must fit in an allocation of `capacity` bytes.
fn fits(what: &str, bytes: usize, capacity: usize) -> Result<(), CudaError> {
    if bytes > capacity {
        return Err(CudaError::OutOfBounds(format!(
            "{what} of {bytes} bytes does not fit in a device allocation of {capacity} bytes"
        )));
    }
    Ok(())
}

/// Copies `rows` rows of `row_bytes` between device pitches (synchronously), e.g. to give a
/// matrix a leading dimension that TMA can describe.
///
/// # Safety
/// Both regions must be valid device memory of the bound context for the whole copy.
pub unsafe fn copy_2d(
    gpu: &Gpu,
    dst: u64,
    dst_pitch: usize,
    src: u64,
    src_pitch: usize,
    row_bytes: usize,
    rows: usize,
) -> Result<(), CudaError> {
    gpu.bind()?;
    // every field spelled out: the memory-type enums have no valid all-zero value
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: row_bytes,
        Height: rows,
    };
    check("cuMemcpy2D", sys::cuMemcpy2D_v2(&copy))
}

/// The swizzle of a box whose rows are `bytes` long: as wide as the row, since the kernels'
/// shared-memory layouts (and their wgmma descriptors) take 128- or 64-byte swizzled rows.
fn swizzle_of_box_row(bytes: usize) -> Result<sys::CUtensorMapSwizzle, CudaError> {
    match bytes {
        128 => Ok(sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B),
        64 => Ok(sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B),
        other => Err(CudaError::OutOfBounds(format!(
            "a tensor map's box rows must be 64 or 128 bytes, got {other}"
        ))),
    }
}

/// A 2D TMA descriptor over a row-major matrix of `dtype` elements: `dims` = (columns, rows),
/// `row_bytes` the distance between rows (a multiple of 16), `boxed` = (columns, rows) of the
/// box one copy moves, swizzled as wide as the box's rows (128 or 64 bytes), zero fill
/// outside on loads; stores leave what lies outside alone.
pub fn tensor_map_2d(
    addr: u64,
    dtype: DType,
    dims: (u64, u64),
    row_bytes: u64,
    boxed: (u32, u32),
) -> Result<[u64; 16], CudaError> {
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    let row_of_box = boxed.0 as usize * dtype.size();
    let dtype = match dtype {
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    };
    let global_dim = [dims.0, dims.1];
    let global_strides = [row_bytes];
    let box_dim = [boxed.0, boxed.1];
    let element_strides = [1u32, 1];
    let swizzle = swizzle_of_box_row(row_of_box)?;
    // SAFETY: out-parameter and arrays of the documented lengths (rank 2)
    check("cuTensorMapEncodeTiled", unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            2,
            addr as *mut c_void,
            global_dim.as_ptr(),
            global_strides.as_ptr(),
            box_dim.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    })?;
    Ok(map.opaque)
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if is_wedged(self.ctx) {
            // a kernel that will not end may still write it (see `StreamGuard`)
            return;
        }
        // SAFETY: allocated by cuMemAlloc in this context; nothing uses it any more
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// A CUDA IPC handle of a device allocation: 64 opaque bytes that another process on the same
/// machine opens with [`IpcMapping::open`] (one process per GPU, PyTorch's model), exchanged
/// through whatever rendezvous the processes already share.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl DeviceMemory {
    /// The IPC handle of this allocation (a whole `cuMemAlloc` allocation, as all of ours are),
    /// for a peer process to open.
    pub fn ipc_handle(&self, gpu: &Gpu) -> Result<IpcHandle, CudaError> {
        gpu.bind()?;
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: a live allocation of the bound context; the handle is written in place
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, self.ptr)
        })?;
        Ok(IpcHandle(handle.reserved.map(|c| c as u8)))
    }
}

/// Another process's device allocation opened into this process's context (peer access enabled
/// as needed), closed on drop. Kernels of this process address it at [`IpcMapping::addr`].
pub struct IpcMapping {
    addr: sys::CUdeviceptr,
    ctx: sys::CUcontext,
    _ctx_ref: ContextRef,
}

// SAFETY: a device address is valid from any thread that binds the owning context.
unsafe impl Send for IpcMapping {}
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens `handle` (made by [`DeviceMemory::ipc_handle`] in another process) on `gpu`.
    pub fn open(gpu: &Gpu, handle: &IpcHandle) -> Result<IpcMapping, CudaError> {
        gpu.bind()?;
        let ctx_ref = ContextRef::retain(gpu)?;
        let raw = sys::CUipcMemHandle_st {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut addr = 0;
        // SAFETY: context bound; the driver validates the handle
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut addr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(IpcMapping {
            addr,
            ctx: gpu.ctx,
            _ctx_ref: ctx_ref,
        })
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: opened here, in this context, closed once; nothing of ours uses it any more
        // (its owners drop it after their last launch ended)
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = sys::cuIpcCloseMemHandle(self.addr);
        }
    }
}

/// Pinned host memory mapped into every context's address space: the GPU writes it, the host
/// reads it even while a kernel still runs (timeouts are reported through it). `Pod`: the GPU
/// may leave any bytes there, and the value is shared between threads as raw memory.
pub struct MappedHost<T: Pod> {
    host: *mut T,
    device: u64,
    _ctx_ref: ContextRef,
}

// SAFETY: pinned, portable memory holding plain old data (no pointers, no invariants); access
// is through volatile reads and writes
unsafe impl<T: Pod> Send for MappedHost<T> {}
unsafe impl<T: Pod> Sync for MappedHost<T> {}

impl<T: Pod> MappedHost<T> {
    pub fn new(gpu: &Gpu, value: T) -> Result<Self, CudaError> {
        gpu.bind()?;
        // a context's pinned allocations go with it: freeing one after that would free twice
        let ctx_ref = ContextRef::retain(gpu)?;
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: out-parameter; size of one T
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut host, std::mem::size_of::<T>(), flags)
        })?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: host was just allocated with DEVICEMAP
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
        })?;
        let mapped = MappedHost {
            host: host as *mut T,
            device,
            _ctx_ref: ctx_ref,
        };
        mapped.write(value);
        Ok(mapped)
    }

    /// The address kernels use.
    pub fn device_addr(&self) -> u64 {
        self.device
    }

    pub fn read(&self) -> T {
        // SAFETY: valid pinned memory; volatile because the GPU writes it behind our back
        unsafe { std::ptr::read_volatile(self.host) }
    }

    pub fn write(&self, value: T) {
        // SAFETY: as for read
        unsafe { std::ptr::write_volatile(self.host, value) }
    }
}

impl MappedHost<ErrorRecord> {
    /// Raises the record's `abort` word, and only that word (a kernel may be writing the
    /// others): every device-side wait that polls it gives up.
    pub fn raise_abort(&self) {
        // SAFETY: a field of live pinned memory; volatile because the GPU reads it behind our
        // back; the fence orders it after whatever the host did before (the GPU polls it)
        unsafe { std::ptr::addr_of_mut!((*self.host).abort).write_volatile(1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl<T: Pod> Drop for MappedHost<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc
        unsafe {
            let _ = result::free_host(self.host as *mut c_void);
        }
    }
}

/// A non-blocking stream.
pub struct Stream {
    raw: sys::CUstream,
    /// Whether dropping this destroys the stream (false for a caller's stream we only borrow)
    owned: bool,
    /// An owned stream's context, kept until the stream is destroyed
    _ctx_ref: Option<ContextRef>,
}

// SAFETY: streams may be used from any thread with the owning context bound.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(gpu: &Gpu) -> Result<Stream, CudaError> {
        gpu.bind()?;
        let ctx_ref = ContextRef::retain(gpu)?;
        Ok(Stream {
            raw: drv(
                "cuStreamCreate",
                result::stream::create(result::stream::StreamKind::NonBlocking),
            )?,
            owned: true,
            _ctx_ref: Some(ctx_ref),
        })
    }

    /// A caller's stream (PyTorch's current stream, say), used but never destroyed by us.
    ///
    /// # Safety
    /// `raw` must be a live stream (or null, the legacy default stream) of the context that is
    /// bound when work is queued on it, for as long as the returned value is used.
    pub unsafe fn borrowed(raw: sys::CUstream) -> Stream {
        Stream {
            raw,
            owned: false,
            _ctx_ref: None,
        }
    }

    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: live stream
        drv("cuStreamSynchronize", unsafe {
            result::stream::synchronize(self.raw)
        })
    }

    /// Whether work queued on this stream now is being captured into a CUDA graph (by us or by
    /// the caller, as `torch.cuda.graph` does) rather than run.
    pub fn is_capturing(&self) -> Result<bool, CudaError> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: live stream, a valid out-pointer
        check("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(self.raw, &mut status)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Whether everything queued so far has finished (a failed kernel is an error).
    pub fn is_idle(&self) -> Result<bool, CudaError> {
        // SAFETY: live stream
        not_ready_is_false("cuStreamQuery", unsafe { sys::cuStreamQuery(self.raw) })
    }

    /// [`Stream::synchronize`] that gives up after `timeout`: `Ok(false)` when work is still
    /// running then. The owning context must be bound.
    pub fn wait_idle(&self, timeout: Duration) -> Result<bool, CudaError> {
        host_sync::poll_until(timeout, || self.is_idle())
    }

    /// [`Stream::synchronize`] bounded by `limit`: past it, [`CudaError::stalled`] saying that
    /// `who` waited on `what` (the work queued on this stream). The owning context must be
    /// bound.
    pub fn synchronize_within(
        &self,
        limit: Duration,
        who: &str,
        what: &str,
    ) -> Result<(), CudaError> {
        if self.wait_idle(limit)? {
            Ok(())
        } else {
            Err(CudaError::stalled(who, what, limit))
        }
    }
}

/// `CUDA_SUCCESS` → true, `CUDA_ERROR_NOT_READY` → false, anything else an error.
fn not_ready_is_false(call: &'static str, rc: sys::CUresult) -> Result<bool, CudaError> {
    if rc == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(call, rc).map(|()| true)
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: live stream we created, no longer used
        unsafe {
            let _ = result::stream::destroy(self.raw);
        }
    }
}

/// Waits for everything enqueued on a stream when dropped. Declared after the device memory
/// (and modules, handles) that kernels on the stream use, it drops before them, so that no
/// error path frees memory a running kernel still writes. The wait is bounded
/// ([`StreamGuard::LIMIT`] unless given): every wait of our GEMM times out after 5 s and ends
/// the kernel, the other kernels run to completion on their own, so a stream still busy past
/// the bound holds a kernel that will not end. Then the guard says so on stderr and marks the
/// stream's context wedged: device memory of that context dropped afterwards stays allocated
/// (freeing it would wait for the device without bound, and must not happen under a kernel
/// that may still write it).
pub struct StreamGuard<'a> {
    stream: &'a Stream,
    limit: Duration,
}

impl<'a> StreamGuard<'a> {
    /// How long a dropped guard waits by default.
    pub const LIMIT: Duration = Duration::from_secs(60);

    pub fn new(stream: &'a Stream) -> StreamGuard<'a> {
        StreamGuard::with_limit(stream, StreamGuard::LIMIT)
    }

    /// A guard whose drop waits at most `limit`.
    pub fn with_limit(stream: &'a Stream, limit: Duration) -> StreamGuard<'a> {
        StreamGuard { stream, limit }
    }
}

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        // an error here is the kernel's own failure, already reported by whoever returned it
        // (a faulted context runs nothing any more): what matters is that the stream stopped
        if let Ok(false) = self.stream.wait_idle(self.limit) {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: a live stream; the driver writes its context into `ctx`
            let rc = unsafe { sys::cuStreamGetCtx(self.stream.raw, &mut ctx) };
            if rc == sys::CUresult::CUDA_SUCCESS {
                wedged_contexts().push(ctx as usize);
            }
            eprintln!(
                "commfuse: a stream still ran {:?} after the error that ended its work; the device memory its kernels use stays allocated",
                self.limit
            );
        }
    }
}

/// Contexts with a stream that a [`StreamGuard`] gave up waiting for.
fn wedged_contexts() -> std::sync::MutexGuard<'static, Vec<usize>> {
    static WEDGED: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
    WEDGED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a [`StreamGuard`] of `ctx` gave up waiting for its stream.
fn is_wedged(ctx: sys::CUcontext) -> bool {
    wedged_contexts().contains(&(ctx as usize))
}

/// A timing event (created with CU_EVENT_DEFAULT: events made without timing cannot be timed).
pub struct Event {
    raw: sys::CUevent,
    _ctx_ref: ContextRef,
}

// SAFETY: events may be used from any thread with the owning context bound.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new(gpu: &Gpu) -> Result<Event, CudaError> {
        Self::create(gpu, sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    /// An event for ordering streams only (no timestamps: cheaper to record and wait on).
    pub fn new_untimed(gpu: &Gpu) -> Result<Event, CudaError> {
        Self::create(gpu, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    fn create(gpu: &Gpu, flags: sys::CUevent_flags) -> Result<Event, CudaError> {
        gpu.bind()?;
        let ctx_ref = ContextRef::retain(gpu)?;
        Ok(Event {
            raw: drv("cuEventCreate", result::event::create(flags))?,
            _ctx_ref: ctx_ref,
        })
    }

    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: live event and stream of the bound context
        drv("cuEventRecord", unsafe {
            result::event::record(self.raw, stream.raw)
        })
    }

    /// Whether the work before the last `record` has finished.
    pub fn is_done(&self) -> Result<bool, CudaError> {
        // SAFETY: live event
        not_ready_is_false("cuEventQuery", unsafe { sys::cuEventQuery(self.raw) })
    }

    /// Milliseconds from `self` to `later` (both recorded and complete).
    pub fn elapsed_ms(&self, later: &Event) -> Result<f32, CudaError> {
        // SAFETY: live events
        drv("cuEventElapsedTime", unsafe {
            result::event::elapsed(self.raw, later.raw)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: live event, no longer used
        unsafe {
            let _ = result::event::destroy(self.raw);
        }
    }
}

/// A stream capture turned into an executable graph: replaying it launches everything captured
/// with one call, so launch overhead stops counting (how small messages are timed).
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// The captured stream's context (where the stream is ours), kept until the graph is
    /// destroyed
    _ctx_ref: Option<ContextRef>,
}

// SAFETY: graph handles are usable from any thread with the owning context bound.
unsafe impl Send for Graph {}

impl Graph {
    /// Captures what `record` enqueues on `stream` (which must be idle).
    pub fn capture(
        stream: &Stream,
        record: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<Graph, CudaError> {
        let ctx_ref = stream
            ._ctx_ref
            .as_ref()
            .map(ContextRef::another)
            .transpose()?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: live stream
        drv("cuStreamBeginCapture", unsafe {
            result::stream::begin_capture(stream.raw, mode)
        })?;
        let recorded = record();
        // SAFETY: the capture begun above
        let graph = drv("cuStreamEndCapture", unsafe {
            result::stream::end_capture(stream.raw)
        })?;
        if let Err(e) = recorded {
            // SAFETY: graph from the capture, unused
            unsafe {
                let _ = result::graph::destroy(graph);
            }
            return Err(e);
        }
        let flags = sys::CUgraphInstantiate_flags(0);
        // SAFETY: a complete graph
        let exec = match unsafe { result::graph::instantiate(graph, flags) } {
            Ok(exec) => exec,
            Err(e) => {
                // SAFETY: as above
                unsafe {
                    let _ = result::graph::destroy(graph);
                }
                return Err(CudaError::Driver {
                    call: "cuGraphInstantiate",
                    message: format!("{e:?}"),
                });
            }
        };
        Ok(Graph {
            graph,
            exec,
            _ctx_ref: ctx_ref,
        })
    }

    pub fn launch(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: live executable graph and stream
        drv("cuGraphLaunch", unsafe {
            result::graph::launch(self.exec, stream.raw)
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: live handles, nothing replays them any more
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// A loaded cubin. Its entry points ([`Function`]) share ownership of it, so a function handle
/// can never outlive the code it points into; the module in turn holds a reference on its
/// primary context, so the context outlives the module.
pub struct Module {
    loaded: Arc<LoadedModule>,
}

struct LoadedModule {
    raw: sys::CUmodule,
    ctx: sys::CUcontext,
    _ctx_ref: ContextRef,
}

// SAFETY: module handles are usable from any thread with the owning context bound.
unsafe impl Send for LoadedModule {}
unsafe impl Sync for LoadedModule {}

/// A kernel entry point; keeps its module loaded.
#[derive(Clone)]
pub struct Function {
    raw: sys::CUfunction,
    _module: Arc<LoadedModule>,
}

// SAFETY: as for a module: a function handle is usable from any thread with its context bound,
// and the Arc keeps its module loaded
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

impl Module {
    pub fn load(gpu: &Gpu, cubin: &[u8]) -> Result<Module, CudaError> {
        gpu.bind()?;
        let ctx_ref = ContextRef::retain(gpu)?;
        // SAFETY: cubin is a complete image produced by NVRTC
        let raw = drv("cuModuleLoadData", unsafe {
            result::module::load_data(cubin.as_ptr() as *const c_void)
        })?;
        Ok(Module {
            loaded: Arc::new(LoadedModule {
                raw,
                ctx: gpu.ctx,
                _ctx_ref: ctx_ref,
            }),
        })
    }

    pub fn function(&self, name: &str) -> Result<Function, CudaError> {
        let cname = CString::new(name).map_err(|_| {
            CudaError::OutOfBounds(format!("kernel name {name:?} holds a NUL byte"))
        })?;
        // SAFETY: live module
        let raw = drv("cuModuleGetFunction", unsafe {
            result::module::get_function(self.loaded.raw, cname)
        })?;
        // Loaded now, not at its first launch (CUDA loads functions lazily by default): a
        // lazy load waits for the context's running kernels, and where ranks share a GPU
        // (one context) another rank's kernel may be spinning until this one runs.
        // SAFETY: a function of the live module
        check("cuFuncLoad", unsafe { sys::cuFuncLoad(raw) })?;
        Ok(Function {
            raw,
            _module: Arc::clone(&self.loaded),
        })
    }
}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        // SAFETY: the last handle to a live module is gone, so no launch can name it any more
        // (launches that already ran are the owners' to have waited for); unloading needs the
        // module's context current (kept alive by the module's context reference)
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::module::unload(self.raw);
        }
    }
}

impl Function {
    /// Resident blocks of `threads` threads per multiprocessor.
    pub fn max_blocks_per_sm(&self, threads: u32) -> Result<u32, CudaError> {
        let mut n = 0;
        // SAFETY: live function, out-parameter
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.raw, threads as i32, 0)
        })?;
        Ok(n as u32)
    }

    /// Lets launches ask for `bytes` of dynamic shared memory (above the default 48 KiB).
    pub fn allow_dynamic_smem(&self, bytes: u32) -> Result<(), CudaError> {
        // SAFETY: live function
        check(
            "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            unsafe {
                sys::cuFuncSetAttribute(
                    self.raw,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            },
        )
    }

    /// Launches with one by-value parameter struct.
    ///
    /// # Safety
    /// `P` must match the kernel's parameter layout, and every device address inside it must be
    /// valid for what the kernel does with it until the launch completes.
    pub unsafe fn launch<P>(
        &self,
        grid: u32,
        block: u32,
        stream: &Stream,
        params: &P,
    ) -> Result<(), CudaError> {
        self.launch_with_smem(grid, block, 0, stream, params)
    }

    /// [`Function::launch`] with `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// As for [`Function::launch`].
    pub unsafe fn launch_with_smem<P>(
        &self,
        grid: u32,
        block: u32,
        smem: u32,
        stream: &Stream,
        params: &P,
    ) -> Result<(), CudaError> {
        let mut args = [params as *const P as *mut c_void];
        drv(
            "cuLaunchKernel",
            result::launch_kernel(
                self.raw,
                (grid, 1, 1),
                (block, 1, 1),
                smem,
                stream.raw,
                &mut args,
            ),
        )
    }

    /// [`Function::launch_with_smem`] as a cooperative launch: the driver schedules the grid
    /// only once every block of it can be resident at the same time (it waits for SMs that
    /// other kernels hold to free up rather than start a part of the grid), and refuses a grid
    /// larger than the GPU can hold at once. What a kernel needs whose blocks wait for one
    /// another.
    ///
    /// # Safety
    /// As for [`Function::launch`].
    pub unsafe fn launch_cooperative_with_smem<P>(
        &self,
        grid: u32,
        block: u32,
        smem: u32,
        stream: &Stream,
        params: &P,
    ) -> Result<(), CudaError> {
        // SAFETY: all-zero is a valid attribute (IGNORE) and value union
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        self.launch_with_attribute(
            "cuLaunchKernelEx(cooperative)",
            (grid, block, smem),
            stream,
            params,
            attr,
        )
    }

    /// [`Function::launch_with_smem`] in thread-block clusters of `cluster` blocks (a 1-D grid,
    /// a multiple of `cluster`): the blocks of a cluster run at once on one GPC and may read,
    /// write and arrive on each other's shared memory (TMA multicast, remote mbarriers).
    ///
    /// # Safety
    /// As for [`Function::launch`], and the kernel must be written for clusters of that size.
    pub unsafe fn launch_cluster_with_smem<P>(
        &self,
        grid: u32,
        block: u32,
        smem: u32,
        cluster: u32,
        stream: &Stream,
        params: &P,
    ) -> Result<(), CudaError> {
        self.launch_with_attribute(
            "cuLaunchKernelEx(cluster)",
            (grid, block, smem),
            stream,
            params,
            cluster_attribute(cluster),
        )
    }

    /// Clusters of `cluster` blocks of `block` threads and `smem` bytes of dynamic shared
    /// memory that the GPU can hold at once (what sizes a persistent grid of clusters).
    pub fn max_active_clusters(
        &self,
        block: u32,
        smem: u32,
        cluster: u32,
    ) -> Result<u32, CudaError> {
        let mut attr = cluster_attribute(cluster);
        let config = launch_config((cluster, block, smem), std::ptr::null_mut(), &mut attr);
        let mut n = 0;
        // SAFETY: live function, a config that outlives the call, an out-parameter
        check("cuOccupancyMaxActiveClusters", unsafe {
            sys::cuOccupancyMaxActiveClusters(&mut n, self.raw, &config)
        })?;
        if n <= 0 {
            return Err(CudaError::Unavailable(format!(
                "no cluster of {cluster} blocks of {block} threads and {smem} bytes of shared memory fits on this GPU"
            )));
        }
        Ok(n as u32)
    }

    /// [`Function::launch`] with programmatic stream serialization (programmatic dependent
    /// launch): the kernel may be scheduled before the kernel ahead of it on `stream` has
    /// finished — once every block of that one has exited or let it (`allow_next_grid` in
    /// common.cuh) — so its launch latency hides under that kernel's tail. Under stream
    /// capture the dependency becomes a programmatic edge of the graph.
    ///
    /// # Safety
    /// As for [`Function::launch`], and every block of the kernel must execute
    /// `wait_for_prior_grid` (common.cuh) before it reads or writes memory that earlier work on
    /// the stream touches.
    pub unsafe fn launch_programmatic<P>(
        &self,
        grid: u32,
        block: u32,
        stream: &Stream,
        params: &P,
    ) -> Result<(), CudaError> {
        // SAFETY: all-zero is a valid attribute (IGNORE) and value union
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        self.launch_with_attribute(
            "cuLaunchKernelEx(programmatic stream serialization)",
            (grid, block, 0),
            stream,
            params,
            attr,
        )
    }

    /// One `cuLaunchKernelEx` of a 1-D grid with one launch attribute (`what` names the call
    /// in its error).
    ///
    /// # Safety
    /// As for [`Function::launch`], and whatever `attr` asks of the kernel.
    unsafe fn launch_with_attribute<P>(
        &self,
        what: &'static str,
        (grid, block, smem): (u32, u32, u32),
        stream: &Stream,
        params: &P,
        mut attr: sys::CUlaunchAttribute,
    ) -> Result<(), CudaError> {
        let mut args = [params as *const P as *mut c_void];
        let config = launch_config((grid, block, smem), stream.raw, &mut attr);
        check(what, {
            // SAFETY: the config and its attribute outlive the call; the parameter block
            // matches the kernel (the caller's contract)
            sys::cuLaunchKernelEx(&config, self.raw, args.as_mut_ptr(), std::ptr::null_mut())
        })
    }
}

/// A 1-D launch of `grid` blocks of `block` threads and `smem` bytes of dynamic shared memory
/// on `stream`, with one attribute (which must outlive the config's use).
fn launch_config(
    (grid, block, smem): (u32, u32, u32),
    stream: sys::CUstream,
    attr: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: attr,
        numAttrs: 1,
    }
}

/// The launch attribute of a 1-D cluster of `blocks` blocks.
fn cluster_attribute(blocks: u32) -> sys::CUlaunchAttribute {
    // SAFETY: all-zero is a valid attribute (IGNORE) and value union
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
        x: blocks,
        y: 1,
        z: 1,
    };
    attr
}

/// The end of an operator's last call, so that its next call comes after it on the device even
/// when the caller moves to another stream, and so that the host can wait for it.
///
/// Calls queued while their stream is captured into a CUDA graph are left out: a graph's calls
/// are ordered by the graph, and each replay by the stream it is launched on, as any work of
/// the caller's is. (An event recorded during a capture cannot be waited on after it, and one
/// recorded before it cannot order the replays.)
pub struct CallOrder {
    last: Event,
}

impl CallOrder {
    pub fn new(gpu: &Gpu) -> Result<CallOrder, CudaError> {
        Ok(CallOrder {
            last: Event::new_untimed(gpu)?,
        })
    }

    /// Makes `stream` wait for the last call recorded (unless `stream` is capturing).
    pub fn after_last(&self, stream: &Stream) -> Result<(), CudaError> {
        self.after_last_if(stream, stream.is_capturing()?)
    }

    /// Marks the end of the call just queued on `stream` (unless `stream` is capturing).
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        self.record_if(stream, stream.is_capturing()?)
    }

    /// [`CallOrder::after_last`] for a caller that asked once per call whether `stream` is
    /// capturing (`capturing`): each ask is a driver call, on the path of every call.
    pub fn after_last_if(&self, stream: &Stream, capturing: bool) -> Result<(), CudaError> {
        if capturing {
            return Ok(());
        }
        stream.wait_event(&self.last)
    }

    /// [`CallOrder::record`] for a caller that asked whether `stream` is capturing.
    pub fn record_if(&self, stream: &Stream, capturing: bool) -> Result<(), CudaError> {
        if capturing {
            return Ok(());
        }
        self.last.record(stream)
    }

    /// Whether the last call recorded has finished.
    pub fn is_done(&self) -> Result<bool, CudaError> {
        self.last.is_done()
    }
}

impl Stream {
    /// Makes work queued on this stream from now on wait until `event`'s last record is done
    /// (on the device: the host does not wait). Forks and joins a side stream.
    pub fn wait_event(&self, event: &Event) -> Result<(), CudaError> {
        // SAFETY: live stream and event
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }

    /// Enqueues a copy of `bytes` from `src` to `dst` (device addresses, this GPU or a peer).
    ///
    /// # Safety
    /// Both ranges must stay valid device memory until the copy completes.
    pub unsafe fn copy_async(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        drv(
            "cuMemcpyDtoDAsync",
            result::memcpy_dtod_async(dst, src, bytes, self.raw),
        )
    }

    /// Enqueues a copy of `bytes` from `src` in context `src_ctx` to `dst` in context `dst_ctx`
    /// (another GPU's, peer access enabled) by the copy engine. Unlike a plain copy between
    /// two GPUs' addresses, which the driver may hold until the destination GPU's running
    /// work finishes, this one waits for nothing on the other GPU: a kernel there may spin on
    /// a flag that only this stream's later work raises.
    ///
    /// # Safety
    /// Both ranges must stay valid device memory of their contexts until the copy completes.
    pub unsafe fn copy_peer_async(
        &self,
        (dst_ctx, dst): (sys::CUcontext, u64),
        (src_ctx, src): (sys::CUcontext, u64),
        bytes: usize,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        drv(
            "cuMemcpyPeerAsync",
            result::memcpy_peer_async(dst_ctx, dst, src_ctx, src, bytes, self.raw),
        )
    }

    /// Enqueues writing `value` to the 8 bytes at device address `dst` (this GPU's or a peer's)
    /// once the stream's earlier work is done, that work's writes made visible first (the
    /// driver's default memory barrier): a flag that tells another GPU a copy has landed.
    ///
    /// # Safety
    /// `dst` must stay valid device memory, aligned to 8 bytes, until the write completes.
    pub unsafe fn write_value_u64(&self, dst: u64, value: u64) -> Result<(), CudaError> {
        check("cuStreamWriteValue64", unsafe {
            sys::cuStreamWriteValue64_v2(self.raw, dst, value, 0)
        })
    }

    /// Enqueues setting `bytes` bytes at device address `dst` to `value`.
    ///
    /// # Safety
    /// The range must stay valid device memory until the fill completes.
    pub unsafe fn fill_async(&self, dst: u64, value: u8, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        drv(
            "cuMemsetD8Async",
            result::memset_d8_async(dst, value, bytes, self.raw),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gemm_operators_refuse_a_gpu_named_twice() {
        assert!(one_rank_per_gpu(&[0, 1, 2]).is_ok());
        let e = one_rank_per_gpu(&[0, 1, 1]).unwrap_err();
        assert!(e.starts_with("device 1 is listed twice"), "{e}");
    }

    #[test]
    fn a_host_copy_larger_than_its_allocation_is_an_error() {
        fits("upload", 64, 64).unwrap();
        fits("download", 0, 0).unwrap();
        let e = fits("download", 65, 64).unwrap_err();
        assert_eq!(
            e.to_string(),
            "download of 65 bytes does not fit in a device allocation of 64 bytes"
        );
        fits_at("download", 60, 4, 64).unwrap();
        fits_at("download", 0, 64, 64).unwrap();
        let e = fits_at("download", 8, 60, 64).unwrap_err();
        assert_eq!(
            e.to_string(),
            "download of 8 bytes at offset 60 runs past a device allocation of 64 bytes"
        );
        let e = fits_at("download", 1, usize::MAX, 64).unwrap_err();
        assert!(e.to_string().contains("runs past"), "{e}");
        let e = fits_at("download", 65, 0, 64).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
    }

    #[test]
    fn only_not_ready_reads_as_still_running() {
        assert!(not_ready_is_false("q", sys::CUresult::CUDA_SUCCESS).unwrap());
        assert!(!not_ready_is_false("q", sys::CUresult::CUDA_ERROR_NOT_READY).unwrap());
        // (an error's message needs libcuda, which this test may not have)
    }

    #[test]
    fn a_box_is_swizzled_as_wide_as_its_rows() {
        use sys::CUtensorMapSwizzle::*;
        // boxes of 32 16-bit elements a row, and the kernels' boxes (128 bytes)
        assert_eq!(swizzle_of_box_row(64).unwrap(), CU_TENSOR_MAP_SWIZZLE_64B);
        assert_eq!(swizzle_of_box_row(128).unwrap(), CU_TENSOR_MAP_SWIZZLE_128B);
        let e = swizzle_of_box_row(96).unwrap_err().to_string();
        assert_eq!(e, "a tensor map's box rows must be 64 or 128 bytes, got 96");
    }
}
