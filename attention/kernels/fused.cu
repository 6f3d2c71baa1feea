// The fused protected attention core on the GPU: softmax(scale Q K^T + mask) V in tiles, with the
// algorithm, the checks per site and the thresholds of attention/fused.py (the CPU's copy is
// attention/_cpu_fused.py; attention/_cuda_fused.py launches these kernels). Heads are the leading
// axis, (n, L, d) with n = batch * heads; head_dim d <= FDMAX.
//
// Forward: one block of FNT threads per (head, query block of FBR rows); key tiles of FBC. Per
// tile: S = Q_blk K_blk^T with its column checksums predicted from the query block's column
// encoding (fused:S); the masks (causal, key_visible, an additive float64 mask and a per-key
// float64 mask of each batch item, key padding, added to the scaled scores after the S check:
// masked_score); the online softmax; P = exp(z - m) judged entry
// by entry on the softmax invariant log P = z - m, z the masked scores as stored (fused:P);
// l = alpha l + rowsum P (fused:rowsum, against sum P carried in float64); O_acc = alpha O_acc
// + P V with V's row encodings carried through the same rescaling (fused:O_acc, judged on the
// output O_acc / l in the arithmetic type, before it is rounded to T: 16-bit data stage it in the
// workspace ws_o). Attention dropout (thr > 0) as the CPU's: the keep decisions regenerated per
// tile from (seed, head, query, key) (keep_tile, bit for bit attention/dropout_hash.py), the P
// check and l reading P before dropout, the product reading the dropped tile P_d = fl(P ks) keep
// (fault site DROP_), O's carried checksums made from P and keep entry by entry as P_d is, so a
// fault in P_d shows at O_acc. A flagged tile is recomputed once, a flagged block
// (rowsum, O_acc) likewise; the decision is block-uniform (thread 0 settles it through shared
// memory). Tile arithmetic is in Arith<T> (float for half, bfloat16 and float; double for double);
// the tile products S and dP of half and bfloat16 run on tensor cores (tile_product).
//
// Records (rec, float64, (tasks, NSITES, FIELDS), zeroed by the host) and the per-task status
// (int, 0 or -1: a recomputation did not verify) are read by the host once per call. When
// checking, the forward also writes each output row's carried checksums P [V1, Vw, |V|1] / l
// and the sum of its kept probabilities P_d 1 / l (sums, float64, (n, lq, 4): plain, weighted,
// absolute, kept; 0 for a row that sees no key), which attention/fused_final.py checks the
// returned O (fused:out) and dV (fused:dV_out) against, as the CPU kernel's.
//
// Fault injection (tests and campaigns): `fault` is null or a float64 descriptor (F_* fields):
// site, head, row and column of the element in the site's matrix (S, P, the dropped tile DROP_:
// query x key; O_acc: query x head dim; rowsum: query, column 0), the tile step of the sweep after
// which an accumulator is hit (0 for tile sites), the kind (1 set, 2 set the magnitude keeping the
// sign, 3 add, 4 multiply, 5 flip the bit numbered by the value in the element as the tile holds
// it, Arith<T>), whether it persists through recomputations, the value; the kernel counts its hits
// and stores the last old value.
// Tensor cores through CUDA's mma.h, which includes crt/mma.h: a header set without the latter
// (the pip wheel nvidia-cuda-runtime 13.5 ships mma.h alone) cannot use them, and the 16-bit tile
// products then run on FMAs (tile_product). FUSED_WMMA says which.
#if __has_include(<crt/mma.h>)
#include <mma.h>
#define FUSED_WMMA 1
#else
#define FUSED_WMMA 0
#endif

namespace {

constexpr int FBR = 32;    // query rows per block
constexpr int FBC = 32;    // keys per tile
constexpr int FNT = 128;   // threads per block
constexpr int FDMAX = 128; // largest head dimension
constexpr int FPER = FBR * FDMAX / FNT;  // accumulator elements per thread

enum Site { S_, P_, O_, L_, DP_, DS_, DQ_, DK_, DV_, NSITES };
// The fault injector's site of the dropped probabilities (attention._cpu_fused.DROP_): no check
// of its own, no record; the O_acc and dV_acc checks cover it.
constexpr int DROP_ = NSITES;
enum Field { FLAGS, FAILED, RATIO, MAG, TAU, ROW, COL, AFTER, FIELDS };
enum Param { C_S = 0, C_O = 5, C_L = 10, TOL_P = 15, TOL_DS = 19, C_KV = 21, C_Q = 26 };
enum FaultField { F_SITE, F_HEAD, F_ROW, F_COL, F_STEP, F_KIND, F_PERSIST, F_VALUE, F_HITS, F_OLD };

__device__ __forceinline__ bool finite(double x) { return x - x == 0.0; }

// ------------------------------------------------------------------ dropout keep decisions

// attention/dropout_hash.py, bit for bit: element (b, i, j) of an (n, lq, lk) product has the
// counter c = (b lq + i) lk + j + 1 and the hash mix64(seed + c GAMMA) (SplitMix64, arithmetic
// modulo 2^64); it is kept (1) when the hash's top 24 bits reach thr = ceil(p 2^24).
constexpr unsigned long long GAMMA = 0x9E3779B97F4A7C15ULL;
constexpr unsigned long long MIX1 = 0xBF58476D1CE4E5B9ULL;
constexpr unsigned long long MIX2 = 0x94D049BB133111EBULL;
constexpr int KEEP_SHIFT = 64 - 24;

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * MIX1;
    z = (z ^ (z >> 27)) * MIX2;
    return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned char kept(unsigned long long seed, unsigned long long thr,
                                              int b, int i, int j, int lq, int lk) {
    const unsigned long long c =
        (static_cast<unsigned long long>(b) * lq + i) * static_cast<unsigned long long>(lk) + j + 1;
    return (mix64(seed + c * GAMMA) >> KEEP_SHIFT) >= thr ? 1 : 0;
}

// The keep decisions of the tile (query rows [i0, i0 + rows), keys [j0, j0 + cols)) of head b
// into keep; every thread of the block calls it (no barrier).
__device__ void keep_tile(unsigned char (*keep)[FBC], unsigned long long seed,
                          unsigned long long thr, int b, int i0, int rows, int j0, int cols,
                          int lq, int lk) {
    for (int e = threadIdx.x; e < rows * cols; e += FNT) {
        const int r = e / cols, j = e % cols;
        keep[r][j] = kept(seed, thr, b, i0 + r, j0 + j, lq, lk);
    }
}

// ------------------------------------------------------------------ tile products

template <typename T> struct TensorCores {
    static constexpr bool value = false;
};
template <> struct TensorCores<__half> {
    static constexpr bool value = true;
};
template <> struct TensorCores<__nv_bfloat16> {
    static constexpr bool value = true;
};

// tile[r][j] = sum_c left[r][c] right[j][c] (r < rows, j < cols; rows of length d): S = Q K^T
// and dP = dO V^T. Half and bfloat16 with d % 16 == 0 on tensor cores (nvcuda::wmma 16 x 16 x 16,
// float accumulation; the operands staged zero-padded in shared memory, one 16 x 16 block of the
// tile per warp; FUSED_WMMA), everything else with FMAs in the arithmetic type (16-bit products
// are exact in float either way). Every thread of the block calls it; it ends with a barrier.
template <typename T, typename A>
__device__ void tile_product(A (*tile)[FBC], const T* left, const T* right, int rows, int cols,
                             int d) {
#if FUSED_WMMA
    if constexpr (TensorCores<T>::value) {
        static_assert(FBR == 32 && FBC == 32 && FNT == 128, "one 16 x 16 block per warp");
        if (d % 16 == 0) {
            struct alignas(32) Staging {
                T lhs[FBR][FDMAX], rhs[FBC][FDMAX];
            };
            __shared__ Staging st;
            T (*lhs)[FDMAX] = st.lhs;
            T (*rhs)[FDMAX] = st.rhs;
            const T zero = narrow<T>(0.0f);
            for (int e = threadIdx.x; e < FBR * d; e += FNT) {
                const int r = e / d, c = e % d;
                lhs[r][c] = r < rows ? left[r * d + c] : zero;
                rhs[r][c] = r < cols ? right[r * d + c] : zero;
            }
            __syncthreads();
            const int w = threadIdx.x / 32, wr = w / 2, wc = w % 2;
            namespace wmma = nvcuda::wmma;
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
            wmma::fill_fragment(fc, 0.0f);
            for (int k = 0; k < d; k += 16) {
                wmma::load_matrix_sync(fa, &lhs[wr * 16][k], FDMAX);
                wmma::load_matrix_sync(fb, &rhs[wc * 16][k], FDMAX);
                wmma::mma_sync(fc, fa, fb, fc);
            }
            wmma::store_matrix_sync(&tile[wr * 16][wc * 16], fc, FBC, wmma::mem_row_major);
            __syncthreads();
            return;
        }
    }
#endif
    for (int e = threadIdx.x; e < rows * cols; e += FNT) {
        const int r = e / cols, j = e % cols;
        A t = static_cast<A>(0);
        for (int c = 0; c < d; ++c) t += widen(left[r * d + c]) * widen(right[j * d + c]);
        tile[r][j] = t;
    }
    __syncthreads();
}

// ------------------------------------------------------------------ fault injection

struct FaultAt {
    double* f;
    int site, head, row, col, step, kind;
    bool persist;
    double value;
};

__device__ __forceinline__ FaultAt load_fault(double* f) {
    FaultAt a{f, -1, -1, -1, -1, -1, 0, false, 0.0};
    if (f) {
        a.site = static_cast<int>(f[F_SITE]);
        a.head = static_cast<int>(f[F_HEAD]);
        a.row = static_cast<int>(f[F_ROW]);
        a.col = static_cast<int>(f[F_COL]);
        a.step = static_cast<int>(f[F_STEP]);
        a.kind = static_cast<int>(f[F_KIND]);
        a.persist = f[F_PERSIST] != 0.0;
        a.value = f[F_VALUE];
    }
    return a;
}

// x with bit `bit` (0: the least significant mantissa bit) flipped.
__device__ __forceinline__ float flip_bit(float x, int bit) {
    return __uint_as_float(__float_as_uint(x) ^ (1u << bit));
}
__device__ __forceinline__ double flip_bit(double x, int bit) {
    const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(x));
    return __longlong_as_double(static_cast<long long>(bits ^ (1ULL << bit)));
}

