// Checksum accumulation shared by every abftgemm kernel: abftgemm.kernels.source() prepends this
// file to each .cu source (rather than #include-ing it, so that CuPy's kernel cache, keyed on the
// source text, sees a change here).
//
// Per vector v of length L the accumulator produces five float64 numbers
//     [sum c0[l]*v[l], sum c1[l]*v[l], sum c2[l]*|v[l]|, #non-finite, last non-finite index or -1]
// with c0 = 1, c1 = (l + 1) / L, c2 = 1 when no coefficient array is given (coef == nullptr), else
// c_j[l] = coef[j*fstride + l] (an encoding, field-major: each field's vector contiguous). Non-finite elements still enter the sums, as plain arithmetic would.
// NVRTC has no host headers, so no INFINITY / <cmath>: finiteness is a bit test on the double.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace {

// float -> double, exactly, subnormals included. CuPy compiles with -ftz=true, under which NVRTC
// turns a plain conversion into cvt.ftz.f64.f32: every subnormal float (and bfloat16) would count as
// 0 in the float64 checksums while the products keep it. So the double is assembled from the float's
// bits (integer operations and float64 arithmetic, which -ftz does not touch).
__device__ __forceinline__ double to_double(float v) {
    const unsigned bits = __float_as_uint(v);
    const unsigned exponent = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
    const unsigned long long sign = static_cast<unsigned long long>(bits >> 31) << 63;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-149, exact in double
        const double magnitude = static_cast<double>(mantissa) * 0x1p-149;
        return __longlong_as_double(static_cast<long long>(
            sign | static_cast<unsigned long long>(__double_as_longlong(magnitude))));
    }
    const unsigned long long e = exponent == 0xffu ? 0x7ffULL : exponent + (1023ULL - 127ULL);
    return __longlong_as_double(static_cast<long long>(
        sign | e << 52 | static_cast<unsigned long long>(mantissa) << 29));
}
__device__ __forceinline__ double to_double(double v) { return v; }
// Subnormal halves are normal floats, so the conversion to float loses nothing.
__device__ __forceinline__ double to_double(__half v) { return to_double(__half2float(v)); }
__device__ __forceinline__ double to_double(__nv_bfloat16 v) {
    return to_double(__bfloat162float(v));
}

// All exponent bits set <=> INF or NaN. Conversions to double keep INF/NaN, so one test serves
// every element type.
__device__ __forceinline__ bool not_finite(double v) {
    const long long exp_mask = 0x7ff0000000000000LL;
    return (__double_as_longlong(v) & exp_mask) == exp_mask;
}

struct Acc {
    double s0, s1, s2;
    double weight_scale;  // 1 / L: default location weights (l + 1) / L stay <= 1, so the
                          // weighted sum cannot overflow where the plain sum does not
    int count, last;

    __device__ __forceinline__ void init(int len) {
        s0 = 0.0; s1 = 0.0; s2 = 0.0; count = 0; last = -1;
        weight_scale = 1.0 / static_cast<double>(len > 0 ? len : 1);
    }

    // Element l (0-based) of the vector with the default coefficients (1, (l + 1) / L, 1).
    __device__ __forceinline__ void add(double v, int l) { add(v, l, nullptr, 0); }

    // Element l (0-based) of the vector; coef is this batch's coefficients, field j's vector at
    // coef + j*fstride, or null.
    __device__ __forceinline__ void add(double v, int l, const double* __restrict__ coef,
                                        long long fstride) {
        double c0 = 1.0, c1 = static_cast<double>(l + 1) * weight_scale, c2 = 1.0;
        if (coef != nullptr) {
            c0 = coef[l];
            c1 = coef[fstride + l];
            c2 = coef[2LL * fstride + l];
        }
        s0 += c0 * v;
        s1 += c1 * v;
        s2 += c2 * fabs(v);
        if (not_finite(v)) {
            ++count;
            last = max(last, l);
        }
    }

    __device__ __forceinline__ void merge(double t0, double t1, double t2, int tc, int tl) {
        s0 += t0; s1 += t1; s2 += t2; count += tc; last = max(last, tl);
    }

    __device__ __forceinline__ void store(double* __restrict__ out) const {
        out[0] = s0; out[1] = s1; out[2] = s2;
        out[3] = static_cast<double>(count);
        out[4] = static_cast<double>(last);
    }
};

__device__ __forceinline__ void warp_allreduce(Acc& a) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        a.merge(__shfl_xor_sync(0xffffffffu, a.s0, off), __shfl_xor_sync(0xffffffffu, a.s1, off),
                __shfl_xor_sync(0xffffffffu, a.s2, off), __shfl_xor_sync(0xffffffffu, a.count, off),
                __shfl_xor_sync(0xffffffffu, a.last, off));
    }
}

// The verdict on one vector (abftgemm._cpu.judge is the CPU's copy): from the predicted
// [plain, weighted, S = sum |A||B|] and observed [plain, weighted, sum |C|, non-finite count]
// checksums, sets the threshold tau and returns whether the vector is flagged; *verifiable says
// whether its inputs are finite (finite prediction) and it is not an overflow to settle on the
// host (S at or above safe and holding INF/NaN). Flagged: verifiable and a checksum difference
// above tau, a non-finite element, or sum |C| above the rigorous bound c_mag * S + floor.
__device__ __forceinline__ bool judge(const double* p, double o0, double o1, double o2,
                                      double o3, double c_obs, double c_pred, double floor_abs,
                                      double c_mag, double safe, double* tau, bool* verifiable) {
    const double t = c_obs * o2 + c_pred * p[2] + floor_abs;
    const bool observed_finite = !not_finite(o2) && o3 == 0.0;
    const bool ok = !not_finite(p[0]) && !not_finite(p[1]) && !not_finite(p[2]) &&
                    (p[2] < safe || observed_finite);
    const bool within = fabs(p[0] - o0) <= t && fabs(p[1] - o1) <= t && observed_finite &&
                        o2 <= c_mag * p[2] + floor_abs;
    *tau = t;
    *verifiable = ok;
    return ok && !within;
}

}  // namespace
