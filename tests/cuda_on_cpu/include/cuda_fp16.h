// Empty stand-in: tests/cuda_on_cpu/simt.h defines __half and its conversions for the host compiler.
#pragma once
