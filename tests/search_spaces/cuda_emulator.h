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
// Half and bfloat16 are _Float16 and a rounding 16-bit struct. TVM's PTX helpers (functions around
// inline asm: mbarriers, bulk and TMA tensor copies, wgmma, named and cluster barriers, fences,
// programmatic dependent launch) are emulated by name; cuda_emulator.py strips their definitions
// from the source. Copies and wgmma complete at once, so an mbarrier wait only waits for arrivals.
// The blocks of a cluster run together.
// Not emulated: wmma/mma.sync, cp.async, other inline PTX, textures, cooperative groups. Float
// atomics would be emulated but are not deterministic on a GPU.
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

// Half and bfloat16 (TVM's prelude includes <cuda_fp16.h>, <cuda_bf16.h>: stubs).
typedef _Float16 __half;
typedef __half half;
struct alignas(4) __half2 { __half x, y; };
typedef __half2 half2;
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline bool __hgt(__half a, __half b) { return a > b; }
inline bool __hlt(__half a, __half b) { return a < b; }
inline __half __hmax(__half a, __half b) { return a > b ? a : b; }
inline __half __hmin(__half a, __half b) { return a < b ? a : b; }
inline __half hexp(__half h) { return __half(std::exp(float(h))); }
struct alignas(2) __nv_bfloat16 {  // float's upper half, rounded to nearest even as the GPU converts
  unsigned short bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                           : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  __nv_bfloat16(double d) : __nv_bfloat16(float(d)) {}
  __nv_bfloat16(int i) : __nv_bfloat16(float(i)) {}
  operator float() const {
    unsigned int u = (unsigned int)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef __nv_bfloat16 nv_bfloat16;
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __nv_bfloat162 nv_bfloat162;
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }

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
enum State { kRunnable, kBarrier, kWarp, kMbarrier, kCluster, kWarpgroup, kNamedBarrier, kDone };
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
  unsigned int mbarrier = 0, parity = 0;  // the mbarrier (shared address) and phase parity it waits on
  // the cluster barrier's phase this thread last arrived in (apart from `parity`: an mbarrier wait
  // between a cluster arrive and its wait must not change what the wait waits for)
  unsigned int cluster_phase = 0;
  int named_barrier = -1;                 // the bar.sync id it waits at
  int block = 0;                          // its block's rank in the cluster
  const void* wgmma = nullptr;            // its operands while it waits in a wgmma (on its stack)
};

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;
constexpr size_t kStaticShared = 48 * 1024;
constexpr int kMaxThreads = 1024;
constexpr int kMaxSharedArrays = 256;
constexpr size_t kMaxDynamicShared = 227 * 1024;  // an H100/H200 block's opt-in limit

struct Kernel {
  const char* name;
  void (*entry)(void* const*);
  void* const* args;
};

inline ucontext_t g_scheduler;
inline Fiber* g_current = nullptr;
inline const Kernel* g_kernel = nullptr;
inline size_t g_dynamic_bytes = 0;
inline size_t g_shared_offset[kMaxSharedArrays], g_shared_bytes[kMaxSharedArrays];  // per declaration
inline size_t g_shared_arrays = 0, g_shared_used = 0;
inline int g_nthreads = 0;  // per block
// mbarriers by shared address / 8: arrivals still expected, transaction bytes still expected, phase
struct Mbarrier {
  unsigned int count = 0, pending = 0, phase = 0;
  int tx = 0;
};
constexpr size_t kMbarriers = (kStaticShared + kMaxDynamicShared) / 8;

// The blocks of one cluster run together (one block where the launch has no cluster); the scheduler
// points the g_ names below at the block of the fiber it runs.
constexpr int kMaxCluster = 16;
struct Block {
  dim3 idx;
  Fiber* fibers;
  unsigned char* shared;
  unsigned char* dynamic_shared = nullptr;
  Mbarrier* mbarriers;
};
inline Fiber g_all_fibers[kMaxCluster * kMaxThreads];
inline char* g_stacks[kMaxCluster * kMaxThreads];
inline unsigned char g_shared_store[kMaxCluster][kStaticShared];
inline Mbarrier g_mbarrier_store[kMaxCluster][kMbarriers];
inline Block g_blocks[kMaxCluster];
inline int g_cluster_size = 1;
inline dim3 g_cluster_dims;
inline Block* g_block = &g_blocks[0];
inline Fiber* g_fibers = g_all_fibers;
inline unsigned char* g_shared = g_shared_store[0];
inline unsigned char* g_dynamic_shared = nullptr;
inline Mbarrier* g_mbarriers = g_mbarrier_store[0];
// barrier.cluster: arrivals in the current phase (exited threads count as arrived)
inline unsigned int g_cluster_arrived = 0, g_cluster_phase = 0;

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

