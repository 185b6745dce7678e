// Emulator runtime: runs one compiled kernel over MLX's dispatchThreads geometry on the CPU.
//
// Each threadgroup runs on one worker OS thread; its GPU threads are cooperative fibers that switch
// only at threadgroup barriers and SIMD-group collectives, so a launch of thousands of threads
// costs thousands of small stacks, not thousands of OS threads. Deterministic scheduling makes
// barrier divergence a precise report instead of a hang. Buffers sit flush against a PROT_NONE
// guard page, so reading or writing past their end faults and is reported by buffer name.
//
// Compiled without instrumentation even in ThreadSanitizer builds: only the kernel's own memory
// accesses are checked, with happens-before edges declared at barriers and SIMD exchanges.
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "thread_ids.h"

#ifdef MTL_TSAN
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#define TSAN(...) __VA_ARGS__
#else
#define TSAN(...)
#endif


extern "C" void __mtl_kernel_entry(void* const* buffers, const ThreadIds* ids);

namespace {

const int kLanes = 32;
const size_t kStack = 256 * 1024;
const unsigned kThreadgroupMemoryLimit = 32 * 1024;  // Apple GPUs: 32 KiB per threadgroup

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;
  ThreadIds ids;
  State state = DONE;
  int site = 0;
  unsigned group_mask = 0;
  unsigned barrier_count = 0, simd_count = 0;
  alignas(16) unsigned char deposit[16];
  TSAN(void* tsan_fiber = nullptr; char sync[2][8]);
};

struct Worker {
  void* sched_sp = nullptr;
  Fiber* fibers = nullptr;
  Fiber* current = nullptr;
  unsigned n_threads = 0;
  unsigned char (*snapshot)[kLanes][16] = nullptr;  // per SIMD-group lane values
  unsigned char* arena = nullptr;
  unsigned arena_used = 0;
  int arena_ids[64];
  unsigned arena_offsets[64];
  int n_arena = 0;
  TSAN(void* tsan_sched = nullptr; char tg_sync[2][8]; char run_sync[1][8]);
};

struct Buffer {
  char name[128];
  size_t nbytes, offset;
  int is_output;
  char* data;
  char* guard;
};

unsigned g_grid[3], g_tg[3], g_groups[3];
int g_reverse = 0, g_workers = 1;
Buffer* g_buffers = nullptr;
int g_nbuf = 0;
void** g_ptrs = nullptr;
unsigned g_next_group = 0;  // atomic work counter
thread_local Worker* t_worker = nullptr;

[[noreturn]] void fail(const char* kind, const char* fmt, ...) {
  char msg[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "MTL-EMU-ERROR %s %s\n", kind, msg);
  fflush(stderr);
  _exit(3);
}

void describe_thread(char* out, size_t n, const Fiber* f) {
  if (!f) {
    snprintf(out, n, "outside any GPU thread");
    return;
  }
  const ThreadIds& t = f->ids;
  snprintf(out, n, "thread_position_in_grid=(%u,%u,%u) threadgroup=(%u,%u,%u)", t.thread_position_in_grid[0],
           t.thread_position_in_grid[1], t.thread_position_in_grid[2], t.threadgroup_position_in_grid[0],
           t.threadgroup_position_in_grid[1], t.threadgroup_position_in_grid[2]);
}

// ---- context switching ---------------------------------------------------------------------------
extern "C" void mtl_switch(void** save_sp, void* load_sp);
#if defined(__x86_64__)
asm(R"(
.text
.globl mtl_switch
.type mtl_switch,@function
mtl_switch:
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
)");
#elif defined(__aarch64__)
asm(R"(
.text
.globl mtl_switch
.type mtl_switch,%function
mtl_switch:
  sub sp, sp, #176
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #176
  ret
)");
#else
#error "the Metal emulator supports x86-64 and aarch64 hosts"
#endif

void fiber_main();

