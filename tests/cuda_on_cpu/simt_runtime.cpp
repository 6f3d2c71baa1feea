// The SIMT runtime behind simt.h: runs a grid on one OS thread, blocks one after another, every
// CUDA thread of a block a fiber switched at __syncthreads and warp intrinsics; and the checks a
// GPU sanitizer makes, fed by the __tsan_* hooks the instrumented kernel code calls on every load
// and store:
//   - global memory: every access must fall inside a registered device allocation (its guard
//     zones and anything unregistered are out of bounds); reads of bytes of a fresh (cupy.empty)
//     allocation that nothing wrote yet are reads of uninitialized memory;
//   - shared memory (the kernel module's .bss): a byte written by one thread and read or written
//     by another within one barrier interval is a race; reading a byte no thread of the block has
//     written is a read of uninitialized shared memory;
//   - warp intrinsics: every lane of the mask must reach the same intrinsic with the same mask,
//     else the launch fails with a message (on a GPU: a hang or undefined values).
// The first error aborts the launch; the message names the kernel, the block and the thread.
// Compiled without instrumentation (tests/cuda_on_cpu/build.py), loaded once with RTLD_GLOBAL.
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <link.h>
#include <dlfcn.h>
#include <map>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>
#include <xmmintrin.h>

#include "simt_abi.h"

namespace simt {
int fail(const SimtLaunch* launch, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
}

namespace {

// ------------------------------------------------------------------ fibers
#if defined(__x86_64__)
extern "C" void simt_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl simt_switch
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
)");
#else
#error "tests/cuda_on_cpu: the fiber switch is written for x86-64"
#endif

constexpr size_t kStack = 256 * 1024;

enum State : int { READY, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
    void* sp = nullptr;
    char* stack = nullptr;  // usable [stack, stack + kStack), a guard page below
    uint3 tid{};
    int linear = 0;
    State state = READY;
    // a pending warp intrinsic
    int op = 0;
    unsigned mask = 0;
    int arg = 0, width = 32;
    unsigned char value[8] = {};
    const char* op_name = "";
};

struct Alloc {
    uintptr_t lo = 0, hi = 0, guard = 0;
    mutable unsigned long long read_bytes = 0;  // by kernels, since registration
    std::vector<unsigned char> written;  // per byte, while the allocation is fresh
    size_t unwritten = 0;
};

struct SharedShadow {
    unsigned block = 0;       // block sequence number of the record; older = never written here
    unsigned w_epoch = 0, w_wepoch = 0, r_epoch = 0, r_wepoch = 0;
    unsigned short w_tid = 0, r_tid = 0;  // thread + 1; 0 = none this block
    unsigned char r_multi = 0;
};

struct Module {
    uintptr_t lo = 0, hi = 0;  // .bss: the module's __shared__ variables
    std::vector<SharedShadow> shadow;
};

std::map<uintptr_t, Alloc> g_allocs;  // by lo
std::map<uintptr_t, Module> g_modules;  // by load base

std::vector<Fiber> g_fibers;
Fiber* g_current = nullptr;
void* g_sched_sp = nullptr;
bool g_in_kernel = false;  // hooks check only while a fiber runs kernel code
bool g_abort = false;
std::string g_error;

const SimtLaunch* g_launch = nullptr;
void (*g_entry)(void*) = nullptr;
void* g_ctx = nullptr;
uint3 g_block{};
dim3 g_block_dim{}, g_grid_dim{};
unsigned g_block_seq = 0;
unsigned g_epoch = 0;               // barrier intervals of the running block
std::vector<unsigned> g_warp_epoch;  // __syncwarp intervals per warp
Module* g_module = nullptr;

std::string where() {
    char buf[160];
    const Fiber* f = g_current;
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", g_block.x, g_block.y,
                  g_block.z, f ? f->tid.x : 0, f ? f->tid.y : 0, f ? f->tid.z : 0);
    return buf;
}

