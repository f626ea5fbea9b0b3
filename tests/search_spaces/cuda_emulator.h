// CPU emulation of the CUDA subset TVM emits for autofuse's templates (see cuda_emulator.py).
//
// Every CUDA thread of a block is a fiber (ucontext) of one OS thread; blocks run one after
// another. A fiber runs until it reaches a synchronisation point (__syncthreads, a warp shuffle,
// __activemask, __syncwarp, a warp-synchronous volatile access) and then yields; when no fiber can
// run, the scheduler releases the groups whose members have all arrived. Cooperative scheduling
// makes a run deterministic for a given thread order, so a kernel is run once with threads (and
// blocks) in ascending order and once in descending order: a race or a missing barrier shows up as
// different bits. Shared memory and outputs start as 0xFF bytes (NaN, -1), so reading what nobody
// wrote shows up too.
//
// Not emulated: half/bfloat16 types, tensor cores (wmma/mma), cp.async, inline PTX, textures,
// cooperative groups, clusters. Float atomics would be emulated but are not deterministic on a GPU.
#pragma once
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>  // (no <vector>/<string>: each costs g++ a few tenths of a second per program)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __inline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

// ---------------------------------------------------------------------------------------------
// Vector types: CUDA's sizes and alignments (float4/int4 16 bytes, float2 8, char4 4, ...).
#define EMU_VEC(T, N, A, ...)                                      \
  struct alignas(A) N { T __VA_ARGS__; };
