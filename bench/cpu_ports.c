// Throughput and latency of the AVX-512 instructions the int4 / bf16 CPU expert loops are made of, on
// one core: how many cycles a VDPBF16PS, an FMA, a VPERMW... costs here, so a loop's bound can be
// counted instead of guessed (bench/RESULTS.md, session 16: the dev box VM exposes no PMU).
//
//   gcc -O2 -march=native -pthread -o /tmp/cpu_ports bench/cpu_ports.c && taskset -c 1 /tmp/cpu_ports
//   /tmp/cpu_ports --threads    the same loops on 1, 2, 4, ... threads at once, each pinned to its own CPU,
//                               and CPU 0 paired with every other CPU: does a CPU's compute rate hold when
//                               the others run too (frequency licences, SMT siblings behind the VM's CPUs)?
//
// Every test is inline assembly (the compiler cannot fold or reorder it): "thr" runs 8 independent
// chains (throughput), "lat" one dependent chain (latency). The core clock comes from a chain of
// dependent 1-cycle integer adds timed the same way; AVX-512 code may run at a lower clock than that
// scalar chain (frequency licences), so cycles are "scalar-clock cycles": an upper bound.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

// The int4 1-token loop's instruction mix for one 64-weight span of one row (kernels_avx512.cc, pair64
// path), registers only: widen 32 bytes, two VPERMW lookups (one after a shift), the two-group scale
// vector from its dword (broadcast, shift, masked and), two chained VDPBF16PS, one FMA into the row's
// accumulator. Four rows per iteration, as the micro-tile runs them; returns ns per row and span.
#define SPAN_ROW(acc, v, t)                                                             \
  "vpmovzxbw %%ymm12, %%" v "\n\t"                                                       \
  "vpermw %%zmm13, %%" v ", %%zmm14\n\t"                                                 \
  "vpsrlw $4, %%" v ", %%" v "\n\t"                                                       \
  "vpermw %%zmm13, %%" v ", %%" v "\n\t"                                                  \
  "vpbroadcastd %%r8d, %%" t "\n\t"                                                       \
  "vpslld $16, %%" t ", %%zmm15\n\t"                                                     \
  "vpandd %%zmm11, %%" t ", %%zmm15%{%%k1%}\n\t"                                          \
  "vpxord %%zmm10, %%zmm10, %%zmm10\n\t"                                                 \
  "vdpbf16ps %%zmm8, %%zmm14, %%zmm10\n\t"                                               \
  "vdpbf16ps %%zmm9, %%" v ", %%zmm10\n\t"                                                 \
  "vfmadd231ps %%zmm15, %%zmm10, %%" acc "\n\t"

