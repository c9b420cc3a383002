// Runs the kernels of kernels/paged_attention.cu on the CPU (see cuda_fp16.h
// here for the model and its limits). Built by crates/kernels-turing's
// build.rs under the `cuda-emu` feature; the Rust side is src/emu.rs, which
// drives the same host code as the CUDA backend.
//
// C interface:
//   siliceo_emu_alloc / siliceo_emu_free   buffers that end at a guard page,
//       so a kernel reading or writing past the end faults at once;
//   siliceo_emu_launch                     one launch: grid × block threads,
//       arguments as cuLaunchKernel takes them (an array of pointers to the
//       values) plus their kinds ('p' pointer, 'i' int, 'u' unsigned, 'f' float), which
//       must match the kernel's signature.
//   siliceo_emu_trace / siliceo_emu_trace_stats
//                                          count what the K/V loads of the
//       launches in between cost: loads are grouped per warp as a GPU
//       issues them (a thread's k-th load since its last __syncthreads), and
//       each warp-wide load counts the 32-byte sectors it touches.
#include "paged_attention.cu"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_set>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace emu {

thread_local dim3 block_idx, block_dim, grid_dim;
thread_local void* dynamic_shared_memory = nullptr;

void* dynamic_shared() { return dynamic_shared_memory; }

namespace {

// A fiber's stack: the kernels keep a few hundred bytes of locals (printf
// while debugging needs a few KiB more).
constexpr size_t STACK_BYTES = 64 * 1024;
constexpr unsigned MAX_THREADS = 1024;

// A fiber's stack with a guard page below it (stacks grow down): a kernel
// that overflows it faults instead of writing over other memory.
struct Stack {
    char* base = nullptr;  // the guard page; the stack is the STACK_BYTES above it
    size_t page = 0;
    Stack() {
        page = (size_t)sysconf(_SC_PAGESIZE);
        void* p = mmap(nullptr, page + STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p != MAP_FAILED) {
            base = static_cast<char*>(p);
            mprotect(base, page, PROT_NONE);
        }
    }
    ~Stack() {
        if (base) munmap(base, page + STACK_BYTES);
    }
    Stack(const Stack&) = delete;
    Stack& operator=(const Stack&) = delete;
    char* bottom() const { return base ? base + page : nullptr; }
};

struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    bool done;
    std::unique_ptr<Stack> stack;
    // Barriers passed, and traced loads since the last one.
    unsigned epoch = 0, loads = 0;
};

// What the traced loads cost, over the launches since tracing began.
struct Trace {
    bool on = false;
    // This CTA's loads: (warp, epoch, k) → every lane's (address, bytes).
    std::map<std::tuple<unsigned, unsigned, unsigned>, std::vector<std::pair<uintptr_t, unsigned>>> warp_loads;
    uint64_t requests = 0;      // warp-wide loads
    uint64_t bytes = 0;         // distinct bytes they asked for (a byte two lanes read counts once)
    uint64_t sectors = 0;       // 32-byte sectors they touched, summed over the loads
    std::unordered_set<uintptr_t> distinct;  // sectors touched at all

    // Folds a finished CTA's warp loads into the totals.
    void flush() {
        std::vector<std::pair<uintptr_t, uintptr_t>> spans;
        std::vector<uintptr_t> secs;
        for (auto& kv : warp_loads) {
            spans.clear();
            secs.clear();
            for (auto [a, n] : kv.second) {
                spans.push_back({a, a + n});
                for (uintptr_t sct = a / 32; sct <= (a + n - 1) / 32; sct++) secs.push_back(sct);
            }
            std::sort(spans.begin(), spans.end());
            uintptr_t end = 0;
            for (auto [a, b] : spans) {
                if (b <= end) continue;
                bytes += b - std::max(a, end);
                end = b;
            }
            std::sort(secs.begin(), secs.end());
            sectors += std::unique(secs.begin(), secs.end()) - secs.begin();
            for (uintptr_t sct : secs) distinct.insert(sct);
            requests++;
        }
        warp_loads.clear();
    }
};
thread_local Trace trace;

