// Checksum reductions for abftgemm: one read of a matrix produces, per row or per column vector,
// the five float64 fields of checksum_acc.cuh (which abftgemm.kernels.source prepends).
//
// Compiled by NVRTC through cupy.RawModule (see abftgemm/kernels/__init__.py for the options and
// name expressions).
namespace {

// double has no atomicMax; the index is a small non-negative integer stored as double, so a CAS
// loop on the bit pattern is exact. Only reached by chunks that saw a non-finite element.
__device__ __forceinline__ void atomic_max_double(double* addr, double v) {
    unsigned long long* p = reinterpret_cast<unsigned long long*>(addr);
    unsigned long long old = *p;
    while (__longlong_as_double(static_cast<long long>(old)) < v) {
        const unsigned long long seen =
            atomicCAS(p, old, static_cast<unsigned long long>(__double_as_longlong(v)));
        if (seen == old) break;
        old = seen;
    }
}

}  // namespace

// Sets every output vector to the identity of the reduction: sums 0, count 0, last -1. Needed
// before abft_col_reduce splits columns across blocks (chunks > 1) and combines them atomically.
extern "C" __global__ void abft_reduce_init(double* __restrict__ out, long long vectors) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < vectors;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        double* o = out + 5 * i;
        o[0] = 0.0; o[1] = 0.0; o[2] = 0.0; o[3] = 0.0; o[4] = -1.0;
    }
}

// Reduces contiguous vectors: vector r of batch b starts at x + b*batch_stride + r*ld and has len
// elements. One warp per vector; the aligned middle of each vector is read with 16-byte loads, the
// unaligned head and the tail element by element. out is (batch, nvec, 5). coef (or null): batch
// b's coefficient field j at coef + b*coef_stride + j*coef_fstride, contiguous.
template <typename T>
__global__ void abft_row_reduce(const T* __restrict__ x, long long batch_stride, long long ld,
                                const double* __restrict__ coef, long long coef_stride,
                                long long coef_fstride,
                                double* __restrict__ out, int batch, int nvec, int len) {
    constexpr int V = 16 / sizeof(T);
    const int lane = threadIdx.x & 31;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    const long long total = static_cast<long long>(batch) * nvec;
    for (long long w = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) >> 5;
         w < total; w += warps) {
        const long long b = w / nvec;
        const long long r = w - b * nvec;
        const T* row = x + b * batch_stride + r * ld;
        const double* c = coef == nullptr ? nullptr : coef + b * coef_stride;
        Acc a;
        a.init(len);
        // Elements before the first 16-byte boundary (fewer than V <= 8, so one per lane at most).
        const int head = min(len, static_cast<int>(
            ((16 - (reinterpret_cast<unsigned long long>(row) & 15)) & 15) / sizeof(T)));
        if (lane < head) a.add(to_double(row[lane]), lane, c, coef_fstride);
        const int chunks = (len - head) / V;
        const uint4* body = reinterpret_cast<const uint4*>(row + head);
        for (int i = lane; i < chunks; i += 32) {
            const uint4 bits = body[i];
            const T* vals = reinterpret_cast<const T*>(&bits);
            const int l0 = head + i * V;
            #pragma unroll
            for (int j = 0; j < V; ++j) a.add(to_double(vals[j]), l0 + j, c, coef_fstride);
        }
        for (int l = head + chunks * V + lane; l < len; l += 32) a.add(to_double(row[l]), l, c, coef_fstride);
        warp_allreduce(a);
        if (lane == 0) a.store(out + 5 * w);
    }
}

// Reduces strided vectors: vector j of batch b is the column x[b*batch_stride + i*ld + j],
// i = 0..len-1. Blocks are (32, ROWS_PER_BLOCK): threadIdx.x picks the column, so each warp reads
// 32 consecutive elements of a row (coalesced); threadIdx.y interleaves rows. The flat grid is
// (batch, chunks, col_blocks); with chunks > 1 every block reduces chunk_rows rows and combines
// into out atomically (out must hold abft_reduce_init's identity then), otherwise it stores.
template <typename T>
__global__ void abft_col_reduce(const T* __restrict__ x, long long batch_stride, long long ld,
                                const double* __restrict__ coef, long long coef_stride,
                                long long coef_fstride,
                                double* __restrict__ out, int nvec, int len, int col_blocks,
                                int chunks, int chunk_rows) {
    constexpr int ROWS = 8;  // must match blockDim.y (COL_BLOCK in abftgemm/_cuda.py)
    __shared__ double sh_s[3][ROWS][32];
    __shared__ int sh_count[ROWS][32];
    __shared__ int sh_last[ROWS][32];

    const long long flat = blockIdx.x;
    const int col_block = static_cast<int>(flat % col_blocks);
    const long long rest = flat / col_blocks;
    const int chunk = static_cast<int>(rest % chunks);
    const long long b = rest / chunks;

    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = col_block * 32 + tx;
    const int row_begin = chunk * chunk_rows;
    const int row_end = min(len, row_begin + chunk_rows);
    const T* base = x + b * batch_stride + col;
    const double* c = coef == nullptr ? nullptr : coef + b * coef_stride;

    Acc a;
    a.init(len);
    if (col < nvec) {
        #pragma unroll 4
        for (int i = row_begin + ty; i < row_end; i += ROWS) a.add(to_double(base[i * ld]), i, c, coef_fstride);
    }
    sh_s[0][ty][tx] = a.s0;
    sh_s[1][ty][tx] = a.s1;
    sh_s[2][ty][tx] = a.s2;
    sh_count[ty][tx] = a.count;
    sh_last[ty][tx] = a.last;
    __syncthreads();
    if (ty != 0 || col >= nvec) return;
    for (int k = 1; k < ROWS; ++k)
        a.merge(sh_s[0][k][tx], sh_s[1][k][tx], sh_s[2][k][tx], sh_count[k][tx], sh_last[k][tx]);

    double* o = out + 5 * (b * nvec + col);
    if (chunks == 1) {
        a.store(o);
        return;
    }
    atomicAdd(o, a.s0);
    atomicAdd(o + 1, a.s1);
    atomicAdd(o + 2, a.s2);
    if (a.count > 0) {
        atomicAdd(o + 3, static_cast<double>(a.count));
        atomic_max_double(o + 4, static_cast<double>(a.last));
    }
}

// Flags the vectors whose checksums disagree, for n vectors of 5 float64 fields each (predicted
// and observed, as written by the reductions above), by the rule of judge (checksum_acc.cuh;
// the coefficients come from abftgemm/thresholds.py). counts[0] and counts[1] accumulate the
// numbers of bad and unverifiable vectors; only such (rare) vectors touch them.
extern "C" __global__ void abft_flag(const double* __restrict__ pred,
                                     const double* __restrict__ obs, double c_obs, double c_pred,
                                     double floor_abs, double c_mag, double safe, long long n,
                                     double* __restrict__ tau, bool* __restrict__ bad,
                                     bool* __restrict__ verifiable,
                                     unsigned long long* __restrict__ counts) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const double* o = obs + 5 * i;
        double t;
        bool ok;
        const bool flagged = judge(pred + 5 * i, o[0], o[1], o[2], o[3], c_obs, c_pred,
                                   floor_abs, c_mag, safe, &t, &ok);
        tau[i] = t;
        bad[i] = flagged;
        verifiable[i] = ok;
        if (flagged) atomicAdd(counts, 1ULL);
        if (!ok) atomicAdd(counts + 1, 1ULL);
    }
}
