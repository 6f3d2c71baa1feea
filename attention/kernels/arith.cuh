// Element arithmetic shared by attention's kernels (softmax.cu, fused.cu): attention.kernels.source()
// prepends this file, after abftgemm's checksum prelude, to each of them (not #include-d: CuPy's
// kernel cache, keyed on the source text, sees a change here).
namespace {

// The arithmetic type of an element type: float for half, bfloat16 and float; double for double.
template <typename T> struct Arith {
    typedef float type;
};
template <> struct Arith<double> {
    typedef double type;
};

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double widen(double v) { return v; }

template <typename T> __device__ __forceinline__ T narrow(typename Arith<T>::type v);
template <> __device__ __forceinline__ float narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ double narrow<double>(double v) { return v; }
template <> __device__ __forceinline__ __half narrow<__half>(float v) {
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// No host headers under NVRTC: infinities are bit patterns.
__device__ __forceinline__ float neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double neg_inf(double) {
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
}
__device__ __forceinline__ double pos_inf() {
    return __longlong_as_double(0x7ff0000000000000LL);
}

// Full-precision exponential and logarithm (not __expf).
__device__ __forceinline__ float exp_of(float v) { return expf(v); }
__device__ __forceinline__ double exp_of(double v) { return exp(v); }
__device__ __forceinline__ float log_of(float v) { return logf(v); }
__device__ __forceinline__ double log_of(double v) { return log(v); }

}  // namespace