std::string thread_name(int linear) {
    const unsigned bx = g_block_dim.x, by = g_block_dim.y;
    char buf[64];
    std::snprintf(buf, sizeof buf, "thread (%u,%u,%u)", linear % bx, (linear / bx) % by,
                  linear / (bx * by));
    return buf;
}

// Record the first error and leave the kernel: the fiber never runs again.
[[noreturn]] void abort_fiber(const std::string& message) {
    if (!g_abort) {
        g_abort = true;
        g_error = std::string(g_launch ? g_launch->name : "?") + ": " + message;
    }
    Fiber* f = g_current;
    f->state = DONE;
    simt_switch(&f->sp, g_sched_sp);
    __builtin_unreachable();
}

int g_n = 0;                        // threads of the block
int g_done = 0, g_at_barrier = 0;
std::vector<int> g_warp_waiting;    // lanes of each warp at a warp intrinsic

// Leave the current fiber (its state already says why) for the next ready one, or the scheduler
// when none is ready; returns when something switches back to it.
// The current warp's lanes come first (a warp runs from intrinsic to intrinsic while it can, so
// few stacks are in cache), then the other warps in order.
void run_next() {
    Fiber* f = g_current;
    const int base = f->linear & ~31, lanes = std::min(32, g_n - base), lane = f->linear - base;
    for (int k = 1; k < lanes; ++k) {
        Fiber& g = g_fibers[base + (lane + k) % lanes];
        if (g.state == READY) {
            g_current = &g;
            simt_switch(&f->sp, g.sp);
            return;
        }
    }
    for (int k = lanes; k < g_n; ++k) {
        int j = base + k;
        if (j >= g_n) j -= g_n;
        Fiber& g = g_fibers[j];
        if (g.state == READY) {
            g_current = &g;
            simt_switch(&f->sp, g.sp);
            return;
        }
    }
    simt_switch(&f->sp, g_sched_sp);
}

void release_barrier() {
    ++g_epoch;  // every live thread is at __syncthreads: a new interval
    g_at_barrier = 0;
    for (int i = 0; i < g_n; ++i)
        if (g_fibers[i].state == AT_BARRIER) g_fibers[i].state = READY;
}

void fiber_main() {
    g_entry(g_ctx);
    g_current->state = DONE;
    ++g_done;
    if (g_at_barrier && g_at_barrier + g_done == g_n) release_barrier();  // exited threads drop out
    run_next();
    __builtin_unreachable();
}

char* new_stack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) return nullptr;
    mprotect(p, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
    return static_cast<char*>(p) + page;
}

void start_fiber(Fiber& f) {
    // Stack tops staggered by thread: tops 256 KiB apart would share cache sets and evict each
    // other at every switch.
    const uintptr_t stagger = (static_cast<uintptr_t>(f.linear) * 1088u) % 32768u;
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack + kStack) - stagger) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;                                            // fiber_main's return address (never used)
    *--sp = reinterpret_cast<uint64_t>(&fiber_main);      // simt_switch returns here
    for (int i = 0; i < 6; ++i) *--sp = 0;                // rbp rbx r12 r13 r14 r15
    f.sp = sp;
    f.state = READY;
}

// ------------------------------------------------------------------ warp intrinsics
int popcount(unsigned m) {
    m = m - ((m >> 1) & 0x55555555u);
    m = (m & 0x33333333u) + ((m >> 2) & 0x33333333u);
    return static_cast<int>((((m + (m >> 4)) & 0x0f0f0f0fu) * 0x01010101u) >> 24);
}

void finish_group(int w, Fiber* fs, unsigned mask);

// Complete the intrinsic f waits at if every lane of its mask waits at the same one.
__attribute__((noinline)) bool try_complete(int w, const Fiber& f) {
    const int base = w * 32;
    const int lanes = std::min(32, g_n - base);
    Fiber* fs = &g_fibers[base];
    for (int o = 0; o < 32; ++o) {
        if (!(f.mask >> o & 1u)) continue;
        if (o >= lanes || fs[o].state != AT_WARP || fs[o].op != f.op || fs[o].mask != f.mask)
            return false;
    }
    finish_group(w, fs, f.mask);
    return !g_abort;
}

