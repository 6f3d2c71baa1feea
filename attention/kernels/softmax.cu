// The attention core's masked softmax, forward and backward, each in one kernel that reads its
// rows once and checks what it stores (attention/_cpu_softmax.py is the CPU's copy, with the same
// boundaries; attention/softmax.py holds the invariants and their tolerances).
//
// Both kernels run one warp per row (any multiple of 32 threads per block, grid-stride over rows)
// and take two flags: `compute` (produce the output) and `check` (judge the row's invariants).
// compute && check is the fused clean path; the other two are the fault-injection path, where a
// hook sees the output between computing and checking.
//
// Forward, row r = query i of head-batch t = r / seq_q (batch t / heads), keys l < len:
//   - stats (optional, (rows, 5) float64): the raw scores' row checksums, the fields of
//     abft_row_reduce with default weights (checksum_acc.cuh, prepended by attention.kernels);
//   - z_l = scale * x_l (+ attn_add), rounded like the CPU's (no fused multiply-add); key l is
//     visible iff key_visible[batch, l] (when given), l <= i (when causal) and z_l != -INF;
//     m = max of the visible z (NaN ignored; 0 when nothing is visible); e_l = exp(z_l - m) on
//     visible keys, 0 elsewhere; P_l = e_l / total (total = sum e, 1 when 0). A visible NaN or
//     +INF makes the row NaN, as plain arithmetic (and the CPU kernel) does, except past the
//     diagonal of a causal row (l > i), which holds 0 in every row;
//   - check, on the stored P (rounded to T) and z recomputed from the raw scores (rounded to the
//     arithmetic type as the CPU's check rounds it, then widened exactly to double): rows
//     whose visible z are all finite must sum to 1 (0 without a visible key) within row_tol, and
//     the visible entries above max(floor * max P, p_min) (p_min: the smallest normal T) must
//     share one value of log P_l - z_l: its spread (largest minus smallest) within log_base +
//     log_slope * (the largest |z_l| + |log P_l| of those entries).
// Backward, row r of dP and P (length len; query i = r mod seq_q):
//   - stats (optional): dP's row checksums, as above;
//   - dS_l = P_l (dP_l - r), r = sum P dP, in float (double for double); with `causal`, entries
//     l > i are 0 and stay out of r, whatever dP holds there (the check takes P and dP there as
//     0, unread, and dS in its plain sums only); stored unscaled into
//     ds_acc (the arithmetic type) and/or as T after multiplying by scale into ds, whichever is
//     given. Without `compute` the unscaled dS is read from ds_acc instead;
//   - check, on the unscaled dS: sum dS = r (1 - sum P) and sum dS dP = sum P dP^2 - r^2, each
//     within u * (its terms' magnitudes) + tiny, sums in double with r recomputed there. Rows whose
//     P or dP hold INF/NaN (sum P, sum |P dP| or sum P dP^2 not finite) are not judged.
//
// A row that fails its check records (error, tolerance) in details[2r..2r+1] and raises *worst to
// (its error/tolerance ratio rounded up to float) << 32 | r: 0 means every row passed. Only
// failing rows write, so the clean path costs no atomics, and the host reads the verdict when it
// settles the pass.
//
// Rows up to CACHE 16-byte vectors per lane (512 fp16/bf16 elements, 256 fp32, 128 fp64, plus the
// unaligned head and tail) stay in registers between passes; longer rows, and the forward check's
// log pass, re-read them (L1/L2). No host headers under NVRTC (no INFINITY): infinities are bit
// patterns.
//
// Arguments: every pointer is a __restrict__ parameter of its own (only then does NVCC turn the
// kernels' loads into read-only ld.global.nc: one pointer inside a struct parameter, even a const
// one, loses them all), then the scalars, grouped in the structs below and passed by value.
// attention/_cuda_softmax.py builds them with the same layouts (abftgemm.cuda_structs;
// tests/test_softmax_structs.py and tests/test_kernels_compile.py compare the layouts with the
// compilers').
namespace softmax {

// `n` rows of `len` elements; row r is query r mod seq_q of matrix t = r / seq_q. With `causal`,
// query i sees keys l <= i only.
struct Rows {
    long long n;
    int seq_q, len, causal;
};

// Where the forward's masks hold matrix t's rows: key_visible (batch, len) at batch t / heads,
// attn_add (1 or batch*heads, seq_q, len) at t * attn_stride (0: one shared matrix).
struct MaskIndex {
    long long attn_stride;
    int heads;
};

// What a launch does: compute the output, judge the invariants on what it holds (or both).
struct Mode {
    int compute, check;
};

// The forward check's bounds: entries above max(floor * top, p_min) take part in the log identity;
// the row sum is judged within row_tol, the log spread within log_base + log_slope * size.
struct ForwardTolerances {
    double floor, p_min, row_tol, log_base, log_slope;
};

// The backward check's tolerance: u * (the terms' magnitudes) + tiny.
struct BackwardTolerance {
    double u, tiny;
};

}  // namespace softmax