// x corrupted as the descriptor says (the element is the one it names): out of line, since the
// hot loops call inject once per element, and inlined there this body multiplied the kernels'
// code and NVRTC's compile time (bench/NOTES.md, GPU 2026-12-04).
template <typename A> __device__ __noinline__ A corrupt(const FaultAt& ft, A x) {
    const double old = to_double(x);
    ft.f[F_HITS] += 1.0;
    ft.f[F_OLD] = old;
    if (ft.kind == 5) return flip_bit(x, static_cast<int>(ft.value));
    double y = ft.value;
    if (ft.kind == 2) y = copysign(ft.value, old);
    if (ft.kind == 3) y = old + ft.value;
    if (ft.kind == 4) y = old * ft.value;
    return static_cast<A>(y);
}

// x, or x corrupted when the descriptor names this element (first: the first computation of it,
// not a recomputation).
template <typename A>
__device__ __forceinline__ A inject(const FaultAt& ft, int site, int head, int row, int col,
                                   int step, bool first, A x) {
    if (ft.site != site || ft.head != head || ft.row != row || ft.col != col || ft.step != step ||
        !(first || ft.persist))
        return x;
    return corrupt(ft, x);
}

// ------------------------------------------------------------------ judging

struct Ratio {
    double ratio, d, tau;
};

// |d| / tau of one vector (attention._cpu_fused._ratio): predicted (p0, p1, p2) against observed
// (o0, o1, o2), c = (c_obs, c_pred, floor, c_mag, safe).
__device__ Ratio ratio3(double p0, double p1, double p2, double o0, double o1, double o2,
                        const double* c) {
    if (!(finite(p0) && finite(p1) && finite(p2))) return Ratio{0.0, 0.0, 1.0};
    const double tau = c[0] * o2 + c[1] * p2 + c[2];
    if (!(finite(o0) && finite(o1) && finite(o2)))
        return p2 >= c[4] ? Ratio{0.0, 0.0, 1.0} : Ratio{pos_inf(), pos_inf(), tau};
    const double d = fmax(fabs(p0 - o0), fabs(p1 - o1));
    const double mag = o2 / (c[3] * p2 + c[2]);
    const double r = d / tau;
    return Ratio{r > mag ? r : mag, d, tau};
}

// The element a weighted and a plain checksum difference point at (weights (i + 1) / len), or -1.
__device__ int locate(double p0, double p1, double o0, double o1, int len) {
    const double d0 = p0 - o0;
    if (d0 == 0.0) return -1;
    const double pos = len * (p1 - o1) / d0 - 1.0;
    if (!finite(pos)) return -1;
    const double r = floor(pos + 0.5);
    return fabs(pos - r) <= 0.25 && r >= 0.0 && r < len ? static_cast<int>(r) : -1;
}

// Per-vector verdicts of one check, then thread 0's settlement (attention._cpu_fused._settle).
struct Votes {
    double ratio[FBR > FBC ? FBR : FBC], d[FBR > FBC ? FBR : FBC], tau[FBR > FBC ? FBR : FBC];
    int pos[FBR > FBC ? FBR : FBC];
    int code;
};

__device__ __forceinline__ void vote(Votes& vt, int v, Ratio r, int pos) {
    vt.ratio[v] = r.ratio == r.ratio ? r.ratio : pos_inf();
    vt.d[v] = r.d;
    vt.tau[v] = r.tau;
    vt.pos[v] = pos;
}

__device__ int settle(double* rec, int site, int attempt, double ratio, bool correct, double d,
                      double tau, int v, int pos, int row0, int col0, bool by_rows) {
    double* r = rec + site * FIELDS;
    if (attempt > 0) r[AFTER] = fmax(r[AFTER], ratio);
    if (ratio <= 1.0) return 0;
    if (attempt > 0) {
        r[FAILED] = 1.0;
        return -1;
    }
    r[FLAGS] += 1.0;
    if (ratio > r[RATIO] || r[FLAGS] == 1.0) {
        r[RATIO] = ratio;
        r[MAG] = d;
        r[TAU] = tau;
        const int rr = by_rows ? v : pos, cc = by_rows ? pos : v;
        r[ROW] = rr >= 0 ? row0 + rr : -1.0;
        r[COL] = cc >= 0 && col0 >= 0 ? col0 + cc : -1.0;
    }
    return correct ? 1 : 0;
}

