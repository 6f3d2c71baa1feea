// CUDA C++ on the host compiler, for tests: the built-ins the abftgemm kernels use, defined over
// the SIMT runtime of simt_runtime.cpp (blocks one after another, each CUDA thread a fiber, warp
// intrinsics and __syncthreads as scheduling points).
//
// The kernel translation unit is compiled with -fsanitize=thread but linked without libtsan: every
// load and store of kernel code calls the runtime's __tsan_* hooks, which check it (bounds of
// device allocations, uninitialized reads, shared-memory races). Functions here that only move
// kernel arguments or talk to the runtime are SIMT_UNCHECKED; those that access memory on the
// kernel's behalf (atomics, __ldcg) either stay instrumented or tell the runtime themselves.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "simt_abi.h"

#define SIMT_UNCHECKED __attribute__((no_sanitize_thread))

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __constant__ static const
// Shared memory: a function-local static in the module's .bss (valid while one block runs at a
// time); the runtime knows the module's .bss range and checks every access to it for races.
#define __shared__ static

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(8) uint2 { unsigned int x, y; };

extern "C" {
// simt_runtime.cpp
uint3 simt_thread_idx();
uint3 simt_block_idx();
dim3 simt_block_dim();
dim3 simt_grid_dim();
void simt_syncthreads();
void simt_syncwarp(unsigned mask);
// kind: 0 idx, 1 xor, 2 down, 3 up, 4 any, 5 all, 6 ballot; value in/out (8 bytes)
void simt_warp_op(int kind, unsigned mask, void* value, int arg, int width,
                  const char* name);
void simt_atomic_access(const void* p, int size, const char* name);
void simt_fail(const char* message);
int simt_run(const SimtLaunch* launch, void (*entry)(void*), void* ctx, const void* anchor);
}

#define threadIdx (simt_thread_idx())
#define blockIdx (simt_block_idx())
#define blockDim (simt_block_dim())
#define gridDim (simt_grid_dim())
#define warpSize 32

inline void __syncthreads() { simt_syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { simt_syncwarp(mask); }
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---- warp intrinsics: every lane of the mask must reach the same one
template <typename T> SIMT_UNCHECKED inline T simt_shfl(int kind, unsigned mask, T v, int arg, int width,
                                                      const char* name) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    unsigned char buf[8] = {};
    std::memcpy(buf, &v, sizeof(T));
    simt_warp_op(kind, mask, buf, arg, width, name);
    std::memcpy(&v, buf, sizeof(T));
    return v;
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return simt_shfl(0, mask, v, src, width, "__shfl_sync");
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return simt_shfl(1, mask, v, lane_mask, width, "__shfl_xor_sync");
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return simt_shfl(2, mask, v, static_cast<int>(delta), width, "__shfl_down_sync");
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return simt_shfl(3, mask, v, static_cast<int>(delta), width, "__shfl_up_sync");
}
inline int __any_sync(unsigned mask, int p) { return simt_shfl(4, mask, p ? 1 : 0, 0, 32, "__any_sync"); }
inline int __all_sync(unsigned mask, int p) { return simt_shfl(5, mask, p ? 1 : 0, 0, 32, "__all_sync"); }
inline unsigned __ballot_sync(unsigned mask, int p) {
    return static_cast<unsigned>(simt_shfl(6, mask, p ? 1 : 0, 0, 32, "__ballot_sync"));
}

// ---- atomics: the runtime checks the access (bounds, initialized), then a plain read-modify-write,
// atomic because fibers are never preempted
#define SIMT_ATOMIC(NAME, T, EXPR)                                   \
    SIMT_UNCHECKED inline T NAME(T* p, T v) {                        \
        simt_atomic_access(p, sizeof(T), #NAME);                     \
        const T old = *p;                                            \
        *p = (EXPR);                                                 \
        return old;                                                  \
    }
SIMT_ATOMIC(atomicAdd, int, old + v)
SIMT_ATOMIC(atomicAdd, unsigned int, old + v)
SIMT_ATOMIC(atomicAdd, unsigned long long, old + v)
SIMT_ATOMIC(atomicAdd, float, old + v)
SIMT_ATOMIC(atomicAdd, double, old + v)
SIMT_ATOMIC(atomicMax, int, old > v ? old : v)
SIMT_ATOMIC(atomicMax, unsigned int, old > v ? old : v)
SIMT_ATOMIC(atomicMax, unsigned long long, old > v ? old : v)
SIMT_ATOMIC(atomicMin, int, old < v ? old : v)
SIMT_ATOMIC(atomicMin, unsigned int, old < v ? old : v)
SIMT_ATOMIC(atomicExch, unsigned int, v)
SIMT_ATOMIC(atomicExch, unsigned long long, v)
#undef SIMT_ATOMIC
SIMT_UNCHECKED inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp,
                                                   unsigned long long v) {
    simt_atomic_access(p, sizeof(*p), "atomicCAS");
    const unsigned long long old = *p;
    if (old == cmp) *p = v;
    return old;
}
SIMT_UNCHECKED inline unsigned int atomicCAS(unsigned int* p, unsigned int cmp, unsigned int v) {
    simt_atomic_access(p, sizeof(*p), "atomicCAS");
    const unsigned int old = *p;
    if (old == cmp) *p = v;
    return old;
}

