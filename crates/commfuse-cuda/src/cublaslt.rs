//! The cuBLASLt baseline: a small wrapper that builds descriptors, layouts and the heuristic's
//! choice once per shape and caches them (cudarc's safe layer redoes all of it per call), and
//! can cap the SMs cuBLASLt uses (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`, to leave SMs to
//! communication kernels).
//!
//! Row-major D[M,N] = A[M,K]·B is computed as the column-major Dᵀ[N,M] = Bᵀ·Aᵀ: B goes first.

use crate::driver::{DeviceMemory, Gpu, Stream};
use crate::error::CudaError;
use commfuse_core::gemm::{BLayout, GemmProblem};
use commfuse_core::DType;
use cudarc::cublaslt::{result, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

const WORKSPACE_BYTES: usize = 64 << 20;
// cublasOperation_t (cudarc's cublasLt bindings do not carry the enum)
const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;

fn lt<T>(call: &'static str, r: Result<T, result::CublasError>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    })
}

fn data_type(d: DType) -> sys::cudaDataType {
    match d {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    problem: GemmProblem,
    sms: u32,
}

struct Prepared {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// One cuBLASLt handle on one GPU, with its workspace and per-shape cache.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceMemory,
    cache: Mutex<HashMap<Key, Prepared>>,
}

// SAFETY: the handle is used from one thread at a time (the cache's lock serialises setup;
// launches go to one stream per GPU).
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Lt {
    pub fn new(gpu: &Gpu) -> Result<Lt, CudaError> {
        // SAFETY: only tries to dlopen libcublasLt
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "cuBLASLt (libcublasLt.so) is not on the library path".into(),
            ));
        }
        gpu.bind()?;
        Ok(Lt {
            handle: lt("cublasLtCreate", result::create_handle())?,
            workspace: DeviceMemory::zeroed(gpu, WORKSPACE_BYTES)?,
            cache: Mutex::new(HashMap::new()),
        })
    }

    fn prepare(&self, key: Key) -> Result<(), CudaError> {
        let mut cache = self.cache.lock().unwrap();
        if cache.contains_key(&key) {
            return Ok(());
        }
        let p = &key.problem;
        let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
        let desc = lt(
            "cublasLtMatmulDescCreate",
            result::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            ),
        )?;
        // first operand: B as column-major; [K,N] row-major is (N×K, ld N); [N,K] row-major is
        // (K×N, ld K) transposed
        let (b_rows, b_cols, b_ld, trans) = match p.b_layout {
            BLayout::KN => (n, k, n as i64, CUBLAS_OP_N),
            BLayout::NK => (k, n, k as i64, CUBLAS_OP_T),
        };
        // SAFETY: live descriptor, attribute buffers of the documented types
        unsafe {
            lt(
                "cublasLtMatmulDescSetAttribute(TRANSA)",
                result::set_matmul_desc_attribute(
                    desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    &trans as *const _ as *const c_void,
                    std::mem::size_of_val(&trans),
                ),
            )?;
            if key.sms > 0 {
                let sms = key.sms as i32;
                lt(
                    "cublasLtMatmulDescSetAttribute(SM_COUNT_TARGET)",
                    result::set_matmul_desc_attribute(
                        desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                        &sms as *const _ as *const c_void,
                        std::mem::size_of_val(&sms),
                    ),
                )?;
            }
        }
        let first = lt(
            "cublasLtMatrixLayoutCreate",
            result::create_matrix_layout(data_type(p.input), b_rows, b_cols, b_ld),
        )?;
        let second = lt(
            "cublasLtMatrixLayoutCreate",
            result::create_matrix_layout(data_type(p.input), k, m, k as i64),
        )?;
        let out = lt(
            "cublasLtMatrixLayoutCreate",
            result::create_matrix_layout(data_type(p.output), n, m, n as i64),
        )?;
        let pref = lt(
            "cublasLtMatmulPreferenceCreate",
            result::create_matmul_pref(),
        )?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: live handles
        let heuristic = unsafe {
            lt(
                "cublasLtMatmulPreferenceSetAttribute",
                result::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const _ as *const c_void,
                    std::mem::size_of_val(&ws),
                ),
            )?;
            let h =
                result::get_matmul_algo_heuristic(self.handle, desc, first, second, out, out, pref);
            let _ = result::destroy_matmul_pref(pref);
            lt("cublasLtMatmulAlgoGetHeuristic", h)?
        };
        cache.insert(
            key,
            Prepared {
                desc,
                layouts: [first, second, out],
                algo: heuristic.algo,
            },
        );
        Ok(())
    }

    /// D = alpha·A·B + beta·D on `stream`; `sms` > 0 caps the SMs used.
    ///
    /// # Safety
    /// `a`, `b` and `d` must be device addresses on this GPU holding the problem's operands.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        stream: &Stream,
        problem: &GemmProblem,
        sms: u32,
        a: u64,
        b: u64,
        d: u64,
        alpha: f32,
        beta: f32,
    ) -> Result<(), CudaError> {
        let key = Key {
            problem: *problem,
            sms,
        };
        self.prepare(key)?;
        let cache = self.cache.lock().unwrap();
        let p = &cache[&key];
        lt(
            "cublasLtMatmul",
            result::matmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                p.layouts[0],
                a as *const c_void,
                p.layouts[1],
                d as *const c_void,
                p.layouts[2],
                d as *mut c_void,
                p.layouts[2],
                &p.algo,
                self.workspace.addr() as *mut c_void,
                WORKSPACE_BYTES,
                stream.raw() as sys::cudaStream_t,
            ),
        )
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: handles created here, no launch in flight (callers synchronise)
        unsafe {
            for (_, p) in self.cache.get_mut().unwrap().drain() {
                let _ = result::destroy_matmul_desc(p.desc);
                for l in p.layouts {
                    let _ = result::destroy_matrix_layout(l);
                }
            }
            let _ = result::destroy_handle(self.handle);
        }
    }
}
