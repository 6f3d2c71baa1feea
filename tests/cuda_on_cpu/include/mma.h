// Empty stand-in: tests/cuda_on_cpu/simt.h defines nvcuda::wmma for the host compiler.
#pragma once