// Every thread: after the votes of vectors [0, n), 0 go on, 1 recompute, -1 give up.
__device__ int settle_block(Votes& vt, double* rec, int site, int attempt, bool correct, int n,
                            bool by_rows, int row0, int col0) {
    __syncthreads();
    if (threadIdx.x == 0) {
        int w = 0;
        double worst = 0.0;
        for (int v = 0; v < n; ++v)
            if (vt.ratio[v] > worst) {
                worst = vt.ratio[v];
                w = v;
            }
        vt.code = settle(rec, site, attempt, worst, correct, vt.d[w], vt.tau[w], w, vt.pos[w],
                         row0, col0, by_rows);
    }
    __syncthreads();
    return vt.code;
}

// A backward tile step (rows x cols at (i0, j0)), checked, and made once more when flagged and
// correct asks it: make(a) computes it (faults are injected on the first making, a == 0), then
// each thread r below rows calls cast(r), its vote on row r. Returns settle_block's last answer:
// 0 go on, -1 give up (also 0 without check). The forward's tile loop spells its two steps
// out: through this function, its float32 build spilled 160 bytes (ptxas at sm_90,
// scripts/kernel_resources.py).
template <typename Make, typename Cast>
__device__ __forceinline__ int checked_step(Votes& vt, double* rec, int site, bool check,
                                            bool correct, int rows, int i0, int j0, Make make,
                                            Cast cast) {
    for (int a = 0;; ++a) {
        __syncthreads();
        make(a);
        if (!check) return 0;
        __syncthreads();
        if (threadIdx.x < rows) cast(threadIdx.x);
        const int st = settle_block(vt, rec, site, a, correct, rows, true, i0, j0);
        if (st != 1) return st;  // a second making settles 0 or -1
    }
}

// Faults at site into a tile product (rows x cols) of head b at (i0, j0).
template <typename A>
__device__ __forceinline__ void inject_tile(A (*tile)[FBC], const FaultAt& ft, int site, int b,
                                            int i0, int j0, int rows, int cols, bool armed) {
    for (int e = threadIdx.x; e < rows * cols; e += FNT) {
        const int r = e / cols, j = e % cols;
        tile[r][j] = inject(ft, site, b, i0 + r, j0 + j, 0, armed, tile[r][j]);
    }
}

// One entry of the softmax invariant (judged on the logarithm; the CPU's _probs_excess makes the
// exponential again instead), pv the stored P and
// x = z - m: 0 when it holds, else its ratio (at least 1 + 2^-20, INF where the logarithm cannot
// measure it). t = (base, slope, flush, tiny).
template <typename A> __device__ double probs_bad(A pv, A x, const double* t) {
    const A tiny = static_cast<A>(t[3]), flush = static_cast<A>(t[2]);
    if (pv != pv) return pos_inf();
    if (pv >= tiny) {
        const double lp = to_double(log_of(pv)), xd = to_double(x);
        const double tol = t[0] + t[1] * fabs(xd);
        const double e = fabs(lp - xd) / tol;
        if (e <= 1.0 && !(x < flush - static_cast<A>(1))) return 0.0;
        return e == e ? fmax(e, 1.0 + 0x1p-20) : pos_inf();
    }
    return pv < static_cast<A>(0) || x >= flush + static_cast<A>(1) ? pos_inf() : 0.0;
}

// Row r of the probabilities p (rows x cols) on the softmax invariant, z the masked scores as
// stored and mr the row's maximum (forward) or log-sum-exp (backward; -inf: a row that sees no key,
// whose entries must be 0): a vote of vector r, located at its worst entry.
template <typename A>
__device__ void vote_probs_row(Votes& votes, A (*p)[FBC], A (*z)[FBC], A mr, int r, int cols,
                               const double* tol) {
    const A zero = static_cast<A>(0);
    double worst = 0.0;
    int at = -1;
    for (int j = 0; j < cols; ++j) {
        const A pv = p[r][j];
        const double e = mr == neg_inf(zero) ? (pv == zero ? 0.0 : pos_inf())
                                             : probs_bad(pv, z[r][j] - mr, tol);
        if (e > worst) {
            worst = e;
            at = j;
        }
    }
    vote(votes, r, Ratio{worst, worst, 1.0}, at);
}

// The masked, scaled score z of one entry: -inf where hidden (causality, key_visible), else
// P = exp(z - m[r]) of a tile (rows with m[r] = -inf: 0), with the faults at P_.
template <typename A>
__device__ __forceinline__ void probs_tile(A (*p)[FBC], A (*z)[FBC], const A* m,
                                           const FaultAt& ft, int b, int i0, int j0, int rows,
                                           int cols, bool armed) {
    const A zero = static_cast<A>(0);
    for (int e = threadIdx.x; e < rows * cols; e += FNT) {
        const int r = e / cols, j = e % cols;
        const A pv = m[r] == neg_inf(zero) ? zero : exp_of(z[r][j] - m[r]);
        p[r][j] = inject(ft, P_, b, i0 + r, j0 + j, 0, armed, pv);
    }
}

// sc * s plus the additive mask's entry add_row[j] and the per-key mask's key_row[j] (either null:
// none), the two summed in double first (as a mask folded from both holds them), that sum added
// in double (z widened through its bits: -ftz would flush a subnormal z) and rounded to A once, as
// attention/_cpu_fused._mask. The S check has already judged s.
template <typename A>
__device__ __forceinline__ A masked_score(A s, A sc, bool seen, const double* add_row,
                                          const double* key_row, int j) {
    if (!seen) return neg_inf(sc);
    const A z = s * sc;
    if (!add_row && !key_row) return z;
    const double m = !key_row ? add_row[j] : !add_row ? key_row[j] : add_row[j] + key_row[j];
    return static_cast<A>(to_double(z) + m);
}

// The additive mask of head b: add (1 or n, lq, lk) float64, stride 0 or lq * lk; null: none.
__device__ __forceinline__ const double* head_mask(const double* add, long long stride, int b) {
    return add ? add + stride * b : nullptr;
}

// Head b's row of the per-key mask keys (m, lk) float64, shared by key_heads consecutive heads
// (the heads of one batch item); null: none.
__device__ __forceinline__ const double* head_keys(const double* keys, int key_heads, int b,
                                                   int lk) {
    return keys ? keys + static_cast<long long>(b / key_heads) * lk : nullptr;
}

// Row i of a head's additive mask from key j0 on (null: none).
__device__ __forceinline__ const double* mask_row(const double* addh, int i, int lk, int j0) {
    return addh ? addh + static_cast<long long>(i) * lk + j0 : nullptr;
}

// ------------------------------------------------------------------ forward

template <typename A> struct Forward {
    double qenc[3][FDMAX];
    alignas(32) A s[FBR][FBC];  // S, then z, then (dropout) the dropped tile P_d
    A p[FBR][FBC];
    unsigned char keep[FBR][FBC];  // dropout: the tile's keep decisions
    A m[FBR], l[FBR], alpha[FBR];
    double oc[FBR][5];  // O's carried checksums, sum P (the rowsum check), sum P_d
    Votes votes;
};

}  // namespace

// Row encodings (rows, 3) of x (rows, d): plain, weighted by (c + 1) / d, absolute sums.
template <typename T>
__global__ void attn_fused_encode_rows(const T* x, long long rows, int d, double* out) {
    for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; r < rows;
         r += static_cast<long long>(gridDim.x) * blockDim.x) {
        double s0 = 0.0, s1 = 0.0, s2 = 0.0;
        for (int c = 0; c < d; ++c) {
            const double v = to_double(x[r * d + c]);
            s0 += v;
            s1 += v * (static_cast<double>(c + 1) / d);
            s2 += fabs(v);
        }
        out[3 * r] = s0;
        out[3 * r + 1] = s1;
        out[3 * r + 2] = s2;
    }
}