void fail_block(const char* message) {
    if (!g_abort) {
        g_abort = true;
        g_error = std::string(g_launch->name) + ": " + message;
    }
}

// The results of a complete intrinsic, from the values as the lanes brought them; the lanes go on.
__attribute__((noinline)) void finish_group(int w, Fiber* fs, unsigned mask) {
    unsigned char in[32][8];
    unsigned ballot = 0;
    for (int o = 0; o < 32; ++o) {
        if (!(mask >> o & 1u)) continue;
        std::memcpy(in[o], fs[o].value, 8);
        if (in[o][0]) ballot |= 1u << o;
    }
    const int op = fs[__builtin_ctz(mask)].op;
    for (int o = 0; o < 32; ++o) {
        if (!(mask >> o & 1u)) continue;
        Fiber& g = fs[o];
        const int width = g.width, seg = o & ~(width - 1);
        int src = o;
        switch (op) {
            case 0: src = seg + (g.arg & (width - 1)); break;
            case 1: src = o ^ g.arg; if (src >= seg + width) src = o; break;
            case 2: src = (o - seg) + g.arg < width ? o + g.arg : o; break;
            case 3: src = (o - seg) - g.arg >= 0 ? o - g.arg : o; break;
            default: break;
        }
        if (op <= 3) {
            if (src < 0 || src > 31 || !(mask >> src & 1u)) {
                char buf[300];
                std::snprintf(buf, sizeof buf, "%s (mask 0x%08x) in block (%u,%u,%u) warp %d: lane "
                              "%d reads lane %d, which is not in the mask", g.op_name, mask,
                              g_block.x, g_block.y, g_block.z, w, o, src);
                fail_block(buf);
                return;
            }
            std::memcpy(g.value, in[src], 8);
        } else {
            const unsigned r = op == 4 ? ballot != 0 : op == 5 ? ballot == mask
                               : op == 6 ? ballot : 0;
            std::memset(g.value, 0, 8);
            std::memcpy(g.value, &r, 4);
        }
        g.state = READY;
    }
    if (op == 7) ++g_warp_epoch[w];  // __syncwarp: a new interval for the warp
}

// Nothing is ready: say why the lanes of warp w that wait at an intrinsic cannot go on (a lane
// of the mask exited, waits at __syncthreads or at another intrinsic).
void diagnose_warp(int w) {
    const int base = w * 32;
    const int lanes = std::min(32, g_n - base);
    Fiber* fs = &g_fibers[base];
    for (int l = 0; l < lanes; ++l) {
        const Fiber& f = fs[l];
        if (f.state != AT_WARP) continue;
        for (int o = 0; o < 32; ++o) {
            if (!(f.mask >> o & 1u)) continue;
            char buf[400];
            if (o >= lanes || fs[o].state == DONE) {
                std::snprintf(buf, sizeof buf, "%s (mask 0x%08x) in block (%u,%u,%u) warp %d: lane "
                              "%d waits for lane %d, which %s", f.op_name, f.mask, g_block.x,
                              g_block.y, g_block.z, w, l, o,
                              o >= lanes ? "does not exist" : "has exited");
                fail_block(buf);
                return;
            }
            const Fiber& g = fs[o];
            if (g.state != AT_WARP || g.op != f.op || g.mask != f.mask) {
                std::snprintf(buf, sizeof buf, "%s (mask 0x%08x) in block (%u,%u,%u) warp %d: lane "
                              "%d waits there, lane %d of the mask is at %s (divergent warp "
                              "intrinsic)", f.op_name, f.mask, g_block.x, g_block.y, g_block.z, w,
                              l, o, g.state == AT_BARRIER ? "__syncthreads" : g.op_name);
                fail_block(buf);
                return;
            }
        }
    }
}

