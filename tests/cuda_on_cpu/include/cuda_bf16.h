// Empty stand-in: tests/cuda_on_cpu/simt.h defines __nv_bfloat16 and its conversions for the host compiler.
#pragma once