template <typename T>
__global__ void __launch_bounds__(FNT)
attn_fused_forward(const T* q, const T* k, const T* v, const double* ve, const bool* visible,
                   const double* add, long long add_stride, const double* keys,
                   int key_heads, int lq, int lk, int d, double scale,
                   int causal, int check, int correct, unsigned long long seed,
                   unsigned long long thr, double ks_in, const double* params, double* fault,
                   typename Arith<T>::type* ws_o, T* out, typename Arith<T>::type* lse,
                   typename Arith<T>::type* lse_lo, double* sums, double* rec, int* status) {
    typedef typename Arith<T>::type A;
    __shared__ Forward<A> sh;
    const int tid = threadIdx.x;
    const int nqb = (lq + FBR - 1) / FBR;
    const long long task = blockIdx.x;
    const int b = static_cast<int>(task / nqb), i0 = static_cast<int>(task % nqb) * FBR;
    const int i1 = min(i0 + FBR, lq), rows = i1 - i0;
    const T* qb = q + (static_cast<long long>(b) * lq + i0) * d;
    const T* kb = k + static_cast<long long>(b) * lk * d;
    const T* vb = v + static_cast<long long>(b) * lk * d;
    const double* vb_enc = ve + static_cast<long long>(b) * lk * 3;
    const bool* vis = visible ? visible + static_cast<long long>(b) * lk : nullptr;
    const double* addh = head_mask(add, add_stride, b);
    const double* keyh = head_keys(keys, key_heads, b, lk);
    double* rt = rec + task * NSITES * FIELDS;
    // the fault descriptor in shared memory, not in registers and a stack copy: the per-tile
    // partial sums of O_acc take one register more, and the double build spilled 40 bytes
    __shared__ FaultAt ft;
    if (tid == 0) ft = load_fault(fault);
    __syncthreads();
    const A sc = static_cast<A>(scale), zero = static_cast<A>(0), ks = static_cast<A>(ks_in);
    const bool drop = thr > 0;
    if (check)
        for (int c = tid; c < d; c += FNT) {
            double s0 = 0.0, s1 = 0.0, s2 = 0.0;
            for (int r = 0; r < rows; ++r) {
                const double x = to_double(qb[r * d + c]), w = static_cast<double>(r + 1) / rows;
                s0 += x;
                s1 += w * x;
                s2 += fabs(x);
            }
            sh.qenc[0][c] = s0;
            sh.qenc[1][c] = s1;
            sh.qenc[2][c] = s2;
        }
    const int jend = causal ? min(lk, i1) : lk;
    A acc[FPER];
    for (int attempt = 0; attempt < 2; ++attempt) {
#pragma unroll
        for (int e = 0; e < FPER; ++e) acc[e] = zero;
        if (tid < rows) {
            sh.m[tid] = neg_inf(zero);
            sh.l[tid] = zero;
            for (int f = 0; f < 5; ++f) sh.oc[tid][f] = 0.0;
        }
        int st = 0;
        for (int j0 = 0, step = 0; j0 < jend; j0 += FBC, ++step) {
            const int cols = min(FBC, jend - j0);
            for (int a = 0; a < 2; ++a) {  // ---- S, checked by its column checksums
                __syncthreads();
                tile_product(sh.s, qb, kb + static_cast<long long>(j0) * d, rows, cols, d);
                inject_tile(sh.s, ft, S_, b, i0, j0, rows, cols, a == 0 && attempt == 0);
                if (!check) break;
                __syncthreads();
                if (tid < cols) {
                    const int j = tid;
                    double p0 = 0.0, p1 = 0.0, p2 = 0.0, o0 = 0.0, o1 = 0.0, o2 = 0.0;
                    for (int c = 0; c < d; ++c) {
                        const double y = to_double(kb[(j0 + j) * d + c]);
                        p0 += y * sh.qenc[0][c];
                        p1 += y * sh.qenc[1][c];
                        p2 += fabs(y) * sh.qenc[2][c];
                    }
                    for (int r = 0; r < rows; ++r) {
                        const double x = to_double(sh.s[r][j]);
                        o0 += x;
                        o1 += x * (static_cast<double>(r + 1) / rows);
                        o2 += fabs(x);
                    }
                    vote(sh.votes, j, ratio3(p0, p1, p2, o0, o1, o2, params + C_S),
                         locate(p0, p1, o0, o1, rows));
                }
                st = settle_block(sh.votes, rt, S_, a, correct, cols, false, i0, j0);
                if (st != 1) break;
            }
            if (st < 0) break;
            __syncthreads();
            if (tid < rows) {  // ---- mask, scale, running maximum
                const int r = tid;
                const int lim = causal ? max(0, min(cols, i0 + r - j0 + 1)) : cols;
                const double* add_row = mask_row(addh, i0 + r, lk, j0);
                const double* key_row = keyh ? keyh + j0 : nullptr;
                A mx = sh.m[r];
                for (int j = 0; j < cols; ++j) {
                    const A z = masked_score(sh.s[r][j], sc, j < lim && (!vis || vis[j0 + j]),
                                             add_row, key_row, j);
                    sh.s[r][j] = z;
                    mx = z > mx ? z : mx;
                }
                sh.alpha[r] = mx > neg_inf(zero) ? exp_of(sh.m[r] - mx) : static_cast<A>(1);
                sh.m[r] = mx;
            }
            for (int a = 0; a < 2; ++a) {  // ---- P, checked by the softmax invariant
                __syncthreads();
                probs_tile(sh.p, sh.s, sh.m, ft, b, i0, j0, rows, cols, a == 0 && attempt == 0);
                if (!check) break;
                __syncthreads();
                if (tid < rows)
                    vote_probs_row(sh.votes, sh.p, sh.s, sh.m[tid], tid, cols, params + TOL_P);
                st = settle_block(sh.votes, rt, P_, a, correct, rows, true, i0, j0);
                if (st != 1) break;
            }
            if (st < 0) break;
            __syncthreads();
            if (drop) {  // ---- the dropped tile P_d = fl(P ks) keep, into sh.s (z is done with)
                keep_tile(sh.keep, seed, thr, b, i0, rows, j0, cols, lq, lk);
                for (int e = tid; e < rows * cols; e += FNT) {
                    const int r = e / cols, j = e % cols;
                    sh.s[r][j] = inject(ft, DROP_, b, i0 + r, j0 + j, 0, attempt == 0,
                                        sh.p[r][j] * ks * static_cast<A>(sh.keep[r][j]));
                }
                __syncthreads();
            }
            if (tid < rows) {  // ---- l, and the float64 checksums carried beside O
                const int r = tid;
                A t = zero;
                for (int j = 0; j < cols; ++j) t += sh.p[r][j];
                sh.l[r] = inject(ft, L_, b, i0 + r, 0, step, attempt == 0,
                                 sh.alpha[r] * sh.l[r] + t);
                if (check) {  // with dropout made from P and keep as P_d is, not read from it
                    const double al = to_double(sh.alpha[r]);
                    double t0 = 0.0, t1 = 0.0, t2 = 0.0, t3 = 0.0, t4 = 0.0;
                    for (int j = 0; j < cols; ++j) {
                        const double x = to_double(sh.p[r][j]);
                        const double y =
                            drop ? to_double(sh.p[r][j] * ks) * static_cast<double>(sh.keep[r][j])
                                 : x;
                        const double* e = vb_enc + 3 * (j0 + j);
                        t0 += y * e[0];
                        t1 += y * e[1];
                        t2 += fabs(y) * e[2];
                        t3 += x;
                        t4 += y;
                    }
                    sh.oc[r][0] = sh.oc[r][0] * al + t0;
                    sh.oc[r][1] = sh.oc[r][1] * al + t1;
                    sh.oc[r][2] = sh.oc[r][2] * al + t2;
                    sh.oc[r][3] = sh.oc[r][3] * al + t3;
                    sh.oc[r][4] = sh.oc[r][4] * al + t4;
                }
            }
#pragma unroll
            for (int e = 0; e < FPER; ++e) {  // ---- O_acc = alpha O_acc + P V (P_d V)
                const int idx = tid + e * FNT, r = idx / d, c = idx % d;
                if (r < rows) {
                    // the tile's product summed on its own, then added once: the thresholds'
                    // rounding model (2 roundings a tile); summed into the running accumulator
                    // key by key, one dominant key lost every later addend (~L u, flagged)
                    A t = zero;
                    const A* pr = drop ? sh.s[r] : sh.p[r];
                    for (int j = 0; j < cols; ++j) t += pr[j] * widen(vb[(j0 + j) * d + c]);
                    acc[e] = inject(ft, O_, b, i0 + r, c, step, attempt == 0,
                                    sh.alpha[r] * acc[e] + t);
                }
            }
        }
        if (st < 0) break;
        __syncthreads();
        if (check) {  // ---- rowsum: l against the carried sum P
            if (tid < rows) {
                const double x = to_double(sh.l[tid]), y = sh.oc[tid][3];
                vote(sh.votes, tid, ratio3(y, y, y, x, x, x, params + C_L), -1);
            }
            st = settle_block(sh.votes, rt, L_, attempt, correct, rows, true, i0, -1);
            if (st < 0) break;
            if (st == 1) continue;
        }
        T* ob = out + (static_cast<long long>(b) * lq + i0) * d;
        // the output in the arithmetic type, which the check judges (16-bit data: staged in
        // ws_o, as the backward's accumulators; else out itself), then rounded to T
        A* wo = ws_o ? ws_o + (static_cast<long long>(b) * lq + i0) * d
                     : reinterpret_cast<A*>(ob);
#pragma unroll
        for (int e = 0; e < FPER; ++e) {  // ---- out = O_acc / l; m + log l as lse + lse_lo
            const int idx = tid + e * FNT, r = idx / d, c = idx % d;
            if (r < rows) {
                const A lr = sh.l[r];
                // a row without a visible key (m = -inf) is 0, whatever a fault made l
                const bool sees = lr > zero && sh.m[r] > neg_inf(zero);
                ob[r * d + c] = narrow<T>(sees ? acc[e] / lr : zero);
            }
        }
        // 16-bit data: the same values unrounded into ws_o, in a loop of their own (stored in the
        // loop above, they made ptxas spill 876 bytes)
        if (sizeof(T) < sizeof(A) && check && ws_o) {
#pragma unroll
            for (int e = 0; e < FPER; ++e) {
                const int idx = tid + e * FNT, r = idx / d, c = idx % d;
                if (r < rows) {
                    const A lr = sh.l[r];
                    const bool sees = lr > zero && sh.m[r] > neg_inf(zero);
                    wo[r * d + c] = sees ? acc[e] / lr : zero;
                }
            }
        }
        if (tid < rows) {
            const A lr = sh.l[tid];
            A* lb = lse + static_cast<long long>(b) * lq + i0;
            A* lob = lse_lo + static_cast<long long>(b) * lq + i0;
            if (lr > zero && sh.m[tid] > neg_inf(zero)) {
                for (int f = 0; f < 5; ++f)
                    if (f != 3) sh.oc[tid][f] /= to_double(lr);
                // lse rounded, lse_lo the rest (an exact two-sum in double), as
                // attention/_cpu_fused._finish: lse alone loses log l where m dwarfs it
                const double mr = to_double(sh.m[tid]), ll = log(to_double(lr));
                lb[tid] = static_cast<A>(mr + ll);
                const double hi = to_double(lb[tid]);
                lob[tid] = static_cast<A>(fabs(mr) >= fabs(ll) ? (mr - hi) + ll : (ll - hi) + mr);
            } else {
                for (int f = 0; f < 5; ++f)
                    if (f != 3) sh.oc[tid][f] = 0.0;
                lb[tid] = neg_inf(zero);
                lob[tid] = neg_inf(zero);
            }
        }
        __syncthreads();
        if (check) {  // ---- the output's row checksums against the carried ones
            if (tid < rows) {
                double o0 = 0.0, o1 = 0.0, o2 = 0.0;
                for (int c = 0; c < d; ++c) {
                    const double x = to_double(wo[tid * d + c]);
                    o0 += x;
                    o1 += x * (static_cast<double>(c + 1) / d);
                    o2 += fabs(x);
                }
                const double* p = sh.oc[tid];
                vote(sh.votes, tid, ratio3(p[0], p[1], p[2], o0, o1, o2, params + C_O),
                     locate(p[0], p[1], o0, o1, d));
                double* sr = sums + (static_cast<long long>(b) * lq + i0 + tid) * 4;
                for (int f = 0; f < 3; ++f) sr[f] = p[f];  // for the final check, fused:out
                sr[3] = p[4];  // for fused:dV_out: the kept probabilities' row sum
            }
            st = settle_block(sh.votes, rt, O_, attempt, correct, rows, true, i0, 0);
            if (st == 1) continue;
        }
        if (tid == 0) status[task] = st;
        return;
    }
    if (tid == 0) status[task] = -1;
}