void* initial_stack(char* stack) {
  char* top = stack + kStack;
  top -= (uintptr_t)top % 16;
  void** sp = (void**)top;
#if defined(__x86_64__)
  *--sp = nullptr;                    // fake return address of fiber_main (keeps ABI alignment)
  *--sp = (void*)&fiber_main;         // `ret` lands here
  for (int i = 0; i < 6; i++) *--sp = nullptr;  // rbp rbx r12-r15
  unsigned csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  sp -= 1;
  memcpy(sp, csr, 8);
#else
  sp -= 22;  // 176 bytes of saved registers
  memset(sp, 0, 176);
  sp[11] = (void*)&fiber_main;  // x30 (link register)
#endif
  return sp;
}

void yield_to_scheduler() {
  Worker* w = t_worker;
  Fiber* f = w->current;
  TSAN(__tsan_switch_to_fiber(w->tsan_sched, 1));  // no sync: fibers stay unordered
  mtl_switch(&f->sp, w->sched_sp);
}

void fiber_main() {
  Worker* w = t_worker;
  Fiber* f = w->current;
  __mtl_kernel_entry(g_ptrs, &f->ids);
  TSAN(__tsan_release(w->run_sync[0]));  // the scheduler acquires it before reusing stacks and arena
  f->state = DONE;
  yield_to_scheduler();
  __builtin_trap();
}

