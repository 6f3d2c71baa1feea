// What simt.h (the kernel modules) and simt_runtime.cpp (the runtime) both see: the index types
// and the launch record one simt_launch_<i> entry point receives from tests/cuda_on_cpu/launch.py.
#pragma once

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };

struct SimtLaunch {
    const char* name;
    unsigned grid[3];
    unsigned block[3];
    int ftz;
    int nargs;
    void* const* values;    // pointers to each argument's bytes
    const int* sizes;       // bytes of each argument as passed
    const int* pointers;    // 1 where a device pointer (or None) was passed
    char* error;            // message on failure
    int error_size;
};