// ---- cache-hint loads: plain (checked) loads here
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldca(const T* p) { return *p; }

// ---- bit casts and correctly rounded arithmetic (SSE is IEEE; the build disables contraction)
template <typename To, typename From> inline To simt_bits(From v) {
    static_assert(sizeof(To) == sizeof(From));
    To t;
    std::memcpy(&t, &v, sizeof(To));
    return t;
}
inline long long __double_as_longlong(double v) { return simt_bits<long long>(v); }
inline double __longlong_as_double(long long v) { return simt_bits<double>(v); }
inline float __int_as_float(int v) { return simt_bits<float>(v); }
inline float __int_as_float(unsigned v) { return simt_bits<float>(v); }
inline float __uint_as_float(unsigned v) { return simt_bits<float>(v); }
inline int __float_as_int(float v) { return simt_bits<int>(v); }
inline unsigned __float_as_uint(float v) { return simt_bits<unsigned>(v); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float __double2float_rn(double v) { return static_cast<float>(v); }
// Round up: the nearest float, moved one step toward +inf when it fell below v.
inline float __double2float_ru(double v) {
    float f = static_cast<float>(v);
    if (static_cast<double>(f) < v) f = std::nextafter(f, INFINITY);
    return f;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
using std::exp;
using std::fabs;
using std::fmax;
using std::log;

// ---- half precision: _Float16 (software conversions, round to nearest even, subnormals kept)
typedef _Float16 __half;
inline float __half2float(__half v) { return static_cast<float>(v); }
inline __half __float2half_rn(float v) { return static_cast<__half>(v); }
inline __half __float2half(float v) { return static_cast<__half>(v); }

// ---- bfloat16: the top half of a float32, rounded to nearest even; NaN stays NaN
struct __nv_bfloat16 {
    unsigned short x;
    __nv_bfloat16() = default;
    __nv_bfloat16(int v) : x(from_float(static_cast<float>(v))) {}
    __nv_bfloat16(float v) : x(from_float(v)) {}
    __nv_bfloat16(double v) : x(from_float(static_cast<float>(v))) {}
    static unsigned short from_float(float f) {
        const unsigned u = simt_bits<unsigned>(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
        return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
};
inline float __bfloat162float(__nv_bfloat16 v) {
    return simt_bits<float>(static_cast<unsigned>(v.x) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return __nv_bfloat16(v); }
inline __nv_bfloat16 __float2bfloat16(float v) { return __nv_bfloat16(v); }

// ---- launches: argument checks against the kernel's parameter types, then the grid
namespace simt {

template <typename P> SIMT_UNCHECKED inline P load_arg(void* const* values, size_t i) {
    P v;
    std::memcpy(&v, values[i], sizeof(P));
    return v;
}

template <typename... P> struct Kernel {
    void (*fn)(P...);
    void* const* values;

    template <size_t... I>
    SIMT_UNCHECKED static void call(void (*fn)(P...), void* const* values, std::index_sequence<I...>) {
        fn(load_arg<P>(values, I)...);
    }
    SIMT_UNCHECKED static void entry(void* self) {
        const Kernel* k = static_cast<const Kernel*>(self);
        call(k->fn, k->values, std::index_sequence_for<P...>{});
    }
};

int fail(const SimtLaunch* launch, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

template <typename... P>
SIMT_UNCHECKED int launch(void (*fn)(P...), const SimtLaunch* launch, const void* anchor) {
    constexpr int n = sizeof...(P);
    constexpr int sizes[] = {static_cast<int>(sizeof(P))..., 0};
    constexpr bool pointers[] = {std::is_pointer_v<P>..., false};
    if (launch->nargs != n)
        return fail(launch, "%s takes %d arguments, the launch passed %d", launch->name, n,
                    launch->nargs);
    for (int i = 0; i < n; ++i) {
        if (pointers[i] != (launch->pointers[i] != 0))
            return fail(launch, "argument %d of %s: the kernel takes a %s, the launch passed a %s",
                        i, launch->name, pointers[i] ? "pointer" : "scalar",
                        launch->pointers[i] ? "device array or None" : "scalar");
        if (sizes[i] != launch->sizes[i])
            return fail(launch, "argument %d of %s: the kernel takes %d bytes, the launch passed %d",
                        i, launch->name, sizes[i], launch->sizes[i]);
    }
    Kernel<P...> k{fn, launch->values};
    return simt_run(launch, &Kernel<P...>::entry, &k, anchor);
}

}  // namespace simt

// ---- nvcuda::wmma (mma.h): warp-collective tile products on fragments whose layout is opaque,
// as on the GPU. Lane l holds elements l, l + 32, l + 64, ... of the fragment's matrix in row-major
// order (M x K for matrix_a, K x N for matrix_b, M x N for the accumulator): code that assumes a
// layout gets wrong results. Every function is a warp intrinsic with the full mask (every lane of
// the warp must reach the same one; the sanitizer reports a lane that exited or waits elsewhere);
// loads and stores are checked lane by lane like any access, and none of them orders memory
// between lanes (no __syncwarp). Products are summed in the accumulator's type, k in order.
inline int simt_linear_thread() {
    const uint3 t = simt_thread_idx();
    const dim3 b = simt_block_dim();
    return static_cast<int>(t.x + b.x * (t.y + b.y * t.z));
}
SIMT_UNCHECKED inline void simt_collective(int kind, const char* name) {
    unsigned char v[8] = {};
    simt_warp_op(kind, 0xffffffffu, v, 0, 32, name);
}
inline float simt_wmma_value(float v) { return v; }
inline float simt_wmma_value(__half v) { return static_cast<float>(v); }
inline float simt_wmma_value(__nv_bfloat16 v) { return __bfloat162float(v); }
inline double simt_wmma_value(double v) { return v; }

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K> struct simt_shape;
template <int M, int N, int K> struct simt_shape<matrix_a, M, N, K> {
    static constexpr int rows = M, cols = K;
};
template <int M, int N, int K> struct simt_shape<matrix_b, M, N, K> {
    static constexpr int rows = K, cols = N;
};
template <int M, int N, int K> struct simt_shape<accumulator, M, N, K> {
    static constexpr int rows = M, cols = N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static constexpr int rows = simt_shape<Use, M, N, K>::rows;
    static constexpr int cols = simt_shape<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols / 32;
    static_assert(rows * cols % 32 == 0, "a fragment spreads over the 32 lanes of a warp");
    T x[num_elements];
};

template <typename F, typename T> inline void simt_load(F& f, const T* p, unsigned ldm, bool col) {
    const int lane = simt_linear_thread() % 32;
    for (int i = 0; i < F::num_elements; ++i) {
        const int e = lane + 32 * i, r = e / F::cols, c = e % F::cols;
        f.x[i] = col ? p[static_cast<size_t>(c) * ldm + r] : p[static_cast<size_t>(r) * ldm + c];
    }
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
    static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load takes a layout_t");
    simt_collective(8, "nvcuda::wmma::load_matrix_sync");
    simt_load(f, p, ldm, std::is_same_v<Layout, col_major>);
}

template <int M, int N, int K, typename T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm,
                             layout_t layout) {
    simt_collective(8, "nvcuda::wmma::load_matrix_sync");
    simt_load(f, p, ldm, layout == mem_col_major);
}

template <int M, int N, int K, typename T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout) {
    simt_collective(9, "nvcuda::wmma::store_matrix_sync");
    const int lane = simt_linear_thread() % 32;
    for (int i = 0; i < f.num_elements; ++i) {
        const int e = lane + 32 * i, r = e / N, c = e % N;
        p[layout == mem_col_major ? static_cast<size_t>(c) * ldm + r
                                  : static_cast<size_t>(r) * ldm + c] = f.x[i];
    }
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& v) {
    simt_collective(10, "nvcuda::wmma::fill_fragment");
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = static_cast<T>(v);
}

// The lanes' operand fragments during an mma_sync, per warp (one block runs at a time).
inline const void* simt_mma_operands[32][32][2];

// d = a b + c: every lane publishes its operands, the warp meets, each lane sums its own elements
// of d from every lane's operands, the warp meets again (no lane changes an operand that another
// still reads), then d is written.
template <int M, int N, int K, typename TA, typename LA, typename LB, typename TC>
SIMT_UNCHECKED inline void mma_sync(fragment<accumulator, M, N, K, TC>& d,
                                    const fragment<matrix_a, M, N, K, TA, LA>& a,
                                    const fragment<matrix_b, M, N, K, TA, LB>& b,
                                    const fragment<accumulator, M, N, K, TC>& c) {
    typedef fragment<matrix_a, M, N, K, TA, LA> FA;
    typedef fragment<matrix_b, M, N, K, TA, LB> FB;
    const int t = simt_linear_thread(), w = t / 32, lane = t % 32;
    simt_mma_operands[w][lane][0] = &a;
    simt_mma_operands[w][lane][1] = &b;
    simt_collective(11, "nvcuda::wmma::mma_sync");
    TC out[fragment<accumulator, M, N, K, TC>::num_elements];
    for (int i = 0; i < d.num_elements; ++i) {
        const int e = lane + 32 * i, m = e / N, n = e % N;
        TC s = c.x[i];
        for (int k = 0; k < K; ++k) {
            const int ia = m * K + k, ib = k * N + n;
            const FA* fa = static_cast<const FA*>(simt_mma_operands[w][ia % 32][0]);
            const FB* fb = static_cast<const FB*>(simt_mma_operands[w][ib % 32][1]);
            s += static_cast<TC>(simt_wmma_value(fa->x[ia / 32])) *
                 static_cast<TC>(simt_wmma_value(fb->x[ib / 32]));
        }
        out[i] = s;
    }
    simt_collective(12, "nvcuda::wmma::mma_sync");
    for (int i = 0; i < d.num_elements; ++i) d.x[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda
