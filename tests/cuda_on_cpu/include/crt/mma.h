// Empty stand-in: its presence tells kernels that mma.h is complete (attention/kernels/fused.cu);
// tests/cuda_on_cpu/simt.h defines nvcuda::wmma for the host compiler.
#pragma once