// mbarrier waits whose phase has completed; true if any was released.
inline bool release_mbarriers() {
  bool released = false;
  for (int t = 0; t < g_nthreads; ++t) {
    Fiber& f = g_fibers[t];
    if (f.state == kMbarrier && g_mbarriers[f.mbarrier / 8].phase != f.parity) {
      f.state = kRunnable;
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
    const char* kind = f.state == kDone      ? "exited"
                       : f.state == kBarrier ? "__syncthreads"
                       : f.state == kMbarrier ? "mbarrier wait"
                       : f.state == kCluster  ? "cluster barrier"
                       : f.state == kWarpgroup ? "wgmma"
                       : f.state == kNamedBarrier ? "named barrier"
                                              : "warp op";
    used += snprintf(what + used, sizeof what - used, "%s t%d-%d %s", t ? "," : "", t, end, kind);
    if (f.state != kDone && used < sizeof what)
      used += snprintf(what + used, sizeof what - used, " at line %d", f.line);
    t = end + 1;
  }
  g_current = nullptr;
  fail("threads of a block wait at different synchronisation points (a divergent __syncthreads or "
       "shuffle: the GPU would hang or misbehave):%s%s", what, used >= 1500 ? " ..." : "");
}

inline void select_block(int rank) {
  Block& b = g_blocks[rank];
  g_block = &b;
  g_fibers = b.fibers;
  g_shared = b.shared;
  g_dynamic_shared = b.dynamic_shared;
  g_mbarriers = b.mbarriers;
  blockIdx = b.idx;
}

inline int cluster_threads_left() {
  int left = 0;
  for (int t = 0; t < g_cluster_size * g_nthreads; ++t) left += g_all_fibers[t].state != kDone;
  return left;
}

// Fibers waiting at barrier.cluster whose phase has completed; true if any was released.
inline bool release_cluster_waits() {
  bool released = false;
  int left = cluster_threads_left();
  if (left && g_cluster_arrived >= unsigned(left)) {
    g_cluster_arrived = 0;
    g_cluster_phase++;
  }
  for (int t = 0; t < g_cluster_size * g_nthreads; ++t) {
    Fiber& f = g_all_fibers[t];
    if (f.state == kCluster && f.cluster_phase != g_cluster_phase) {
      f.state = kRunnable;
      released = true;
    }
  }
  return released;
}

// One cluster's blocks (g_blocks[0, g_cluster_size)), their threads interleaved; blocks and
// threads in descending order with ``reverse``.
inline void run_cluster(bool reverse) {
  const int n = g_nthreads, total = g_cluster_size * n;
  for (int t = 0; t < total; ++t) {
    Fiber& f = g_all_fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &g_scheduler;
    makecontext(&f.ctx, trampoline, 0);
    f.state = kRunnable;
    f.shared_ordinal = 0;
  }
  g_cluster_arrived = g_cluster_phase = 0;
  for (;;) {
    for (int k = 0; k < total; ++k) {
      Fiber& f = g_all_fibers[reverse ? total - 1 - k : k];
      if (f.state != kRunnable) continue;
      select_block(f.block);
      g_current = &f;
      threadIdx = f.idx;
      swapcontext(&g_scheduler, &f.ctx);
    }
    g_current = nullptr;
    bool all_done = true, released = false;
    for (int rank = 0; rank < g_cluster_size; ++rank) {
      select_block(rank);
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
      all_done &= done == n;
      if (release_warp_groups() || release_active_masks() || release_mbarriers()) {
        released = true;
      } else if (barrier && barrier + done == n && done == 0 && same_line) {
        for (int t = 0; t < n; ++t) g_fibers[t].state = kRunnable;
        released = true;
      }
    }
    if (all_done) return;
    if (release_cluster_waits() || released) continue;
    bool runnable = false;  // released inside a fiber (the last thread at a wgmma releases the others)
    for (int t = 0; t < total; ++t) runnable |= g_all_fibers[t].state == kRunnable;
    if (runnable) continue;
    for (int rank = 0; rank < g_cluster_size; ++rank) {
      select_block(rank);
      bool waiting = false;
      for (int t = 0; t < n; ++t) waiting |= g_fibers[t].state != kDone && g_fibers[t].state != kCluster;
      if (waiting) deadlock();
    }
    select_block(0);
    g_current = nullptr;
    fail("threads wait at a cluster barrier that some threads of the cluster never reach");
  }
}

// One kernel launch: clusters of blocks in order (or reverse order), threads as fibers.
inline void launch(const Kernel& kernel, dim3 grid, dim3 block, size_t dynamic_shared, bool reverse,
                   dim3 cluster = dim3{1, 1, 1}) {
  g_kernel = &kernel;
  gridDim = grid;
  blockDim = block;
  g_nthreads = int(block.x * block.y * block.z);
  g_cluster_size = int(cluster.x * cluster.y * cluster.z);
  g_cluster_dims = cluster;
  if (g_nthreads < 1 || g_nthreads > 1024) fail("%d threads per block (the GPU allows 1 to 1024)", g_nthreads);
  if (block.z > 64) fail("blockDim.z = %u (the GPU allows at most 64)", block.z);
  if (grid.y > 65535 || grid.z > 65535) fail("gridDim (%u,%u,%u) beyond the GPU's limits", grid.x, grid.y, grid.z);
  if (g_cluster_size < 1 || g_cluster_size > kMaxCluster || grid.x % cluster.x || grid.y % cluster.y ||
      grid.z % cluster.z)
    fail("cluster (%u,%u,%u) of grid (%u,%u,%u): at most %d blocks dividing the grid", cluster.x, cluster.y, cluster.z,
         grid.x, grid.y, grid.z, kMaxCluster);
  if (dynamic_shared > kMaxDynamicShared)
    fail("%zu bytes of dynamic shared memory (the GPU allows %zu)", dynamic_shared, kMaxDynamicShared);
  for (int t = 0; t < g_cluster_size * g_nthreads; ++t) {
    if (!g_stacks[t]) {
      // A PROT_NONE page under each stack turns an overflow into SIGSEGV instead of corruption.
      void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) fail("cannot map a fiber stack");
      mprotect(p, kGuardBytes, PROT_NONE);
      g_stacks[t] = static_cast<char*>(p) + kGuardBytes;
    }
    Fiber& f = g_all_fibers[t];
    int local = t % g_nthreads;
    f = Fiber{};
    f.tid = local;
    f.block = t / g_nthreads;
    f.idx = {unsigned(local % block.x), unsigned(local / block.x % block.y), unsigned(local / (block.x * block.y))};
    f.stack = g_stacks[t];
  }
  g_dynamic_bytes = dynamic_shared;
  for (int rank = 0; rank < g_cluster_size; ++rank) {
    Block& b = g_blocks[rank];
    free(b.dynamic_shared);
    b.dynamic_shared = static_cast<unsigned char*>(std::aligned_alloc(256, (dynamic_shared + 256) / 256 * 256));
    b.fibers = &g_all_fibers[rank * g_nthreads];
    b.shared = g_shared_store[rank];
    b.mbarriers = g_mbarrier_store[rank];
  }
  g_shared_arrays = 0;
  g_shared_used = kStaticShared;
  dim3 clusters{grid.x / cluster.x, grid.y / cluster.y, grid.z / cluster.z};
  long nclusters = long(clusters.x) * clusters.y * clusters.z;
  for (long k = 0; k < nclusters; ++k) {
    long c = reverse ? nclusters - 1 - k : k;
    dim3 first{unsigned(c % clusters.x) * cluster.x, unsigned(c / clusters.x % clusters.y) * cluster.y,
               unsigned(c / (long(clusters.x) * clusters.y)) * cluster.z};
    for (int rank = 0; rank < g_cluster_size; ++rank) {
      Block& b = g_blocks[rank];  // ranks x-fastest, as %cluster_ctarank counts
      b.idx = {first.x + rank % cluster.x, first.y + rank / cluster.x % cluster.y,
               first.z + rank / (cluster.x * cluster.y)};
      std::memset(b.shared, 0xff, g_shared_used);
      std::memset(b.dynamic_shared, 0xff, g_dynamic_bytes);
      std::memset(static_cast<void*>(b.mbarriers), 0, sizeof(Mbarrier) * kMbarriers);
    }
    run_cluster(reverse);
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
// (A pointer parameter gets the pointer, a by-value one, a CUtensorMap, the value it points to.)
template <class P>
inline P argument(void* p) {
  if constexpr (std::is_pointer_v<P>)
    return static_cast<P>(p);
  else
    return *static_cast<std::remove_cv_t<P>*>(p);
}
template <class... P, size_t... I>
inline void invoke(void (*kernel)(P...), void* const* args, std::index_sequence<I...>) {
  kernel(argument<P>(args[I])...);
}
template <class... P>
inline void invoke(void (*kernel)(P...), void* const* args) {
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

// ---------------------------------------------------------------------------------------------
// TVM's PTX helpers, by the names its CUDA code generator gives them (cuda_emulator.py strips their
// definitions, EMULATED_HELPERS). A shared address: dynamic shared memory from 0 (as TVM's tirx
// kernels have it: 1024-byte aligned tiles, descriptors' 14-bit start addresses), static arrays
// from kMaxDynamicShared.
namespace emu {
inline unsigned char* block_shared(const Block& b, unsigned int address, size_t bytes) {
  if (address + bytes <= g_dynamic_bytes) return b.dynamic_shared + address;
  if (address >= kMaxDynamicShared && address - kMaxDynamicShared + bytes <= kStaticShared)
    return b.shared + (address - kMaxDynamicShared);
  return nullptr;
}
inline unsigned int shared_address(const void* p, int line) {
  auto* b = static_cast<const unsigned char*>(p);
  if (b >= g_dynamic_shared && b < g_dynamic_shared + g_dynamic_bytes) return unsigned(b - g_dynamic_shared);
  if (b >= g_shared && b < g_shared + kStaticShared) return unsigned(kMaxDynamicShared + (b - g_shared));
  fail("a shared address taken of memory outside shared memory (line %d)", line);
}
inline unsigned char* shared_pointer(unsigned int address, size_t bytes, int line) {
  if (unsigned char* p = block_shared(*g_block, address, bytes)) return p;
  fail("%zu bytes at shared address %u: outside the block's shared memory (line %d)", bytes, address, line);
}
inline Mbarrier& mbarrier(unsigned int address, int line) {
  if (address % 8) fail("mbarrier at shared address %u, not 8-byte aligned (line %d)", address, line);
  shared_pointer(address, 8, line);
  return g_mbarriers[address / 8];
}
inline void complete(Mbarrier& m) {
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1u;
    m.pending = m.count;
  }
}
inline void mbarrier_init(unsigned int address, unsigned int count, int line) {
  if (!count) fail("mbarrier initialised with no arrivals (line %d)", line);
  mbarrier(address, line) = Mbarrier{count, count, 0, 0};
}
inline void mbarrier_arrive_expect_tx(unsigned int address, unsigned int bytes, int line) {
  Mbarrier& m = mbarrier(address, line);
  if (!m.count) fail("arrival at an mbarrier never initialised (line %d)", line);
  m.tx += bytes;
  m.pending -= 1;
  complete(m);
}
// A copy into shared memory has landed: its bytes off the mbarrier's transaction count.
inline void complete_tx(unsigned int address, size_t bytes, int line) {
  Mbarrier& m = mbarrier(address, line);
  if (!m.count) fail("a copy signals an mbarrier never initialised (line %d)", line);
  m.tx -= int(bytes);
  complete(m);
}
inline void mbarrier_wait(void* barrier, int parity, int line) {
  Fiber* f = g_current;
  f->mbarrier = shared_address(barrier, line);
  f->parity = unsigned(parity) & 1u;
  Mbarrier& m = mbarrier(f->mbarrier, line);
  if (!m.count) fail("wait on an mbarrier never initialised (line %d)", line);
  while (m.phase == f->parity) yield(kMbarrier, line);
}
inline void bulk_check(const void* global, unsigned int address, unsigned int bytes, int line) {
  if (reinterpret_cast<uintptr_t>(global) % 16 || address % 16 || bytes % 16)
    fail("a bulk copy of %u bytes between shared address %u and global %p: not 16-byte aligned (line %d)", bytes,
         address, global, line);
}
// global -> shared, completing `bytes` of the mbarrier's transaction
inline void bulk_to_shared(unsigned int address, const void* global, unsigned int bytes, unsigned int barrier,
                           int line) {
  bulk_check(global, address, bytes, line);
  std::memcpy(shared_pointer(address, bytes, line), global, bytes);
  complete_tx(barrier, bytes, line);
}
inline void bulk_to_global(const void* global, unsigned int address, unsigned int bytes, int line) {
  bulk_check(global, address, bytes, line);
  std::memcpy(const_cast<void*>(global), shared_pointer(address, bytes, line), bytes);
}
}  // namespace emu

#define tvm_builtin_cuda_cta_sync() emu_syncthreads(__LINE__)
#define tvm_builtin_cuda_cvta_generic_to_shared(p) emu::shared_address((p), __LINE__)
#define __cvta_generic_to_shared(p) emu::shared_address((p), __LINE__)
#define tvm_builtin_ptx_mbarrier_init_init_shared_b64(a, n) emu::mbarrier_init((a), (n), __LINE__)
#define tvm_builtin_ptx_mbarrier_arrive_expect_tx_arrive_expect_tx_shared_b64(a, n) \
  emu::mbarrier_arrive_expect_tx((a), (n), __LINE__)
#define tvm_builtin_cuda_mbarrier_wait(b, parity) emu::mbarrier_wait((b), (parity), __LINE__)
#define tvm_builtin_ptx_cp_async_bulk_g2s_cluster_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes( \
    dst, src, n, bar)                                                                                            \
  emu::bulk_to_shared((dst), (src), (n), (bar), __LINE__)
#define tvm_builtin_ptx_cp_async_bulk_s2g_async_bulk_global_shared__cta_bulk_group(dst, src, n) \
  emu::bulk_to_global((dst), (src), (n), __LINE__)
// An L2 policy only says which lines L2 evicts first: no cache here, the copies as without one.
#define tvm_builtin_ptx_createpolicy_fractional_fractional_L2__evict_first_b64(policy) ((policy) = 0)
#define tvm_builtin_ptx_cp_async_bulk_g2s_cluster_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes_L2__cache_hint( \
    dst, src, n, bar, policy)                                                                                                  \
  emu::bulk_to_shared((dst), (src), (n), (bar), __LINE__)