// ------------------------------------------------------------------ backward
//
// FlashAttention-2 order in two kernels, so that no accumulator is shared between blocks: one
// block per (head, key block) sweeps the query blocks for dK and dV (attn_fused_backward_kv), one
// per (head, query block) sweeps the key tiles for dQ (attn_fused_backward_q); each recomputes S, P
// = exp(z - lse), dP = dO V^T and dS = P (dP - D) per tile with their checks (backward_tile), and
// checks its accumulators against the row encodings of the other operand carried beside them
// (fused:dK_acc, fused:dV_acc, fused:dQ_acc). With dropout (FlashAttention-2's): dV += P_d^T dO,
// P_d = fl(P ks) keep the dropped tile (the dK/dV kernel's fault site DROP_; dV's checksum columns
// made from P and keep), dS = P (fl(dP ks) keep - D). The unscaled accumulators are judged as the
// CPU judges them, staged through a workspace of the arithmetic type; the outputs are then scaled
// and rounded to T. Tile sites are injected by the key-block kernel only.

namespace {

template <typename A> struct Backward {
    double kenc[3][FDMAX], venc[3][FDMAX];
    alignas(32) A s[FBR][FBC];  // S, then z, then dS
    A p[FBR][FBC];
    alignas(32) A dp[FBR][FBC];  // dP, then (dK/dV kernel, dropout) the dropped tile P_d
    unsigned char keep[FBR][FBC];  // dropout: the tile's keep decisions
    double acc_enc[FBR > FBC ? FBR : FBC][3];  // the checksum columns beside the accumulator
    Votes votes;
    // head b's per-key mask (lk), or null: in shared memory, not a register live through every
    // tile (as a kernel argument of backward_tile it spilled 24-52 bytes)
    const double* keys;
};

// Column encodings of the key block's rows [j0, j0 + cols) of K and V (weights (j + 1) / cols).
template <typename T, typename A>
__device__ void encode_key_block(Backward<A>& sh, const T* kh, const T* vh, int j0, int cols,
                                 int d) {
    for (int c = threadIdx.x; c < d; c += FNT) {
        double k0 = 0.0, k1 = 0.0, k2 = 0.0, v0 = 0.0, v1 = 0.0, v2 = 0.0;
        for (int j = 0; j < cols; ++j) {
            const double w = static_cast<double>(j + 1) / cols;
            const double x = to_double(kh[(j0 + j) * d + c]), y = to_double(vh[(j0 + j) * d + c]);
            k0 += x;
            k1 += w * x;
            k2 += fabs(x);
            v0 += y;
            v1 += w * y;
            v2 += fabs(y);
        }
        sh.kenc[0][c] = k0;
        sh.kenc[1][c] = k1;
        sh.kenc[2][c] = k2;
        sh.venc[0][c] = v0;
        sh.venc[1][c] = v1;
        sh.venc[2][c] = v2;
    }
}

// Row r's checksums of a tile product x (rows x cols) against x_r . enc (x the tile's left
// operand row, enc the right operand block's column encoding): a vote of vector r.
template <typename T, typename A>
__device__ void vote_product_row(Votes& votes, A (*tile)[FBC], const T* left,
                                 double (*enc)[FDMAX], int r, int cols, int d,
                                 const double* coef) {
    double p0 = 0.0, p1 = 0.0, p2 = 0.0, o0 = 0.0, o1 = 0.0, o2 = 0.0;
    for (int c = 0; c < d; ++c) {
        const double y = to_double(left[r * d + c]);
        p0 += y * enc[0][c];
        p1 += y * enc[1][c];
        p2 += fabs(y) * enc[2][c];
    }
    for (int j = 0; j < cols; ++j) {
        const double x = to_double(tile[r][j]);
        o0 += x;
        o1 += x * (static_cast<double>(j + 1) / cols);
        o2 += fabs(x);
    }
    vote(votes, r, ratio3(p0, p1, p2, o0, o1, o2, coef), locate(p0, p1, o0, o1, cols));
}

// One tile (query rows [i0, i0 + rows), keys [j0, j0 + cols)) of head b: S, P, dP and dS into sh.s
// (dS), sh.p, sh.dp, each checked and recomputed once when flagged. qh, kh, vh, doh, lseh, loh (the
// log-sum-exp as lse + lse_lo), ddh: head b's rows; addh: head b's additive mask (lq x lk), or
// null; sh.keys: head b's per-key mask (lk), or null. first: the first computation of the tile
// in this kernel (faults that do not persist hit it
// only); tiles: inject at tile sites. Dropout when thr > 0 (seed, thr: keep_tile's; ks = 1 / (1 -
// p)): the tile's keep decisions into sh.keep, and FlashAttention-2's dS = P (fl(dP ks) keep - D),
// the dropped dP made entry by entry from sh.dp and sh.keep, never stored. Returns 0, or -1 when a
// recomputation did not verify. Ends with a barrier.
template <typename T, typename A>
__device__ int backward_tile(Backward<A>& sh, const T* qh, const T* kh, const T* vh,
                             const T* doh, const A* lseh, const A* loh, const A* ddh,
                             const bool* vis, const double* addh,
                             int lq, int lk, int i0, int rows, int j0,
                             int cols, int d, A sc, bool causal, bool check, bool correct,
                             unsigned long long seed, unsigned long long thr, A ks,
                             const double* params, const FaultAt& ft, bool tiles, bool first,
                             double* rt, int b) {
    const int tid = threadIdx.x;
    const T* qi = qh + static_cast<long long>(i0) * d;
    const T* doi = doh + static_cast<long long>(i0) * d;
    const FaultAt none = load_fault(nullptr);
    const FaultAt& f = tiles ? ft : none;
    const bool drop = thr > 0;
    if (drop) {
        __syncthreads();  // the previous tile's readers are done with sh.keep
        keep_tile(sh.keep, seed, thr, b, i0, rows, j0, cols, lq, lk);
    }
    // A product left right^T of the tile into out (S = Q K^T, dP = dO V^T), with the faults at
    // site, checked by its row checksums against enc, the right operand block's encoding.
    auto checked_product = [&](A (*out)[FBC], const T* left, const T* right,
                               double (*enc)[FDMAX], int site) {
        return checked_step(sh.votes, rt, site, check, correct, rows, i0, j0, [&](int a) {
            tile_product(out, left, right + static_cast<long long>(j0) * d, rows, cols, d);
            inject_tile(out, f, site, b, i0, j0, rows, cols, a == 0 && first);
        }, [&](int r) {
            vote_product_row(sh.votes, out, left, enc, r, cols, d, params + C_S);
        });
    };
    if (checked_product(sh.s, qi, kh, sh.kenc, S_) < 0) return -1;  // ---- S
    __syncthreads();
    if (tid < rows) {  // ---- mask and scale, then z - lse (rows that see a key)
        const int r = tid;
        const int lim = causal ? max(0, min(cols, i0 + r - j0 + 1)) : cols;
        const double* add_row = mask_row(addh, i0 + r, lk, j0);
        const double* key_row = sh.keys ? sh.keys + j0 : nullptr;
        const A hi = lseh[i0 + r];
        const A shift = hi == neg_inf(hi) ? static_cast<A>(0) : hi;
        for (int j = 0; j < cols; ++j)
            sh.s[r][j] = masked_score(sh.s[r][j], sc, j < lim && (!vis || vis[j0 + j]), add_row,
                                      key_row, j) - shift;
    }
    // ---- P = exp((z - lse) - lse_lo), checked by the softmax invariant
    if (checked_step(sh.votes, rt, P_, check, correct, rows, i0, j0, [&](int a) {
            probs_tile(sh.p, sh.s, loh + i0, f, b, i0, j0, rows, cols, a == 0 && first);
        }, [&](int r) {
            vote_probs_row(sh.votes, sh.p, sh.s, loh[i0 + r], r, cols, params + TOL_P);
        }) < 0)
        return -1;
    if (checked_product(sh.dp, doi, vh, sh.venc, DP_) < 0) return -1;  // ---- dP = dO V^T
    // ---- dS = P (dP - D), checked by the backward invariants
    if (checked_step(sh.votes, rt, DS_, check, correct, rows, i0, j0, [&](int a) {
            for (int e = tid; e < rows * cols; e += FNT) {
                const int r = e / cols, j = e % cols;
                // a select, not a product with keep: dP' ks may overflow, and INF * 0 is NaN
                const A g = !drop           ? sh.dp[r][j]
                            : sh.keep[r][j] ? sh.dp[r][j] * ks
                                            : static_cast<A>(0);
                const A x = sh.p[r][j] * (g - ddh[i0 + r]);
                sh.s[r][j] = inject(f, DS_, b, i0 + r, j0 + j, 0, a == 0 && first, x);
            }
        }, [&](int r) {
            const double dr = to_double(ddh[i0 + r]);
            double r1 = 0.0, r2 = 0.0, v = 0.0, s = 0.0, sw = 0.0, mag = 0.0, magw = 0.0;
            double gabs = 0.0;
            for (int j = 0; j < cols; ++j) {
                const double pj = to_double(sh.p[r][j]);
                const double g = !drop ? to_double(sh.dp[r][j])
                                 : sh.keep[r][j] ? to_double(sh.dp[r][j] * ks) : 0.0;
                const double x = to_double(sh.s[r][j]);
                r1 += pj * g;
                r2 += pj;
                v += pj * g * g;
                s += x;
                sw += x * g;
                const double m = pj * (fabs(g) + fabs(dr));
                mag += m;
                magw += m * fabs(g);
                gabs += fabs(g);
            }
            // The floor, tol[1] (the smallest normal number), per entry: CuPy compiles with
            // -ftz=true, so a float32 dS entry whose exact value is below it (with g or g - D
            // flushed too: under twice it) is stored as 0. In a tile of keys far below the row's
            // top every entry can be one, and the magnitude term is then as small.
            const double* tol = params + TOL_DS;
            const double tau = tol[0] * mag + 2.0 * tol[1] * cols;
            const double tauw = tol[0] * magw + 2.0 * tol[1] * gabs + tol[1];
            const double d1 = fabs(s - (r1 - dr * r2)), d2 = fabs(sw - (v - dr * r1));
            const double e1 = d1 / tau, e2 = d2 / tauw;
            const double e = e1 != e1 || e2 != e2 ? pos_inf() : fmax(e1, e2);
            vote(sh.votes, r, Ratio{e, d1, tau}, -1);
        }) < 0)
        return -1;
    __syncthreads();
    return 0;
}

// The staged accumulator rows [0, n) (ws, head dim d) against the carried encodings: votes.
template <typename A>
__device__ void vote_accumulator(Votes& votes, const A* ws, double (*enc)[3], int n, int d,
                                 const double* coef) {
    const int r = threadIdx.x;
    if (r >= n) return;
    double o0 = 0.0, o1 = 0.0, o2 = 0.0;
    for (int c = 0; c < d; ++c) {
        const double x = to_double(ws[r * d + c]);
        o0 += x;
        o1 += x * (static_cast<double>(c + 1) / d);
        o2 += fabs(x);
    }
    const double* p = enc[r];
    vote(votes, r, ratio3(p[0], p[1], p[2], o0, o1, o2, coef), locate(p[0], p[1], o0, o1, d));
}

}  // namespace