namespace {

// Explicit rounding: no contraction into a fused multiply-add, so every pass computes the same z.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// fmax ignores NaN, so a NaN score never becomes the row maximum (the CPU's `z > top` neither).
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }

// max(a, b) where a NaN on either side wins (attention._cpu_checks._worse).
__device__ __forceinline__ double worse(double a, double b) {
    if (a != a || b != b) return a + b;
    return b > a ? b : a;
}

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

__device__ __forceinline__ double warp_worse(double v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = worse(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Lane l's share of a row of `len` T elements starting at `row`: the elements before the first
// 16-byte boundary (fewer than V, one per lane), the aligned body of 16-byte vectors (lane l takes
// vectors l, l + 32, ...), and the tail (fewer than V, one per lane). Another array of the same
// shape is accessed with the same split: by vectors when it agrees with `row` modulo 16 bytes,
// element by element otherwise.
template <typename T> struct Split {
    static constexpr int V = 16 / static_cast<int>(sizeof(T));
    int len, head, chunks, tail_start, lane;

    __device__ __forceinline__ Split(const T* row, int length, int lane_)
        : len(length), lane(lane_) {
        head = min(len, static_cast<int>(
            ((16 - (reinterpret_cast<unsigned long long>(row) & 15)) & 15) / sizeof(T)));
        chunks = (len - head) / V;
        tail_start = head + chunks * V;
    }
    __device__ __forceinline__ bool has_head() const { return lane < head; }
    __device__ __forceinline__ int head_l() const { return lane; }
    __device__ __forceinline__ bool has_tail() const { return tail_start + lane < len; }
    __device__ __forceinline__ int tail_l() const { return tail_start + lane; }
    __device__ __forceinline__ int first(int i) const { return head + i * V; }
};

// Vector i of the body of `row` (16 bytes), by one load when `wide`, else element by element.
template <typename T>
__device__ __forceinline__ uint4 load_vec(const T* row, int l0, bool wide) {
    if (wide) return *reinterpret_cast<const uint4*>(row + l0);
    uint4 bits;
    T* v = reinterpret_cast<T*>(&bits);
    #pragma unroll
    for (int j = 0; j < Split<T>::V; ++j) v[j] = row[l0 + j];
    return bits;
}

template <typename T>
__device__ __forceinline__ void store_vec(T* row, int l0, bool wide, const uint4& bits) {
    if (wide) {
        *reinterpret_cast<uint4*>(row + l0) = bits;
        return;
    }
    const T* v = reinterpret_cast<const T*>(&bits);
    #pragma unroll
    for (int j = 0; j < Split<T>::V; ++j) row[l0 + j] = v[j];
}

__device__ __forceinline__ bool agree16(const void* a, const void* b) {
    return ((reinterpret_cast<unsigned long long>(a) ^ reinterpret_cast<unsigned long long>(b)) &
            15) == 0;
}

// Record a row whose worse check has error/tolerance `ratio` (NaN counts as failing).
__device__ __forceinline__ void record(unsigned long long* worst, double* details, long long r,
                                       double ratio, double err, double tol) {
    if (ratio <= 1.0) return;
    const float up = ratio != ratio ? __int_as_float(0x7f800000) : __double2float_ru(ratio);
    details[2 * r] = err;
    details[2 * r + 1] = tol;
    atomicMax(worst, (static_cast<unsigned long long>(__float_as_uint(up)) << 32) |
                         static_cast<unsigned int>(r));
}

}  // namespace

template <typename T>
__global__ void attn_softmax_forward(const T* __restrict__ scores, T* __restrict__ probs,
                                     const bool* __restrict__ key_visible,
                                     const double* __restrict__ attn_add,
                                     double* __restrict__ stats,
                                     unsigned long long* __restrict__ worst,
                                     double* __restrict__ details, softmax::Rows rows,
                                     softmax::MaskIndex mask, double scale, softmax::Mode mode,
                                     softmax::ForwardTolerances tol) {
    typedef typename Arith<T>::type C;
    constexpr int V = Split<T>::V;
    constexpr int CACHE = 4;  // vectors per lane in registers; NVRTC time grows with 4 * V copies

    const int lane = threadIdx.x & 31;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    const C sc = static_cast<C>(scale);

    for (long long r = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) >> 5;
         r < rows.n; r += warps) {
        const long long t = r / rows.seq_q;
        const int i = static_cast<int>(r - t * rows.seq_q);
        const bool* kv = key_visible == nullptr
                             ? nullptr
                             : key_visible + (t / mask.heads) * static_cast<long long>(rows.len);
        const double* add =
            attn_add == nullptr
                ? nullptr
                : attn_add + t * mask.attn_stride + static_cast<long long>(i) * rows.len;
        const T* row = scores + r * static_cast<long long>(rows.len);
        T* out = probs + r * static_cast<long long>(rows.len);
        const Split<T> s(row, rows.len, lane);
        const bool wide = agree16(row, out);
        const bool cached = s.chunks <= 32 * CACHE;  // uniform across the warp

        auto shown = [&](int l) -> bool {
            return (kv == nullptr || kv[l]) && (!rows.causal || l <= i);
        };
        // The softmax's z (arithmetic type) and the check's (double, from the raw score).
        auto z_of = [&](T x, int l) -> C {
            const C z = mul_rn(widen(x), sc);
            return add == nullptr ? z : add_rn(z, static_cast<C>(add[l]));
        };
        // Rounded to the arithmetic type like the CPU's check (attention._cpu_softmax._z): a
        // float64 mask value below the float32 range hides its key here as in the softmax.
        auto z_check = [&](T x, int l) -> double {
            const C z = mul_rn(widen(x), sc);
            return add == nullptr ? to_double(z) : to_double(static_cast<C>(to_double(z) + add[l]));
        };

        T hx = T(), tx = T();
        if (s.has_head()) hx = row[s.head_l()];
        if (s.has_tail()) tx = row[s.tail_l()];
        uint4 buf[CACHE];
        if (cached) {
            #pragma unroll
            for (int k = 0; k < CACHE; ++k) {
                const int v = lane + 32 * k;
                if (v < s.chunks) buf[k] = load_vec(row, s.first(v), true);
            }
        }
        // Calls vec(bits, l0) for every 16-byte vector of this lane's share of the raw row,
        // from the registers when the row is cached there, else from memory.
        auto each_vec = [&](auto vec) {
            if (cached) {
                #pragma unroll
                for (int k = 0; k < CACHE; ++k) {
                    const int v = lane + 32 * k;
                    if (v < s.chunks) vec(buf[k], s.first(v));
                }
            } else {
                for (int v = lane; v < s.chunks; v += 32)
                    vec(load_vec(row, s.first(v), true), s.first(v));
            }
        };
        // Calls f(l, x) for every element of this lane's share of the raw row.
        auto each = [&](auto f) {
            if (s.has_head()) f(s.head_l(), hx);
            auto vec = [&](const uint4& bits, int l0) {
                const T* x = reinterpret_cast<const T*>(&bits);
                #pragma unroll
                for (int j = 0; j < V; ++j) f(l0 + j, x[j]);
            };
            each_vec(vec);
            if (s.has_tail()) f(s.tail_l(), tx);
        };
        // Calls g(l0, n, x) per piece (n = 1 or V elements x) and stores what it returns into P.
        auto each_piece = [&](auto g) {
            if (s.has_head()) {
                const uint4 o = g(s.head_l(), 1, &hx);
                out[s.head_l()] = reinterpret_cast<const T*>(&o)[0];
            }
            auto vec = [&](const uint4& bits, int l0) {
                store_vec(out, l0, wide, g(l0, V, reinterpret_cast<const T*>(&bits)));
            };
            each_vec(vec);
            if (s.has_tail()) {
                const uint4 o = g(s.tail_l(), 1, &tx);
                out[s.tail_l()] = reinterpret_cast<const T*>(&o)[0];
            }
        };

        // ---- pass 1: checksums of the raw row, the maximum, the check's view of visibility
        Acc a;
        a.init(rows.len);
        C m = neg_inf(C(0));
        bool any_visible = false, finite = true;
        each([&](int l, T x) {
            if (stats != nullptr) a.add(to_double(widen(x)), l);
            if (mode.compute && shown(l)) {
                const C z = z_of(x, l);
                if (z != neg_inf(C(0))) m = max_of(m, z);
            }
            if (mode.check && shown(l)) {
                const double z = z_check(x, l);
                if (z != neg_inf(0.0)) {
                    any_visible = true;
                    if (not_finite(z)) finite = false;
                }
            }
        });
        if (stats != nullptr) {
            warp_allreduce(a);
            if (lane == 0) a.store(stats + 5 * r);
        }

        // ---- pass 2: sum of exponentials; pass 3: P, and the sum and maximum (NaN wins) of
        // what is stored
        double p_sum = 0.0, top = neg_inf(0.0);
        auto fold = [&](double v) {
            p_sum += v;
            top = worse(top, v);
        };
        if (mode.compute) {
            m = warp_max(m);
            if (m == neg_inf(C(0))) m = C(0);  // nothing visible: every e is 0
            C total = C(0);
            each([&](int l, T x) {
                if (!shown(l)) return;
                const C z = z_of(x, l);
                if (z != neg_inf(C(0))) total += exp_of(z - m);
            });
            total = warp_sum(total);
            const C inv = C(1) / (total == C(0) ? C(1) : total);
            each_piece([&](int l0, int n, const T* x) -> uint4 {
                uint4 o;
                T* p = reinterpret_cast<T*>(&o);
                #pragma unroll
                for (int j = 0; j < V; ++j) {
                    if (j < n) {
                        const int l = l0 + j;
                        const C z = z_of(x[j], l);
                        const C e = shown(l) && z != neg_inf(C(0)) ? exp_of(z - m) : C(0);
                        // past the diagonal of a causal row: 0 even in a NaN row (as on the CPU)
                        p[j] = rows.causal && l > i ? T(0) : narrow<T>(e * inv);
                        if (mode.check) fold(to_double(widen(p[j])));
                    }
                }
                return o;
            });
        } else if (mode.check) {
            auto read = [&](int l) { fold(to_double(widen(out[l]))); };
            if (s.has_head()) read(s.head_l());
            for (int v = lane; v < s.chunks; v += 32) {
                const uint4 bits = load_vec(static_cast<const T*>(out), s.first(v), wide);
                const T* p = reinterpret_cast<const T*>(&bits);
                #pragma unroll
                for (int j = 0; j < V; ++j) fold(to_double(widen(p[j])));
            }
            if (s.has_tail()) read(s.tail_l());
        }
        if (!mode.check) continue;

        // ---- pass 4: the invariants, on the stored P
        p_sum = warp_sum(p_sum);
        top = warp_worse(top);
        any_visible = __any_sync(0xffffffffu, any_visible);
        finite = __all_sync(0xffffffffu, finite);
        if (!finite) continue;  // non-finite input: plain math passes through, unjudged
        const double row_err = fabs(p_sum - (any_visible ? 1.0 : 0.0));
        double log_err = 0.0, size = 0.0;
        if (top == top) {
            const double threshold = fmax(tol.floor * top, tol.p_min);
            double d_hi = neg_inf(0.0), d_lo = neg_inf(0.0);  // the largest d and -d
            auto identity = [&](int l, T x, double v) {
                if (!(v > threshold) || !shown(l)) return;
                const double z = z_check(x, l);
                if (z == neg_inf(0.0)) return;
                const double lp = log(v), d = lp - z;
                d_hi = worse(d_hi, d);
                d_lo = worse(d_lo, -d);
                size = worse(size, fabs(z) + fabs(lp));
            };
            if (s.has_head()) identity(s.head_l(), hx, to_double(widen(out[s.head_l()])));
            auto vec = [&](const uint4& bits, int v) {
                const uint4 pb = load_vec(static_cast<const T*>(out), s.first(v), wide);
                const T* x = reinterpret_cast<const T*>(&bits);
                const T* p = reinterpret_cast<const T*>(&pb);
                #pragma unroll
                for (int j = 0; j < V; ++j) identity(s.first(v) + j, x[j], to_double(widen(p[j])));
            };
            // Not unrolled over the register cache (the double log would be inlined 64 times):
            // the raw row is re-read, from L1/L2 where this warp just read it.
            for (int v = lane; v < s.chunks; v += 32) vec(load_vec(row, s.first(v), true), v);
            if (s.has_tail()) identity(s.tail_l(), tx, to_double(widen(out[s.tail_l()])));
            d_hi = warp_worse(d_hi);
            d_lo = warp_worse(d_lo);
            size = warp_worse(size);
            if (d_hi != neg_inf(0.0)) log_err = d_hi + d_lo;  // max d - min d
        }
        if (lane == 0) {
            const double log_tol = tol.log_base + tol.log_slope * size;
            const double row_ratio = row_err / tol.row_tol, log_ratio = log_err / log_tol;
            if (row_ratio >= log_ratio || row_ratio != row_ratio)
                record(worst, details, r, row_ratio, row_err, tol.row_tol);
            else
                record(worst, details, r, log_ratio, log_err, log_tol);
        }
    }
}