// ------------------------------------------------------------------ memory checks
std::string describe_global(uintptr_t a, unsigned size) {
    // The allocation whose guard zones or data hold a, if any.
    char buf[200];
    auto it = g_allocs.upper_bound(a + (1u << 20));
    while (it != g_allocs.begin()) {
        const Alloc& al = (--it)->second;
        if (a >= al.hi + al.guard) break;
        if (a + al.guard < al.lo) continue;
        const size_t bytes = al.hi - al.lo;
        if (a >= al.hi)
            std::snprintf(buf, sizeof buf, "%u bytes at %zu bytes past the end of a %zu-byte "
                          "device allocation", size, static_cast<size_t>(a - al.hi), bytes);
        else if (a < al.lo)
            std::snprintf(buf, sizeof buf, "%u bytes at %zu bytes before the start of a %zu-byte "
                          "device allocation", size, static_cast<size_t>(al.lo - a), bytes);
        else
            std::snprintf(buf, sizeof buf, "%u bytes at offset %zu of a %zu-byte device "
                          "allocation, across its end", size, static_cast<size_t>(a - al.lo),
                          bytes);
        return buf;
    }
    std::snprintf(buf, sizeof buf, "%u bytes at 0x%llx, outside every device allocation", size,
                  static_cast<unsigned long long>(a));
    return buf;
}

// A few recently hit allocations: kernels alternate between their operands.
constexpr int kCache = 8;
const Alloc* g_cache[kCache] = {};
int g_cache_next = 0;

void forget_allocations() {
    for (auto& c : g_cache) c = nullptr;
}

const Alloc* find_alloc(uintptr_t a) {
    for (const Alloc* c : g_cache)
        if (c && a >= c->lo && a < c->hi) return c;
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin()) return nullptr;
    const Alloc& al = std::prev(it)->second;
    if (a < al.lo || a >= al.hi) return nullptr;
    g_cache[g_cache_next] = &al;
    g_cache_next = (g_cache_next + 1) % kCache;
    return &al;
}

void global_access(uintptr_t a, unsigned size, bool write, bool atomic) {
    const Alloc* al = find_alloc(a);
    if (!al || a + size > al->hi) {
        abort_fiber(where() + (atomic ? " atomically accesses " : write ? " writes " : " reads ") +
                    describe_global(a, size) +
                    " (out-of-bounds global memory access)");
    }
    if (!write || atomic) al->read_bytes += size;
    if (al->unwritten == 0) return;
    Alloc* m = const_cast<Alloc*>(al);
    const size_t off = a - al->lo;
    if (!write || atomic) {
        for (unsigned i = 0; i < size; ++i) {
            if (!m->written[off + i]) {
                char buf[160];
                std::snprintf(buf, sizeof buf, " reads %u bytes at offset %zu of a %zu-byte device "
                              "allocation that nothing has written (uninitialized memory)", size,
                              off, static_cast<size_t>(al->hi - al->lo));
                abort_fiber(where() + buf);
            }
        }
    }
    if (write) {
        for (unsigned i = 0; i < size; ++i) {
            if (!m->written[off + i]) {
                m->written[off + i] = 1;
                if (--m->unwritten == 0) {
                    m->written.clear();
                    m->written.shrink_to_fit();
                    forget_allocations();
                    return;
                }
            }
        }
    }
}

