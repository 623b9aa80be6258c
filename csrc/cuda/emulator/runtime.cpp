// The runtime of the host emulation in csrc/cuda/primitives/emulated.h: fibers, the scheduler of
// one CTA, the warp collectives, cp.async groups and the memory checks.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/primitives/primitives.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace paged_attention::emulator {

namespace {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 256 * 1024;

// ---- context switching ----------------------------------------------------------------------

#if defined(__x86_64__)
// Saves the callee-saved registers, MXCSR and the x87 control word of the running context on its
// stack, stores its stack pointer to *from and resumes the context whose stack pointer is `to`.
extern "C" void pa_emulator_switch(void** from, void* to);
asm(R"(
  .text
  .p2align 4
  .hidden pa_emulator_switch
  .globl pa_emulator_switch
  .type pa_emulator_switch, @function
pa_emulator_switch:
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
  .size pa_emulator_switch, .-pa_emulator_switch
)");
#endif

struct Copy {
  uint32_t dst;
  const void* src;
  int bytes;
};

enum class FiberState { kReady, kWaiting, kDone };

struct Fiber {
  int tid = 0;
  FiberState state = FiberState::kReady;
  std::unique_ptr<char[]> stack;
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t context{};
#endif
  std::vector<Copy> open;  // issued, not yet committed
  std::deque<std::vector<Copy>> groups;  // committed, oldest first
  const char* waiting_at = "";
};

enum class Op { kNone, kSyncwarp, kShflXor, kShfl, kAny, kLdmatrix, kMma };

const char* op_name(Op op) {
  switch (op) {
    case Op::kNone:
      return "none";
    case Op::kSyncwarp:
      return "syncwarp";
    case Op::kShflXor:
      return "shfl_xor";
    case Op::kShfl:
      return "shfl";
    case Op::kAny:
      return "any";
    case Op::kLdmatrix:
      return "ldmatrix_x4";
    case Op::kMma:
      return "mma_16816";
  }
  return "?";
}

constexpr int kMaxIn = 10;
constexpr int kMaxOut = 4;

struct Warp {
  int arrived = 0;
  Op op = Op::kNone;
  int param = 0;
  uint32_t in[kWarpSize][kMaxIn];
  uint32_t out[kWarpSize][kMaxOut];
};

struct LocalStats {
  uint64_t ctas = 0, ldmatrix = 0, ldmatrix_conflicted = 0, mma = 0, cp_async_bytes = 0;
  int ldmatrix_max_ways = 0;
};

// One host thread's emulation of one CTA at a time.
struct Cta {
  const std::function<void()>* body = nullptr;
  prim::Index3 block{}, grid{};
  int threads = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int barrier_arrived = 0;
  std::unique_ptr<unsigned char[]> shared_storage;
  unsigned char* shared = nullptr;
  uint32_t shared_bytes = 0;
  Fiber* current = nullptr;
#if defined(__x86_64__)
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler{};
#endif
  std::string error;
  LocalStats stats;
};

thread_local Cta* tls_cta = nullptr;

struct Region {
  const unsigned char* begin;
  const unsigned char* end;
  bool writable;
};

std::mutex globals_mutex;
std::vector<Region> globals;

std::mutex stats_mutex;
Stats global_stats;

Cta& cta() { return *tls_cta; }
Fiber& fiber() { return *cta().current; }

void switch_to_scheduler() {
  Cta& c = cta();
#if defined(__x86_64__)
  pa_emulator_switch(&c.current->sp, c.scheduler_sp);
#else
  swapcontext(&c.current->context, &c.scheduler);
#endif
}

void run_fiber(Cta& c, Fiber& f) {
  c.current = &f;
#if defined(__x86_64__)
  pa_emulator_switch(&c.scheduler_sp, f.sp);
#else
  swapcontext(&c.scheduler, &f.context);
#endif
  c.current = nullptr;
}

void fiber_main() {
  Cta& c = cta();
  (*c.body)();
  Fiber& f = fiber();
  size_t pending = f.open.size();
  for (const auto& group : f.groups) pending += group.size();
  if (pending > 0 && c.error.empty()) {
    c.error = "thread " + std::to_string(f.tid) + " exited with " + std::to_string(pending) +
              " asynchronous copies it never waited for";
  }
  f.state = FiberState::kDone;
  switch_to_scheduler();
  std::abort();  // a finished fiber is never resumed
}

#if defined(__x86_64__)
extern "C" void pa_emulator_fiber_entry() { fiber_main(); }
#endif

void init_fiber(Fiber& f) {
  if (!f.stack) f.stack.reset(new char[kStackBytes]);
#if defined(__x86_64__)
  // The frame pa_emulator_switch pops: MXCSR and x87 control word, six registers, then the
  // return address (the entry function), with the stack 16-byte aligned as at a call.
  auto top = reinterpret_cast<uintptr_t>(f.stack.get() + kStackBytes) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uint64_t*>(top - 72);
  frame[0] = 0x1f80u | (uint64_t{0x037f} << 32);
  for (int i = 1; i <= 6; ++i) frame[i] = 0;
  frame[7] = reinterpret_cast<uint64_t>(&pa_emulator_fiber_entry);
  f.sp = frame;
#else
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack.get();
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, &fiber_main, 0);
#endif
}