#define tvm_builtin_ptx_cp_async_bulk_s2g_async_bulk_global_shared__cta_bulk_group_L2__cache_hint(dst, src, n, policy) \
  emu::bulk_to_global((dst), (src), (n), __LINE__)
// Copies complete at once: nothing to commit or wait for, no proxy to fence.
#define tvm_builtin_ptx_cp_async_bulk_commit_group_async_bulk_commit_group() ((void)0)
#define tvm_builtin_ptx_cp_async_bulk_wait_group_async_bulk_wait_group_read_0() ((void)0)
#define tvm_builtin_ptx_fence_proxy_proxy_async_shared__cta() ((void)0)
// Programmatic dependent launch: kernels run one after another anyway.
#define tvm_builtin_ptx_griddepcontrol_wait() ((void)0)
#define tvm_builtin_ptx_griddepcontrol_launch_dependents() ((void)0)

// search_spaces/lib/cuda_attention's split counter (an acq_rel atom.add in PTX): the split that
// brings the count to `splits` resets it and merges.
extern unsigned int autofuse_split_arrivals[];
inline int autofuse_split_arrive(int row_set, int splits) {
  unsigned int before = atomicAdd(&autofuse_split_arrivals[row_set], 1u);
  if (before + 1 != (unsigned int)splits) return 0;
  autofuse_split_arrivals[row_set] = 0u;
  return 1;
}

