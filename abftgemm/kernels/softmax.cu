// Fused masked softmax + checksum statistics of the attention scores (DESIGN.md section 3:
// "Fusing verification into the softmax is free"). One warp per score row reads the raw row once
// and produces
//   - probs: P = softmax over the visible keys of scale * score, hidden entries 0, a row without
//     a visible key all 0. Arithmetic in float for 16/32-bit T, double for double;
//   - stats (rows, 5): for the RAW row v (all len entries, masked or not), accumulated in double,
//     exactly the fields of abft_row_reduce (reduce.cu) with coef == nullptr, through the same
//     accumulator (checksum_acc.cuh, prepended by abftgemm.kernels.source):
//       [sum v, sum ((l+1)/len) v, sum |v|, #non-finite v, last non-finite index or -1].
//
// Softmax semantics, element for element those of attention/softmax.py softmax_forward except
// for NaN: m = max of the visible z = scale * score (NaN ignored), replaced by 0 when it is
// infinite (no visible key, or +INF present); e = exp(z - m) on visible keys; total = sum e;
// P = e * (1 / total), or 0 when total == 0. No special case for non-finite data: a visible NaN
// makes total NaN and so every visible P of its row NaN; a visible +INF gives NaN there (INF/INF)
// and 0 elsewhere, as plain float math would.
//
// Row r is query q = r % seq of head-batch bh = r / seq, batch b = bh / heads; key l is visible
// iff (key_mask == nullptr || key_mask[b*seq + l]) && (!causal || l <= q).
//
// Rows short enough (up to CACHE 16-byte vectors per lane: 2048 fp16/bf16, 1024 fp32, 512 fp64
// elements, plus the unaligned head and tail) stay in registers between the passes (max, sum,
// write); longer rows are re-read for the second and third pass (L1/L2 serve those).
//
// Compiled by NVRTC through cupy.RawModule (abftgemm/kernels/__init__.py has the options and
// name expressions); no host headers, so no INFINITY: -inf is a bit pattern.
namespace {

// ---- Softmax arithmetic: float for __half, __nv_bfloat16 and float; double for double. ----

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

__device__ __forceinline__ float neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double neg_inf(double) {
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
}

__device__ __forceinline__ bool is_finite(float v) {
    return (__float_as_int(v) & 0x7f800000) != 0x7f800000;
}
__device__ __forceinline__ bool is_finite(double v) { return !not_finite(v); }

// fmax ignores NaN, so a NaN score never becomes the row maximum.
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }

// Full-precision exponentials (not __expf): CUDA's expf is within 2 ulp over the whole range.
__device__ __forceinline__ float exp_of(float v) { return expf(v); }
__device__ __forceinline__ double exp_of(double v) { return exp(v); }