// Blocks the running fiber until a release marks it ready again.
void wait_here(const char* what) {
  Fiber& f = fiber();
  f.state = FiberState::kWaiting;
  f.waiting_at = what;
  switch_to_scheduler();
}

// ---- collectives ----------------------------------------------------------------------------

void execute(Warp& w, Cta& c, int warp_index) {
  switch (w.op) {
    case Op::kNone:
    case Op::kSyncwarp:
      break;
    case Op::kShflXor:
      for (int l = 0; l < kWarpSize; ++l) w.out[l][0] = w.in[l ^ w.param][0];
      break;
    case Op::kShfl:
      for (int l = 0; l < kWarpSize; ++l) w.out[l][0] = w.in[w.in[l][1] & (kWarpSize - 1)][0];
      break;
    case Op::kAny: {
      uint32_t any = 0;
      for (int l = 0; l < kWarpSize; ++l) any |= w.in[l][0];
      for (int l = 0; l < kWarpSize; ++l) w.out[l][0] = any;
      break;
    }
    case Op::kLdmatrix: {
      for (int l = 0; l < kWarpSize; ++l) {
        const uint32_t row = w.in[l][0];
        if (row % 16 != 0 || row + 16 > c.shared_bytes) {
          c.error = "ldmatrix: lane " + std::to_string(l) + " of warp " +
                    std::to_string(warp_index) + " gives row address " + std::to_string(row) +
                    " (rows are 16-byte aligned and inside the " +
                    std::to_string(c.shared_bytes) + " bytes of shared memory)";
          return;
        }
      }
      int worst = 1;
      for (int m = 0; m < 4; ++m) {
        int rows_in_group[8] = {};
        for (int r = 0; r < 8; ++r) {
          const uint32_t row = w.in[8 * m + r][0];
          bool repeated = false;
          for (int s = 0; s < r; ++s) repeated |= w.in[8 * m + s][0] == row;
          if (!repeated) ++rows_in_group[(row / 16) % 8];
        }
        for (int g = 0; g < 8; ++g) worst = std::max(worst, rows_in_group[g]);
      }
      ++c.stats.ldmatrix;
      if (worst > 1) ++c.stats.ldmatrix_conflicted;
      c.stats.ldmatrix_max_ways = std::max(c.stats.ldmatrix_max_ways, worst);
      for (int l = 0; l < kWarpSize; ++l) {
        for (int m = 0; m < 4; ++m) {
          const uint32_t row = w.in[8 * m + l / 4][0];
          std::memcpy(&w.out[l][m], c.shared + row + 4 * (l % 4), 4);
        }
      }
      break;
    }
    case Op::kMma: {
      // in[l] = a0..a3, b0, b1, c0..c3 (floats as bits); PTX ISA fragment layouts of
      // mma.m16n8k16 with 16-bit A/B and f32 C/D: groupID = l / 4, threadID_in_group = l % 4.
      const bool bf16 = w.param != 0;
      const auto element = [bf16](uint32_t reg, int half) {
        const auto bits = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffffu);
        return static_cast<double>(bf16 ? prim::bf16_to_float(bits) : prim::half_to_float(bits));
      };
      double a[16][16], b[16][8], acc[16][8];
      for (int l = 0; l < kWarpSize; ++l) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 8; ++i) {  // a_i: register i / 2, half i % 2
          const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
          const int col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
          a[row][col] = element(w.in[l][i / 2], i % 2);
        }
        for (int i = 0; i < 4; ++i) {  // b_i: register i / 2, half i % 2
          const int row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
          b[row][g] = element(w.in[l][4 + i / 2], i % 2);
        }
        for (int i = 0; i < 4; ++i) {
          const int row = i < 2 ? g : g + 8;
          const int col = t * 2 + (i & 1);
          acc[row][col] = prim::bits_to_float(w.in[l][6 + i]);
        }
      }
      for (int row = 0; row < 16; ++row) {
        for (int col = 0; col < 8; ++col) {
          for (int k = 0; k < 16; ++k) acc[row][col] += a[row][k] * b[k][col];
        }
      }
      for (int l = 0; l < kWarpSize; ++l) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; ++i) {
          const int row = i < 2 ? g : g + 8;
          w.out[l][i] = prim::float_to_bits(static_cast<float>(acc[row][t * 2 + (i & 1)]));
        }
      }
      ++c.stats.mma;
      break;
    }
  }
}