// Clusters: a shared::cluster address is the block's rank + 1 above bit 24 over its shared address.
namespace emu {
inline unsigned int cluster_rank() { return unsigned(g_current->block); }
inline void cluster_arrive() {
  g_current->cluster_phase = g_cluster_phase;
  g_cluster_arrived++;
}
inline void cluster_wait(int line) {
  while (g_current->cluster_phase == g_cluster_phase) yield(kCluster, line);
}
inline unsigned int map_shared(unsigned int address, unsigned int rank, int line) {
  if (rank >= unsigned(g_cluster_size)) fail("mapa to block %u of a cluster of %d (line %d)", rank, g_cluster_size, line);
  if (address >> 24) fail("mapa of shared address %u, not a local one (line %d)", address, line);
  return ((rank + 1u) << 24) | address;
}
template <class T, int N>
inline void cluster_store(unsigned int address, const T (&values)[N], int line) {
  unsigned int rank = (address >> 24) - 1u;
  if (!(address >> 24) || rank >= unsigned(g_cluster_size))
    fail("a shared::cluster store to %u: not an address mapa gave (line %d)", address, line);
  if ((address & 0xffffffu) % sizeof(values)) fail("a misaligned %zu-byte shared::cluster store (line %d)", sizeof(values), line);
  Block& b = g_blocks[rank];
  unsigned int local = address & 0xffffffu;
  unsigned char* p = block_shared(b, local, sizeof(values));
  if (!p) fail("a shared::cluster store outside block %u's shared memory (line %d)", rank, line);
  std::memcpy(p, values, sizeof(values));
}
}  // namespace emu