void shared_access(uintptr_t a, unsigned size, bool write) {
    Module& mod = *g_module;
    if (a + size > mod.hi) abort_fiber(where() + " accesses shared memory past its end");
    const Fiber& f = *g_current;
    const unsigned short me = static_cast<unsigned short>(f.linear + 1);
    const int my_warp = f.linear / 32;
    const unsigned wepoch = g_warp_epoch[my_warp];
    auto concurrent = [&](unsigned epoch, unsigned wep, unsigned short tid) {
        if (epoch != g_epoch) return false;
        const int other_warp = (tid - 1) / 32;
        return !(other_warp == my_warp && wep != wepoch);
    };
    for (unsigned i = 0; i < size; ++i) {
        SharedShadow& s = mod.shadow[a - mod.lo + i];
        if (s.block != g_block_seq) {
            if (!write) {
                char buf[200];
                std::snprintf(buf, sizeof buf, " reads %u bytes at shared offset %zu that no thread "
                              "of the block has written (uninitialized shared memory)", size,
                              static_cast<size_t>(a - mod.lo));
                abort_fiber(where() + buf);
            }
            s = SharedShadow{};
            s.block = g_block_seq;
        }
        const char* race = nullptr;
        unsigned short other = 0;
        if (s.w_tid && s.w_tid != me && concurrent(s.w_epoch, s.w_wepoch, s.w_tid)) {
            race = write ? "writes" : "reads";
            other = s.w_tid;
        } else if (write && s.r_tid && (s.r_tid != me || s.r_multi) &&
                   concurrent(s.r_epoch, s.r_wepoch, s.r_tid)) {
            race = "writes";
            other = s.r_tid != me ? s.r_tid : 0;
        }
        if (race) {
            char buf[300];
            std::snprintf(buf, sizeof buf, " %s %u bytes at shared offset %zu, which %s %s in the "
                          "same barrier interval (shared-memory race)", race, size,
                          static_cast<size_t>(a - mod.lo),
                          other ? thread_name(other - 1).c_str() : "another thread",
                          other == s.w_tid ? "wrote" : "read");
            abort_fiber(where() + buf);
        }
        if (write) {
            s.w_tid = me;
            s.w_epoch = g_epoch;
            s.w_wepoch = wepoch;
        } else if (!s.r_tid || !concurrent(s.r_epoch, s.r_wepoch, s.r_tid)) {
            s.r_tid = me;
            s.r_epoch = g_epoch;
            s.r_wepoch = wepoch;
            s.r_multi = 0;
        } else if (s.r_tid != me) {
            s.r_multi = 1;
        }
    }
}

inline void access(void* p, unsigned size, bool write) {
    if (!g_in_kernel) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const Fiber* f = g_current;
    if (a >= reinterpret_cast<uintptr_t>(f->stack) &&
        a < reinterpret_cast<uintptr_t>(f->stack) + kStack)
        return;
    if (g_module && a >= g_module->lo && a < g_module->hi) {
        shared_access(a, size, write);
        return;
    }
    global_access(a, size, write, false);
}

int find_bss(struct dl_phdr_info* info, size_t, void* data) {
    auto* out = static_cast<std::pair<uintptr_t, Module*>*>(data);
    if (info->dlpi_addr != out->first) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_LOAD && (ph.p_flags & PF_W) && ph.p_memsz > ph.p_filesz) {
            out->second->lo = info->dlpi_addr + ph.p_vaddr + ph.p_filesz;
            out->second->hi = info->dlpi_addr + ph.p_vaddr + ph.p_memsz;
        }
    }
    return 1;
}

Module* module_of(const void* anchor) {
    Dl_info info;
    if (!dladdr(anchor, &info)) return nullptr;
    const uintptr_t base = reinterpret_cast<uintptr_t>(info.dli_fbase);
    auto it = g_modules.find(base);
    if (it != g_modules.end()) return &it->second;
    Module& m = g_modules[base];
    // dl_iterate_phdr reports dlpi_addr (the load bias), which for a shared object is its base.
    std::pair<uintptr_t, Module*> data{base, &m};
    dl_iterate_phdr(find_bss, &data);
    m.shadow.resize(m.hi - m.lo);
    return &m;
}

}  // namespace

