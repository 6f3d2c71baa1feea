// The two verification launches of a planned product (abftgemm/plan.py, abftgemm/_cuda_plan.py):
//
//   abft_plan_predict<T>        predicted column checksums of C = A @ B: the column encoding of A
//                               (plain, location-weighted (i+1)/m and absolute column sums) times
//                               B, reading A and B once each;
//   abft_plan_observe_flag<T>   observed column checksums of C, judged against the prediction on
//                               the same read (one read of C).
//
// Neither allocates, and neither needs the host between launches: partial sums go to float64
// accumulators with atomics, and the last block to finish a piece of work (a "last block" counter
// per piece, fenced) finishes it and puts the accumulators and counters back to zero, so the
// workspaces are clean for the next execute without a memset. The verdict is two cumulative
// counts (flagged, unverifiable) that the host reads at settle and compares with the previous
// read.
//
// checksum_acc.cuh (prepended by abftgemm.kernels.source) provides to_double and not_finite.

namespace {

constexpr int PLAN_THREADS = 256;   // blockDim.x of both kernels
constexpr int PLAN_WARPS = PLAN_THREADS / 32;
constexpr int SLAB = 32;            // columns of A (rows of B) per predict block

// Element (i, j) of a row-major (transposed = 0) or transposed (1) matrix with leading dim ld.
template <typename T>
__device__ __forceinline__ double load(const T* __restrict__ x, long long ld, int transposed,
                                       long long i, long long j) {
    return to_double(transposed ? x[j * ld + i] : x[i * ld + j]);
}

// The sum of v over the warp's 32 lanes, in every lane.
__device__ __forceinline__ double warp_total(double v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

}  // namespace

// Grid: batch (or 1) * slabs * chunks blocks (flat); block (t, slab, chunk) sums the SLAB columns
// c0 = slab*SLAB.. of A's rows [chunk*chunk_rows, ...) into enc_acc (atomics); the last chunk of
// a slab to finish multiplies the slab's encoding with rows c0.. of B into pred (atomics), then
// zeroes enc_acc and the slab counter. With enc_in (the column encoding handed in, field-major:
// element (f, t, c) at enc_in[f*enc_fstride + t*enc_bstride + c], t clamped to
// enc_batches - 1, so a warp's reads of one field are consecutive), A is not
// read and chunks must be 1. A single A that every batch item shares (a_batches == 1, no enc_in)
// is encoded once: the grid is then slabs * chunks blocks (t = 0), and each slab's B pass runs
// for all `batch` items.
// pred (batch, 3, n) must hold zeros (abft_plan_observe_flag leaves it so).
template <typename T>
__global__ void abft_plan_predict(
    const T* __restrict__ a, long long a_bstride, long long lda, int a_transposed, int a_batches,
    const T* __restrict__ b, long long b_bstride, long long ldb, int b_transposed, int b_batches,
    const double* __restrict__ enc_in, long long enc_bstride, long long enc_fstride,
    int enc_batches, double* __restrict__ enc_acc, unsigned int* __restrict__ slab_count,
    double* __restrict__ pred, int m, int k, int n, int slabs, int chunks, int chunk_rows,
    int batch) {
    __shared__ double sh[3][PLAN_WARPS][SLAB];
    __shared__ double enc[3][SLAB];
    __shared__ bool last_chunk;

    const long long flat = blockIdx.x;
    const int chunk = static_cast<int>(flat % chunks);
    const long long rest = flat / chunks;
    const int slab = static_cast<int>(rest % slabs);
    const long long t = rest / slabs;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c0 = slab * SLAB;
    double* acc = enc_acc + (t * slabs + slab) * 3 * SLAB;

    if (enc_in == nullptr) {
        const T* at = a + (a_batches == 1 ? 0 : t) * a_bstride;
        const int i1 = min(m, (chunk + 1) * chunk_rows);
        const double inv_m = 1.0 / static_cast<double>(m > 0 ? m : 1);
        if (a_transposed) {
            // A column of a transposed A is contiguous: the lanes read consecutive rows of it
            // (coalesced), each warp takes whole columns and sums them over its lanes.
            for (int l = warp; l < SLAB; l += PLAN_WARPS) {
                double s0 = 0.0, s1 = 0.0, s2 = 0.0;
                if (c0 + l < k) {
                    for (int i = chunk * chunk_rows + lane; i < i1; i += 32) {
                        const double v = load(at, lda, 1, i, c0 + l);
                        s0 += v;
                        s1 += v * (static_cast<double>(i + 1) * inv_m);
                        s2 += fabs(v);
                    }
                }
                s0 = warp_total(s0);
                s1 = warp_total(s1);
                s2 = warp_total(s2);
                if (lane == 0 && chunks == 1) {
                    enc[0][l] = s0;
                    enc[1][l] = s1;
                    enc[2][l] = s2;
                } else if (lane == 0) {
                    atomicAdd(acc + l, s0);
                    atomicAdd(acc + SLAB + l, s1);
                    atomicAdd(acc + 2 * SLAB + l, s2);
                }
            }
        } else {
            // Row-major: lane l reads column c0 + l of the warp's rows (coalesced along a row).
            const int c = c0 + lane;
            double s0 = 0.0, s1 = 0.0, s2 = 0.0;
            if (c < k) {
                for (int i = chunk * chunk_rows + warp; i < i1; i += PLAN_WARPS) {
                    const double v = load(at, lda, 0, i, c);
                    s0 += v;
                    s1 += v * (static_cast<double>(i + 1) * inv_m);
                    s2 += fabs(v);
                }
            }
            sh[0][warp][lane] = s0;
            sh[1][warp][lane] = s1;
            sh[2][warp][lane] = s2;
            __syncthreads();
            if (warp < 3) {
                double s = 0.0;
                for (int w = 0; w < PLAN_WARPS; ++w) s += sh[warp][w][lane];
                if (chunks == 1) enc[warp][lane] = s;
                else atomicAdd(acc + warp * SLAB + lane, s);
            }
        }
        if (chunks > 1) {
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0)
                last_chunk = atomicAdd(slab_count + t * slabs + slab, 1u) == chunks - 1u;
            __syncthreads();
            if (!last_chunk) return;
            __threadfence();
            if (threadIdx.x < 3 * SLAB) {
                const int f = threadIdx.x / SLAB, l = threadIdx.x % SLAB;
                enc[f][l] = __ldcg(acc + f * SLAB + l);
                acc[f * SLAB + l] = 0.0;
            }
            if (threadIdx.x == 0) slab_count[t * slabs + slab] = 0u;
        }
    } else if (threadIdx.x < 3 * SLAB) {
        const int f = threadIdx.x / SLAB, l = threadIdx.x % SLAB;
        const long long te = enc_batches == 1 ? 0 : t;
        enc[f][l] = c0 + l < k ? enc_in[f * enc_fstride + te * enc_bstride + c0 + l] : 0.0;
    }
    __syncthreads();