// TVM's x reads %cluster_ctarank (the rank), y and z %cluster_ctaid (the block's place in its cluster)
#define tvm_builtin_cluster_ctaid_x() emu::cluster_rank()
#define tvm_builtin_cluster_ctaid_y() (emu::cluster_rank() / emu::g_cluster_dims.x % emu::g_cluster_dims.y)
#define tvm_builtin_cluster_ctaid_z() (emu::cluster_rank() / (emu::g_cluster_dims.x * emu::g_cluster_dims.y))
#define tvm_builtin_ptx_barrier_cluster_arrive_cluster_arrive_aligned() emu::cluster_arrive()
#define tvm_builtin_ptx_barrier_cluster_arrive_cluster_arrive_relaxed_aligned() emu::cluster_arrive()
#define tvm_builtin_ptx_barrier_cluster_wait_cluster_wait_aligned() emu::cluster_wait(__LINE__)
#define tvm_builtin_ptx_mapa_u32_shared__cluster_u32(d, address, rank) ((d) = emu::map_shared((address), (rank), __LINE__))
#define tvm_builtin_ptx_st_shared__cluster_f32(address, v) \
  emu::cluster_store<float, 1>((address), {float(v)}, __LINE__)
#define tvm_builtin_ptx_st_vec_shared__cluster_v2_f32(address, v0, v1) \
  emu::cluster_store<float, 2>((address), {float(v0), float(v1)}, __LINE__)