// D = rowsum(dO * O) per row (float64 sums, stored in the arithmetic type).
template <typename T>
__global__ void attn_fused_delta(const T* d_out, const T* o, long long rows, int d,
                                 typename Arith<T>::type* out) {
    for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; r < rows;
         r += static_cast<long long>(gridDim.x) * blockDim.x) {
        double t = 0.0;
        for (int c = 0; c < d; ++c) t += to_double(d_out[r * d + c]) * to_double(o[r * d + c]);
        out[r] = static_cast<typename Arith<T>::type>(t);
    }
}

template <typename T>
__global__ void __launch_bounds__(FNT)
attn_fused_backward_kv(const T* q, const T* k, const T* v, const T* d_out,
                       const typename Arith<T>::type* lse,
                       const typename Arith<T>::type* lse_lo, const typename Arith<T>::type* dd,
                       const double* qe, const double* doe, const bool* visible,
                       const double* add, long long add_stride, const double* keys,
                       int key_heads, int lq, int lk,
                       int d, double scale, int causal, int check, int correct,
                       unsigned long long seed, unsigned long long thr, double ks_in,
                       const double* params, double* fault, typename Arith<T>::type* ws_k,
                       typename Arith<T>::type* ws_v, T* dk, T* dv, double* kv_sums,
                       double* rec, int* status) {
    typedef typename Arith<T>::type A;
    __shared__ Backward<A> sh;
    __shared__ double dv_enc[FBC][3];
    const int tid = threadIdx.x;
    const int nkb = (lk + FBC - 1) / FBC;
    const long long task = blockIdx.x;
    const int b = static_cast<int>(task / nkb), j0 = static_cast<int>(task % nkb) * FBC;
    const int cols = min(FBC, lk - j0);
    const T* qh = q + static_cast<long long>(b) * lq * d;
    const T* kh = k + static_cast<long long>(b) * lk * d;
    const T* vh = v + static_cast<long long>(b) * lk * d;
    const T* doh = d_out + static_cast<long long>(b) * lq * d;
    const A* lseh = lse + static_cast<long long>(b) * lq;
    const A* loh = lse_lo + static_cast<long long>(b) * lq;
    const A* ddh = dd + static_cast<long long>(b) * lq;
    const bool* vis = visible ? visible + static_cast<long long>(b) * lk : nullptr;
    const double* addh = head_mask(add, add_stride, b);
    const long long row0 = static_cast<long long>(b) * lk + j0;
    A* wk = ws_k + row0 * d;
    A* wv = ws_v + row0 * d;
    double* rt = rec + task * NSITES * FIELDS;
    __shared__ FaultAt ft;  // as the forward's: in registers, the double build spilled
    if (tid == 0) {
        ft = load_fault(fault);
        sh.keys = head_keys(keys, key_heads, b, lk);
    }
    __syncthreads();
    const A sc = static_cast<A>(scale), zero = static_cast<A>(0), ks = static_cast<A>(ks_in);
    const bool drop = thr > 0;
    if (check) encode_key_block(sh, kh, vh, j0, cols, d);
    const int first_i = causal ? (j0 / FBR) * FBR : 0;
    A kacc[FPER], vacc[FPER];
    for (int attempt = 0; attempt < 2; ++attempt) {
#pragma unroll
        for (int e = 0; e < FPER; ++e) kacc[e] = vacc[e] = zero;
        if (tid < cols)
            for (int f = 0; f < 3; ++f) sh.acc_enc[tid][f] = dv_enc[tid][f] = 0.0;
        int st = 0;
        for (int i0 = first_i, step = 0; i0 < lq; i0 += FBR, ++step) {
            const int rows = min(FBR, lq - i0);
            st = backward_tile(sh, qh, kh, vh, doh, lseh, loh, ddh, vis, addh, lq, lk, i0,
                               rows,
                               j0, cols, d, sc, causal != 0, check != 0, correct != 0, seed, thr,
                               ks, params, ft, true, attempt == 0, rt, b);
            if (st < 0) break;
            if (drop) {  // ---- the dropped tile P_d = fl(P ks) keep, into sh.dp (dS is made)
                for (int e = tid; e < rows * cols; e += FNT) {
                    const int r = e / cols, j = e % cols;
                    sh.dp[r][j] = inject(ft, DROP_, b, i0 + r, j0 + j, 0, attempt == 0,
                                         sh.p[r][j] * ks * static_cast<A>(sh.keep[r][j]));
                }
                __syncthreads();
            }
            A (*pd)[FBC] = drop ? sh.dp : sh.p;
#pragma unroll
            for (int e = 0; e < FPER; ++e) {  // ---- dV += P^T dO (P_d^T dO), dK += dS^T Q
                const int idx = tid + e * FNT, j = idx / d, c = idx % d;
                if (j < cols) {  // each tile's product added once (as the forward's O_acc)
                    A tv = zero, tk = zero;
                    for (int r = 0; r < rows; ++r) {
                        tv += pd[r][j] * widen(doh[(i0 + r) * d + c]);
                        tk += sh.s[r][j] * widen(qh[(i0 + r) * d + c]);
                    }
                    vacc[e] = inject(ft, DV_, b, j0 + j, c, step, attempt == 0, vacc[e] + tv);
                    kacc[e] = inject(ft, DK_, b, j0 + j, c, step, attempt == 0, kacc[e] + tk);
                }
            }
            if (check && tid < cols) {  // ---- their checksum columns, float64 (dV's from P, keep)
                const int j = tid;
                const double* qer = qe + (static_cast<long long>(b) * lq + i0) * 3;
                const double* der = doe + (static_cast<long long>(b) * lq + i0) * 3;
                for (int r = 0; r < rows; ++r) {
                    const double x = drop ? to_double(sh.p[r][j] * ks) *
                                                static_cast<double>(sh.keep[r][j])
                                          : to_double(sh.p[r][j]);
                    const double y = to_double(sh.s[r][j]);
                    dv_enc[j][0] += x * der[3 * r];
                    dv_enc[j][1] += x * der[3 * r + 1];
                    dv_enc[j][2] += fabs(x) * der[3 * r + 2];
                    sh.acc_enc[j][0] += y * qer[3 * r];
                    sh.acc_enc[j][1] += y * qer[3 * r + 1];
                    sh.acc_enc[j][2] += fabs(y) * qer[3 * r + 2];
                }
            }
        }
        if (st < 0) break;
        if (check) {  // ---- the accumulators, staged unscaled, against the carried checksums
#pragma unroll
            for (int e = 0; e < FPER; ++e) {
                const int idx = tid + e * FNT, j = idx / d, c = idx % d;
                if (j < cols) {
                    wk[j * d + c] = kacc[e];
                    wv[j * d + c] = vacc[e];
                }
            }
            __syncthreads();
            vote_accumulator(sh.votes, wk, sh.acc_enc, cols, d, params + C_KV);
            const int st_k = settle_block(sh.votes, rt, DK_, attempt, correct, cols, true, j0, 0);
            vote_accumulator(sh.votes, wv, dv_enc, cols, d, params + C_KV);
            const int st_v = settle_block(sh.votes, rt, DV_, attempt, correct, cols, true, j0, 0);
            st = min(st_k, st_v) < 0 ? -1 : max(st_k, st_v);
            if (st < 0) break;
            if (st == 1) continue;
        }
        T* dkb = dk + row0 * d;
        T* dvb = dv + row0 * d;
#pragma unroll
        for (int e = 0; e < FPER; ++e) {
            const int idx = tid + e * FNT, j = idx / d, c = idx % d;
            if (j < cols) {
                dkb[j * d + c] = narrow<T>(kacc[e] * sc);
                dvb[j * d + c] = narrow<T>(vacc[e]);
            }
        }
        if (check)  // the verified carried row checksums of dK (scaled) and dV, for the final check
            for (int j = tid; j < cols; j += FNT)
                for (int f = 0; f < 3; ++f) {
                    kv_sums[(row0 + j) * 6 + f] = sh.acc_enc[j][f] * to_double(sc);
                    kv_sums[(row0 + j) * 6 + 3 + f] = dv_enc[j][f];
                }
        if (tid == 0) status[task] = 0;
        return;
    }
    if (tid == 0) status[task] = -1;
}

