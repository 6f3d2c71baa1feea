"""The CPU run of the CUDA backend checks kernels as a GPU sanitizer would: each check is shown
firing on a small deliberately wrong kernel, next to the same kernel written correctly.

The kernels are compiled by the host C++ compiler through the CuPy stand-in's RawModule
(tests/cuda_on_cpu); docs/gpu_testing.md lists what these checks can and cannot see.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import CUDA_ON_CPU

pytestmark = [pytest.mark.cuda_on_cpu,
              pytest.mark.skipif(CUDA_ON_CPU is None, reason="no CUDA-on-CPU backend here")]


def _kernel(source: str, name: str, options: tuple[str, ...] = ()):
    import cupy

    return cupy.RawModule(code=source, options=options, name_expressions=(name,)).get_function(name)


def _error():
    from cuda_on_cpu.launch import SimtError

    return SimtError


COPY = """
extern "C" __global__ void copy(const float* x, float* y, int n) {
    const int i = threadIdx.x;
    if (i %s n) y[i] = x[i];
}
"""


def test_out_of_bounds_global_read_is_reported_with_its_distance_past_the_end():
    import cupy

    x = cupy.arange(32, dtype=np.float32)
    y = cupy.zeros(64, dtype=np.float32)
    _kernel(COPY % "<", "copy")((1,), (64,), (x, y, np.int32(32)))
    np.testing.assert_array_equal(y.get()[:32], np.arange(32))
    with pytest.raises(_error(), match=r"copy: block \(0,0,0\) thread \(32,0,0\) reads 4 bytes at "
                                       r"0 bytes past the end of a 128-byte device allocation"):
        _kernel(COPY % "<=", "copy")((1,), (64,), (x, y, np.int32(32)))


def test_out_of_bounds_global_write_is_reported_before_it_happens():
    import cupy

    source = """
    extern "C" __global__ void shift(const float* x, float* y, int n) {
        const int i = threadIdx.x;
        if (i < n) y[i + 1] = x[i];
    }
    """
    x = cupy.arange(32, dtype=np.float32)
    y = cupy.zeros(32, dtype=np.float32)
    with pytest.raises(_error(), match=r"thread \(31,0,0\) writes 4 bytes at 0 bytes past the end"):
        _kernel(source, "shift")((1,), (32,), (x, y, np.int32(32)))
    assert y._alloc.guards_intact()


def test_a_pointer_into_no_allocation_is_reported():
    import cupy

    source = """
    extern "C" __global__ void far(float* y) { y[threadIdx.x * (1ULL << 38)] = 1.0f; }
    """  # a TiB past y: 400 kB past it, another test's allocation could lie there
    y = cupy.zeros(16, dtype=np.float32)
    with pytest.raises(_error(), match=r"thread \(1,0,0\) writes 4 bytes at (0x[0-9a-f]+, outside "
                                       r"every device allocation|.* past the end)"):
        _kernel(source, "far")((1,), (2,), (y,))


def test_reading_device_memory_nothing_wrote_is_reported():
    import cupy

    source = """
    extern "C" __global__ void partial(float* buf, float* out) {
        const int i = threadIdx.x;
        if (i < 16) buf[i] = 1.0f;
        __syncthreads();
        out[i] = buf[i];
    }
    """
    buf, out = cupy.empty(32, dtype=np.float32), cupy.zeros(32, dtype=np.float32)
    with pytest.raises(_error(), match=r"thread \((\d+),0,0\) reads 4 bytes at offset (\d+) of a "
                                       r"128-byte device allocation that nothing has written") as e:
        _kernel(source, "partial")((1,), (32,), (buf, out))
    thread, offset = (int(v) for v in re.search(r"thread \((\d+),.* offset (\d+)", str(e.value)).groups())
    assert thread >= 16 and offset == 4 * thread
    buf = cupy.zeros(32, dtype=np.float32)  # written by the host: every byte counts
    _kernel(source, "partial")((1,), (32,), (buf, out))
    np.testing.assert_array_equal(out.get(), [1.0] * 16 + [0.0] * 16)


NEIGHBOUR = """
extern "C" __global__ void neighbour(const float* x, float* y) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    s[i] = x[i];
    %s
    y[i] = s[i > 0 ? i - 1 : 0];
}
"""


def test_a_missing_barrier_is_a_shared_memory_race_named_with_its_kernel():
    import cupy

    x = cupy.arange(64, dtype=np.float32)
    y = cupy.zeros(64, dtype=np.float32)
    _kernel(NEIGHBOUR % "__syncthreads();", "neighbour")((2,), (64,), (x, y))
    np.testing.assert_array_equal(y.get(), np.r_[0, np.arange(63)])
    with pytest.raises(_error(), match=r"neighbour: block \(0,0,0\) thread \(1,0,0\) reads 4 bytes "
                                       r"at shared offset \d+, which thread \(0,0,0\) wrote in the "
                                       r"same barrier interval \(shared-memory race\)"):
        _kernel(NEIGHBOUR % "", "neighbour")((2,), (64,), (x, y))


def test_a_write_after_another_threads_read_in_one_interval_is_a_race():
    import cupy

    source = """
    extern "C" __global__ void rotate(float* y) {
        __shared__ float s[32];
        const int i = threadIdx.x;
        s[i] = static_cast<float>(i);
        __syncthreads();
        const float v = s[(i + 1) & 31];
        %s
        s[i] = v;
        __syncthreads();
        y[i] = s[i];
    }
    """
    y = cupy.zeros(32, dtype=np.float32)
    _kernel(source % "__syncthreads();", "rotate")((1,), (32,), (y,))
    np.testing.assert_array_equal(y.get(), np.roll(np.arange(32), -1))
    with pytest.raises(_error(), match=r"thread \(\d+,0,0\) writes 4 bytes at shared offset \d+, "
                                       r"which thread \(\d+,0,0\) read in the same barrier "
                                       r"interval \(shared-memory race\)"):
        _kernel(source % "", "rotate")((1,), (32,), (y,))


def test_reading_shared_memory_no_thread_wrote_is_reported():
    import cupy

    source = """
    extern "C" __global__ void stale(float* y) {
        __shared__ float s[32];
        if (threadIdx.x < 16) s[threadIdx.x] = 1.0f;
        __syncthreads();
        y[threadIdx.x] = s[threadIdx.x];
    }
    """
    y = cupy.zeros(32, dtype=np.float32)
    with pytest.raises(_error(), match=r"thread \((1[6-9]|2\d|3[01]),0,0\) reads 4 bytes at shared "
                                       r"offset \d+ that no thread of the block has written"):
        _kernel(source, "stale")((1,), (32,), (y,))


WARP_SUM = """
extern "C" __global__ void warp_sum(const float* x, float* y) {
    float v = x[threadIdx.x];
    %s
    y[threadIdx.x] = v;
}
"""
FULL = "for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);"


def test_warp_shuffles_reduce_like_a_warp():
    import cupy

    x = cupy.asarray(np.arange(64, dtype=np.float32))
    y = cupy.zeros(64, dtype=np.float32)
    _kernel(WARP_SUM % FULL, "warp_sum")((1,), (64,), (x, y))
    np.testing.assert_array_equal(y.get(), [sum(range(32))] * 32 + [sum(range(32, 64))] * 32)


def test_a_warp_intrinsic_some_lanes_of_the_mask_skip_is_an_error_not_a_hang():
    import cupy

    x = cupy.zeros(32, dtype=np.float32)
    y = cupy.zeros(32, dtype=np.float32)
    with pytest.raises(_error(), match=r"__shfl_xor_sync \(mask 0xffffffff\) in block \(0,0,0\) "
                                       r"warp 0: lane 0 waits for lane 16, which has exited"):
        _kernel(WARP_SUM % ("if (threadIdx.x < 16) " + FULL), "warp_sum")((1,), (32,), (x, y))
    with pytest.raises(_error(), match=r"lane 0 waits there, lane 16 of the mask is at "
                                       r"__syncthreads \(divergent warp intrinsic\)"):
        _kernel(WARP_SUM % ("if (threadIdx.x < 16) { " + FULL + " } __syncthreads();"),
                "warp_sum")((1,), (32,), (x, y))


WMMA = """
#include <mma.h>
using namespace nvcuda;
extern "C" __global__ void tile(const __half* a, const __half* b, float* c) {
    __shared__ __half bs[16 * 16];
    for (int i = threadIdx.x; i < 256; i += 32) bs[i] = b[i];
    %s
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
    wmma::fill_fragment(fc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, bs, 16);
    %s
    wmma::mma_sync(fc, fa, fb, fc);
    wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
}
"""


def test_wmma_fragments_multiply_like_a_warp_and_must_be_reached_by_every_lane():
    """nvcuda::wmma with an opaque fragment layout: a 16 x 16 x 16 product (b column-major, i.e.
    a @ b_stored.T) from global and shared memory; a lane that leaves before mma_sync is reported,
    as is a load from shared memory other lanes wrote without a barrier."""
    import cupy

    rng = np.random.default_rng(0)
    a, b = (rng.integers(-4, 5, (16, 16)).astype(np.float16) for _ in "ab")
    c = cupy.zeros((16, 16), np.float32)
    args = (cupy.asarray(a), cupy.asarray(b), c)
    _kernel(WMMA % ("__syncwarp();", ""), "tile")((1,), (32,), args)
    np.testing.assert_array_equal(c.get(), a.astype(np.float32) @ b.astype(np.float32).T)
    with pytest.raises(_error(), match=r"nvcuda::wmma::mma_sync \(mask 0xffffffff\) in block "
                                       r"\(0,0,0\) warp 0: lane 0 waits for lane 16, which has "
                                       r"exited"):
        _kernel(WMMA % ("__syncwarp();", "if (threadIdx.x >= 16) return;"), "tile")(
            (1,), (32,), args)
    with pytest.raises(_error(), match=r"reads 2 bytes at shared offset \d+, which thread "
                                       r"\(\d+,0,0\) wrote in the same barrier interval"):
        _kernel(WMMA % ("", ""), "tile")((1,), (32,), args)


def test_a_mask_without_the_callers_lane_is_an_error():
    import cupy

    x = cupy.zeros(32, dtype=np.float32)
    y = cupy.zeros(32, dtype=np.float32)
    half = "v += __shfl_xor_sync(0x0000ffffu, v, 1);"
    with pytest.raises(_error(), match=r"thread \(16,0,0\) calls __shfl_xor_sync with mask "
                                       r"0x0000ffff, which does not hold its own lane 16"):
        _kernel(WARP_SUM % half, "warp_sum")((1,), (32,), (x, y))
    _kernel(WARP_SUM % ("if (threadIdx.x < 16) " + half), "warp_sum")((1,), (32,), (x, y))


def test_atomics_from_every_block_add_up():
    import cupy

    source = """
    extern "C" __global__ void count(unsigned long long* c, double* s) {
        atomicAdd(c, 1ULL);
        atomicAdd(s + (threadIdx.x & 1), 0.5);
    }
    """
    c = cupy.zeros(1, dtype=np.uint64)
    s = cupy.zeros(2, dtype=np.float64)
    _kernel(source, "count")((7,), (96,), (c, s))
    assert int(c.get()[0]) == 7 * 96
    np.testing.assert_array_equal(s.get(), [7 * 48 * 0.5] * 2)


def test_arguments_are_checked_against_the_kernels_parameter_types():
    import cupy

    x = cupy.arange(32, dtype=np.float32)
    y = cupy.zeros(32, dtype=np.float32)
    k = _kernel(COPY % "<", "copy")
    with pytest.raises(_error(), match="argument 2 of copy: the kernel takes 4 bytes, the launch "
                                       "passed 8"):
        k((1,), (32,), (x, y, 32))  # a Python int goes as int64, like CuPy's
    with pytest.raises(_error(), match="copy takes 3 arguments, the launch passed 2"):
        k((1,), (32,), (x, y))
    with pytest.raises(_error(), match="argument 1 of copy: the kernel takes a pointer"):
        k((1,), (32,), (x, np.float32(0), np.int32(32)))
    with pytest.raises(TypeError, match="NumPy array is host memory"):
        k((1,), (32,), (x, np.zeros(32, np.float32), np.int32(32)))


PAIR = """
struct Pair { int a; double b; };
extern "C" __global__ void pair(Pair p, double* y) { y[0] = p.a + p.b; }
"""


def test_a_one_element_numpy_array_passes_by_value_as_a_struct_of_its_size():
    import cupy

    y = cupy.zeros(1)
    k = _kernel(PAIR, "pair")
    arg = np.zeros(1, np.dtype([("a", np.int32), ("b", np.float64)], align=True))
    arg["a"], arg["b"] = 2, 0.5
    k((1,), (1,), (arg, y))
    assert y.get()[0] == 2.5
    packed = np.zeros(1, np.dtype([("a", np.int32), ("b", np.float64)]))  # no C padding
    with pytest.raises(_error(), match="argument 0 of pair: the kernel takes 16 bytes, the launch "
                                       "passed 12"):
        k((1,), (1,), (packed, y))
    with pytest.raises(TypeError, match=r"NumPy array is host memory \(shape \(2,\)\)"):
        k((1,), (1,), (np.zeros(2, arg.dtype), y))


def test_launch_configurations_beyond_cudas_limits_are_refused():
    import cupy

    x = cupy.arange(32, dtype=np.float32)
    k = _kernel(COPY % "<", "copy")
    with pytest.raises(_error(), match="more than 1024 threads per block"):
        k((1,), (64, 32), (x, x, np.int32(0)))
    with pytest.raises(_error(), match=r"grid.x = 0"):
        k((0,), (32,), (x, x, np.int32(0)))


FLUSH = """
extern "C" __global__ void widen(const float* x, double* y) { y[threadIdx.x] = x[threadIdx.x]; }
"""


def test_ftz_flushes_subnormal_floats_when_widened_as_cupys_nvrtc_options_do():
    import cupy

    x = cupy.asarray(np.array([1e-40, 1.5], np.float32))
    y = cupy.zeros(2, dtype=np.float64)
    _kernel(FLUSH, "widen")((1,), (2,), (x, y))  # CuPy compiles with -ftz=true
    np.testing.assert_array_equal(y.get(), [0.0, 1.5])
    _kernel(FLUSH, "widen", ("-ftz=false",))((1,), (2,), (x, y))
    np.testing.assert_array_equal(y.get(), [np.float64(np.float32(1e-40)), 1.5])


def test_cublas_refuses_reads_past_an_allocation():
    from cupy_backends.cuda.libs import cublas

    import cupy

    a = cupy.ones((4, 4), np.float32)
    c = cupy.zeros((2, 4, 4), np.float32)
    one, zero = np.ones((), np.float32), np.zeros((), np.float32)
    h = cublas.create()
    try:
        with pytest.raises(cublas.CUBLASError, match="A spans memory past the end"):
            cublas.gemmStridedBatchedEx(h, 0, 0, 4, 4, 4, one.ctypes.data, a.data.ptr, 0, 4, 16,
                                        a.data.ptr, 0, 4, 0, zero.ctypes.data, c.data.ptr, 0, 4,
                                        16, 2, cublas.CUBLAS_COMPUTE_32F, -1)
        with pytest.raises(cublas.CUBLASError, match="ldA = 2 < 4"):
            cublas.gemmStridedBatchedEx(h, 0, 0, 4, 4, 4, one.ctypes.data, a.data.ptr, 0, 2, 0,
                                        a.data.ptr, 0, 4, 0, zero.ctypes.data, c.data.ptr, 0, 4,
                                        0, 1, cublas.CUBLAS_COMPUTE_32F, -1)
    finally:
        cublas.destroy(h)


def test_ci_subset_launches_every_kernel_of_every_dtype_on_every_launch_path():
    """What CI's cupy-on-cpu subset is guaranteed to cover, in one test: every name expression of
    every module (each kernel and dtype instantiation), the column reduction with one chunk and
    with several (atomics and the init kernel), the prediction encoding a itself and taking a
    handed-on encoding, the observation by 16-byte vectors and element by element, and the
    softmax kernels with and without compute and check, causal or not."""
    import cupy

    import abftgemm
    from abftgemm import ProtectedMatmul, kernels
    from abftgemm._cuda import backend
    from attention import kernels as attention_kernels
    from attention.context import Context
    from attention.fused import fused_backward, fused_forward
    from attention.layer import MultiHeadAttention
    from cuda_on_cpu import launch

    seen: list[tuple[str, tuple]] = []
    call = launch.RawKernel.__call__

    def recording(self, grid, block, args, **kw):
        seen.append((self.name, tuple(a for a in args if isinstance(a, (np.integer, int)))))
        return call(self, grid, block, args, **kw)

    launch.RawKernel.__call__ = recording
    try:
        be, rng = backend(), np.random.default_rng(0)
        for dtype in abftgemm.SUPPORTED_DTYPES:
            a = cupy.asarray(rng.integers(-2, 3, (2, 256, 40)).astype(dtype))  # 4 row chunks
            b = cupy.asarray(rng.integers(-2, 3, (40, 24)).astype(dtype))
            plan = ProtectedMatmul(a, b)
            for _ in range(2):  # the second finds the accumulators as the first left them
                plan.execute(a, b)
                assert not plan.settle().detected  # k = 40: two slabs add into each prediction
            assert plan.counters.rare_paths == 0
            odd = cupy.asarray(rng.integers(-2, 3, (40, 23)).astype(dtype))  # n % V != 0
            plan = ProtectedMatmul(a, odd)
            handed = plan.execute(a, odd)
            assert not plan.settle().detected
            cols = cupy.zeros((2, 40, 5))
            be.col_reduce(a, None, cols)  # a's column encoding, handed on below
            nxt = ProtectedMatmul(a, odd)
            enc = cupy.ascontiguousarray(cols[..., :3].transpose(2, 0, 1))
            nxt.execute(a, odd, a_checksums=abftgemm.Checksums(cols=enc))
            assert not nxt.settle().detected
            assert handed is not None
            long_host = rng.integers(-3, 4, (1, 1024, 8)).astype(dtype)
            long = cupy.asarray(long_host)
            out = cupy.zeros((1, 8, 5))
            be.col_reduce(long, None, out)  # 1024 rows, one column block: several chunks
            col = long_host.astype(np.float64)[0]
            w = (np.arange(1024) + 1) / 1024
            want = np.stack([col.sum(0), w @ col, np.abs(col).sum(0), 0 * col[0], -1 + 0 * col[0]], -1)
            np.testing.assert_array_equal(out.get()[0], want)  # small integers: exact sums
            be.row_reduce(long, None, cupy.zeros((1, 1024, 5)))
            counts = cupy.zeros(2, np.uint64)
            off = out.copy()
            off[0, 1:6, 0] += 100.0  # five vectors disagree
            tau, bad, _ = be.flag(off, out, (1e-3, 1e-3, 0.0, 2.0), np.inf, counts)
            assert bad.get()[0].tolist() == [False] + [True] * 5 + [False] * 2
            assert counts.get().tolist() == [5, 0]
            for causal in (False, True):
                layer = MultiHeadAttention(16, 2, causal=causal, dtype=dtype, xp=cupy, seed=1)
                x = cupy.asarray(rng.standard_normal((2, 9, 16)).astype(dtype))
                y, cache = layer.forward(x)
                layer.backward(cupy.asarray(rng.standard_normal((2, 9, 16)).astype(dtype)), cache)
            q, k, v = (cupy.asarray(rng.standard_normal((2, 40, 16)).astype(dtype)) for _ in "qkv")
            _, saved = fused_forward(q, k, v, Context(), causal=True)  # the fused core's kernels
            fused_backward(saved, q, Context())
    finally:
        launch.RawKernel.__call__ = call
    names = {name for name, _ in seen}
    observe = {scalars[-1] for name, scalars in seen if name.startswith(kernels.PLAN_OBSERVE_FLAG)}
    assert observe == {0, 1}  # by 16-byte vectors and element by element
    assert any(name.startswith(kernels.PLAN_PREDICT) and scalars[-2] > 1 for name, scalars in seen)
    everything = {n for registry in (kernels, attention_kernels)
                  for names_ in registry.MODULES.values() for n in names_}
    assert everything <= names, sorted(everything - names)


def test_a_shared_a_is_read_once_by_the_prediction_whatever_the_batch():
    """A product of one a with a batch of b (a_batches == 1) predicts every batch item from one
    encoding of a: the kernels read a's bytes once (they read it once per batch item before),
    and the predictions are those of the batch written out."""
    import cupy

    from abftgemm import ProtectedMatmul

    rng = np.random.default_rng(3)
    a_host = rng.integers(-2, 3, (1, 300, 64)).astype(np.float32)
    b_host = rng.integers(-2, 3, (6, 64, 40)).astype(np.float32)
    a, b = cupy.asarray(a_host), cupy.asarray(b_host)
    plan = ProtectedMatmul(a, b)
    before = a._alloc.read_bytes()
    got = plan.execute(a, b)
    assert not plan.settle().detected
    assert a._alloc.read_bytes() - before == a_host.nbytes  # cuBLAS's own read is not counted
    np.testing.assert_array_equal(got.get(), np.matmul(a_host, b_host))
    plan.execute(a, b)  # the kernels left their accumulators and counters clean for it
    assert not plan.settle().detected
    assert plan.counters.rare_paths == 0  # not even a flag that the rare path then cleared
    faulty = plan.execute(a, b, fault_hook=lambda site, c: c.__setitem__((4, 7, 3), 1e6))
    assert plan.settle().detected
    np.testing.assert_array_equal(faulty.get(), np.matmul(a_host, b_host))