#define EMU_VEC_ALL(T, P, A2, A4)                                  \
  EMU_VEC(T, P##1, sizeof(T), x)                                   \
  EMU_VEC(T, P##2, A2, x, y)                                       \
  EMU_VEC(T, P##3, sizeof(T), x, y, z)                             \
  EMU_VEC(T, P##4, A4, x, y, z, w)                                 \
  inline P##1 make_##P##1(T x) { return {x}; }                     \
  inline P##2 make_##P##2(T x, T y) { return {x, y}; }             \
  inline P##3 make_##P##3(T x, T y, T z) { return {x, y, z}; }     \
  inline P##4 make_##P##4(T x, T y, T z, T w) { return {x, y, z, w}; }
EMU_VEC_ALL(float, float, 8, 16)
EMU_VEC_ALL(double, double, 16, 16)
EMU_VEC_ALL(int, int, 8, 16)
EMU_VEC_ALL(unsigned int, uint, 8, 16)
EMU_VEC_ALL(signed char, char, 2, 4)
EMU_VEC_ALL(unsigned char, uchar, 2, 4)
EMU_VEC_ALL(short, short, 4, 8)
EMU_VEC_ALL(unsigned short, ushort, 4, 8)
EMU_VEC_ALL(long long, longlong, 16, 16)
EMU_VEC_ALL(unsigned long long, ulonglong, 16, 16)
#undef EMU_VEC_ALL
#undef EMU_VEC
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

// ---------------------------------------------------------------------------------------------
// Math and integer intrinsics (the exact host versions stand in for the fast GPU ones).
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) { return a > b ? a : b; }
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline unsigned int __float2uint_rn(float x) { return (unsigned int)std::nearbyint(x); }
inline float __int2float_rn(int x) { return float(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline unsigned int __float_as_uint(float f) { unsigned int x; std::memcpy(&x, &f, 4); return x; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += int((signed char)(a >> (8 * i))) * int((signed char)(b >> (8 * i)));
  return c;
}
inline unsigned int __dp4a(unsigned int a, unsigned int b, unsigned int c) {
  for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
  return c;
}
inline int __dp4a(int a, unsigned int b, int c) {
  for (int i = 0; i < 4; ++i) c += int((signed char)(a >> (8 * i))) * int((b >> (8 * i)) & 0xffu);
  return c;
}
inline int __dp4a(unsigned int a, int b, int c) { return __dp4a(b, a, c); }
inline int __dp4a(char4 a, char4 b, int c) {
  int x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return __dp4a(x, y, c);
}
inline unsigned int __dp4a(uchar4 a, uchar4 b, unsigned int c) {
  unsigned int x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return __dp4a(x, y, c);
}
template <class T>
inline T __ldg(const T* p) { return *p; }
inline void __threadfence() {}
inline void __threadfence_block() {}

namespace emu {

[[noreturn]] inline void fail(const char* fmt, ...);

// ---------------------------------------------------------------------------------------------
// The scheduler.
enum State { kRunnable, kBarrier, kWarp, kDone };
enum WarpOp { kActiveMask, kLockstep, kSyncWarp, kShflIdx, kShflDown, kShflUp, kShflXor };

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  dim3 idx;
  int tid = 0;
  State state = kRunnable;
  int line = 0;            // where it waits
  WarpOp op = kSyncWarp;   // which warp operation it waits in
  unsigned int mask = 0;   // the mask it passed (__activemask: its result)
  int arg = 0, width = 32; // shuffle lane/offset and width
  uint64_t value = 0;      // shuffle operand, then result (raw bits)
  size_t shared_ordinal = 0;  // shared arrays declared so far in this block
};

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;
constexpr size_t kStaticShared = 48 * 1024;
constexpr int kMaxThreads = 1024;
constexpr int kMaxSharedArrays = 256;

struct Kernel {
  const char* name;
  void (*entry)(void* const*);
  void* const* args;
};

inline ucontext_t g_scheduler;
inline Fiber g_fibers[kMaxThreads];
inline char* g_stacks[kMaxThreads];
inline Fiber* g_current = nullptr;
inline const Kernel* g_kernel = nullptr;
inline unsigned char g_shared[kStaticShared];
inline unsigned char* g_dynamic_shared = nullptr;
inline size_t g_dynamic_bytes = 0;
inline size_t g_shared_offset[kMaxSharedArrays], g_shared_bytes[kMaxSharedArrays];  // per declaration
inline size_t g_shared_arrays = 0, g_shared_used = 0;
inline int g_nthreads = 0;

inline int imin(int a, int b) { return a < b ? a : b; }

}  // namespace emu

inline dim3 threadIdx, blockIdx, blockDim, gridDim;
constexpr int warpSize = 32;

namespace emu {

inline void fail(const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (g_kernel && g_current)
    fprintf(stderr, "emulator: %s (kernel %s, block (%u,%u,%u), thread (%u,%u,%u))\n", msg, g_kernel->name,
            blockIdx.x, blockIdx.y, blockIdx.z, g_current->idx.x, g_current->idx.y, g_current->idx.z);
  else if (g_kernel)
    fprintf(stderr, "emulator: %s (kernel %s, block (%u,%u,%u))\n", msg, g_kernel->name, blockIdx.x,
            blockIdx.y, blockIdx.z);
  else
    fprintf(stderr, "emulator: %s\n", msg);
  fflush(stderr);
  _exit(3);
}

inline void crash_handler(int sig) {
  char msg[512];
  int n = snprintf(msg, sizeof msg,
                   "emulator: signal %d (%s) in kernel %s, block (%u,%u,%u), thread (%u,%u,%u): an "
                   "out-of-bounds access, or a fiber stack overflow (local arrays over %zu KiB)\n",
                   sig, sig == SIGSEGV ? "segmentation fault" : sig == SIGFPE ? "arithmetic error" : "bus error",
                   g_kernel ? g_kernel->name : "?", blockIdx.x, blockIdx.y, blockIdx.z,
                   g_current ? g_current->idx.x : 0, g_current ? g_current->idx.y : 0,
                   g_current ? g_current->idx.z : 0, kStackBytes / 1024);
  if (n > 0 && write(2, msg, (size_t)n) < 0) {}
  _exit(4);
}

inline void install_crash_handler() {
  static char alt[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_handler = crash_handler;
  sa.sa_flags = SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  sigaction(SIGFPE, &sa, nullptr);
}

inline void yield(State state, int line) {
  Fiber* self = g_current;
  self->state = state;
  self->line = line;
  swapcontext(&self->ctx, &g_scheduler);
}

inline void trampoline() {
  g_kernel->entry(g_kernel->args);
  g_current->state = kDone;
}  // returns into uc_link, the scheduler

// Lanes of warp w that exist (a block of 48 threads has a 16-lane second warp).
inline unsigned int existing_lanes(int w) {
  int n = imin(32, g_nthreads - w * 32);
  return n >= 32 ? 0xffffffffu : ((1u << n) - 1u);
}

// Release the shuffle/__syncwarp groups whose members have all arrived, and per warp the lockstep
// group at the lowest line (after a branch, the lanes still inside it go first, as a warp that
// reconverges after the branch would run them); true if any was released.
inline bool release_warp_groups() {
  bool released = false;
  int nwarps = (g_nthreads + 31) / 32;
  for (int w = 0; w < nwarps; ++w) {
    Fiber* lanes = &g_fibers[w * 32];
    int n = imin(32, g_nthreads - w * 32);
    int first = -1;
    for (int i = 0; i < n; ++i)
      if (lanes[i].state == kWarp && lanes[i].op == kLockstep && (first < 0 || lanes[i].line < lanes[first].line))
        first = i;
    for (int j = 0; first >= 0 && j < n; ++j)
      if (lanes[j].state == kWarp && lanes[j].op == kLockstep && lanes[j].line == lanes[first].line) {
        lanes[j].state = kRunnable;
        released = true;
      }
    for (int i = 0; i < n; ++i) {
      Fiber& f = lanes[i];
      if (f.state != kWarp || f.op == kActiveMask || f.op == kLockstep) continue;
      unsigned int group = f.mask & existing_lanes(w);
      if (!(group >> i & 1u))
        fail("warp operation at line %d by lane %d outside its own mask 0x%08x", f.line, i, f.mask);
      bool ready = true;
      for (int j = 0; j < n && ready; ++j) {
        if (!(group >> j & 1u)) continue;
        Fiber& g = lanes[j];
        if (g.state == kDone)
          fail("lane %d of warp %d exited but is in the mask 0x%08x of the warp operation at line %d", j, w,
               f.mask, f.line);
        ready = g.state == kWarp && g.op != kActiveMask && g.op != kLockstep && g.line == f.line;
        if (ready && (g.mask != f.mask || g.op != f.op || g.width != f.width))
          fail("lanes %d and %d of warp %d disagree on mask/width at the warp operation at line %d", i, j, w, f.line);
      }
      if (!ready) continue;
      uint64_t operand[32];
      for (int j = 0; j < n; ++j) operand[j] = lanes[j].value;
      for (int j = 0; j < n; ++j) {
        if (!(group >> j & 1u)) continue;
        Fiber& g = lanes[j];
        g.state = kRunnable;
        if (g.op == kSyncWarp) continue;
        int width = g.width, base = j / width * width, src = j;
        if (width <= 0 || width > 32 || (width & (width - 1)))
          fail("shuffle width %d at line %d is not a power of two up to 32", width, g.line);
        switch (g.op) {
          case kShflIdx: src = base + ((g.arg % width) + width) % width; break;
          case kShflDown: src = j + g.arg < base + width ? j + g.arg : j; break;
          case kShflUp: src = j - g.arg >= base ? j - g.arg : j; break;
          case kShflXor: src = (j ^ g.arg) < base + width && (j ^ g.arg) >= base ? (j ^ g.arg) : j; break;
          default: break;
        }
        // A lane that is not in the group (or does not exist) gives an undefined value: poison it.
        g.value = (src < n && (group >> src & 1u)) ? operand[src] : ~uint64_t(0);
      }
      released = true;
    }
  }
  return released;
}

// __activemask, once nothing else can move: the lanes of a warp waiting at the same call converged
// there (the others are held at a barrier or in another branch); true if any was released.
inline bool release_active_masks() {
  bool released = false;
  int nwarps = (g_nthreads + 31) / 32;
  for (int w = 0; w < nwarps; ++w) {
    Fiber* lanes = &g_fibers[w * 32];
    int n = imin(32, g_nthreads - w * 32);
    for (int i = 0; i < n; ++i) {
      if (lanes[i].state != kWarp || lanes[i].op != kActiveMask) continue;
      unsigned int group = 0;
      for (int j = 0; j < n; ++j)
        if (lanes[j].state == kWarp && lanes[j].op == kActiveMask && lanes[j].line == lanes[i].line) group |= 1u << j;
      for (int j = 0; j < n; ++j)
        if (group >> j & 1u) lanes[j].mask = group, lanes[j].state = kRunnable;
      released = true;
    }
  }
  return released;
}

[[noreturn]] inline void deadlock() {
  // Runs of consecutive threads in the same state: "t0-31 __syncthreads@3, t32-63 exited".
  char what[1600];
  size_t used = 0;
  what[0] = 0;
  for (int t = 0; t < g_nthreads && used < 1500;) {
    const Fiber& f = g_fibers[t];
    int end = t;
    while (end + 1 < g_nthreads && g_fibers[end + 1].state == f.state &&
           (f.state == kDone || g_fibers[end + 1].line == f.line))
      ++end;
    const char* kind = f.state == kDone ? "exited" : f.state == kBarrier ? "__syncthreads" : "warp op";
    used += snprintf(what + used, sizeof what - used, "%s t%d-%d %s", t ? "," : "", t, end, kind);
    if (f.state != kDone && used < sizeof what)
      used += snprintf(what + used, sizeof what - used, " at line %d", f.line);
    t = end + 1;
  }
  g_current = nullptr;
  fail("threads of a block wait at different synchronisation points (a divergent __syncthreads or "
       "shuffle: the GPU would hang or misbehave):%s%s", what, used >= 1500 ? " ..." : "");
}

inline void run_block(bool reverse) {
  for (int t = 0; t < g_nthreads; ++t) {
    Fiber& f = g_fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &g_scheduler;
    makecontext(&f.ctx, trampoline, 0);
    f.state = kRunnable;
    f.shared_ordinal = 0;
  }
  const int n = g_nthreads;
  for (;;) {
    for (int k = 0; k < n; ++k) {
      Fiber& f = g_fibers[reverse ? n - 1 - k : k];
      if (f.state != kRunnable) continue;
      g_current = &f;
      threadIdx = f.idx;
      swapcontext(&g_scheduler, &f.ctx);
    }
    g_current = nullptr;
    int done = 0, barrier = 0, line = -1;
    bool same_line = true;
    for (int t = 0; t < n; ++t) {
      const Fiber& f = g_fibers[t];
      done += f.state == kDone;
      if (f.state == kBarrier) {
        same_line &= line < 0 || f.line == line;
        line = f.line;
        ++barrier;
      }
    }
    if (done == n) return;
    if (release_warp_groups() || release_active_masks()) continue;
    if (barrier + done == n && done == 0 && same_line) {
      for (int t = 0; t < n; ++t) g_fibers[t].state = kRunnable;
      continue;
    }
    deadlock();
  }
}

// One kernel launch: blocks in order (or reverse order), threads as fibers.
inline void launch(const Kernel& kernel, dim3 grid, dim3 block, size_t dynamic_shared, bool reverse) {
  g_kernel = &kernel;
  gridDim = grid;
  blockDim = block;
  g_nthreads = int(block.x * block.y * block.z);
  if (g_nthreads < 1 || g_nthreads > 1024) fail("%d threads per block (the GPU allows 1 to 1024)", g_nthreads);
  if (block.z > 64) fail("blockDim.z = %u (the GPU allows at most 64)", block.z);
  if (grid.y > 65535 || grid.z > 65535) fail("gridDim (%u,%u,%u) beyond the GPU's limits", grid.x, grid.y, grid.z);
  for (int t = 0; t < g_nthreads; ++t) {
    if (!g_stacks[t]) {
      // A PROT_NONE page under each stack turns an overflow into SIGSEGV instead of corruption.
      void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) fail("cannot map a fiber stack");
      mprotect(p, kGuardBytes, PROT_NONE);
      g_stacks[t] = static_cast<char*>(p) + kGuardBytes;
    }
    Fiber& f = g_fibers[t];
    f = Fiber{};
    f.tid = t;
    f.idx = {unsigned(t % block.x), unsigned(t / block.x % block.y), unsigned(t / (block.x * block.y))};
    f.stack = g_stacks[t];
  }
  free(g_dynamic_shared);
  g_dynamic_shared = static_cast<unsigned char*>(std::aligned_alloc(256, (dynamic_shared + 256) / 256 * 256));
  g_dynamic_bytes = dynamic_shared;
  g_shared_arrays = 0;
  g_shared_used = kStaticShared;
  long nblocks = long(grid.x) * grid.y * grid.z;
  for (long k = 0; k < nblocks; ++k) {
    long b = reverse ? nblocks - 1 - k : k;
    blockIdx = {unsigned(b % grid.x), unsigned(b / grid.x % grid.y), unsigned(b / (long(grid.x) * grid.y))};
    std::memset(g_shared, 0xff, g_shared_used);
    std::memset(g_dynamic_shared, 0xff, g_dynamic_bytes);
    run_block(reverse);
  }
  g_kernel = nullptr;
}

// `__shared__ T name[n];` becomes `T* name = emu::shared_array<T>(n, align)`: every thread walks
// the same declarations in the same order and so gets the same offsets in the block's arena.
template <class T>
inline T* shared_array(size_t count, size_t align) {
  Fiber* f = g_current;
  size_t bytes = count * sizeof(T);
  size_t k = f->shared_ordinal++;
  if (k == g_shared_arrays) {
    if (k == kMaxSharedArrays) fail("more than %d shared arrays in one kernel", kMaxSharedArrays);
    size_t end = k ? g_shared_offset[k - 1] + g_shared_bytes[k - 1] : 0;
    size_t offset = (end + align - 1) / align * align;
    if (offset + bytes > kStaticShared)
      fail("static shared memory of %zu bytes exceeds the %zu bytes per block", offset + bytes, kStaticShared);
    g_shared_offset[k] = offset;
    g_shared_bytes[k] = bytes;
    g_shared_arrays = k + 1;
    g_shared_used = offset + bytes;
  } else if (g_shared_bytes[k] != bytes) {
    fail("threads declare different shared arrays (declaration %zu)", k);
  }
  return reinterpret_cast<T*>(g_shared + g_shared_offset[k]);
}

inline unsigned char* dynamic_shared() { return g_dynamic_shared; }

// `((volatile float*)buf)[i]` becomes `((volatile float*)emu::lockstep(buf, __LINE__))[i]`. TVM's
// shared-memory reductions over a group that is not a whole number of warps end in warp-synchronous
// code: volatile accesses with no barrier, correct only if the lanes of a warp execute them in
// lockstep (what a converged warp does, though CUDA no longer promises it without __syncwarp).
// The lanes of a warp at the same access wait for each other, which is that lockstep.
template <class T>
inline T* lockstep(T* p, int line) {
  g_current->op = kLockstep;
  yield(kWarp, line);
  return p;
}

// `*(float4*)(p)` becomes `*emu::vector_at<float4>(__LINE__, p)`: the GPU faults on misaligned
// vector accesses, which x86 would silently allow.
template <class T>
inline T* vector_at(int line, const volatile void* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T))
    fail("misaligned %zu-byte access at line %d (address %% %zu = %zu)", sizeof(T), line, alignof(T),
         size_t(reinterpret_cast<uintptr_t>(p) % alignof(T)));
  return const_cast<T*>(static_cast<const volatile T*>(p));
}

template <class T>
inline T shuffle(WarpOp op, unsigned int mask, T var, int arg, int width, int line) {
  static_assert(sizeof(T) <= 8, "shuffle of a type over 8 bytes");
  Fiber* f = g_current;
  f->op = op;
  f->mask = mask;
  f->arg = arg;
  f->width = width;
  f->value = 0;
  std::memcpy(&f->value, &var, sizeof(T));
  yield(kWarp, line);
  T out;
  std::memcpy(&out, &f->value, sizeof(T));
  return out;
}

// Global buffers: parameters then workspaces, 256-byte aligned like cudaMalloc's, with guard bytes
// on both sides. Inputs come from DIR/in<i>.bin; everything else starts as 0xFF bytes (NaN, -1).
// The guards hold a signalling NaN whose payload names the buffer: arithmetic on it quiets it and
// copying it into another buffer's guard changes it, so an out-of-bounds read that feeds an
// out-of-bounds write shows up too (TVM's mixed thread extents produce exactly that).
class Buffers {
 public:
  static constexpr size_t kGuard = 256;
  static constexpr int kMax = 256;
  Buffers(const char* dir, const char* const* names, const size_t* sizes, int count, int params)
      : dir_(dir), names_(names), sizes_(sizes), count_(count), params_(params) {
    if (count > kMax) fail("more than %d buffers", kMax);
    for (int i = 0; i < count; ++i) {
      size_t total = (sizes[i] + 2 * kGuard + 255) / 256 * 256;
      auto* base = static_cast<unsigned char*>(std::aligned_alloc(256, total));
      if (!base) fail("cannot allocate %zu bytes for %s", sizes[i], names[i]);
      std::memset(base, 0xff, total);
      for (size_t k = 0; k < total; ++k)
        if (k < kGuard || k >= kGuard + sizes[i]) base[k] = guard_byte(i, k);
      base_[i] = base;
      totals_[i] = total;
      if (i >= params) continue;
      char path[4096];
      snprintf(path, sizeof path, "%s/in%d.bin", dir_, i);
      if (FILE* f = fopen(path, "rb")) {
        size_t got = fread(base + kGuard, 1, sizes[i], f);
        fclose(f);
        if (got != sizes[i]) fail("%s holds %zu bytes, %s needs %zu", path, got, names[i], sizes[i]);
      }
    }
  }
  void* data(int i) { return base_[i] + kGuard; }
  static unsigned char guard_byte(int buffer, size_t k) {
    uint32_t word = 0xff800000u | (uint32_t((buffer + 1) & 0x3fff) << 8) | 0x5au;
    return (unsigned char)(word >> (8 * (k % 4)));
  }
  // Called after each launch, so that the message names the kernel.
  void check_guards(const char* kernel) {
    for (int i = 0; i < count_; ++i) {
      const unsigned char* b = base_[i];
      for (size_t k = 0; k < totals_[i]; ++k) {
        bool guard = k < kGuard || k >= kGuard + sizes_[i];
        if (guard && b[k] != guard_byte(i, k)) {
          long off = k < kGuard ? long(k) - long(kGuard) : long(k - kGuard);
          fail("kernel %s wrote outside buffer %s (%zu bytes), around byte offset %ld", kernel, names_[i],
               sizes_[i], off);
        }
      }
    }
  }
  void save(const char* tag) {
    for (int i = 0; i < params_; ++i) {
      char path[4096];
      snprintf(path, sizeof path, "%s/%s%d.bin", dir_, tag, i);
      FILE* f = fopen(path, "wb");
      if (!f || fwrite(base_[i] + kGuard, 1, sizes_[i], f) != sizes_[i]) fail("cannot write %s", path);
      fclose(f);
    }
  }

 private:
  const char* dir_;
  const char* const* names_;
  const size_t* sizes_;
  int count_, params_;
  unsigned char* base_[kMax];
  size_t totals_[kMax];
};

// Calls a kernel with pointers from an untyped argument array.
template <class... P, size_t... I>
inline void invoke(void (*kernel)(P...), void* const* args, std::index_sequence<I...>) {
  kernel(static_cast<P>(args[I])...);
}
template <class... P>
inline void invoke(void (*kernel)(P...), void* const* args) {
  static_assert((std::is_pointer_v<P> && ...), "kernels with scalar parameters are not emulated");
  invoke(kernel, args, std::index_sequence_for<P...>{});
}

}  // namespace emu

inline void emu_syncthreads(int line) { emu::yield(emu::kBarrier, line); }
#define __syncthreads() emu_syncthreads(__LINE__)
inline unsigned int emu_activemask(int line) {
  emu::g_current->op = emu::kActiveMask;
  emu::yield(emu::kWarp, line);
  return emu::g_current->mask;
}
#define __activemask() emu_activemask(__LINE__)
#define __syncwarp(...) emu::shuffle<int>(emu::kSyncWarp, EMU_MASK(__VA_ARGS__), 0, 0, 32, __LINE__)
#define EMU_MASK(...) (0xffffffffu __VA_OPT__(& (__VA_ARGS__)))
#define EMU_SHUFFLE(op, mask, var, arg, ...) emu::shuffle(op, mask, var, arg, EMU_WIDTH(__VA_ARGS__), __LINE__)
#define __shfl_sync(mask, var, lane, ...) EMU_SHUFFLE(emu::kShflIdx, mask, var, lane, __VA_ARGS__)
#define __shfl_down_sync(mask, var, delta, ...) EMU_SHUFFLE(emu::kShflDown, mask, var, delta, __VA_ARGS__)
#define __shfl_up_sync(mask, var, delta, ...) EMU_SHUFFLE(emu::kShflUp, mask, var, delta, __VA_ARGS__)
#define __shfl_xor_sync(mask, var, lanemask, ...) EMU_SHUFFLE(emu::kShflXor, mask, var, lanemask, __VA_ARGS__)
#define EMU_WIDTH(...) (32 __VA_OPT__(* 0 + (__VA_ARGS__)))

// Atomics: trivially atomic, the threads being fibers of one OS thread.
template <class T>
inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T>
inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <class T>
inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T>
inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T>
inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T>
inline T atomicCAS(T* p, T compare, T v) { T old = *p; if (old == compare) *p = v; return old; }
template <class T>
inline T atomicAnd(T* p, T v) { T old = *p; *p = old & v; return old; }
template <class T>
inline T atomicOr(T* p, T v) { T old = *p; *p = old | v; return old; }