// Live buffers by start address, so a traced address is counted in sectors
// from its buffer's start: cudaMalloc aligns buffers to 256 bytes, these
// (placed to end at a guard page) only to 16.
std::mutex buffers_lock;
std::map<uintptr_t, size_t> buffers;

// `p` as an offset from a 256-byte-aligned start of its buffer (p itself
// when it lies in none: shared memory, the stack).
uintptr_t device_address(uintptr_t p) {
    std::lock_guard<std::mutex> g(buffers_lock);
    auto it = buffers.upper_bound(p);
    if (it == buffers.begin()) return p;
    --it;
    if (p >= it->first + it->second) return p;
    // A distinct 256-aligned base per buffer, far above any offset.
    return (it->first << 8) + (p - it->first);
}

struct Cta {
    std::vector<Fiber> fibers;
    ucontext_t scheduler;
    Fiber* current = nullptr;
    unsigned live = 0;
    unsigned bar_count = 0, bar_gen = 0;
    unsigned warp_count[MAX_THREADS / 32] = {}, warp_gen[MAX_THREADS / 32] = {};
    float warp_slots[MAX_THREADS / 32][32] = {};
    unsigned long progress = 0;
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
    std::string error;
};

thread_local Cta* cta = nullptr;

void yield_to_scheduler() { swapcontext(&cta->current->ctx, &cta->scheduler); }

void fail(const std::string& what) {
    if (cta->error.empty()) cta->error = what;
}

void fiber_entry() {
    cta->body(cta->body_arg);
    cta->current->done = true;
    cta->live--;
    cta->progress++;
    // Threads that have exited no longer count at __syncthreads.
    if (cta->bar_count > 0 && cta->bar_count == cta->live) {
        cta->bar_count = 0;
        cta->bar_gen++;
    }
    // uc_link returns to the scheduler.
}

void warp_barrier(unsigned warp) {
    unsigned lanes = std::min(32u, block_dim.x - warp * 32);
    unsigned gen = cta->warp_gen[warp];
    cta->progress++;
    if (++cta->warp_count[warp] == lanes) {
        cta->warp_count[warp] = 0;
        cta->warp_gen[warp]++;
        return;
    }
    while (cta->warp_gen[warp] == gen && cta->error.empty()) yield_to_scheduler();
}

}  // namespace

dim3 thread_idx() { return cta->current->tid; }

void trace_load(const void* p, unsigned long bytes) {
    // A GPU faults on a load that is not aligned to its size (these buffers
    // are 16-byte aligned, a GPU's at least 256, so the address tells).
    if ((uintptr_t)p % bytes != 0)
        fail("a " + std::to_string(bytes) + "-byte load from an address that is not a multiple of " +
             std::to_string(bytes) + " (a misaligned address on a GPU)");
    if (!trace.on) return;
    Fiber& f = *cta->current;
    trace.warp_loads[{f.tid.x / 32, f.epoch, f.loads++}].push_back({device_address((uintptr_t)p), (unsigned)bytes});
}

void sync_threads() {
    cta->current->epoch++;
    cta->current->loads = 0;
    unsigned gen = cta->bar_gen;
    cta->progress++;
    if (++cta->bar_count == cta->live) {
        cta->bar_count = 0;
        cta->bar_gen++;
        return;
    }
    while (cta->bar_gen == gen && cta->error.empty()) yield_to_scheduler();
}

