// The reference GEMM every output element of a fast GEMM (ours, cuBLASLt) is checked against on
// the device: value[M, N] = A[M, K] · B in float64 and abs_products[M, N] = Σk |a_ik · b_kj| (the
// scale of commfuse_core::gemm::element_bound). Plain CUDA cores and shared-memory tiles, no
// tensor cores, TMA or wgmma: it shares no code path with the kernels it checks.
//
// Operands are widened to double on their way into shared memory: a product of two bf16 or f16
// values is exact in double (and in f32), and K terms summed in double lose under K · 2^-53 of
// Σ|ab|, far below any bound a 32-bit accumulation is held to.
#include "common.cuh"

namespace reference {
constexpr int TILE = 64;       // a block computes a TILE x TILE tile of D
constexpr int BK = 16;         // k-slice staged per step
constexpr int THREADS = 256;   // 16 x 16 threads, each 4 x 4 elements strided by 16
constexpr int PER_THREAD = TILE / 16;
}  // namespace reference

// Mirrored by `ReferenceParams` in src/gemm_bench.rs.
struct ReferenceParams {
    u64 a;             // A [M, K], row-major, bf16 or f16
    u64 b;             // B [N, K] (nk) or [K, N] (kn), row-major
    u64 value;         // double [M, N]
    u64 abs_products;  // float [M, N]
    u32 m;
    u32 n;
    u32 k;
    u32 tiles_n;       // tiles along N; the grid is tiles_m * tiles_n blocks
};

template <typename T, bool KN>
__device__ __forceinline__ void reference_gemm(const ReferenceParams& p) {
    using namespace reference;
    // padded by one: the staging stores (consecutive threads along k) spread over the banks
    __shared__ double as[BK][TILE + 1];
    __shared__ double bs[BK][TILE + 1];
    const T* a = reinterpret_cast<const T*>(p.a);
    const T* b = reinterpret_cast<const T*>(p.b);
    const u64 row0 = (u64)(blockIdx.x / p.tiles_n) * TILE;
    const u64 col0 = (u64)(blockIdx.x % p.tiles_n) * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    double acc[PER_THREAD][PER_THREAD] = {};
    double abs_acc[PER_THREAD][PER_THREAD] = {};
    for (u64 k0 = 0; k0 < p.k; k0 += BK) {
        for (int e = threadIdx.x; e < TILE * BK; e += THREADS) {
            // A and B [N, K]: consecutive threads read consecutive k of one row
            const int r = e / BK, kk = e % BK;
            const u64 k = k0 + kk;
            const u64 row = row0 + r;
            as[kk][r] = (row < p.m && k < p.k) ? (double)Elem<T>::to_f32(a[row * p.k + k]) : 0.0;
            if (KN) {
                // B [K, N]: consecutive threads read consecutive columns of one k
                const int kb = e / TILE, c = e % TILE;
                const u64 kg = k0 + kb, col = col0 + c;
                bs[kb][c] = (col < p.n && kg < p.k) ? (double)Elem<T>::to_f32(b[kg * p.n + col]) : 0.0;
            } else {
                const u64 col = col0 + r;
                bs[kk][r] = (col < p.n && k < p.k) ? (double)Elem<T>::to_f32(b[col * p.k + k]) : 0.0;
            }
        }
        __syncthreads();
#pragma unroll 4
        for (int kk = 0; kk < BK; ++kk) {
            double av[PER_THREAD], bv[PER_THREAD];
#pragma unroll
            for (int i = 0; i < PER_THREAD; ++i) {
                av[i] = as[kk][ty + 16 * i];
                bv[i] = bs[kk][tx + 16 * i];
            }
#pragma unroll
            for (int i = 0; i < PER_THREAD; ++i) {
#pragma unroll
                for (int j = 0; j < PER_THREAD; ++j) {
                    acc[i][j] = fma(av[i], bv[j], acc[i][j]);
                    abs_acc[i][j] = fma(fabs(av[i]), fabs(bv[j]), abs_acc[i][j]);
                }
            }
        }
        __syncthreads();
    }
    double* value = reinterpret_cast<double*>(p.value);
    float* abs_products = reinterpret_cast<float*>(p.abs_products);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const u64 row = row0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) {
            const u64 col = col0 + tx + 16 * j;
            if (row < p.m && col < p.n) {
                value[row * p.n + col] = acc[i][j];
                abs_products[row * p.n + col] = (float)abs_acc[i][j];
            }
        }
    }
}

#define REFERENCE_ENTRY(NAME, T, KN)                                                             \
    extern "C" __global__ void __launch_bounds__(reference::THREADS)                            \
        NAME(const ReferenceParams p) {                                                          \
        reference_gemm<T, KN>(p);                                                                \
    }

REFERENCE_ENTRY(reference_gemm_bf16_nk, __nv_bfloat16, false)
REFERENCE_ENTRY(reference_gemm_bf16_kn, __nv_bfloat16, true)
REFERENCE_ENTRY(reference_gemm_f16_nk, __half, false)
REFERENCE_ENTRY(reference_gemm_f16_kn, __half, true)
