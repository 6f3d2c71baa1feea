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

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct SimtLaunch {
    const char* name;
    unsigned grid[3];
    unsigned block[3];
    int ftz;
    int nargs;
    void* const* values;
    const int* sizes;
    const int* pointers;
    char* error;
    int error_size;
};

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
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
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
    int arg = 0, width = 32, size = 0;
    unsigned char value[8] = {};
    const char* op_name = "";
};

struct Alloc {
    uintptr_t lo = 0, hi = 0, guard = 0;
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
const Alloc* g_last = nullptr;

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
    g_in_kernel = false;
    Fiber* f = g_current;
    f->state = DONE;
    simt_switch(&f->sp, g_sched_sp);
    __builtin_unreachable();
}

void yield(State s) {
    Fiber* f = g_current;
    f->state = s;
    g_in_kernel = false;
    simt_switch(&f->sp, g_sched_sp);
    g_in_kernel = true;
}

void fiber_main() {
    g_in_kernel = true;
    g_entry(g_ctx);
    g_in_kernel = false;
    g_current->state = DONE;
    simt_switch(&g_current->sp, g_sched_sp);
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
    uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + kStack) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;                                            // fiber_main's return address (never used)
    *--sp = reinterpret_cast<uint64_t>(&fiber_main);      // simt_switch returns here
    for (int i = 0; i < 6; ++i) *--sp = 0;                // rbp rbx r12 r13 r14 r15
    --sp;
    uint32_t csr = _mm_getcsr();
    uint16_t cw;
    asm volatile("fnstcw %0" : "=m"(cw));
    std::memcpy(sp, &csr, 4);
    std::memcpy(reinterpret_cast<char*>(sp) + 4, &cw, 2);
    f.sp = sp;
    f.state = READY;
}

// ------------------------------------------------------------------ warp intrinsics
bool complete_warp(int w, int n_threads) {
    // Lanes of warp w waiting at an intrinsic whose mask is complete: compute and release them.
    const int base = w * 32;
    const int lanes = std::min(32, n_threads - base);
    Fiber* fs = &g_fibers[base];
    bool progress = false;
    for (int l = 0; l < lanes; ++l) {
        Fiber& f = fs[l];
        if (f.state != AT_WARP) continue;
        const unsigned mask = f.mask;
        for (int o = 0; o < 32; ++o) {
            if (!(mask >> o & 1u)) continue;
            char buf[400];
            if (o >= lanes || fs[o].state == DONE) {
                std::snprintf(buf, sizeof buf,
                              "%s (mask 0x%08x) in block (%u,%u,%u) warp %d: lane %d waits for lane "
                              "%d, which %s",
                              f.op_name, mask, g_block.x, g_block.y, g_block.z, w, l, o,
                              o >= lanes ? "does not exist" : "has exited");
                g_current = &f;
                g_abort = true;
                g_error = std::string(g_launch->name) + ": " + buf;
                return false;
            }
            const Fiber& g = fs[o];
            if (g.state == AT_BARRIER || g.op != f.op || g.mask != mask) {
                std::snprintf(buf, sizeof buf,
                              "%s (mask 0x%08x) in block (%u,%u,%u) warp %d: lane %d waits there, "
                              "lane %d of the mask is at %s (divergent warp intrinsic)",
                              f.op_name, mask, g_block.x, g_block.y, g_block.z, w, l, o,
                              g.state == AT_BARRIER ? "__syncthreads" : g.op_name);
                g_abort = true;
                g_error = std::string(g_launch->name) + ": " + buf;
                return false;
            }
        }
        // Every lane of the mask is here: results from the values as they arrived.
        unsigned char in[32][8];
        for (int o = 0; o < 32; ++o)
            if (mask >> o & 1u) std::memcpy(in[o], fs[o].value, 8);
        unsigned ballot = 0;
        for (int o = 0; o < 32; ++o)
            if ((mask >> o & 1u) && in[o][0]) ballot |= 1u << o;
        for (int o = 0; o < 32; ++o) {
            if (!(mask >> o & 1u)) continue;
            Fiber& g = fs[o];
            const int width = g.width, seg = o & ~(width - 1);
            int src = o;
            switch (g.op) {
                case 0: src = seg + (g.arg & (width - 1)); break;
                case 1: src = o ^ g.arg; if (src >= seg + width) src = o; break;
                case 2: src = (o - seg) + g.arg < width ? o + g.arg : o; break;
                case 3: src = (o - seg) - g.arg >= 0 ? o - g.arg : o; break;
                default: break;
            }
            if (g.op <= 3) {
                if (!(mask >> src & 1u)) {
                    char buf[300];
                    std::snprintf(buf, sizeof buf,
                                  "%s (mask 0x%08x) in block (%u,%u,%u) warp %d: lane %d reads lane "
                                  "%d, which is not in the mask",
                                  g.op_name, mask, g_block.x, g_block.y, g_block.z, w, o, src);
                    g_abort = true;
                    g_error = std::string(g_launch->name) + ": " + buf;
                    return false;
                }
                std::memcpy(g.value, in[src], 8);
            } else {
                const unsigned r = g.op == 4 ? ballot != 0 : g.op == 5 ? ballot == mask
                                   : g.op == 6 ? ballot : 0;
                std::memset(g.value, 0, 8);
                std::memcpy(g.value, &r, 4);
            }
            g.state = READY;
        }
        if (fs[l].op == 7) ++g_warp_epoch[w];  // __syncwarp: a new interval for the warp
        progress = true;
    }
    return progress;
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

const Alloc* find_alloc(uintptr_t a) {
    if (g_last && a >= g_last->lo && a < g_last->hi) return g_last;
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin()) return nullptr;
    const Alloc& al = std::prev(it)->second;
    if (a >= al.lo && a < al.hi) return g_last = &al;
    return nullptr;
}