// ------------------------------------------------------------------ API for simt.h
extern "C" {

uint3 simt_thread_idx() { return g_current->tid; }
uint3 simt_block_idx() { return g_block; }
dim3 simt_block_dim() { return g_block_dim; }
dim3 simt_grid_dim() { return g_grid_dim; }

void simt_syncthreads() {
    g_current->state = AT_BARRIER;
    if (++g_at_barrier + g_done == g_n) {
        release_barrier();  // the last thread to arrive goes on at once
        return;
    }
    run_next();
}

void simt_warp_op(int kind, unsigned mask, void* value, int arg, int width,
                  const char* name) {
    Fiber* f = g_current;
    const int lane = f->linear % 32;
    if (!(mask >> lane & 1u)) {
        char buf[160];
        std::snprintf(buf, sizeof buf, " calls %s with mask 0x%08x, which does not hold its own "
                      "lane %d", name, mask, lane);
        abort_fiber(where() + buf);
    }
    if (width <= 0 || width > 32 || (width & (width - 1))) {
        abort_fiber(where() + " calls " + name + " with a width that is not a power of 2 <= 32");
    }
    f->op = kind;
    f->mask = mask;
    f->arg = arg;
    f->width = width;
    f->op_name = name;
    std::memcpy(f->value, value, 8);
    f->state = AT_WARP;
    const int w = f->linear / 32;
    const int lanes = popcount(mask);
    if (++g_warp_waiting[w] >= lanes && try_complete(w, *f)) {
        g_warp_waiting[w] -= lanes;  // the last lane of the mask to arrive goes on at once
    } else if (g_abort) {
        f->state = DONE;
        simt_switch(&f->sp, g_sched_sp);
    } else {
        run_next();
    }
    std::memcpy(value, f->value, 8);
}

void simt_syncwarp(unsigned mask) {
    unsigned char v[8] = {};
    simt_warp_op(7, mask, v, 0, 32, "__syncwarp");
}

void simt_atomic_access(const void* p, int size, const char* name) {
    if (!g_in_kernel) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a % size) abort_fiber(where() + " calls " + name + " on a misaligned address");
    if (g_module && a >= g_module->lo && a < g_module->hi) return;  // shared atomics: no race
    global_access(a, static_cast<unsigned>(size), true, true);
}

void simt_fail(const char* message) { abort_fiber(where() + ": " + message); }

int simt_register(uintptr_t lo, size_t size, size_t guard, int fresh) {
    Alloc a;
    a.lo = lo;
    a.hi = lo + size;
    a.guard = guard;
    if (fresh && size) {
        a.written.assign(size, 0);
        a.unwritten = size;
    }
    forget_allocations();
    g_allocs[lo] = std::move(a);
    return 0;
}

void simt_unregister(uintptr_t lo) {
    forget_allocations();
    g_allocs.erase(lo);
}

// The host wrote into the allocation (a copy, a fill, cuBLAS): all of it counts as written.
void simt_mark_written(uintptr_t lo) {
    auto it = g_allocs.find(lo);
    if (it == g_allocs.end()) return;
    forget_allocations();
    it->second.written.clear();
    it->second.written.shrink_to_fit();
    it->second.unwritten = 0;
}

// Bytes kernels have read from the allocation starting at lo (atomics included).
unsigned long long simt_read_bytes(uintptr_t lo) {
    auto it = g_allocs.find(lo);
    return it == g_allocs.end() ? 0 : it->second.read_bytes;
}

// 1 when some byte of the allocation starting at lo is not written yet.
int simt_is_fresh(uintptr_t lo) {
    auto it = g_allocs.find(lo);
    return it != g_allocs.end() && it->second.unwritten != 0;
}