    const int rows = min(SLAB, k - c0);
    const long long t_end = enc_in == nullptr && a_batches == 1 ? batch : t + 1;
    for (long long u = t; u < t_end; ++u) {
        const T* bt = b + (b_batches == 1 ? 0 : u) * b_bstride;
        double* p = pred + u * 3LL * n;
        if (b_transposed) {
            // Column j of a transposed B is contiguous along the slab's rows: the lanes take one
            // row each (coalesced) and the warp sums the column's three terms.
            for (int j = warp; j < n; j += PLAN_WARPS) {
                const double v = lane < rows ? load(bt, ldb, 1, c0 + lane, j) : 0.0;
                const double p0 = warp_total(lane < rows ? enc[0][lane] * v : 0.0);
                const double p1 = warp_total(lane < rows ? enc[1][lane] * v : 0.0);
                const double p2 = warp_total(lane < rows ? enc[2][lane] * fabs(v) : 0.0);
                if (lane == 0) {
                    atomicAdd(p + j, p0);
                    atomicAdd(p + n + j, p1);
                    atomicAdd(p + 2LL * n + j, p2);
                }
            }
            continue;
        }
        for (int j = threadIdx.x; j < n; j += PLAN_THREADS) {
            double p0 = 0.0, p1 = 0.0, p2 = 0.0;
            for (int r = 0; r < rows; ++r) {
                const double v = load(bt, ldb, b_transposed, c0 + r, j);
                p0 += enc[0][r] * v;
                p1 += enc[1][r] * v;
                p2 += enc[2][r] * fabs(v);
            }
            atomicAdd(p + j, p0);
            atomicAdd(p + n + j, p1);
            atomicAdd(p + 2LL * n + j, p2);
        }
    }
}