template <typename T>
__global__ void __launch_bounds__(FNT)
attn_fused_backward_q(const T* q, const T* k, const T* v, const T* d_out,
                      const typename Arith<T>::type* lse,
                      const typename Arith<T>::type* lse_lo, const typename Arith<T>::type* dd,
                      const double* ke, const bool* visible, const double* add,
                      long long add_stride, const double* keys, int key_heads, int lq,
                      int lk, int d, double scale,
                      int causal, int check, int correct, unsigned long long seed,
                      unsigned long long thr, double ks_in, const double* params, double* fault,
                      typename Arith<T>::type* ws_q, T* dq, double* rec, int* status) {
    typedef typename Arith<T>::type A;
    __shared__ Backward<A> sh;
    const int tid = threadIdx.x;
    const int nqb = (lq + FBR - 1) / FBR;
    const long long task = blockIdx.x;
    const int b = static_cast<int>(task / nqb), i0 = static_cast<int>(task % nqb) * FBR;
    const int i1 = min(i0 + FBR, lq), rows = i1 - i0;
    const T* qh = q + static_cast<long long>(b) * lq * d;
    const T* kh = k + static_cast<long long>(b) * lk * d;
    const T* vh = v + static_cast<long long>(b) * lk * d;
    const T* doh = d_out + static_cast<long long>(b) * lq * d;
    const A* lseh = lse + static_cast<long long>(b) * lq;
    const A* loh = lse_lo + static_cast<long long>(b) * lq;
    const A* ddh = dd + static_cast<long long>(b) * lq;
    const bool* vis = visible ? visible + static_cast<long long>(b) * lk : nullptr;
    const double* addh = head_mask(add, add_stride, b);
    if (tid == 0) sh.keys = head_keys(keys, key_heads, b, lk);  // read after the tile loop's sync
    const long long row0 = static_cast<long long>(b) * lq + i0;
    A* wq = ws_q + row0 * d;
    double* rt = rec + task * NSITES * FIELDS;
    const FaultAt ft = load_fault(fault);
    const A sc = static_cast<A>(scale), zero = static_cast<A>(0), ks = static_cast<A>(ks_in);
    const int jend = causal ? min(lk, i1) : lk;
    A acc[FPER];
    for (int attempt = 0; attempt < 2; ++attempt) {
#pragma unroll
        for (int e = 0; e < FPER; ++e) acc[e] = zero;
        if (tid < rows)
            for (int f = 0; f < 3; ++f) sh.acc_enc[tid][f] = 0.0;
        int st = 0;
        for (int j0 = 0, step = 0; j0 < jend; j0 += FBC, ++step) {
            const int cols = min(FBC, jend - j0);
            __syncthreads();  // the previous tile's checks are done with the encodings
            if (check) encode_key_block(sh, kh, vh, j0, cols, d);
            st = backward_tile(sh, qh, kh, vh, doh, lseh, loh, ddh, vis, addh, lq, lk, i0,
                               rows,
                               j0, cols, d, sc, causal != 0, check != 0, correct != 0, seed, thr,
                               ks, params, ft, false, attempt == 0, rt, b);
            if (st < 0) break;
#pragma unroll
            for (int e = 0; e < FPER; ++e) {  // ---- dQ += dS K
                const int idx = tid + e * FNT, r = idx / d, c = idx % d;
                if (r < rows) {  // the tile's product added once (as the forward's O_acc)
                    A t = zero;
                    for (int j = 0; j < cols; ++j) t += sh.s[r][j] * widen(kh[(j0 + j) * d + c]);
                    acc[e] = inject(ft, DQ_, b, i0 + r, c, step, attempt == 0, acc[e] + t);
                }
            }
            if (check && tid < rows) {  // ---- its checksum columns, float64
                const int r = tid;
                const double* ker = ke + (static_cast<long long>(b) * lk + j0) * 3;
                double t0 = 0.0, t1 = 0.0, t2 = 0.0;
                for (int j = 0; j < cols; ++j) {
                    const double x = to_double(sh.s[r][j]);
                    t0 += x * ker[3 * j];
                    t1 += x * ker[3 * j + 1];
                    t2 += fabs(x) * ker[3 * j + 2];
                }
                sh.acc_enc[r][0] += t0;
                sh.acc_enc[r][1] += t1;
                sh.acc_enc[r][2] += t2;
            }
        }
        if (st < 0) break;
        if (check) {
#pragma unroll
            for (int e = 0; e < FPER; ++e) {
                const int idx = tid + e * FNT, r = idx / d, c = idx % d;
                if (r < rows) wq[r * d + c] = acc[e];
            }
            __syncthreads();
            vote_accumulator(sh.votes, wq, sh.acc_enc, rows, d, params + C_Q);
            st = settle_block(sh.votes, rt, DQ_, attempt, correct, rows, true, i0, 0);
            if (st < 0) break;
            if (st == 1) continue;
        }
        T* dqb = dq + row0 * d;
#pragma unroll
        for (int e = 0; e < FPER; ++e) {
            const int idx = tid + e * FNT, r = idx / d, c = idx % d;
            if (r < rows) dqb[r * d + c] = narrow<T>(acc[e] * sc);
        }
        if (tid == 0) status[task] = 0;
        return;
    }
    if (tid == 0) status[task] = -1;
}