float shfl_xor(unsigned mask, float x, int lane_mask) {
    if (mask != 0xffffffffu) fail("__shfl_xor_sync with a partial mask is not emulated");
    unsigned t = cta->current->tid.x, warp = t / 32, lane = t % 32;
    if (lane_mask < 0 || lane_mask > 31 || (block_dim.x - warp * 32) < 32) {
        fail("__shfl_xor_sync in a partial warp or with a lane mask outside 0..31");
        return x;
    }
    cta->warp_slots[warp][lane] = x;
    warp_barrier(warp);
    float r = cta->warp_slots[warp][lane ^ (unsigned)lane_mask];
    warp_barrier(warp);
    return r;
}

// Sets up thread `i`'s fiber to run the kernel from the start. A function of
// its own: getcontext "returns twice", and a caller's loop variables would
// have to survive that.
__attribute__((noinline)) static void start_fiber(Fiber& f, unsigned i, ucontext_t* scheduler) {
    f.tid = {i, 0, 0};
    f.done = false;
    f.epoch = 0;
    f.loads = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack->bottom();
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
}

// Runs one CTA to completion; false (and cta->error) on a deadlock.
//
// Each pass resumes every live thread once, in an order shuffled afresh per
// pass (seeded by `seed`, so a run is reproducible): a thread runs until it
// blocks, so which thread's writes another sees between two barriers depends
// on that order, and a missing __syncthreads shows up as wrong results in
// some CTA instead of being hidden by one fixed order.
static bool run_cta(Cta& c, unsigned threads, uint64_t seed) {
    c.live = threads;
    c.bar_count = 0;
    for (auto& n : c.warp_count) n = 0;
    for (unsigned i = 0; i < threads; i++) start_fiber(c.fibers[i], i, &c.scheduler);
    std::vector<unsigned> order(threads);
    for (unsigned i = 0; i < threads; i++) order[i] = i;
    uint64_t rng = seed * 0x9E3779B97F4A7C15ull + 1;
    auto next = [&rng]() {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        return rng;
    };
    for (;;) {
        for (unsigned i = threads; i > 1; i--) std::swap(order[i - 1], order[next() % i]);
        unsigned long before = c.progress;
        bool any = false;
        for (unsigned i : order) {
            Fiber& f = c.fibers[i];
            if (f.done) continue;
            any = true;
            c.current = &f;
            swapcontext(&c.scheduler, &f.ctx);
            if (!c.error.empty()) return false;
        }
        if (!any) return true;
        if (c.progress == before) {
            c.error = "deadlock: every live thread waits at a barrier or shuffle that cannot complete";
            return false;
        }
    }
}

}  // namespace emu

// Kernels that only test the emulator itself (not in the .cu file).
// A barrier some threads never reach while others wait at a shuffle that
// half their warp skips: a deadlock, which the emulator must report.
extern "C" __global__ void siliceo_emu_test_deadlock(int* out) {
    const unsigned t = threadIdx.x;
    if (t < 32 || t >= 48) {
        __syncthreads();
    } else {
        out[t] = (int)__shfl_xor_sync(0xffffffffu, (float)t, 1);
    }
}

// Every thread adds its index after a barrier: checks that all threads of
// all CTAs run and that shared memory is per CTA.
extern "C" __global__ void siliceo_emu_test_sum(int* out) {
    __shared__ int total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    for (unsigned i = 0; i < blockDim.x; i++) {
        if (threadIdx.x == i) total += (int)i;
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}

namespace {

struct Entry {
    const char* name;
    std::string kinds;
    void (*invoke)(const void* f, void** args);
    const void* f;
};

template <class T>
constexpr char kind() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, int>) return 'i';
    else if constexpr (std::is_same_v<T, unsigned>) return 'u';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else static_assert(sizeof(T) == 0, "argument type not emulated");
}

template <class... A, size_t... I>
void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<A*>(args[I])...);
}

template <class... A>
Entry entry(const char* name, void (*f)(A...)) {
    return Entry{name, std::string{kind<A>()...},
                 [](const void* fp, void** args) {
                     call(reinterpret_cast<void (*)(A...)>(const_cast<void*>(fp)), args,
                          std::index_sequence_for<A...>{});
                 },
                 reinterpret_cast<const void*>(f)};
}

