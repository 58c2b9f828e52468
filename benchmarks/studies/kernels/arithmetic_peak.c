/* Arithmetic peaks of this CPU: how many multiply-accumulate instructions a core retires per second.
 *
 * Twelve independent accumulators per loop (more than any of these instructions' latency times its
 * throughput), operands in registers, so nothing but the multiply pipes bounds the loop.  Built by
 * arithmetic_peak.py with gcc; each kind runs only where the CPU has it. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define R12(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define DPBUSD_Z(i) "vpdpbusd %%zmm13, %%zmm14, %%zmm" #i "\n\t"
#define FMA_Z(i) "vfmadd231ps %%zmm13, %%zmm14, %%zmm" #i "\n\t"
#define DPBF16_Z(i) "vdpbf16ps %%zmm13, %%zmm14, %%zmm" #i "\n\t"
#define FMA_Y(i) "vfmadd231ps %%ymm13, %%ymm14, %%ymm" #i "\n\t"
#define MADDUBS_Y(i) "vpmaddubsw %%ymm13, %%ymm14, %%ymm" #i "\n\t"

enum { KIND_DPBUSD_Z, KIND_FMA_Z, KIND_DPBF16_Z, KIND_FMA_Y, KIND_MADDUBS_Y, KINDS };
static const char* NAMES[KINDS] = {"vpdpbusd zmm", "vfmadd231ps zmm", "vdpbf16ps zmm", "vfmadd231ps ymm",
                                   "vpmaddubsw ymm"};
/* arithmetic operations an instruction does (a multiply-add counts two) */
static const double OPS[KINDS] = {128, 32, 64, 16, 32};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

__attribute__((target("avx512f,avx512vnni,avx512bf16"))) static void loop512(int kind, long iters) {
  for (long n = 0; n < iters; ++n) {
    if (kind == KIND_DPBUSD_Z) __asm__ volatile(R12(DPBUSD_Z) ::: "memory");
    else if (kind == KIND_FMA_Z) __asm__ volatile(R12(FMA_Z) ::: "memory");
    else __asm__ volatile(R12(DPBF16_Z) ::: "memory");
  }
}

__attribute__((target("avx2,fma"))) static void loop256(int kind, long iters) {
  __asm__ volatile("vpxor %%ymm13, %%ymm13, %%ymm13\n\tvpxor %%ymm14, %%ymm14, %%ymm14" ::: "xmm13", "xmm14");
  for (long n = 0; n < iters; ++n) {
    if (kind == KIND_FMA_Y) __asm__ volatile(R12(FMA_Y) ::: "memory");
    else __asm__ volatile(R12(MADDUBS_Y) ::: "memory");
  }
}

struct job { int kind; long iters; double seconds; };

static void* run(void* arg) {
  struct job* j = arg;
  double t0 = now();
  if (j->kind <= KIND_DPBF16_Z) loop512(j->kind, j->iters);
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
      rate += 12.0 * iters / jobs[t].seconds;
    }
    printf("%s\t%.3f\t%.1f\n", NAMES[kind], rate / 1e9, rate * OPS[kind] / 1e9);
  }
  return 0;
}