// Four rows of a span form per iteration (registers zmm0-7 and zmm16-19 per row); ns per row and span.
#define SPAN_BENCH(name, ROW)                                                                        \
  static double name(void) {                                                                         \
    double t0 = now();                                                                               \
    for (long i = 0; i < N_ITERS / 4; ++i)                                                           \
      __asm__ volatile(ROW("zmm0", "zmm4", "zmm16") ROW("zmm1", "zmm5", "zmm17")                     \
                       ROW("zmm2", "zmm6", "zmm18") ROW("zmm3", "zmm7", "zmm19")                     \
                       ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10",   \
                       "xmm12", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "r8", "k1");   \
    return (now() - t0) / (4.0 * (N_ITERS / 4)) * 1e9;                                              \
  }

SPAN_BENCH(int4_span_mix, SPAN_ROW)

// Candidate: the same span with f32 FMAs instead of VDPBF16PS: the 32 bytes widen to dwords in two
// halves; VPERMPS picks q - 8 from a 16-entry f32 table (its index is the dword's low 4 bits: the low
// nibble as it is, the high one after a shift); each group's table is pre-scaled once (one VMULPS per
// group, its scale broadcast by one VPERMPS from the row's 16 widened scales), so the picked weights
// carry the scale; four FMAs with the activations (even / odd columns).
#define SPAN_ROW_F32(acc, v, t)                                                         \
  "vpermps %%zmm20, %%zmm21, %%zmm12\n\t"                                                 \
  "vmulps %%zmm13, %%zmm12, %%" t "\n\t"                                                  \
  "vpmovzxbd %%xmm11, %%" v "\n\t"                                                        \
  "vpermps %%" t ", %%" v ", %%zmm14\n\t"                                                  \
  "vfmadd231ps %%zmm8, %%zmm14, %%" acc "\n\t"                                             \
  "vpsrld $4, %%" v ", %%" v "\n\t"                                                        \
  "vpermps %%" t ", %%" v ", %%zmm14\n\t"                                                  \
  "vfmadd231ps %%zmm9, %%zmm14, %%" acc "\n\t"                                             \
  "vpermps %%zmm20, %%zmm22, %%zmm12\n\t"                                                 \
  "vmulps %%zmm13, %%zmm12, %%" t "\n\t"                                                  \
  "vpmovzxbd %%xmm10, %%" v "\n\t"                                                        \
  "vpermps %%" t ", %%" v ", %%zmm14\n\t"                                                  \
  "vfmadd231ps %%zmm8, %%zmm14, %%" acc "\n\t"                                             \
  "vpsrld $4, %%" v ", %%" v "\n\t"                                                        \
  "vpermps %%" t ", %%" v ", %%zmm14\n\t"                                                  \
  "vfmadd231ps %%zmm9, %%zmm14, %%" acc "\n\t"

SPAN_BENCH(int4_span_f32, SPAN_ROW_F32)

// Candidate: the span mix with the two-group scale vector picked by one VPERMPS from the row's 16 scales
// widened to f32 once per 8 spans (zmm20; the index, zmm21, steps by 2 groups per span) instead of the
// dword's broadcast, shift and masked and.
#define SPAN_ROW_PS(acc, v, t)                                                          \
  "vpmovzxbw %%ymm12, %%" v "\n\t"                                                       \
  "vpermw %%zmm13, %%" v ", %%zmm14\n\t"                                                 \
  "vpsrlw $4, %%" v ", %%" v "\n\t"                                                       \
  "vpermw %%zmm13, %%" v ", %%" v "\n\t"                                                  \
  "vpermps %%zmm20, %%zmm21, %%" t "\n\t"                                                 \
  "vpxord %%zmm10, %%zmm10, %%zmm10\n\t"                                                 \
  "vdpbf16ps %%zmm8, %%zmm14, %%zmm10\n\t"                                               \
  "vdpbf16ps %%zmm9, %%" v ", %%zmm10\n\t"                                                 \
  "vfmadd231ps %%" t ", %%zmm10, %%" acc "\n\t"

SPAN_BENCH(int4_span_ps, SPAN_ROW_PS)

static double add_lat(void) {
  double t0 = now();
  for (long i = 0; i < N_ITERS; ++i) __asm__ volatile(EIGHT(ADD_L) ::: "rax");
  return (now() - t0) / (8.0 * N_ITERS) * 1e9;
}

// --threads: one test run by n threads at once, each pinned to its own CPU (cpus[i]); the slowest
// thread's ns per instruction (they start together behind a barrier).
typedef struct {
  double (*fn)(void);
  int cpu;
  pthread_barrier_t* bar;
  double ns;
} job_t;

static void* run_job(void* p) {
  job_t* j = (job_t*)p;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(j->cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  __asm__ volatile("vpxord %%zmm8, %%zmm8, %%zmm8\n\tvpxord %%zmm9, %%zmm9, %%zmm9" ::: "xmm8", "xmm9");
  pthread_barrier_wait(j->bar);
  j->ns = j->fn();
  return NULL;
}

static double run_on(double (*fn)(void), const int* cpus, int n, double* fastest) {
  pthread_t th[1024];
  job_t jobs[1024];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, (unsigned)n);
  for (int i = 0; i < n; ++i) {
    jobs[i] = (job_t){fn, cpus[i], &bar, 0.0};
    pthread_create(&th[i], NULL, run_job, &jobs[i]);
  }
  double worst = 0.0, best = 1e30;
  for (int i = 0; i < n; ++i) {
    pthread_join(th[i], NULL);
    worst = jobs[i].ns > worst ? jobs[i].ns : worst;
    best = jobs[i].ns < best ? jobs[i].ns : best;
  }
  pthread_barrier_destroy(&bar);
  if (fastest) *fastest = best;
  return worst;
}

static int threads_main(void) {
  cpu_set_t allowed;
  sched_getaffinity(0, sizeof(allowed), &allowed);
  int cpus[1024], n_cpus = 0;
  for (int c = 0; c < CPU_SETSIZE && n_cpus < 1024; ++c)
    if (CPU_ISSET(c, &allowed)) cpus[n_cpus++] = c;
  struct { const char* name; double (*fn)(void); } tests[] = {
      {"vdpbf16ps throughput", dp_thr}, {"int4 1-token span mix", int4_span_mix},
      {"int4 span, permps scale", int4_span_ps}};
  printf("%d CPUs allowed; ns per instruction (span: per row and 64-weight span), slowest / fastest thread\n", n_cpus);
  for (int t = 0; t < (int)(sizeof(tests) / sizeof(tests[0])); ++t) {
    const double one = run_on(tests[t].fn, cpus, 1, NULL);
    printf("%-24s threads %3d: %7.3f ns (x1.00)\n", tests[t].name, 1, one);
    for (int n = 2; n <= n_cpus; n = (n * 2 > n_cpus && n != n_cpus) ? n_cpus : n * 2) {
      double best;
      const double worst = run_on(tests[t].fn, cpus, n, &best);
      printf("%-24s threads %3d: %7.3f / %7.3f ns (x%.2f of one thread)\n", tests[t].name, n, worst, best, worst / one);
    }
  }
  // pairs: the first CPU with each other one; a pair of SMT siblings halves both threads' rate
  printf("pairs (vdpbf16ps throughput, CPU %d with CPU j), slowest thread's ns / one thread's:\n", cpus[0]);
  const double one = run_on(dp_thr, cpus, 1, NULL);
  for (int j = 1; j < n_cpus; ++j) {
    const int pair[2] = {cpus[0], cpus[j]};
    const double w = run_on(dp_thr, pair, 2, NULL);
    printf("  %d+%d: x%.2f%s", cpus[0], cpus[j], w / one, j % 8 == 0 ? "\n" : "");
  }
  printf("\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "--threads") == 0) return threads_main();
  if (argc > 1) {
    fprintf(stderr, "usage: %s [--threads]\n", argv[0]);
    return 2;
  }
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
  const int n_tests = sizeof(tests) / sizeof(tests[0]);
  for (int i = 0; i < n_tests; ++i) {
    const double ns = tests[i].fn();
    printf("%-30s %9.3f %14.2f\n", tests[i].name, ns, ns / ns_cycle);
  }
  const double mix = int4_span_mix();
  printf("%-30s %9.3f %14.2f   (per row and 64-weight span; the kernel's figure: ns per 64 weights)\n",
         "int4 1-token span mix", mix, mix / ns_cycle);
  const double f32 = int4_span_f32();
  printf("%-30s %9.3f %14.2f   (candidate: f32 FMAs, VPERMPS from a pre-scaled table)\n",
         "int4 1-token span, f32 form", f32, f32 / ns_cycle);
  const double ps = int4_span_ps();
  printf("%-30s %9.3f %14.2f   (candidate: the scale vector by one VPERMPS)\n",
         "int4 1-token span, permps scale", ps, ps / ns_cycle);
  return 0;
}