template <typename C> __device__ __forceinline__ C warp_max(C v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = max_of(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

template <typename C> __device__ __forceinline__ C warp_sum(C v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

}  // namespace

// scores, probs: (rows, len) C-contiguous, rows = batch * heads * seq, len = seq (keys).
// scale > 0 (1 / sqrt(head_dim)); it is passed as double and rounded to float for 16/32-bit T,
// which is what NumPy does for float32_array * python_float. key_mask: null or (batch, seq)
// C-contiguous bool, true = visible. causal: 1 hides keys l > q. stats: (rows, 5) float64.
// One warp per row, any multiple of 32 threads per block, grid-stride over rows. The wide stores
// need scores and probs to agree modulo 16 bytes; otherwise P is stored element by element.
template <typename T>
__global__ void abft_softmax_rows(const T* __restrict__ scores, long long rows, int len, int seq,
                                  int heads, double scale, const bool* __restrict__ key_mask,
                                  int causal, T* __restrict__ probs, double* __restrict__ stats) {
    typedef typename Arith<T>::type C;
    constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
    constexpr int CACHE = 8;                                // vectors per lane kept in registers
    static_assert(CACHE * V <= 64, "visibility bits of the cached vectors must fit in 64 bits");

    const int lane = threadIdx.x & 31;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    const C sc = static_cast<C>(scale);
    const bool wide_out = ((reinterpret_cast<unsigned long long>(scores) ^
                            reinterpret_cast<unsigned long long>(probs)) & 15) == 0;

    for (long long r = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) >> 5;
         r < rows; r += warps) {
        const long long bh = r / seq;
        const int q = static_cast<int>(r - bh * seq);
        const bool* km =
            key_mask == nullptr ? nullptr : key_mask + (bh / heads) * static_cast<long long>(seq);
        const int last_key = causal ? min(q, len - 1) : len - 1;  // keys beyond are hidden
        const T* row = scores + r * static_cast<long long>(len);
        T* out = probs + r * static_cast<long long>(len);

        auto visible = [&](int l) -> bool {
            return l <= last_key && (km == nullptr || km[l]);
        };

        // Elements before the first 16-byte boundary (fewer than V <= 8: one per lane at most),
        // the aligned body of 16-byte vectors, and the tail (fewer than V: one per lane at most).
        const int head = min(len, static_cast<int>(
            ((16 - (reinterpret_cast<unsigned long long>(row) & 15)) & 15) / sizeof(T)));
        const int chunks = (len - head) / V;
        const int tail_start = head + chunks * V;
        const uint4* body = reinterpret_cast<const uint4*>(row + head);
        uint4* body_out = reinterpret_cast<uint4*>(out + head);
        const bool cached = chunks <= 32 * CACHE;  // uniform across the warp

        Acc a;
        a.init(len);
        C m = neg_inf(C(0));

        // ------------------------------------------------ pass 1: the only read of the row
        const int head_l = lane;
        const int tail_l = tail_start + lane;
        const bool has_head = lane < head;
        const bool has_tail = tail_l < len;
        T hx = T(), tx = T();
        bool hv = false, tv = false;
        if (has_head) {
            hx = row[head_l];
            hv = visible(head_l);
            a.add(to_double(widen(hx)), head_l);
            if (hv) m = max_of(m, widen(hx) * sc);
        }
        if (has_tail) {
            tx = row[tail_l];
            tv = visible(tail_l);
            a.add(to_double(widen(tx)), tail_l);
            if (tv) m = max_of(m, widen(tx) * sc);
        }

        // Body: stats of every element, max of the visible ones; returns visibility bits.
        auto scan = [&](const uint4& bits, int l0) -> unsigned int {
            const T* vals = reinterpret_cast<const T*>(&bits);
            unsigned int vis = 0;
            #pragma unroll
            for (int j = 0; j < V; ++j) {
                const C x = widen(vals[j]);
                a.add(to_double(x), l0 + j);
                if (visible(l0 + j)) {
                    vis |= 1u << j;
                    m = max_of(m, x * sc);
                }
            }
            return vis;
        };

        uint4 buf[CACHE];
        unsigned long long vbits = 0;  // bit k*V + j: element j of cached vector k is visible
        if (cached) {
            #pragma unroll
            for (int k = 0; k < CACHE; ++k) {
                const int i = lane + 32 * k;
                if (i < chunks) buf[k] = body[i];  // all loads in flight before any use
            }
            #pragma unroll
            for (int k = 0; k < CACHE; ++k) {
                const int i = lane + 32 * k;
                if (i < chunks)
                    vbits |= static_cast<unsigned long long>(scan(buf[k], head + i * V)) << (k * V);
            }
        } else {
            for (int i = lane; i < chunks; i += 32) scan(body[i], head + i * V);
        }

        warp_allreduce(a);
        if (lane == 0) a.store(stats + 5 * r);

        m = warp_max(m);
        if (!is_finite(m)) m = C(0);  // no visible key (-INF) or a visible +INF

        // ------------------------------------------------ pass 2: sum of exponentials
        auto expsum = [&](const uint4& bits, unsigned int vis) -> C {
            const T* vals = reinterpret_cast<const T*>(&bits);
            C s = C(0);
            #pragma unroll
            for (int j = 0; j < V; ++j)
                if ((vis >> j) & 1u) s += exp_of(widen(vals[j]) * sc - m);
            return s;
        };
        auto vis_of = [&](int l0) -> unsigned int {
            unsigned int vis = 0;
            #pragma unroll
            for (int j = 0; j < V; ++j)
                if (visible(l0 + j)) vis |= 1u << j;
            return vis;
        };
        const unsigned int vmask = (1u << V) - 1u;

        C total = C(0);
        if (hv) total += exp_of(widen(hx) * sc - m);
        if (tv) total += exp_of(widen(tx) * sc - m);
        if (cached) {
            #pragma unroll
            for (int k = 0; k < CACHE; ++k) {
                const int i = lane + 32 * k;
                if (i < chunks)
                    total += expsum(buf[k], static_cast<unsigned int>(vbits >> (k * V)) & vmask);
            }
        } else {
            for (int i = lane; i < chunks; i += 32) total += expsum(body[i], vis_of(head + i * V));
        }
        total = warp_sum(total);
        // total >= 1 whenever m is the finite max of a visible key; 0 when nothing is visible (or
        // every visible z is -INF): P = 0 there. INF and NaN totals propagate as plain math does.
        const C inv = total == C(0) ? C(0) : C(1) / total;

        // ------------------------------------------------ pass 3: write P
        auto prob = [&](T x, bool vis) -> T {
            return narrow<T>(vis ? exp_of(widen(x) * sc - m) * inv : C(0));
        };
        auto emit = [&](const uint4& bits, unsigned int vis, int i) {
            const T* vals = reinterpret_cast<const T*>(&bits);
            uint4 ob;
            T* ov = reinterpret_cast<T*>(&ob);
            #pragma unroll
            for (int j = 0; j < V; ++j) ov[j] = prob(vals[j], (vis >> j) & 1u);
            if (wide_out) {
                body_out[i] = ob;
            } else {
                #pragma unroll
                for (int j = 0; j < V; ++j) out[head + i * V + j] = ov[j];
            }
        };

        if (has_head) out[head_l] = prob(hx, hv);
        if (has_tail) out[tail_l] = prob(tx, tv);
        if (cached) {
            #pragma unroll
            for (int k = 0; k < CACHE; ++k) {
                const int i = lane + 32 * k;
                if (i < chunks)
                    emit(buf[k], static_cast<unsigned int>(vbits >> (k * V)) & vmask, i);
            }
        } else {
            for (int i = lane; i < chunks; i += 32) emit(body[i], vis_of(head + i * V), i);
        }
    }
}