// ---- scheduling of one threadgroup ---------------------------------------------------------------
void run_threadgroup(Worker* w, unsigned gx, unsigned gy, unsigned gz) {
  // dispatchThreads: the last threadgroup along an axis holds only the threads inside the grid,
  // and reports that smaller size as threads_per_threadgroup.
  unsigned g[3] = {gx, gy, gz}, eff[3];
  for (int d = 0; d < 3; d++) eff[d] = g_grid[d] - g[d] * g_tg[d] < g_tg[d] ? g_grid[d] - g[d] * g_tg[d] : g_tg[d];
  unsigned n = eff[0] * eff[1] * eff[2];
  unsigned n_simd = (n + kLanes - 1) / kLanes;
  w->arena_used = 0;
  w->n_arena = 0;
  // The previous threadgroup's accesses happen before this one reuses the stacks and the arena;
  // switching into a fiber with sync hands that on. NaN in every float type: uninitialised
  // threadgroup memory reads show up in the outputs.
  TSAN(__tsan_acquire(w->run_sync[0]));
  memset(w->arena, 0xff, kThreadgroupMemoryLimit);
  for (unsigned i = 0; i < w->n_threads; i++) w->fibers[i].state = DONE;
  for (unsigned i = 0; i < n; i++) {
    Fiber& f = w->fibers[i];
    ThreadIds& t = f.ids;
    unsigned l[3] = {i % eff[0], (i / eff[0]) % eff[1], i / (eff[0] * eff[1])};
    for (int d = 0; d < 3; d++) {
      t.grid_size[d] = g_grid[d];
      t.threads_per_threadgroup[d] = eff[d];
      t.threadgroups_per_grid[d] = g_groups[d];
      t.threadgroup_position_in_grid[d] = g[d];
      t.thread_position_in_threadgroup[d] = l[d];
      t.thread_position_in_grid[d] = g[d] * g_tg[d] + l[d];
    }
    t.thread_index_in_threadgroup = i;
    t.simdgroup_index_in_threadgroup = i / kLanes;
    t.thread_index_in_simdgroup = i % kLanes;
    t.simdgroups_per_threadgroup = n_simd;
    t.threads_per_simdgroup = kLanes;
    t.quadgroup_index_in_threadgroup = i / 4;
    t.thread_index_in_quadgroup = i % 4;
    t.quadgroups_per_threadgroup = (n + 3) / 4;
    f.state = RUNNABLE;
    f.barrier_count = f.simd_count = 0;
    f.sp = initial_stack(f.stack);
  }
  for (;;) {
    for (unsigned k = 0; k < n; k++) {
      unsigned i = g_reverse ? n - 1 - k : k;
      Fiber& f = w->fibers[i];
      if (f.state != RUNNABLE) continue;
      w->current = &f;
      TSAN(__tsan_switch_to_fiber(f.tsan_fiber, 0));
      mtl_switch(&w->sched_sp, f.sp);
    }
    w->current = nullptr;
    bool released = false;
    for (unsigned s = 0; s < n_simd; s++) {  // release each SIMD-group's lanes by call site
      unsigned lo = s * kLanes, hi = lo + kLanes < n ? lo + kLanes : n;
      for (unsigned i = lo; i < hi; i++) {
        Fiber& f = w->fibers[i];
        if (f.state != AT_SIMD) continue;
        unsigned mask = 0;
        for (unsigned j = lo; j < hi; j++)
          if (w->fibers[j].state == AT_SIMD && w->fibers[j].site == f.site) mask |= 1u << (j - lo);
        for (unsigned j = lo; j < hi; j++) {
          if (!(mask >> (j - lo) & 1u)) continue;
          Fiber& g = w->fibers[j];
          memcpy(w->snapshot[s][j - lo], g.deposit, 16);
          g.group_mask = mask;
          g.state = RUNNABLE;
        }
        released = true;
      }
    }
    if (released) continue;
    unsigned live = 0, waiting = 0;
    int site = -1, other_site = -1;
    for (unsigned i = 0; i < n; i++) {
      Fiber& f = w->fibers[i];
      if (f.state == DONE) continue;
      live++;
      if (f.state == AT_BARRIER) {
        waiting++;
        if (site < 0) site = f.site;
        else if (f.site != site) other_site = f.site;
      }
    }
    if (live == 0) return;
    char who[256];
    if (other_site >= 0)
      fail("barrier_divergence", "threadgroup (%u,%u,%u): threads wait at different threadgroup_barrier calls "
           "(lines %d and %d); a Mac would hang or corrupt memory", gx, gy, gz, site / 4096, other_site / 4096);
    if (waiting != n) {
      Fiber* gone = nullptr;
      for (unsigned i = 0; i < n && !gone; i++)
        if (w->fibers[i].state == DONE) gone = &w->fibers[i];
      describe_thread(who, sizeof who, gone);
      fail("barrier_divergence", "deadlock: %u of %u threads of threadgroup (%u,%u,%u) wait at threadgroup_barrier "
           "(line %d) but the others returned without reaching it (e.g. %s)", waiting, n, gx, gy, gz, site / 4096,
           who);
    }
    for (unsigned i = 0; i < n; i++)
      if (w->fibers[i].state == AT_BARRIER) w->fibers[i].state = RUNNABLE;
  }
}

void* worker_main(void* arg) {
  Worker* w = (Worker*)arg;
  t_worker = w;
  stack_t alt;  // the SIGSEGV report must run even when a fiber overflows its stack
  alt.ss_sp = malloc(1 << 16);
  alt.ss_size = 1 << 16;
  alt.ss_flags = 0;
  sigaltstack(&alt, nullptr);
  TSAN(w->tsan_sched = __tsan_get_current_fiber());
  unsigned total = g_groups[0] * g_groups[1] * g_groups[2];
  for (;;) {
    unsigned g = __atomic_fetch_add(&g_next_group, 1, __ATOMIC_RELAXED);
    if (g >= total) break;
    run_threadgroup(w, g % g_groups[0], (g / g_groups[0]) % g_groups[1], g / (g_groups[0] * g_groups[1]));
  }
  // Everything the kernel wrote happens before the main thread reads the outputs (after join).
  TSAN(__tsan_acquire(w->run_sync[0]));
  return nullptr;
}

