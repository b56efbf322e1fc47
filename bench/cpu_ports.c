// Throughput and latency of the AVX-512 instructions the int4 / bf16 CPU expert loops are made of, on
// one core: how many cycles a VDPBF16PS, an FMA, a VPERMW... costs here, so a loop's bound can be
// counted instead of guessed (bench/RESULTS.md, session 16: the dev box VM exposes no PMU).
//
//   gcc -O2 -march=native -o /tmp/cpu_ports bench/cpu_ports.c && taskset -c 1 /tmp/cpu_ports
//
// Every test is inline assembly (the compiler cannot fold or reorder it): "thr" runs 8 independent
// chains (throughput), "lat" one dependent chain (latency). The core clock comes from a chain of
// dependent 1-cycle integer adds timed the same way; AVX-512 code may run at a lower clock than that
// scalar chain (frequency licences), so cycles are "scalar-clock cycles": an upper bound.
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N_ITERS 50000000L

// one loop of 8 instructions per iteration; returns ns per instruction
#define BENCH(name, body)                                  \
  static double name(void) {                               \
    double t0 = now();                                     \
    for (long i = 0; i < N_ITERS; ++i) __asm__ volatile(body ::: "xmm0", "xmm1", "xmm2", "xmm3", \
        "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "memory"); \
    return (now() - t0) / (8.0 * N_ITERS) * 1e9;           \
  }

#define EIGHT(op)                                                                                   \
  op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)

// throughput: zmm0..7 independent accumulators, zmm8..11 inputs
#define DP_T(i) "vdpbf16ps %%zmm8, %%zmm9, %%zmm" #i "\n\t"
#define FMA_T(i) "vfmadd231ps %%zmm8, %%zmm9, %%zmm" #i "\n\t"
#define PERMW_T(i) "vpermw %%zmm8, %%zmm9, %%zmm" #i "\n\t"
#define PERMPS_T(i) "vpermps %%zmm8, %%zmm9, %%zmm" #i "\n\t"
#define ZXBW_T(i) "vpmovzxbw %%ymm8, %%zmm" #i "\n\t"
#define TERN_T(i) "vpternlogd $0xEA, %%zmm8, %%zmm9, %%zmm" #i "\n\t"
#define SRLW_T(i) "vpsrlw $4, %%zmm8, %%zmm" #i "\n\t"
// latency: one chain through zmm0
#define DP_L(i) "vdpbf16ps %%zmm8, %%zmm9, %%zmm0\n\t"
#define FMA_L(i) "vfmadd231ps %%zmm8, %%zmm9, %%zmm0\n\t"
#define ADD_L(i) "add %%rax, %%rax\n\t"  /* not add $imm: Golden Cove folds those at rename */

BENCH(dp_thr, EIGHT(DP_T))
BENCH(fma_thr, EIGHT(FMA_T))
BENCH(permw_thr, EIGHT(PERMW_T))
BENCH(permps_thr, EIGHT(PERMPS_T))
BENCH(zxbw_thr, EIGHT(ZXBW_T))
BENCH(tern_thr, EIGHT(TERN_T))
BENCH(srlw_thr, EIGHT(SRLW_T))
BENCH(dp_lat, EIGHT(DP_L))
BENCH(fma_lat, EIGHT(FMA_L))

static double add_lat(void) {
  double t0 = now();
  for (long i = 0; i < N_ITERS; ++i) __asm__ volatile(EIGHT(ADD_L) ::: "rax");
  return (now() - t0) / (8.0 * N_ITERS) * 1e9;
}

int main(void) {
  __asm__ volatile("vpxord %%zmm8, %%zmm8, %%zmm8\n\tvpxord %%zmm9, %%zmm9, %%zmm9" ::: "xmm8", "xmm9");
  add_lat();  // warm up the clock
  const double ns_cycle = add_lat();
  printf("scalar clock: %.2f GHz (dependent 1-cycle adds)\n", 1.0 / ns_cycle);
  printf("%-30s %9s %14s\n", "instruction (zmm)", "ns", "scalar cycles");
  struct { const char* name; double (*fn)(void); } tests[] = {
      {"vdpbf16ps throughput", dp_thr}, {"vdpbf16ps latency", dp_lat},
      {"vfmadd231ps throughput", fma_thr}, {"vfmadd231ps latency", fma_lat},
      {"vpermw throughput", permw_thr}, {"vpermps throughput", permps_thr},
      {"vpmovzxbw ymm->zmm throughput", zxbw_thr}, {"vpternlogd throughput", tern_thr},
      {"vpsrlw throughput", srlw_thr},
  };
  for (unsigned i = 0; i < sizeof(tests) / sizeof(tests[0]); ++i) {
    const double ns = tests[i].fn();
    printf("%-30s %9.3f %14.2f\n", tests[i].name, ns, ns / ns_cycle);
  }
  return 0;
}