void global_access(uintptr_t a, unsigned size, bool write, bool atomic) {
    const Alloc* al = find_alloc(a);
    if (!al || a + size > al->hi) {
        abort_fiber(where() + (atomic ? " atomically accesses " : write ? " writes " : " reads ") +
                    describe_global(a, size) +
                    " (out-of-bounds global memory access)");
    }
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
                    g_last = nullptr;
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

void simt_syncthreads() { yield(AT_BARRIER); }

void simt_warp_op(int kind, unsigned mask, void* value, int size, int arg, int width,
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
    f->size = size;
    f->op_name = name;
    std::memcpy(f->value, value, 8);
    yield(AT_WARP);
    std::memcpy(value, f->value, 8);
}

void simt_syncwarp(unsigned mask) {
    unsigned char v[8] = {};
    simt_warp_op(7, mask, v, 0, 0, 32, "__syncwarp");
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
    g_last = nullptr;
    g_allocs[lo] = std::move(a);
    return 0;
}

void simt_unregister(uintptr_t lo) {
    g_last = nullptr;
    g_allocs.erase(lo);
}

// The host wrote into the allocation (a copy, a fill, cuBLAS): all of it counts as written.
void simt_mark_written(uintptr_t lo) {
    auto it = g_allocs.find(lo);
    if (it == g_allocs.end()) return;
    g_last = nullptr;
    it->second.written.clear();
    it->second.written.shrink_to_fit();
    it->second.unwritten = 0;
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
                for (;;) {
                    for (int i = 0; i < n && !g_abort; ++i) {
                        Fiber& f = g_fibers[i];
                        if (f.state != READY) continue;
                        g_current = &f;
                        simt_switch(&g_sched_sp, f.sp);
                    }
                    g_current = nullptr;
                    if (g_abort) break;
                    bool progress = false, all_done = true, any_warp = false;
                    for (int w = 0; w * 32 < n; ++w) {
                        progress |= complete_warp(w, n);
                        if (g_abort) break;
                    }
                    if (g_abort) break;
                    if (progress) continue;
                    for (int i = 0; i < n; ++i) {
                        all_done &= g_fibers[i].state == DONE;
                        any_warp |= g_fibers[i].state == AT_WARP;
                    }
                    if (all_done) break;
                    if (any_warp) {  // cannot happen: complete_warp reports every stuck lane
                        g_abort = true;
                        g_error = std::string(launch->name) + ": warp intrinsics deadlocked";
                        break;
                    }
                    ++g_epoch;  // every live thread is at __syncthreads: release them
                    for (int i = 0; i < n; ++i)
                        if (g_fibers[i].state == AT_BARRIER) g_fibers[i].state = READY;
                }
            }
    _mm_setcsr(csr);
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