// Deposits this lane's inputs, waits for the other 31 lanes, returns this lane's outputs.
void warp_collective(Op op, int param, const uint32_t* in, int num_in, uint32_t* out,
                     int num_out) {
  Cta& c = cta();
  Fiber& f = fiber();
  const int warp_index = f.tid / kWarpSize;
  const int lane = f.tid % kWarpSize;
  Warp& w = c.warps[warp_index];
  if (w.arrived == 0) {
    w.op = op;
    w.param = param;
  } else if (w.op != op || w.param != param) {
    detail::fail(std::string("warp ") + std::to_string(warp_index) + ": lane " +
                 std::to_string(lane) + " reached " + op_name(op) + " while other lanes wait at " +
                 op_name(w.op) + " (divergent warp collective)");
  }
  for (int i = 0; i < num_in; ++i) w.in[lane][i] = in[i];
  if (++w.arrived == kWarpSize) {
    execute(w, c, warp_index);
    if (!c.error.empty()) detail::fail(c.error);
    w.arrived = 0;
    w.op = Op::kNone;
    for (int l = 0; l < kWarpSize; ++l) {
      Fiber& other = c.fibers[warp_index * kWarpSize + l];
      if (other.state == FiberState::kWaiting) other.state = FiberState::kReady;
    }
  } else {
    wait_here(op_name(op));
  }
  for (int i = 0; i < num_out; ++i) out[i] = w.out[lane][i];
}

void complete_group(Cta& c, const std::vector<Copy>& group) {
  for (const Copy& copy : group) std::memcpy(c.shared + copy.dst, copy.src, copy.bytes);
}

std::string describe_deadlock(const Cta& c) {
  std::string text = "deadlock in CTA (" + std::to_string(c.block.x) + ", " +
                     std::to_string(c.block.y) + ", " + std::to_string(c.block.z) + "):";
  int done = 0, at_barrier = 0;
  for (const Fiber& f : c.fibers) {
    if (f.state == FiberState::kDone) ++done;
    if (f.state == FiberState::kWaiting && std::string(f.waiting_at) == "syncthreads") {
      ++at_barrier;
    }
  }
  text += " " + std::to_string(done) + " threads exited, " + std::to_string(at_barrier) +
          " wait at syncthreads";
  for (size_t w = 0; w < c.warps.size(); ++w) {
    if (c.warps[w].arrived > 0) {
      text += "; warp " + std::to_string(w) + ": " + std::to_string(c.warps[w].arrived) +
              " lanes wait at " + op_name(c.warps[w].op);
    }
  }
  return text;
}