// ---------------------------------------------------------------------------------------------
// Hopper's tensor-core path: TMA tensor copies (a CUtensorMap made by cuTensorMapEncodeTiled on the
// host: emu::make_tensor_map) and wgmma (m64nNk16, A and B from shared memory through matrix
// descriptors, or A from registers). A warpgroup's 128 threads meet at each wgmma; the last to
// arrive computes for all. wgmma completes at once, so its fences, commits and waits do nothing.
#define __grid_constant__
struct alignas(64) CUtensorMap {
  unsigned long long opaque[16];
};
namespace emu {
struct TensorMap {  // kept in a CUtensorMap's 128 bytes
  const unsigned char* base;
  int rank, elsize, swizzle;  // swizzle: CU_TENSOR_MAP_SWIZZLE_{NONE, 32B, 64B, 128B} = 0..3
  unsigned int dims[5], box[5];
  unsigned long long strides[4];  // bytes, of dims 1..rank-1
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "a tensor map fits a CUtensorMap");

inline void make_tensor_map(CUtensorMap* map, const void* base, int elsize, int rank, const unsigned int* dims,
                            const unsigned long long* strides, const unsigned int* box, const unsigned int* elem_strides,
                            int interleave, int swizzle) {
  if (rank < 1 || rank > 5) fail("a tensor map of rank %d", rank);
  if (interleave) fail("an interleaved tensor map (not emulated)");
  auto* m = reinterpret_cast<TensorMap*>(map);
  *m = TensorMap{};
  m->base = static_cast<const unsigned char*>(base);
  m->rank = rank;
  m->elsize = elsize;
  m->swizzle = swizzle;
  if (swizzle < 0 || swizzle > 3) fail("tensor map swizzle mode %d", swizzle);
  for (int i = 0; i < rank; ++i) {
    if (elem_strides[i] != 1) fail("a tensor map with element stride %u (not emulated)", elem_strides[i]);
    if (!box[i] || box[i] > 256) fail("tensor map box dimension %u (the GPU allows 1 to 256)", box[i]);
    m->dims[i] = dims[i];
    m->box[i] = box[i];
    if (i) m->strides[i - 1] = strides[i - 1];
  }
  if (swizzle && box[0] * unsigned(elsize) > (16u << swizzle))
    fail("a tensor map box row of %u bytes wider than its %u-byte swizzle", box[0] * unsigned(elsize), 16u << swizzle);
}

// The byte a shared address lands on under a swizzle mode (CUTLASS's Swizzle<mode, 4, 3>: the
// 16-byte chunk index within a 2^(mode+4)-byte row XORed with the row index mod 2^mode).
inline unsigned int swizzle(unsigned int address, int mode) {
  if (!mode) return address;
  unsigned int mask = ((1u << mode) - 1u) << 4;
  return address ^ ((address >> 3) & mask);
}

// cp.async.bulk.tensor between global and shared memory: the box at `coords`, laid out in shared
// memory row by row (dimension 0 fastest) under the map's swizzle. Out-of-bounds elements read as
// zero and are not written. Returns the box's bytes (all of which count as transferred).
inline size_t tensor_copy(bool to_shared, unsigned int shared, const void* tensor_map, const int* coords, int n,
                          int line) {
  const auto& m = *static_cast<const TensorMap*>(tensor_map);
  if (n != m.rank) fail("a %dd tensor copy through a rank-%d tensor map (line %d)", n, m.rank, line);
  if (shared % (m.swizzle ? 1024 : 128))
    fail("a tensor copy at shared address %u: not %d-byte aligned (line %d)", shared, m.swizzle ? 1024 : 128, line);
  size_t count = 1;
  for (int i = 0; i < m.rank; ++i) count *= m.box[i];
  unsigned char* smem = shared_pointer(shared, count * m.elsize, line);
  auto* global = const_cast<unsigned char*>(m.base);
  for (size_t e = 0; e < count; ++e) {
    size_t rest = e, offset = 0;
    bool inside = true;
    for (int i = 0; i < m.rank; ++i) {
      long long c = (long long)coords[i] + (long long)(rest % m.box[i]);
      rest /= m.box[i];
      inside &= c >= 0 && c < (long long)m.dims[i];
      offset += size_t(c) * (i ? m.strides[i - 1] : size_t(m.elsize));
    }
    unsigned char* at = smem + (swizzle(shared + unsigned(e * m.elsize), m.swizzle) - shared);
    if (to_shared && inside)
      std::memcpy(at, global + offset, m.elsize);
    else if (to_shared)
      std::memset(at, 0, m.elsize);
    else if (inside)
      std::memcpy(global + offset, at, m.elsize);
  }
  return count * m.elsize;
}
// The generated calls, (dst, map, coords..., mbarrier) and (map, coords..., src): the last
// argument and the coordinates before it.
template <class... P>
inline unsigned int split_coords(int (&coords)[5], P... rest) {
  constexpr int n = int(sizeof...(P)) - 1;
  static_assert(n >= 1 && n <= 5, "a tensor copy of 1 to 5 dimensions");
  long long v[] = {(long long)rest...};
  for (int i = 0; i < n; ++i) coords[i] = int(v[i]);
  return (unsigned int)v[n];
}
template <class... P>
inline void tensor_load(int line, unsigned int dst, const void* tensor_map, P... rest) {
  int coords[5];
  unsigned int bar = split_coords(coords, rest...);
  complete_tx(bar, tensor_copy(true, dst, tensor_map, coords, int(sizeof...(P)) - 1, line), line);
}
template <class... P>
inline void tensor_store(int line, const void* tensor_map, P... rest) {
  int coords[5];
  unsigned int src = split_coords(coords, rest...);
  tensor_copy(false, src, tensor_map, coords, int(sizeof...(P)) - 1, line);
}
inline void mbarrier_arrive(unsigned int address, int line) {
  Mbarrier& m = mbarrier(address, line);
  if (!m.count) fail("arrival at an mbarrier never initialised (line %d)", line);
  m.pending -= 1;
  complete(m);
}
}  // namespace emu