void on_segv(int sig, siginfo_t* info, void*) {
  char* addr = (char*)info->si_addr;
  char who[256];
  describe_thread(who, sizeof who, t_worker ? t_worker->current : nullptr);
  for (int i = 0; i < g_nbuf; i++) {
    Buffer& b = g_buffers[i];
    if (addr >= b.data && addr < b.guard + 4096)
      fail("out_of_bounds", "%s accessed byte %ld of buffer '%s' which has %zu bytes", who,
           (long)(addr - b.data), b.name, b.nbytes);
  }
  fail("crash", "signal %d at address %p (%s)", sig, (void*)addr, who);
}

char* read_file(const char* path, size_t* size) {
  FILE* fp = fopen(path, "rb");
  if (!fp) fail("io", "cannot open %s", path);
  fseek(fp, 0, SEEK_END);
  *size = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  char* data = (char*)malloc(*size + 1);
  if (fread(data, 1, *size, fp) != *size) fail("io", "short read of %s", path);
  fclose(fp);
  return data;
}

}  // namespace

// float -> bfloat16 (round to nearest even): zig's compiler-rt lacks it without libc++.
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)  // quiet NaN
                                              : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return __builtin_bit_cast(__bf16, h);
}

// ---- hooks called from kernel code ---------------------------------------------------------------
extern "C" void __mtl_threadgroup_barrier(int site) {
  Fiber* f = t_worker->current;
  f->state = AT_BARRIER;
  f->site = site;
  TSAN(__tsan_release(t_worker->tg_sync[f->barrier_count % 2]));
  yield_to_scheduler();
  TSAN(__tsan_acquire(t_worker->tg_sync[f->barrier_count % 2]));
  f->barrier_count++;
}

extern "C" const unsigned char* __mtl_simd_exchange(int site, const void* value, unsigned size, unsigned* mask) {
  Worker* w = t_worker;
  Fiber* f = w->current;
  memset(f->deposit, 0, 16);
  memcpy(f->deposit, value, size);
#ifdef MTL_TSAN
  unsigned parity = f->simd_count % 2;
  f->deposit[15] = (unsigned char)parity;  // lanes learn each other's parity from the snapshot
  __tsan_release(f->sync[parity]);
#endif
  f->state = AT_SIMD;
  f->site = site;
  yield_to_scheduler();
  f->simd_count++;
  *mask = f->group_mask;
  unsigned s = f->ids.simdgroup_index_in_threadgroup;
#ifdef MTL_TSAN
  unsigned lo = s * kLanes;
  for (int k = 0; k < kLanes; k++)
    if (*mask >> k & 1u) __tsan_acquire(w->fibers[lo + k].sync[w->snapshot[s][k][15]]);
#endif
  return &w->snapshot[s][0][0];
}

extern "C" unsigned __mtl_lane(void) { return t_worker->current->ids.thread_index_in_simdgroup; }

extern "C" void* __mtl_threadgroup_alloc(int id, unsigned size, unsigned align) {
  Worker* w = t_worker;
  for (int i = 0; i < w->n_arena; i++)
    if (w->arena_ids[i] == id) return w->arena + w->arena_offsets[i];
  unsigned off = (w->arena_used + align - 1) / align * align;
  if (off + size > kThreadgroupMemoryLimit || w->n_arena == 64)
    fail("threadgroup_memory", "threadgroup memory exceeds %u bytes", kThreadgroupMemoryLimit);
  w->arena_ids[w->n_arena] = id;
  w->arena_offsets[w->n_arena++] = off;
  w->arena_used = off + size;
  return w->arena + off;
}

extern "C" void __mtl_fail(const char* kind, const char* message, int site) {
  char who[256];
  describe_thread(who, sizeof who, t_worker ? t_worker->current : nullptr);
  fail(kind, "%s (line %d, %s)", message, site / 4096, who);
}