// Grid: batch * tiles * chunks blocks (flat). A tile is 32*V columns (V = 16 / sizeof(T):
// each lane reads 16 bytes of a row when `vector` is set, i.e. n % V == 0 and C 16-byte aligned);
// a chunk is chunk_rows rows, interleaved over the block's warps. Partial column sums go to acc
// (batch, 3, n), non-finite counts to bad_count (batch, n). The last chunk of a tile judges its
// columns:
//     pred += bias terms (m*bias, (m+1)/2*bias, m*|bias|)
//     tau = c_obs * obs[2] + c_pred * pred[2] + floor_abs
//     verifiable = pred finite && (pred[2] < safe || observed finite)
//     flagged = verifiable && !(|pred[0]-obs[0]| <= tau && |pred[1]-obs[1]| <= tau
//                               && observed finite)
// (the rule of abft_flag in reduce.cu), writes the observed column encoding obs (3, batch, n),
// field-major as every encoding (handed on as it is), adds the flagged and unverifiable columns
// of every batch item to verdict (2, cumulative), and zeroes acc, bad_count, pred and the tile
// counter.
template <typename T>
__global__ void abft_plan_observe_flag(
    const T* __restrict__ c, const T* __restrict__ bias, double* __restrict__ acc,
    int* __restrict__ bad_count, unsigned int* __restrict__ tile_count,
    double* __restrict__ pred, double c_obs, double c_pred, double floor_abs, double c_mag,
    double safe,
    double* __restrict__ obs, unsigned long long* __restrict__ verdict, int batch, int m, int n,
    int tiles, int chunks, int chunk_rows, int vector) {
    constexpr int V = 16 / sizeof(T);
    constexpr int TILE = 32 * V;
    // Column x of a warp's partial sums at x + x / V: one pad double after each lane's V, so the
    // lanes' stores (lane * (V + 1) + e, an odd stride) and the readers' loads (consecutive x)
    // fall in different banks; unpadded, lane * V + e had V lanes per bank.
    constexpr int ROW = TILE + TILE / V;
    __shared__ double sh[PLAN_WARPS][ROW];
    __shared__ bool last_chunk;

    const long long flat = blockIdx.x;
    const int chunk = static_cast<int>(flat % chunks);
    const long long rest = flat / chunks;
    const int tile = static_cast<int>(rest % tiles);
    const long long t = rest / tiles;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j0 = tile * TILE + lane * V;
    const T* ct = c + t * static_cast<long long>(m) * n;
    const double inv_m = 1.0 / static_cast<double>(m > 0 ? m : 1);

    double s0[V], s1[V], s2[V];
    int count[V];
    #pragma unroll
    for (int e = 0; e < V; ++e) { s0[e] = 0.0; s1[e] = 0.0; s2[e] = 0.0; count[e] = 0; }
    const int i1 = min(m, (chunk + 1) * chunk_rows);
    for (int i = chunk * chunk_rows + warp; i < i1; i += PLAN_WARPS) {
        const double w = static_cast<double>(i + 1) * inv_m;
        const T* row = ct + static_cast<long long>(i) * n;
        T vals[V];
        if (vector && j0 < n) {
            const uint4 bits = *reinterpret_cast<const uint4*>(row + j0);
            const T* v = reinterpret_cast<const T*>(&bits);
            #pragma unroll
            for (int e = 0; e < V; ++e) vals[e] = v[e];
        } else {
            #pragma unroll
            for (int e = 0; e < V; ++e) vals[e] = j0 + e < n ? row[j0 + e] : row[0];
        }
        #pragma unroll
        for (int e = 0; e < V; ++e) {
            if (j0 + e >= n) continue;
            const double v = to_double(vals[e]);
            s0[e] += v;
            s1[e] += w * v;
            s2[e] += fabs(v);
            if (not_finite(v)) ++count[e];
        }
    }
    // Combine the warps' partial sums one field at a time through shared memory.
    double* tile_acc = acc + t * 3LL * n;
    for (int f = 0; f < 3; ++f) {
        #pragma unroll
        for (int e = 0; e < V; ++e)
            sh[warp][lane * (V + 1) + e] = f == 0 ? s0[e] : f == 1 ? s1[e] : s2[e];
        __syncthreads();
        for (int x = threadIdx.x; x < TILE; x += PLAN_THREADS) {
            const int j = tile * TILE + x;
            double s = 0.0;
            for (int w = 0; w < PLAN_WARPS; ++w) s += sh[w][x + x / V];
            if (j < n) atomicAdd(tile_acc + f * static_cast<long long>(n) + j, s);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int e = 0; e < V; ++e) {
        if (count[e] > 0 && j0 + e < n) atomicAdd(bad_count + t * n + j0 + e, count[e]);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        last_chunk = atomicAdd(tile_count + t * tiles + tile, 1u) == chunks - 1u;
    __syncthreads();
    if (!last_chunk) return;
    __threadfence();

    unsigned long long n_bad = 0, n_unverifiable = 0;
    double* pt = pred + t * 3LL * n;
    for (int x = threadIdx.x; x < TILE; x += PLAN_THREADS) {
        const int j = tile * TILE + x;
        if (j >= n) continue;
        const double o0 = __ldcg(tile_acc + j), o1 = __ldcg(tile_acc + n + j),
                     o2 = __ldcg(tile_acc + 2LL * n + j);
        const int cnt = __ldcg(bad_count + t * n + j);
        double p0 = __ldcg(pt + j), p1 = __ldcg(pt + n + j), p2 = __ldcg(pt + 2LL * n + j);
        if (bias != nullptr) {
            const double bm = to_double(bias[j]) * static_cast<double>(m);
            p0 += bm;
            p1 += bm * (static_cast<double>(m + 1) * 0.5 * inv_m);
            p2 += fabs(bm);
        }
        const double p[3] = {p0, p1, p2};
        double tau;
        bool ok;
        const bool flagged = judge(p, o0, o1, o2, static_cast<double>(cnt), c_obs, c_pred,
                                   floor_abs, c_mag, safe, &tau, &ok);
        n_bad += flagged;
        n_unverifiable += !ok;
        const long long fstride = static_cast<long long>(batch) * n;
        double* o = obs + t * n + j;
        o[0] = o0; o[fstride] = o1; o[2 * fstride] = o2;
        tile_acc[j] = 0.0; tile_acc[n + j] = 0.0; tile_acc[2LL * n + j] = 0.0;
        pt[j] = 0.0; pt[n + j] = 0.0; pt[2LL * n + j] = 0.0;
        bad_count[t * n + j] = 0;
    }
    if (n_bad) atomicAdd(verdict, n_bad);
    if (n_unverifiable) atomicAdd(verdict + 1, n_unverifiable);
    if (threadIdx.x == 0) tile_count[t * tiles + tile] = 0u;
}