#define tvm_builtin_ptx_mbarrier_arrive_nocount_arrive_shared_b64(a) emu::mbarrier_arrive((a), __LINE__)
#define tvm_builtin_ptx_wgmma_fence_fence_sync_aligned() ((void)0)
#define tvm_builtin_ptx_wgmma_commit_group_commit_group_sync_aligned() ((void)0)
// (setmaxnreg and wgmma.wait_group N, families of names, cuda_emulator.py rewrites to nothing)
// Register pins (an empty asm keeping a value in a register): nothing to do here.
inline void autofuse_pin_float32(float&) {}
inline void autofuse_pin_uint32(uint32_t&) {}

namespace emu {
// One thread's part of a wgmma: its accumulators (float or int32), its A fragment (from registers)
// or descriptors.
struct WgmmaArgs {
  void* d[128];
  uint32_t a[4];
  uint64_t a_desc, b_desc;
  uint32_t scale_d;
};

// An operand element from shared memory through a matrix descriptor: row r (of M or N), column k,
// K-major (k contiguous) or MN-major (r contiguous).
template <class T, class Acc>
inline Acc operand(uint64_t desc, int r, int k, bool mn_major, int line) {
  unsigned int start = unsigned(desc & 0x3fffu) << 4, lbo = unsigned((desc >> 16) & 0x3fffu) << 4,
               sbo = unsigned((desc >> 32) & 0x3fffu) << 4;
  static const int kModes[4] = {0, 3, 2, 1};  // layout type 1: 128B swizzle, 2: 64B, 3: 32B
  int mode = kModes[desc >> 62];
  unsigned int e = sizeof(T), address;
  if (!mode) {  // core matrices of 8 rows x 16 bytes
    unsigned int per = 16 / e;
    address = mn_major ? start + (r / per) * lbo + (k / 8) * sbo + (k % 8) * 16 + (r % per) * e
                       : start + (r / 8) * sbo + (k / per) * lbo + (r % 8) * 16 + (k % per) * e;
  } else {      // swizzle atoms of 8 rows x 2^(mode+4) bytes
    unsigned int row = 16u << mode, per = row / e;
    address = mn_major ? start + (r / per) * lbo + (k / 8) * sbo + (k % 8) * row + (r % per) * e
                       : start + (r / 8) * sbo + (r % 8) * row + k * e;
    address = swizzle(address, mode);
  }
  T v;
  std::memcpy(&v, shared_pointer(address, e, line), e);
  return Acc(v);
}

// Element i (of 8) of a thread's m16n8k16 A fragment: a0 (g, 2q..), a1 (g+8, 2q..), a2 (g, 2q+8..),
// a3 (g+8, 2q+8..), two 16-bit values a register.
template <class T>
inline float fragment(const uint32_t (&a)[4], int half_index) {
  T v[2];
  std::memcpy(v, &a[half_index / 2], 4);
  return float(v[half_index % 2]);
}

// D (64 x N) (+)= A (64 x K) * B (K x N) for the 128 threads of a warpgroup; K = 32 bytes of input.
template <int N, class T, class Acc>
inline void wgmma_compute(WgmmaArgs* const* thread, bool a_in_registers, bool tnsp_a, bool tnsp_b, int line) {
  constexpr int K = 32 / int(sizeof(T));
  static Acc A[64][K], B[N][K];
  for (int m = 0; m < 64; ++m)
    for (int k = 0; k < K; ++k) {
      if (!a_in_registers) {
        A[m][k] = operand<T, Acc>(thread[0]->a_desc, m, k, tnsp_a, line);
        continue;
      }
      int w = m / 16, g = m % 8, q = (k % 8) / 2;
      int t = w * 32 + g * 4 + q, reg = (m % 16) / 8 + 2 * (k / 8);
      A[m][k] = Acc(fragment<T>(thread[t]->a, reg * 2 + k % 2));
    }
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) B[n][k] = operand<T, Acc>(thread[0]->b_desc, n, k, tnsp_b, line);
  for (int t = 0; t < 128; ++t) {
    const WgmmaArgs& x = *thread[t];
    if (x.a_desc != thread[0]->a_desc || x.b_desc != thread[0]->b_desc || x.scale_d != thread[0]->scale_d)
      fail("threads of a warpgroup pass different descriptors or scale-d to a wgmma (line %d)", line);
    // the accumulator fragment: d[i] at row 16w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2q + i % 2
    int w = t / 32, g = (t % 32) / 4, q = t % 4;
    for (int i = 0; i < N / 2; ++i) {
      int m = 16 * w + g + 8 * ((i >> 1) & 1), n = 8 * (i >> 2) + 2 * q + (i & 1);
      Acc sum = 0, old;
      for (int k = 0; k < K; ++k) sum += A[m][k] * B[n][k];
      std::memcpy(&old, x.d[i], sizeof(Acc));
      sum = (x.scale_d ? old : Acc(0)) + sum;
      std::memcpy(x.d[i], &sum, sizeof(Acc));
    }
  }
}

