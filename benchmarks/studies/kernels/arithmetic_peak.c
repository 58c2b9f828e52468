/* Arithmetic peaks of this CPU: how many multiply-accumulate instructions a core retires per second.
 *
 * Twelve independent accumulators per loop (more than any of these instructions' latency times its
 * throughput), operands in registers, so nothing but the multiply pipes bounds the loop; AMX's tile
 * products (tdpbssd: 16 x 64 int8 by 64 x 16, where the CPU and Linux allow it) four accumulator tiles, their
 * operands in tiles.  Built by arithmetic_peak.py with gcc; each kind runs only where the CPU has it. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_LOOP 1
#endif

#define R12(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define DPBUSD_Z(i) "vpdpbusd %%zmm13, %%zmm14, %%zmm" #i "\n\t"
#define FMA_Z(i) "vfmadd231ps %%zmm13, %%zmm14, %%zmm" #i "\n\t"
#define DPBF16_Z(i) "vdpbf16ps %%zmm13, %%zmm14, %%zmm" #i "\n\t"
#define FMA_Y(i) "vfmadd231ps %%ymm13, %%ymm14, %%ymm" #i "\n\t"
#define MADDUBS_Y(i) "vpmaddubsw %%ymm13, %%ymm14, %%ymm" #i "\n\t"

enum { KIND_DPBUSD_Z, KIND_FMA_Z, KIND_DPBF16_Z, KIND_FMA_Y, KIND_MADDUBS_Y, KIND_TDPBSSD, KINDS };
static const char* NAMES[KINDS] = {"vpdpbusd zmm", "vfmadd231ps zmm", "vdpbf16ps zmm", "vfmadd231ps ymm",
                                   "vpmaddubsw ymm", "tdpbssd (AMX)"};
/* arithmetic operations an instruction does (a multiply-add counts two), instructions a loop iteration */
static const double OPS[KINDS] = {128, 32, 64, 16, 32, 16 * 16 * 64 * 2};
static const double PER_ITER[KINDS] = {12, 12, 12, 12, 12, 4};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* the registers the loops write and read: declared, so that the compiler keeps nothing of its own there */
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm13", "xmm14", "memory"
/* operands and accumulators start at zero: no denormal or NaN left in them by earlier code slows a loop */
#define ZERO_REGISTERS() __asm__ volatile("vzeroall" ::: CLOBBERS)

__attribute__((target("avx512f,avx512vnni,avx512bf16"))) static void loop512(int kind, long iters) {
  ZERO_REGISTERS();
  for (long n = 0; n < iters; ++n) {
    if (kind == KIND_DPBUSD_Z) __asm__ volatile(R12(DPBUSD_Z) ::: CLOBBERS);
    else if (kind == KIND_FMA_Z) __asm__ volatile(R12(FMA_Z) ::: CLOBBERS);
    else __asm__ volatile(R12(DPBF16_Z) ::: CLOBBERS);
  }
}

__attribute__((target("avx2,fma"))) static void loop256(int kind, long iters) {
  ZERO_REGISTERS();
  for (long n = 0; n < iters; ++n) {
    if (kind == KIND_FMA_Y) __asm__ volatile(R12(FMA_Y) ::: CLOBBERS);
    else __asm__ volatile(R12(MADDUBS_Y) ::: CLOBBERS);
  }
}

#ifdef HAVE_AMX_LOOP
struct tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((aligned(64)));

/* AMX's tiles with int8 products, and Linux's leave to use them (asked once for the process) */
static int amx_allowed(void) {
  unsigned a, b, c, d;
  if (__get_cpuid_max(0, NULL) < 7) return 0;
  __cpuid_count(7, 0, a, b, c, d);
  if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return 0;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

static void loop_amx(long iters) {
  static const int8_t zeros[1024] __attribute__((aligned(64)));
  struct tile_config config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
  __asm__ volatile(
      "tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
      "tileloadd (%0,%1,1), %%tmm4\n\ttileloadd (%0,%1,1), %%tmm5\n\t"
      "tileloadd (%0,%1,1), %%tmm6\n\ttileloadd (%0,%1,1), %%tmm7" ::"r"(zeros), "r"(64L) : "memory");
  for (long n = 0; n < iters; ++n) {
    __asm__ volatile(
        "tdpbssd %%tmm6, %%tmm4, %%tmm0\n\ttdpbssd %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbssd %%tmm6, %%tmm5, %%tmm2\n\ttdpbssd %%tmm7, %%tmm5, %%tmm3" ::: "memory");
  }
  __asm__ volatile("tilerelease" ::: "memory");
}
#endif

struct job { int kind; long iters; double seconds; };

static void* run(void* arg) {
  struct job* j = arg;
  double t0 = now();
  if (j->kind <= KIND_DPBF16_Z) loop512(j->kind, j->iters);
#ifdef HAVE_AMX_LOOP
  else if (j->kind == KIND_TDPBSSD) loop_amx(j->iters / 8);
#endif
  else loop256(j->kind, j->iters);
  j->seconds = now() - t0;
  return NULL;
}

static int has(int kind) {
  __builtin_cpu_init();
  switch (kind) {
    case KIND_DPBUSD_Z: return __builtin_cpu_supports("avx512vnni");
    case KIND_FMA_Z: return __builtin_cpu_supports("avx512f");
    case KIND_DPBF16_Z: return __builtin_cpu_supports("avx512bf16");
#ifdef HAVE_AMX_LOOP
    case KIND_TDPBSSD: return amx_allowed();
#else
    case KIND_TDPBSSD: return 0;
#endif
    default: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const long iters = argc > 2 ? atol(argv[2]) : 50000000L;
  for (int kind = 0; kind < KINDS; ++kind) {
    if (!has(kind)) continue;
    pthread_t ids[64];
    struct job jobs[64];
    for (int t = 0; t < threads && t < 64; ++t) {
      jobs[t] = (struct job){kind, iters, 0.0};
      pthread_create(&ids[t], NULL, run, &jobs[t]);
    }
    double rate = 0.0;
    for (int t = 0; t < threads && t < 64; ++t) {
      pthread_join(ids[t], NULL);
      const long done = kind == KIND_TDPBSSD ? iters / 8 : iters;  /* a tile product takes 16 cycles or so */
      rate += PER_ITER[kind] * done / jobs[t].seconds;
    }
    printf("%s\t%.3f\t%.1f\n", NAMES[kind], rate / 1e9, rate * OPS[kind] / 1e9);
  }
  return 0;
}
