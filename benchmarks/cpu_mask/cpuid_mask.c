// LD_PRELOAD library: the process (and every process it starts) sees a CPU without the instruction sets that
// CPUID_MASK names, through CPUID itself, so that every engine in a benchmark (ONNX Runtime's MLAS, oneDNN
// under OpenVINO, numpy, edge-spec's native kernels) picks the kernels it would pick on such a CPU.
//
//   CPUID_MASK=avx2      no AVX-512, no AVX-VNNI, no AMX: an AVX2-only CPU (AMD's Zen 2 and 3, Intel before
//                        Alder Lake)
//   CPUID_MASK=avxvnni   no AVX-512, no AMX, AVX-VNNI kept: Intel's laptop cores since Alder Lake
//   CPUID_MASK=noamx     AMX alone removed: the AVX-512 VNNI kinds (AMD's Zen 4 and 5, Intel before Sapphire Rapids)
//
// How: Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, where /proc/cpuinfo lists cpuid_fault) makes every
// CPUID instruction raise SIGSEGV; the handler runs the real instruction with faulting off for a moment, clears
// the masked feature bits and steps past it.  The setting is kept across fork and clone and this library sets it
// again after execve.  Another SIGSEGV handler installed later (Python's faulthandler, a JIT) is kept beside this
// one and called for every other fault.
//
// What it cannot hide: the instructions still run if a program uses them without asking CPUID (code compiled
// with -march=native), and the dynamic loader's own CPU probe (glibc's string functions) runs before any
// preloaded library.  Timings are of this machine's cores and memory with the other kinds' instruction sets, not
// of the other kinds' machines.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#ifndef ARCH_SET_CPUID
#define ARCH_SET_CPUID 0x1012
#endif

#define BIT(n) (1u << (n))

// leaf 7, sub-leaf 0: AVX-512's feature bits, and AMX's
static const uint32_t kAvx512Ebx = BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31);
static const uint32_t kAvx512Ecx = BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14);
static const uint32_t kAvx512Edx = BIT(2) | BIT(3) | BIT(8) | BIT(23);
static const uint32_t kAmxEdx = BIT(22) | BIT(24) | BIT(25);
// leaf 7, sub-leaf 1, EAX: AVX-VNNI (4), AVX512_BF16 (5), AMX-FP16 (21)
static const uint32_t kAvxVnniEax = BIT(4);
static const uint32_t kAvx512Bf16Eax = BIT(5);
static const uint32_t kAmxFp16Eax = BIT(21);

static int g_hide_avx512, g_hide_avx_vnni, g_hide_amx;
static struct sigaction g_chained;  // the program's own SIGSEGV handler, called for every other fault
static int (*g_real_sigaction)(int, const struct sigaction*, struct sigaction*);

static long set_cpuid_faulting(int on) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

static void mask(uint32_t leaf, uint32_t sub, uint32_t* a, uint32_t* b, uint32_t* c, uint32_t* d) {
  if (leaf == 7 && sub == 0) {
    if (g_hide_avx512) {
      *b &= ~kAvx512Ebx;
      *c &= ~kAvx512Ecx;
      *d &= ~kAvx512Edx;
    }
    if (g_hide_amx) *d &= ~kAmxEdx;
  } else if (leaf == 7 && sub == 1) {
    if (g_hide_avx_vnni) *a &= ~kAvxVnniEax;
    if (g_hide_avx512) *a &= ~kAvx512Bf16Eax;
    if (g_hide_amx) *a &= ~kAmxFp16Eax;
  }
}

static void chain(int signo, siginfo_t* info, void* context) {
  if (g_chained.sa_flags & SA_SIGINFO) {
    if (g_chained.sa_sigaction != NULL) return g_chained.sa_sigaction(signo, info, context);
  } else if (g_chained.sa_handler != SIG_DFL && g_chained.sa_handler != SIG_IGN && g_chained.sa_handler != NULL) {
    return g_chained.sa_handler(signo);
  }
  // the default action: the fault happens again with no handler, and the process ends as it would have
  struct sigaction dfl;
  memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  g_real_sigaction(SIGSEGV, &dfl, NULL);
}

static void on_segv(int signo, siginfo_t* info, void* context) {
  ucontext_t* uc = (ucontext_t*)context;
  const uint8_t* rip = (const uint8_t*)uc->uc_mcontext.gregs[REG_RIP];
  if (info->si_code != SI_KERNEL || rip == NULL || rip[0] != 0x0F || rip[1] != 0xA2) return chain(signo, info, context);
  const uint32_t leaf = (uint32_t)uc->uc_mcontext.gregs[REG_RAX];
  const uint32_t sub = (uint32_t)uc->uc_mcontext.gregs[REG_RCX];
  uint32_t a, b, c, d;
  set_cpuid_faulting(0);
  __cpuid_count(leaf, sub, a, b, c, d);
  set_cpuid_faulting(1);
  mask(leaf, sub, &a, &b, &c, &d);
  uc->uc_mcontext.gregs[REG_RAX] = a;
  uc->uc_mcontext.gregs[REG_RBX] = b;
  uc->uc_mcontext.gregs[REG_RCX] = c;
  uc->uc_mcontext.gregs[REG_RDX] = d;
  uc->uc_mcontext.gregs[REG_RIP] += 2;
}

// a program's own SIGSEGV handler goes beside this library's, which stays installed
int sigaction(int signo, const struct sigaction* act, struct sigaction* old) {
  if (g_real_sigaction == NULL) g_real_sigaction = dlsym(RTLD_NEXT, "sigaction");
  if (signo != SIGSEGV || !(g_hide_avx512 || g_hide_avx_vnni || g_hide_amx)) return g_real_sigaction(signo, act, old);
  if (old != NULL) *old = g_chained;
  if (act != NULL) g_chained = *act;
  return 0;
}

sighandler_t signal(int signo, sighandler_t handler) {
  struct sigaction act, old;
  memset(&act, 0, sizeof(act));
  act.sa_handler = handler;
  sigemptyset(&act.sa_mask);
  act.sa_flags = SA_RESTART;
  if (sigaction(signo, &act, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

__attribute__((constructor(101))) static void start(void) {
  g_real_sigaction = dlsym(RTLD_NEXT, "sigaction");
  const char* name = getenv("CPUID_MASK");
  if (name == NULL || name[0] == '\0') return;
  if (strcmp(name, "avx2") == 0) {
    g_hide_avx512 = g_hide_avx_vnni = g_hide_amx = 1;
  } else if (strcmp(name, "avxvnni") == 0) {
    g_hide_avx512 = g_hide_amx = 1;
  } else if (strcmp(name, "noamx") == 0) {
    g_hide_amx = 1;
  } else {
    fprintf(stderr, "cpuid_mask: CPUID_MASK=%s: choose avx2, avxvnni or noamx\n", name);
    _exit(2);
  }
  struct sigaction act;
  memset(&act, 0, sizeof(act));
  act.sa_sigaction = on_segv;
  act.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&act.sa_mask);
  memset(&g_chained, 0, sizeof(g_chained));
  g_chained.sa_handler = SIG_DFL;
  g_real_sigaction(SIGSEGV, &act, NULL);
  if (set_cpuid_faulting(1) != 0) {
    fprintf(stderr, "cpuid_mask: this kernel or CPU has no CPUID faulting (cpuid_fault in /proc/cpuinfo)\n");
    _exit(2);
  }
}