template <typename T>
__global__ void attn_softmax_backward(const T* __restrict__ dp, const T* __restrict__ p,
                                      const bool* __restrict__ keep,
                                      typename Arith<T>::type* __restrict__ ds_acc,
                                      T* __restrict__ ds, double* __restrict__ stats,
                                      unsigned long long* __restrict__ worst,
                                      double* __restrict__ details, softmax::Rows rows,
                                      double scale, double keep_scale, softmax::Mode mode,
                                      softmax::BackwardTolerance tol) {
    typedef typename Arith<T>::type C;
    constexpr int V = Split<T>::V;
    constexpr int CACHE = 4;  // vectors per lane and operand kept in registers

    const int lane = threadIdx.x & 31;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    const C sc = static_cast<C>(scale);
    const C ks = static_cast<C>(keep_scale);

    for (long long r = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) >> 5;
         r < rows.n; r += warps) {
        const long long base = r * static_cast<long long>(rows.len);
        const T* dpr = dp + base;
        const T* pr = p + base;
        // Past the diagonal of a causal row P is 0, and so is dS: computed there as 0 whatever
        // dP holds, and those entries stay out of r. The check takes P and dP there as 0 without
        // reading them, and dS (read back from ds_acc without `compute`) in its plain sums only,
        // so that a fault stored there fails them, as on the CPU.
        const int i = static_cast<int>(r % rows.seq_q);
        auto past = [&](int l) { return rows.causal && l > i; };
        // With attention dropout, dp is the gradient of the dropped probabilities (its row
        // checksums are observed as read); dS takes the gradient of those before dropout.
        const bool* kr = keep == nullptr ? nullptr : keep + base;
        auto grad = [&](int l, T d) -> C {
            return kr == nullptr ? widen(d) : kr[l] ? widen(d) * ks : C(0);
        };
        T* out = ds == nullptr ? nullptr : ds + base;
        C* acc_out = ds_acc == nullptr ? nullptr : ds_acc + base;
        const Split<T> s(dpr, rows.len, lane);
        const bool wide_p = agree16(dpr, pr);
        const bool wide_out = out != nullptr && agree16(dpr, out);
        const bool cached = s.chunks <= 32 * CACHE;

        T hd = T(), hp = T(), td = T(), tp = T();
        if (s.has_head()) {
            hd = dpr[s.head_l()];
            hp = pr[s.head_l()];
        }
        if (s.has_tail()) {
            td = dpr[s.tail_l()];
            tp = pr[s.tail_l()];
        }
        uint4 bd[CACHE], bp[CACHE];
        if (cached) {
            #pragma unroll
            for (int k = 0; k < CACHE; ++k) {
                const int v = lane + 32 * k;
                if (v < s.chunks) {
                    bd[k] = load_vec(dpr, s.first(v), true);
                    bp[k] = load_vec(pr, s.first(v), wide_p);
                }
            }
        }
        // Calls f(l0, n, dP values, P values, body vector index or -1) for this lane's pieces.
        auto each = [&](auto f) {
            if (s.has_head()) f(s.head_l(), 1, &hd, &hp, -1);
            auto vec = [&](const uint4& d, const uint4& q, int v) {
                f(s.first(v), V, reinterpret_cast<const T*>(&d), reinterpret_cast<const T*>(&q),
                  v);
            };
            if (cached) {
                #pragma unroll
                for (int k = 0; k < CACHE; ++k) {
                    const int v = lane + 32 * k;
                    if (v < s.chunks) vec(bd[k], bp[k], v);
                }
            } else {
                for (int v = lane; v < s.chunks; v += 32)
                    vec(load_vec(dpr, s.first(v), true), load_vec(pr, s.first(v), wide_p), v);
            }
            if (s.has_tail()) f(s.tail_l(), 1, &td, &tp, -1);
        };

        // ---- pass 1: dP's checksums and r = sum P dP
        Acc a;
        a.init(rows.len);
        C r_sum = C(0);
        each([&](int l0, int n, const T* d, const T* q, int) {
            #pragma unroll
            for (int j = 0; j < V; ++j) {
                if (j < n) {
                    if (stats != nullptr) a.add(to_double(widen(d[j])), l0 + j);
                    if (mode.compute && !past(l0 + j)) r_sum += widen(q[j]) * grad(l0 + j, d[j]);
                }
            }
        });
        if (stats != nullptr) {
            warp_allreduce(a);
            if (lane == 0) a.store(stats + 5 * r);
        }
        r_sum = warp_sum(r_sum);

        // ---- pass 2: dS, its two checksums, the scaled store
        double rc = 0.0, sum_p = 0.0, sum_ds = 0.0, abs_terms = 0.0, abs_ds = 0.0, second = 0.0,
               ds_dp = 0.0, abs_ds_dp = 0.0;
        each([&](int l0, int n, const T* d, const T* q, int v) {
            uint4 o;
            T* so = reinterpret_cast<T*>(&o);
            #pragma unroll
            for (int j = 0; j < V; ++j) {
                if (j < n) {
                    const int l = l0 + j;
                    const C dsj = !mode.compute ? acc_out[l]
                                  : past(l) ? C(0) : widen(q[j]) * (grad(l, d[j]) - r_sum);
                    if (mode.compute && acc_out != nullptr) acc_out[l] = dsj;
                    so[j] = narrow<T>(dsj * sc);
                    if (!mode.check) continue;
                    const double dsd = to_double(dsj);
                    sum_ds += dsd;
                    abs_ds += fabs(dsd);
                    if (past(l)) continue;
                    const double pj = to_double(widen(q[j])), dpj = to_double(grad(l, d[j]));
                    const double term = pj * dpj;
                    rc += term;
                    sum_p += pj;
                    abs_terms += fabs(term);
                    second += term * dpj;
                    ds_dp += dsd * dpj;
                    abs_ds_dp += fabs(dsd * dpj);
                }
            }
            if (out == nullptr) return;
            if (v >= 0)
                store_vec(out, l0, wide_out, o);
            else
                out[l0] = so[0];
        });
        if (!mode.check) continue;
        rc = warp_sum(rc);
        sum_p = warp_sum(sum_p);
        sum_ds = warp_sum(sum_ds);
        abs_terms = warp_sum(abs_terms);
        abs_ds = warp_sum(abs_ds);
        second = warp_sum(second);
        ds_dp = warp_sum(ds_dp);
        abs_ds_dp = warp_sum(abs_ds_dp);
        if (lane != 0 || not_finite(sum_p) || not_finite(abs_terms) || not_finite(second))
            continue;  // INF/NaN in P or dP: plain math's dS passes through, unjudged
        const double plain_err = fabs(sum_ds - rc * (1.0 - sum_p));
        const double plain_tol = tol.u * (abs_terms + abs_ds + fabs(rc)) + tol.tiny;
        const double weighted_err = fabs(ds_dp - (second - rc * rc));
        const double weighted_tol = tol.u * (fabs(second) + rc * rc + abs_ds_dp) + tol.tiny;
        double ratio = worse(plain_err / plain_tol, weighted_err / weighted_tol);
        if (not_finite(ratio)) ratio = pos_inf();
        record(worst, details, r, ratio, plain_err, plain_tol);
    }
}