// Runs every thread of one CTA to completion; returns false on an error (in c.error).
bool run_cta(Cta& c) {
  std::fill_n(c.shared, c.shared_bytes, static_cast<unsigned char>(0xff));
  for (Fiber& f : c.fibers) {
    f.state = FiberState::kReady;
    f.open.clear();
    f.groups.clear();
    init_fiber(f);
  }
  for (Warp& w : c.warps) {
    w.arrived = 0;
    w.op = Op::kNone;
  }
  c.barrier_arrived = 0;
  c.error.clear();
  tls_cta = &c;
  bool forward = true;
  for (;;) {
    bool ran = false, all_done = true;
    const int n = static_cast<int>(c.fibers.size());
    for (int i = 0; i < n; ++i) {
      Fiber& f = c.fibers[forward ? i : n - 1 - i];
      if (f.state == FiberState::kReady) {
        run_fiber(c, f);
        ran = true;
        if (!c.error.empty()) return false;
      }
      all_done &= f.state == FiberState::kDone;
    }
    forward = !forward;
    if (all_done) break;
    if (!ran) {
      bool really_done = true;
      for (const Fiber& f : c.fibers) really_done &= f.state == FiberState::kDone;
      if (really_done) break;
      c.error = describe_deadlock(c);
      return false;
    }
  }
  ++c.stats.ctas;
  return true;
}

}  // namespace