int simt_run(const SimtLaunch* launch, void (*entry)(void*), void* ctx, const void* anchor) {
    g_launch = launch;
    g_entry = entry;
    g_ctx = ctx;
    g_abort = false;
    g_error.clear();
    g_module = module_of(anchor);
    const unsigned bx = launch->block[0], by = launch->block[1], bz = launch->block[2];
    const int n = static_cast<int>(bx * by * bz);
    g_block_dim = {bx, by, bz};
    g_grid_dim = {launch->grid[0], launch->grid[1], launch->grid[2]};
    while (static_cast<int>(g_fibers.size()) < n) {
        Fiber f;
        f.stack = new_stack();
        if (!f.stack) return simt::fail(launch, "cannot allocate fiber stacks");
        g_fibers.push_back(f);
    }
    const unsigned csr = _mm_getcsr();
    if (launch->ftz) _mm_setcsr(csr | 0x8040);  // FTZ and DAZ, as -ftz=true on the GPU
    g_warp_epoch.assign((n + 31) / 32, 0);
    g_warp_waiting.assign((n + 31) / 32, 0);
    g_n = n;
    g_in_kernel = true;
    for (unsigned z = 0; z < g_grid_dim.z && !g_abort; ++z)
        for (unsigned y = 0; y < g_grid_dim.y && !g_abort; ++y)
            for (unsigned x = 0; x < g_grid_dim.x && !g_abort; ++x) {
                g_block = {x, y, z};
                ++g_block_seq;
                g_epoch = 0;
                std::fill(g_warp_epoch.begin(), g_warp_epoch.end(), 0u);
                for (int i = 0; i < n; ++i) {
                    Fiber& f = g_fibers[i];
                    f.linear = i;
                    f.tid = {i % bx, (i / bx) % by, i / (bx * by)};
                    start_fiber(f);
                }
                g_done = 0;
                g_at_barrier = 0;
                std::fill(g_warp_waiting.begin(), g_warp_waiting.end(), 0);
                int next = 0;
                for (;;) {
                    // Fibers hand over to each other; back here when none is ready.
                    g_current = &g_fibers[next];
                    simt_switch(&g_sched_sp, g_current->sp);
                    g_current = nullptr;
                    if (g_abort || g_done == n) break;
                    for (int w = 0; w * 32 < n && !g_abort; ++w) diagnose_warp(w);
                    if (g_abort) break;
                    if (g_at_barrier + g_done == n) release_barrier();
                    next = -1;
                    for (int i = 0; i < n && next < 0; ++i)
                        if (g_fibers[i].state == READY) next = i;
                    if (next < 0) {
                        fail_block("threads of the block deadlocked");
                        break;
                    }
                }
            }
    _mm_setcsr(csr);
    g_in_kernel = false;
    g_launch = nullptr;
    if (g_abort) {
        std::snprintf(launch->error, launch->error_size, "%s", g_error.c_str());
        return 1;
    }
    return 0;
}

// ------------------------------------------------------------------ -fsanitize=thread entry points
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void*, void*) {}
void __tsan_vptr_read(void*) {}
#define SIMT_HOOKS(N)                                                   \
    void __tsan_read##N(void* p) { access(p, N, false); }               \
    void __tsan_write##N(void* p) { access(p, N, true); }               \
    void __tsan_unaligned_read##N(void* p) { access(p, N, false); }     \
    void __tsan_unaligned_write##N(void* p) { access(p, N, true); }     \
    void __tsan_volatile_read##N(void* p) { access(p, N, false); }      \
    void __tsan_volatile_write##N(void* p) { access(p, N, true); }
SIMT_HOOKS(1)
SIMT_HOOKS(2)
SIMT_HOOKS(4)
SIMT_HOOKS(8)
SIMT_HOOKS(16)
#undef SIMT_HOOKS
void __tsan_read_range(void* p, unsigned long n) {
    for (unsigned long i = 0; i < n; i += 8) access(static_cast<char*>(p) + i, n - i < 8 ? n - i : 8, false);
}
void __tsan_write_range(void* p, unsigned long n) {
    for (unsigned long i = 0; i < n; i += 8) access(static_cast<char*>(p) + i, n - i < 8 ? n - i : 8, true);
}

}  // extern "C"

namespace simt {
int fail(const SimtLaunch* launch, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(launch->error, launch->error_size, fmt, ap);
    va_end(ap);
    return 1;
}
}  // namespace simt