// One thread's wgmma call: the warpgroup's threads meet here; the last to arrive computes.
template <int N, class T, class Acc = float>
inline void wgmma_arrive(WgmmaArgs& args, bool a_in_registers, bool tnsp_a, bool tnsp_b, int line) {
  Fiber* self = g_current;
  int first = (self->tid / 128) * 128;
  if (first + 128 > g_nthreads) fail("a wgmma in a block whose threads are not whole warpgroups (line %d)", line);
  self->wgmma = &args;
  self->line = line;
  int arrived = 0;
  for (int t = first; t < first + 128; ++t)
    arrived += &g_fibers[t] == self || (g_fibers[t].state == kWarpgroup && g_fibers[t].line == line);
  if (arrived < 128) {
    yield(kWarpgroup, line);  // the last thread of the warpgroup computes and releases
    return;
  }
  WgmmaArgs* thread[128];
  for (int t = 0; t < 128; ++t) thread[t] = const_cast<WgmmaArgs*>(static_cast<const WgmmaArgs*>(g_fibers[first + t].wgmma));
  wgmma_compute<N, T, Acc>(thread, a_in_registers, tnsp_a, tnsp_b, line);
  for (int t = first; t < first + 128; ++t)
    if (&g_fibers[t] != self) g_fibers[t].state = kRunnable;
}

// The call's arguments: N/2 accumulators (by reference), then the rest by value in ``tail``.
template <int N, class... P>
inline void wgmma_take(WgmmaArgs& args, uint64_t (&tail)[8], P&&... p) {
  int i = 0;
  auto take = [&](auto&& v) {
    if (i < N / 2)
      args.d[i] = (void*)&v;
    else
      tail[i - N / 2] = (uint64_t)v;
    ++i;
  };
  (take(p), ...);
}
// tvm_builtin_ptx_wgmma_<dtype>_ss_..._m64n<N>k16_f32_<in>_<in>_<scale a>_<scale b>_<tnsp a>_<tnsp b>(d..., a_desc,
// b_desc, scale_d); the int8 ones, ..._int_ss_..._m64n<N>k32_s32_<a>_<b>(...), with int32 sums (Acc)
template <int N, class T, int TA, int TB, class Acc = float, class... P>
inline void wgmma_ss(int line, P&&... p) {
  static_assert(sizeof...(P) == N / 2 + 3, "wgmma ss: N/2 accumulators, two descriptors, scale-d");
  WgmmaArgs args{};
  uint64_t tail[8];
  wgmma_take<N>(args, tail, p...);
  args.a_desc = tail[0];
  args.b_desc = tail[1];
  args.scale_d = uint32_t(tail[2]);
  wgmma_arrive<N, T, Acc>(args, false, TA, TB, line);
}
// ..._rs_..._<scale a>_<scale b>_<tnsp b>(d..., a0, a1, a2, a3, b_desc, scale_d)
template <int N, class T, int TB, class... P>
inline void wgmma_rs(int line, P&&... p) {
  static_assert(sizeof...(P) == N / 2 + 6, "wgmma rs: N/2 accumulators, four A registers, a descriptor, scale-d");
  WgmmaArgs args{};
  uint64_t tail[8];
  wgmma_take<N>(args, tail, p...);
  for (int i = 0; i < 4; ++i) args.a[i] = uint32_t(tail[i]);
  args.b_desc = tail[4];
  args.scale_d = uint32_t(tail[5]);
  wgmma_arrive<N, T>(args, true, false, TB, line);
}
}  // namespace emu

namespace emu {
// bar.sync id, count: `count` threads of the block (any warps) meet at barrier `id`; the last to
// arrive releases the others.
inline void named_barrier(int id, int count, int line) {
  if (id < 0 || id > 15 || count <= 0 || count % 32 || count > g_nthreads)
    fail("bar.sync %d, %d: barrier 0-15, a multiple of 32 threads up to the block's (line %d)", id, count, line);
  Fiber* self = g_current;
  self->named_barrier = id;
  int arrived = 1;
  for (int t = 0; t < g_nthreads; ++t)
    arrived += &g_fibers[t] != self && g_fibers[t].state == kNamedBarrier && g_fibers[t].named_barrier == id;
  if (arrived > count) fail("more than %d threads at bar.sync %d (line %d)", count, id, line);
  if (arrived < count) {
    yield(kNamedBarrier, line);
    return;
  }
  for (int t = 0; t < g_nthreads; ++t)
    if (&g_fibers[t] != self && g_fibers[t].state == kNamedBarrier && g_fibers[t].named_barrier == id)
      g_fibers[t].state = kRunnable;
}
}  // namespace emu
#define tvm_builtin_cuda_warpgroup_sync(id) emu::named_barrier((id), 128, __LINE__)