namespace detail {

int thread_index() { return fiber().tid; }
prim::Index3 block_index() { return cta().block; }
prim::Index3 grid_size() { return cta().grid; }
unsigned char* shared_base() { return cta().shared; }
uint32_t shared_size() { return cta().shared_bytes; }

void fail(const std::string& message) {
  Cta& c = cta();
  if (c.error.empty()) c.error = message;
  Fiber& f = fiber();
  f.state = FiberState::kDone;
  switch_to_scheduler();
  std::abort();  // the scheduler abandons the CTA
}

void check_global(const void* p, size_t bytes, bool write) {
  const auto* begin = static_cast<const unsigned char*>(p);
  for (const Region& r : globals) {
    if (begin >= r.begin && begin + bytes <= r.end) {
      if (write && !r.writable) break;
      return;
    }
  }
  char text[160];
  std::snprintf(text, sizeof text, "thread %d: %s of %zu bytes at %p outside every %sregion",
                fiber().tid, write ? "store" : "load", bytes, p,
                write ? "writable " : "registered ");
  fail(text);
}

void syncthreads() {
  Cta& c = cta();
  if (++c.barrier_arrived == c.threads) {
    c.barrier_arrived = 0;
    for (Fiber& f : c.fibers) {
      if (f.state == FiberState::kWaiting) f.state = FiberState::kReady;
    }
    return;
  }
  wait_here("syncthreads");
}

void syncwarp() { warp_collective(Op::kSyncwarp, 0, nullptr, 0, nullptr, 0); }

uint32_t shfl_xor(uint32_t v, int mask) {
  if (mask <= 0 || mask >= kWarpSize) fail("shfl_xor: lane mask " + std::to_string(mask));
  uint32_t out;
  warp_collective(Op::kShflXor, mask, &v, 1, &out, 1);
  return out;
}

uint32_t shfl(uint32_t v, int src_lane) {
  const uint32_t in[2] = {v, static_cast<uint32_t>(src_lane)};
  uint32_t out;
  warp_collective(Op::kShfl, 0, in, 2, &out, 1);
  return out;
}

bool any(bool p) {
  const uint32_t in = p ? 1u : 0u;
  uint32_t out;
  warp_collective(Op::kAny, 0, &in, 1, &out, 1);
  return out != 0;
}

void cp_async(uint32_t dst, const void* src, int bytes) {
  Cta& c = cta();
  if (dst % bytes != 0 || dst + bytes > c.shared_bytes) {
    fail("cp.async: destination " + std::to_string(dst) + " (" + std::to_string(bytes) +
         " bytes) misaligned or past the " + std::to_string(c.shared_bytes) +
         " bytes of shared memory");
  }
  if (reinterpret_cast<uintptr_t>(src) % bytes != 0) fail("cp.async: misaligned source");
  check_global(src, bytes, false);
  std::memset(c.shared + dst, 0xff, bytes);
  fiber().open.push_back({dst, src, bytes});
  c.stats.cp_async_bytes += bytes;
}

void cp_async_commit() {
  Fiber& f = fiber();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

void cp_async_wait(int n) {
  Cta& c = cta();
  Fiber& f = fiber();
  while (static_cast<int>(f.groups.size()) > n) {
    complete_group(c, f.groups.front());
    f.groups.pop_front();
  }
}

void ldmatrix_x4(uint32_t (&r)[4], uint32_t row_offset) {
  warp_collective(Op::kLdmatrix, 0, &row_offset, 1, r, 4);
}

void mma_16816(bool bf16, float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  uint32_t in[kMaxIn] = {a[0], a[1], a[2], a[3], b0, b1};
  for (int i = 0; i < 4; ++i) in[6 + i] = prim::float_to_bits(d[i]);
  uint32_t out[4];
  warp_collective(Op::kMma, bf16 ? 1 : 0, in, kMaxIn, out, 4);
  for (int i = 0; i < 4; ++i) d[i] = prim::bits_to_float(out[i]);
}

}  // namespace detail

std::string launch(const LaunchConfig& config, const std::function<void()>& body, int workers) {
  if (config.threads <= 0 || config.threads % kWarpSize != 0) {
    return "launch: threads per CTA must be a positive multiple of 32";
  }
  const int64_t total = int64_t{config.grid.x} * config.grid.y * config.grid.z;
  if (total == 0) return "";
  std::atomic<int64_t> next{0};
  std::mutex error_mutex;
  std::string first_error;
  const auto work = [&] {
    Cta c;
    c.body = &body;
    c.grid = config.grid;
    c.threads = config.threads;
    c.fibers.resize(config.threads);
    for (int t = 0; t < config.threads; ++t) c.fibers[t].tid = t;
    c.warps.resize(config.threads / kWarpSize);
    c.shared_bytes = config.shared_bytes;
    c.shared_storage.reset(new unsigned char[config.shared_bytes + 128]);
    c.shared = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(c.shared_storage.get()) + 127) & ~uintptr_t{127});
    for (int64_t i = next++; i < total; i = next++) {
      {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!first_error.empty()) break;
      }
      c.block = {static_cast<int>(i % config.grid.x),
                 static_cast<int>(i / config.grid.x % config.grid.y),
                 static_cast<int>(i / (int64_t{config.grid.x} * config.grid.y))};
      if (!run_cta(c)) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (first_error.empty()) first_error = c.error;
        break;
      }
    }
    tls_cta = nullptr;
    const std::lock_guard<std::mutex> lock(stats_mutex);
    global_stats.ctas += c.stats.ctas;
    global_stats.ldmatrix += c.stats.ldmatrix;
    global_stats.ldmatrix_conflicted += c.stats.ldmatrix_conflicted;
    global_stats.ldmatrix_max_ways =
        std::max(global_stats.ldmatrix_max_ways, c.stats.ldmatrix_max_ways);
    global_stats.mma += c.stats.mma;
    global_stats.cp_async_bytes += c.stats.cp_async_bytes;
  };
  workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(workers, total)));
  std::vector<std::thread> pool;
  for (int i = 1; i < workers; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  return first_error;
}

void register_global(const void* data, size_t bytes, bool writable) {
  const std::lock_guard<std::mutex> lock(globals_mutex);
  const auto* begin = static_cast<const unsigned char*>(data);
  globals.push_back({begin, begin + bytes, writable});
}

void clear_globals() {
  const std::lock_guard<std::mutex> lock(globals_mutex);
  globals.clear();
}

Stats stats() {
  const std::lock_guard<std::mutex> lock(stats_mutex);
  return global_stats;
}

void reset_stats() {
  const std::lock_guard<std::mutex> lock(stats_mutex);
  global_stats = Stats{};
}

}  // namespace paged_attention::emulator