// Usage: kernel MANIFEST. The manifest names the geometry, the buffers and their byte files.
int main(int argc, char** argv) {
  if (argc != 2) fail("usage", "kernel MANIFEST");
  FILE* m = fopen(argv[1], "r");
  if (!m) fail("io", "cannot open manifest %s", argv[1]);
  char data_path[4096], out_path[4096];
  if (fscanf(m, "grid %u %u %u\n", &g_grid[0], &g_grid[1], &g_grid[2]) != 3 ||
      fscanf(m, "threadgroup %u %u %u\n", &g_tg[0], &g_tg[1], &g_tg[2]) != 3 ||
      fscanf(m, "reverse %d\n", &g_reverse) != 1 || fscanf(m, "workers %d\n", &g_workers) != 1 ||
      fscanf(m, "data %4095s\n", data_path) != 1 || fscanf(m, "out %4095s\n", out_path) != 1 ||
      fscanf(m, "buffers %d\n", &g_nbuf) != 1)
    fail("io", "malformed manifest");
  g_buffers = (Buffer*)calloc(g_nbuf, sizeof(Buffer));
  g_ptrs = (void**)calloc(g_nbuf + 1, sizeof(void*));
  size_t data_size;
  char* data = read_file(data_path, &data_size);
  for (int i = 0; i < g_nbuf; i++) {
    Buffer& b = g_buffers[i];
    if (fscanf(m, "%127s %zu %zu %d\n", b.name, &b.nbytes, &b.offset, &b.is_output) != 4)
      fail("io", "malformed buffer line %d", i);
    size_t padded = (b.nbytes + 15) / 16 * 16;  // 16-byte aligned start for vector loads
    size_t pages = (padded + 4095) / 4096;
    char* base = (char*)mmap(nullptr, (pages + 1) * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    b.guard = base + pages * 4096;
    mprotect(b.guard, 4096, PROT_NONE);
    b.data = b.guard - padded;
    memset(b.data + b.nbytes, 0xff, padded - b.nbytes);  // slack before the guard reads as NaN
    memcpy(b.data, data + b.offset, b.nbytes);
    g_ptrs[i] = b.data;
  }
  fclose(m);
  for (int d = 0; d < 3; d++) {
    if (g_grid[d] == 0 || g_tg[d] == 0) fail("launch", "empty grid or threadgroup");
    if (g_tg[d] > g_grid[d]) g_tg[d] = g_grid[d];  // MLX: threadgroup = min(threadgroup, grid)
    g_groups[d] = (g_grid[d] + g_tg[d] - 1) / g_tg[d];
  }
  unsigned n = g_tg[0] * g_tg[1] * g_tg[2];
  if (n > 1024) fail("launch", "threadgroup of %u threads exceeds 1024", n);

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);

  unsigned total = g_groups[0] * g_groups[1] * g_groups[2];
  int n_workers = g_workers < (int)total ? g_workers : (int)total;
  Worker* workers = (Worker*)calloc(n_workers, sizeof(Worker));  // no libc++: no operator new
  pthread_t* threads = (pthread_t*)calloc(n_workers, sizeof(pthread_t));
  for (int k = 0; k < n_workers; k++) {
    Worker& w = workers[k];
    w.n_threads = n;
    w.fibers = (Fiber*)calloc(n, sizeof(Fiber));
    w.snapshot = (unsigned char(*)[kLanes][16])aligned_alloc(16, ((n + kLanes - 1) / kLanes) * kLanes * 16);
    w.arena = (unsigned char*)aligned_alloc(64, kThreadgroupMemoryLimit);
    for (unsigned i = 0; i < n; i++) {
      w.fibers[i].stack = (char*)mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      TSAN(w.fibers[i].tsan_fiber = __tsan_create_fiber(0));
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    pthread_create(&threads[k], &attr, worker_main, &w);
  }
  for (int k = 0; k < n_workers; k++) pthread_join(threads[k], nullptr);

  FILE* out = fopen(out_path, "wb");
  if (!out) fail("io", "cannot write %s", out_path);
  for (int i = 0; i < g_nbuf; i++)
    if (g_buffers[i].is_output) fwrite(g_buffers[i].data, 1, g_buffers[i].nbytes, out);
  fclose(out);
  return 0;
}