#define KERNEL(name) entry(#name, &name)

#define DECODE_KERNELS(fmt, d)                                                                     \
    KERNEL(siliceo_attn_decode_##fmt##_d##d##_g1), KERNEL(siliceo_attn_decode_##fmt##_d##d##_g2), \
        KERNEL(siliceo_attn_decode_##fmt##_d##d##_g4), KERNEL(siliceo_attn_decode_##fmt##_d##d##_g8)

const Entry ENTRIES[] = {
    DECODE_KERNELS(f16_f16, 64),
    DECODE_KERNELS(f16_f16, 128),
    DECODE_KERNELS(f16_f16, 256),
    DECODE_KERNELS(kv8_kv8, 64),
    DECODE_KERNELS(kv8_kv8, 128),
    DECODE_KERNELS(kv8_kv8, 256),
    DECODE_KERNELS(k5_v4, 64),
    DECODE_KERNELS(k5_v4, 128),
    DECODE_KERNELS(k5_v4, 256),
#define DECODE_KERNELS_512(fmt)                                                                           \
    KERNEL(siliceo_attn_decode_##fmt##_d512_g1), KERNEL(siliceo_attn_decode_##fmt##_d512_g2), \
        KERNEL(siliceo_attn_decode_##fmt##_d512_g4)
    DECODE_KERNELS_512(f16_f16),
    DECODE_KERNELS_512(kv8_kv8),
    DECODE_KERNELS_512(k5_v4),
#define LOAD_KERNELS(g)                                                                           \
    KERNEL(siliceo_attn_decode_f16_f16_d128_g##g##_u1), KERNEL(siliceo_attn_decode_f16_f16_d128_g##g##_u2), \
        KERNEL(siliceo_attn_decode_f16_f16_d128_g##g##_u4), KERNEL(siliceo_attn_decode_f16_f16_d128_g##g##_u8)
    LOAD_KERNELS(1),
    LOAD_KERNELS(2),
    LOAD_KERNELS(4),
    LOAD_KERNELS(8),
#define PREFILL_KERNELS(fmt) \
    KERNEL(siliceo_attn_prefill_##fmt##_d64), KERNEL(siliceo_attn_prefill_##fmt##_d128), \
        KERNEL(siliceo_attn_prefill_##fmt##_d256), KERNEL(siliceo_attn_prefill_##fmt##_d512)
    PREFILL_KERNELS(f16_f16),
    PREFILL_KERNELS(kv8_kv8),
    PREFILL_KERNELS(k5_v4),
    KERNEL(siliceo_attn_reduce),
    KERNEL(siliceo_kv_append),
    KERNEL(siliceo_kv_seal_f16_f16),
    KERNEL(siliceo_kv_seal_kv8_kv8),
    KERNEL(siliceo_kv_seal_k5_v4),
    KERNEL(siliceo_kv_write_strided),
    KERNEL(siliceo_gather_q),
    KERNEL(siliceo_kv_copy_rows),
    KERNEL(siliceo_emu_test_deadlock),
    KERNEL(siliceo_emu_test_sum),
};

struct Launch {
    const Entry* e;
    void** args;
};

void run_body(void* p) {
    auto* l = static_cast<Launch*>(p);
    l->e->invoke(l->e->f, l->args);
}

int report(char* err, size_t len, const std::string& what) {
    if (err && len) std::snprintf(err, len, "%s", what.c_str());
    return 1;
}

}  // namespace

extern "C" void* siliceo_emu_alloc(size_t bytes) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t rounded = (bytes + 15) / 16 * 16;
    size_t data = (rounded + page - 1) / page * page;
    if (data == 0) data = page;
    void* base = mmap(nullptr, data + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    char* guard = static_cast<char*>(base) + data;
    if (mprotect(guard, page, PROT_NONE) != 0) {
        munmap(base, data + page);
        return nullptr;
    }
    char* p = guard - rounded;
    std::lock_guard<std::mutex> g(emu::buffers_lock);
    emu::buffers[(uintptr_t)p] = rounded;
    return p;
}

extern "C" void siliceo_emu_free(void* p, size_t bytes) {
    if (!p) return;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t rounded = (bytes + 15) / 16 * 16;
    size_t data = (rounded + page - 1) / page * page;
    if (data == 0) data = page;
    char* guard = static_cast<char*>(p) + rounded;
    {
        std::lock_guard<std::mutex> g(emu::buffers_lock);
        emu::buffers.erase((uintptr_t)p);
    }
    munmap(guard - data, data + page);
}

extern "C" int siliceo_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                  size_t smem_bytes, void** args, const char* kinds, char* err, size_t err_len) {
    const Entry* e = nullptr;
    for (const Entry& x : ENTRIES)
        if (std::string(x.name) == name) e = &x;
    if (!e) return report(err, err_len, std::string("no kernel named ") + name);
    if (e->kinds != kinds)
        return report(err, err_len,
                      std::string(name) + ": arguments " + kinds + " do not match the kernel's " + e->kinds);
    if (bx == 0 || bx > emu::MAX_THREADS || gx == 0 || gy == 0 || gz == 0)
        return report(err, err_len, "launch: empty grid or block, or a block over 1024 threads");
    // Dynamic shared memory: the 64 KiB a CTA may opt into on Turing (sm_75),
    // the smallest target; it ends at a guard page like the buffers.
    constexpr size_t EMU_SMEM_BYTES = 64 * 1024;
    if (smem_bytes > EMU_SMEM_BYTES)
        return report(err, err_len,
                      std::to_string(smem_bytes) + " bytes of dynamic shared memory: over sm_75's 64 KiB");
    emu::Cta c;
    c.fibers.resize(bx);
    for (auto& f : c.fibers) {
        f.stack.reset(new emu::Stack());
        if (!f.stack->bottom()) return report(err, err_len, "cannot allocate the threads' stacks");
    }
    Launch l{e, args};
    c.body = run_body;
    c.body_arg = &l;
    void* shared = siliceo_emu_alloc(smem_bytes);
    if (!shared) return report(err, err_len, "cannot allocate the shared memory");
    emu::Cta* saved = emu::cta;
    void* saved_shared = emu::dynamic_shared_memory;
    emu::dynamic_shared_memory = shared;
    emu::cta = &c;
    emu::block_dim = {bx, 1, 1};
    emu::grid_dim = {gx, gy, gz};
    bool ok = true;
    for (unsigned z = 0; z < gz && ok; z++)
        for (unsigned y = 0; y < gy && ok; y++)
            for (unsigned x = 0; x < gx && ok; x++) {
                emu::block_idx = {x, y, z};
                // Shared memory starts as garbage: NaN in every float in
                // one CTA (spreads through sums), 3.4e38 in the next (wins
                // every max, which ignores NaN).
                std::memset(shared, (x + y + z) % 2 ? 0x7f : 0xff, smem_bytes);
                ok = emu::run_cta(c, bx, ((uint64_t)z * gy + y) * gx + x);
                emu::trace.flush();
            }
    emu::cta = saved;
    emu::dynamic_shared_memory = saved_shared;
    siliceo_emu_free(shared, smem_bytes);
    if (!ok) return report(err, err_len, std::string(name) + ": " + c.error);
    return 0;
}

extern "C" void siliceo_emu_trace(int on) {
    emu::trace = emu::Trace{};
    emu::trace.on = on != 0;
}

extern "C" void siliceo_emu_trace_stats(uint64_t* out) {
    out[0] = emu::trace.requests;
    out[1] = emu::trace.bytes;
    out[2] = emu::trace.sectors;
    out[3] = emu::trace.distinct.size();
}
