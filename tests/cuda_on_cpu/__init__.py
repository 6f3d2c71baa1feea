"""CUDA on the CPU, for tests: the abftgemm CUDA kernels and their unchanged CuPy launch code run
on the host, checked as a GPU sanitizer would check them.

- :mod:`.build` compiles the ``.cu`` sources with the host C++ compiler (``simt.h`` defines the CUDA
  built-ins, ``simt_runtime.cpp`` runs blocks of fibers and checks memory accesses);
- :mod:`.memory` and :mod:`.arrays` are emulated device memory (guarded allocations) and a
  ``cupy.ndarray`` stand-in over it;
- :mod:`.launch` is ``RawModule``/``RawKernel`` with CuPy's argument conventions;
- :mod:`.cublas` is the part of cuBLAS the backend calls (``gemmStridedBatchedEx`` and modes);
- :mod:`.standin` assembles the ``cupy``, ``cupyx`` and ``cupy_backends`` modules and swaps them
  into ``sys.modules`` for the tests marked ``cuda_on_cpu``.

docs/gpu_testing.md says what this proves and what only a GPU can.
"""
