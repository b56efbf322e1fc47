#!/usr/bin/env bash
# One device call that rebuilds, runs the GPU tests and the benchmarks, logs under $OUT (or ./bench/out).
# Each step has its own time limit so one slow step cannot eat the call; the last lines are a summary.
#   bash bench/gpu_session.sh [tests] [host] [cpu] [kernels] [tune] [decode] [decode-more]
#   (default: tests host kernels)
# Session 16 steps: prefill-pipelines (per-tile vs cross-tile prefill pipelines, ~1 min; $PIPE_TOKENS),
# prefill-ncu (Nsight Compute counters of the prefill kernels: DRAM bytes against the weights' own; the
# DeepSeek-like shape ran past 400 s under ncu), prefill-b2b (calls back to back under the profiler), thp,
# cpu-ports (bench/cpu_ports.c on one host core).
# Session 17 steps: cpu-threads (topology; bench/cpu_ports.c --threads; host_runtime.py --threads 1 2 4 8 15: the
# CPU calls' rate per thread as threads are added, ~3 min), decode-ablations (every policy, b1 and b4, 37%),
# tests-units-pallas (the GEMV's per-route units on the GPU), decode-pallas-b1 (lru-split with the Pallas GEMV,
# with and without the unit split).
# Session 18 steps: decode-timeline (b1 / 37% profiled, each run's layer call phase by phase: bench/layer_timeline.py),
# decode-units-default-b4 (b4: the default lru-split, units where it can, vs whole experts deferred).
# Session 19 steps: fill-units (bench/fill_units.py: the in-step fills alone and beside a background fill), tests-yield,
# decode-yield-b1 (the background fill pausing for the in-step transfers: OffloadExperts.background_yield).
# Session 20 steps: prefill-walk (the prefill tiles walked per expert band vs the default walk, b2b, the kernel
# split and per layer of $CHAIN layers in one jitted call; $PIPE_TOKENS, $WALK_CONFIGS, $WALK_DTYPES,
# $PREFILL_ROUTING uniform or trace),
# prefill-trace (the Qwen shape's prefill call op by op, 8K and 16K).
# Session 23 steps: prefill-fused (kernel 1 with the x-row gather fused in, a CUDA call: GPU tests, default vs
# fused at $PIPE_TOKENS, default 8K and 16K).
# Session 25 steps: tests-served (the CPU-branch serve counters' GPU tests), decode-b1-workers (b1 / 37% with the CPU
# serve time per job and the worker-pool variants $WORKER_VARIANTS).
# Session 26 steps: decode-b1-granule (the unit split's step: the default 8 units vs $GRANULES, fresh backends round
# robin, b1 / 37%); bench/unit_windows.py (the CPU call on unit windows [u, I), standalone) runs without a step.
# Session 35 steps: tests-host-plan, decode-host-plan (OffloadExperts.host_plan: the CPU branch planned on the host).
# Session 40 steps: tests-plan-publish, decode-plan-publish (OffloadExperts.plan_publish: the fused plan kernel submits the
# CPU branch itself, before it picks victims).
# Session 42 steps: tests-beside (the fill beside the GEMV; the CUDA tests under concurrent scheduling), decode-beside
# (b1 / 37%: lru-split with the fill beside the GEMV, stamped; the fill after vs beside, round robin).
# Session 41 steps: tests-stamps (the handshake tests with the two-half submit and the stamps, offload = resident),
# decode-stamps (b1 / 37%: lru-split's layer calls cut at the handshake's stamps, bench/layer_stamps.py).
# Session 28 steps: cpu-int4 (kernel tests; the int4 table, the q15 / VPDPBUSD loop against the bf16 one, AMX and
# AVX-512 tiers, and per core).
# Session 27 steps: unit-windows (kernel tests, then bench/unit_windows.py under the CPU kernel knobs $WINDOW_KNOBS,
# ~1 min), cpu-down-rows (the CPU table per $DOWN_ROWS), decode-b1-knobs (b1 / 37%: the same executable under the CPU
# kernels' knobs $KNOBS, round robin).
# Session 24 steps: fused-forms (the fused kernel 1's walk bands x SMEM / direct epilogue x exp / tanh sigmoid, alone and
# in the Qwen prefill; its GPU tests), defaults-check (the prefill's defaults vs XLA's take, both shapes; tests/pallas on
# the GPU less the fused kernel's own cases).
# Session 21 steps: prefill-plan (the route tables by one CUDA call vs XLA's plan: GPU tests, pipelines at 8K / 16K).
# Session 13 steps: tests-plan (the fused plan's GPU tests + the CUDA offload tests, ~2.5 min), decode-plan-b1 /
# -b4 (lru-split with the fused plan vs the jnp plan, lru-fill; ~4.5 min).
# Session 12 steps: prefill-split (the prefill kernels' own times, routed vs one expert, ~1.5 min),
# tests-units (the unit split's GPU tests, ~30 s), decode-units-b1 / -b4 (lru-split with and without
# the unit split, ~4.5 min).
# Step limits (s): tests 300 (the CUDA offload-vs-resident tests added in session 7), host 120, cpu 300 (tests + prefetch sweep), cpu-core 120, cpu-tiers 150, calibrate 120, kernels 240, tune 300, decode 480, decode-profile 405,
# decode-hlo 240 (top-level ops of the compiled step), decode-sync 150 (8 layers, each step waits for
# its logits), decode-xla 420 (the same 8-layer step with XLA's command-buffer update log and the
# update-mode flags, where the build has them), decode-modes 426 (8 layers, the three update modes),
# decode-xla2 300 (8 layers, SKIP_TEMP, update log, stable step buffers vs not), decode-b1 / decode-b1-nostable 360
# each (40 layers, batch 1, 37%, with the online row; stable step buffers or not), decode-b4 480 (40 layers, batch 4, 37% and 11%, with the online row and the sweep), decode-more 540:
# decode-dense 560 (40 layers, b1, 37%: --plan-impl $PLAN_IMPLS, default "mixed dense"; scatter, the
# default, is what the other decode steps run), decode-profile8 300 (8 layers, b1, warm: kernels per step per policy, trace_summary),
# decode-warm-b1 / -b4, decode-text-b1 / -b4 400 each (session 7's warm-cache tables, one batch per step),
# pick steps that fit one 10-minute call, e.g. `tests host cpu kernels`, then `tune`, then `decode`.
# A 40-layer process spends ~35 s making the pool, ~15 s calibrating on a fresh machine, ~60-75 s on
# the resident run, then ~30-40 s per further policy (session 6): budget the limits from that.
# cpu = the CPU kernel tests and table (best tier, weight-row prefetch distances $PREFETCH, default
# 0 512 2048 8192 16384 B: on the dev box, one thread, int4 ran +39% at 8-16 KiB, session 6) and the
# per-core compute rate;
# plan 170 = the expert-cache plan alone, us per layer per policy, LRU victims by f32 top-k rounds vs one
# int32 top-k vs counting ("rank"); $PLAN_ARGS (default: 3,788 slots, batch 1 and 4, scatter; the three
# update forms at one batch took > 150 s in session 8);
# cpu-tiers = the table on every ISA tier of the GPU host (AMX is there, not on the dev box).
# Text routing needs the Qwen3 tokenizer inside the repo: copy ../shared/data/qwen3-tokenizer to
# .carry/qwen3-tokenizer (git-ignored) and carry `.carry`.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests host kernels)
export PYTHONUNBUFFERED=1
summary=()
run() {  # name, limit_s, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1  # a step's trace summary appends to its log (few files come back)
  local rc=$?
  summary+=("$name: rc=$rc in $((SECONDS - t0))s")
  grep -v "^W\|^I0\|redzone\|autotun\|external/xla" "$OUT/$name.log" | tail -25
}
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
tok=.carry/qwen3-tokenizer
for s in "${steps[@]}"; do
  case $s in
    # The whole GPU suite no longer fits one step: in session 23 it ran 93 of its ~108 cases in 330 s, and
    # tests/pallas alone 32 of its 45 in 200 s (they compile many kernels): `tests` then `tests-pallas`.
    tests) run gpu_tests 540 python3 -m pytest -q -m gpu tests/host tests/experts ;;
    host) run host_runtime 120 python3 bench/host_runtime.py --no-cpu --out "$OUT/host_runtime.json" ;;
    cpu) run cpu_tests 60 python3 -m pytest -q tests/host/test_kernels.py
         run cpu_kernels 240 python3 bench/host_runtime.py --no-gpu --calls 10 --prefetch ${PREFETCH:-0 512 2048 8192 16384} \
           --per-core --out "$OUT/cpu_kernels.json" ;;
    cpu-amx)  # kernel tests, then the table on the AMX and AVX-512 tiers and one core's rate (~3 min)
         run cpu_tests 60 python3 -m pytest -q tests/host/test_kernels.py
         run cpu_amx 180 python3 bench/host_runtime.py --no-gpu --tiers amx avx512bf16 --calls 10 --per-core \
           --out "$OUT/cpu_amx.json" ;;
    cpu-core) run cpu_core 120 python3 bench/host_runtime.py --no-gpu --per-core --calls 10 --out "$OUT/cpu_core.json" ;;
    cpu-tiers) run cpu_tiers 150 python3 bench/host_runtime.py --all-tiers --no-gpu --calls 10 --out "$OUT/cpu_tiers.json" ;;
    calibrate) run calibrate 120 python3 -m ftjax calibrate --window-gib 2 ;;
    plan) run plan 170 python3 bench/plan.py ${PLAN_ARGS:---slots 3788 --batches 1 4 --impls scatter --steps 100} \
            --out "$OUT/plan.json" ;;
    decode-rank-b1|decode-rank-b4)  # 40 layers, 37%, warm, the LRU victims by counting (plan_layer victims_by="rank")
       b=${s##*-b}
       run "decode_rank_b$b" 300 python3 bench/decode.py --layers 40 --batches $b --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --no-sweep --no-online --steps 32 --warmup 24 --victims-by rank \
         --out "$OUT/decode_rank_b$b.json" ;;
    decode-defer-b1|decode-defer-b4)  # 40 layers, 37%, warm: lru-split with background fills vs without, lru-fill
       b=${s##*-b}
       run "decode_defer_b$b" 420 python3 bench/decode.py --layers 40 --batches $b --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --defer both --no-sweep --no-online --steps 32 --warmup 24 \
         --out "$OUT/decode_defer_b$b.json" ;;
    tune-prefill-both)  # prefill tile sweep (tile_m / tile_k / tile_n / stages, b2b), 8K tokens, both shapes (~5 min)
       for shape in 4096x2048 2048x512; do
         run "tune_prefill_$shape" 280 python3 bench/kernels.py --only prefill --shapes $shape --dtypes bf16 --tokens 8192 \
           --tune-prefill $shape --iters 3 --out "$OUT/tune_prefill_$shape.json"
       done ;;
    tests-pallas) run gpu_tests_pallas 480 python3 -m pytest -q -m gpu tests/pallas ;;
    prefill-pipelines)  # prefill, 8K tokens, both shapes, bf16: per-tile vs cross-tile pipelines, b2b + kernel split (~4 min)
       run prefill_pipelines 300 python3 bench/kernels.py --only prefill --pipelines --shapes 2048x512 4096x2048 \
         --dtypes bf16 --tokens ${PIPE_TOKENS:-8192} --iters 5 --profile /tmp/ppipe --out "$OUT/prefill_pipelines.json" ;;
    prefill-walk)  # prefill, both shapes, bf16: expert-band walks vs the default, b2b, kernel split, in-step (~5 min)
       cfgs=("per-tile s3" "per-tile s3 walk2" "per-tile s3 walk4" "cross s4" "cross s4 walk4")
       [ -n "${WALK_CONFIGS:-}" ] && eval "cfgs=($WALK_CONFIGS)"  # e.g. WALK_CONFIGS='"per-tile s3" "cross s4"'
       run prefill_walk 420 python3 bench/kernels.py --only prefill --pipelines --shapes 2048x512 4096x2048 \
         --dtypes ${WALK_DTYPES:-bf16} --tokens ${PIPE_TOKENS:-8192} --iters 5 --chain ${CHAIN:-4} --profile /tmp/pwalk \
         --routing ${PREFILL_ROUTING:-uniform} \
         --configs "${cfgs[@]}" --out "$OUT/prefill_walk.json" ;;
    prefill-fused)  # kernel 1 with the row gather fused (CUDA, gate_up_cuda): its GPU tests, then default vs fused (~4 min)
       run prefill_fused_tests 180 python3 -m pytest -q -m gpu tests/pallas/test_gate_up_cuda.py
       run gate_up_fused 200 python3 bench/gate_up_fused.py --shapes 2048x512 4096x2048 --tokens ${PIPE_TOKENS:-8192 16384} \
         --out "$OUT/gate_up_fused.json"
       run prefill_fused 300 python3 bench/kernels.py --only prefill --pipelines --shapes 2048x512 4096x2048 \
         --dtypes bf16 --tokens ${PIPE_TOKENS:-8192 16384} --iters 5 --chain ${CHAIN:-2} --profile /tmp/pfused \
         --configs "default" "fused gather" --out "$OUT/prefill_fused.json" ;;
    fused-forms)  # kernel 1 alone: the fused kernel's walks x epilogues x sigmoids (Qwen 8K / 16K, DeepSeek-like 8K),
                  # then the Qwen prefill with them, then the fused kernel's GPU tests (~9 min)
       run fused_forms 220 python3 bench/gate_up_fused.py --shapes 2048x512 --tokens 8192 16384 --keep --promotions \
         --bands 2 4 --iters 5 --out "$OUT/fused_forms_qwen.json"
       run fused_forms 100 python3 bench/gate_up_fused.py --shapes 4096x2048 --tokens 8192 --keep --promotions \
         --bands 4 --iters 5 --out "$OUT/fused_forms_ds.json"
       run fused_forms_pipe 170 python3 bench/kernels.py --only prefill --pipelines --shapes 2048x512 \
         --dtypes bf16 --tokens ${PIPE_TOKENS:-8192 16384} --iters 5 --chain ${CHAIN:-2} \
         --configs "default" "fused walk2" "fused smem" "fused tanh" "fused walk2 smem tanh" --out "$OUT/fused_forms_pipe.json"
       run fused_forms_tests 150 python3 -m pytest -q -m gpu tests/pallas/test_gate_up_cuda.py ;;
    defaults-check)  # the prefill on its defaults vs XLA's take, both shapes, 8K / 16K, then the GPU tests of
                     # tests/pallas but the fused kernel-vs-reference cases (those: fused-forms) (~9 min)
       run defaults_pipe 230 python3 bench/kernels.py --only prefill --pipelines --shapes 2048x512 4096x2048 \
         --dtypes bf16 --tokens ${PIPE_TOKENS:-8192 16384} --iters 5 --chain ${CHAIN:-2} --profile /tmp/pdef \
         --configs "default" "xla gather" --out "$OUT/defaults_pipe.json"
       run defaults_tests 270 python3 -m pytest -q -m gpu tests/pallas -k "not test_kernel_matches_reference_on_gpu" ;;
    ncu-gate-up)  # Nsight Compute: kernel 1 of the Qwen shape at 8K, Mosaic (gathered rows) then fused (CUDA) (~2 min)
       NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
       if [ -z "$NCU" ]; then echo "no ncu on this machine" | tee "$OUT/ncu_gate_up.log"; else
         run ncu_gate_up 200 "$NCU" -k regex:prefill_gate_up -c 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
           --section MemoryWorkloadAnalysis --section WarpStateStats \
           --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
           python3 bench/prefill_counters.py --shape 2048x512 --gathers xla fused
       fi ;;
    ncu-gate-up-forms)  # Nsight Compute: DRAM bytes (and L2 traffic by source unit: cp.async vs TMA) of every
                        # kernel-1 form of bench/gate_up_fused.py, Qwen 8K (~3 min)
       NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
       if [ -z "$NCU" ]; then echo "no ncu on this machine" | tee "$OUT/ncu_gate_up_forms.log"; else
         run ncu_gate_up_forms 240 "$NCU" -k regex:prefill_gate_up --section SpeedOfLight \
           --section MemoryWorkloadAnalysis_Tables \
           --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
           python3 bench/gate_up_fused.py --shapes 2048x512 --tokens 8192 --keep 0 1 --promotions none --once
         # the forms in order: Mosaic (take + kernel), Mosaic alone, fused default, x_keep 0, x_keep 1, promotion
         # none, 3 stages, in-order rows, then walk (rows, band 2) x epilogue (direct, smem) x sigmoid (exp, tanh)
         # less the default (session 23's run, before the grid: ... SMEM epilogue, 3 stages, in-order rows, band 2)
       fi ;;
    gate-up-fused)  # the fused kernel 1's GPU tests, then kernel 1 alone: Mosaic vs fused forms (~3 min)
       run prefill_fused_tests 180 python3 -m pytest -q -m gpu tests/pallas/test_gate_up_cuda.py
       run gate_up_fused 240 python3 bench/gate_up_fused.py --shapes 2048x512 4096x2048 --tokens ${PIPE_TOKENS:-8192 16384} \
         --out "$OUT/gate_up_fused.json" ;;
    prefill-plan)  # the route tables by one CUDA call vs XLA: GPU tests, then the pipelines at 8K and 16K (~4 min)
       run prefill_plan_tests 240 python3 -m pytest -q -m gpu tests/pallas/test_route_tables.py tests/pallas/test_prefill_gemm.py
       for t in 8192 16384; do
         run prefill_plan 200 python3 bench/kernels.py --only prefill --pipelines --shapes 2048x512 4096x2048 \
           --dtypes bf16 --tokens $t --iters 5 --chain ${CHAIN:-2} --profile /tmp/pplan$t \
           --configs "default" "jnp plan" --out "$OUT/prefill_plan_$t.json"
         for d in /tmp/pplan$t/pipeline-2048x512-*; do run prefill_plan 60 python3 bench/trace_summary.py "$d" --top 12 --steps 1; done
       done ;;
    prefill-trace)  # the Qwen shape's prefill call by trace, 8K and 16K, bf16: kernels and glue op by op (~1.5 min)
       run prefill_trace 200 python3 bench/kernels.py --only prefill --shapes 2048x512 --dtypes bf16 \
         --tokens 8192 16384 --iters 5 --profile /tmp/ptrace --out "$OUT/prefill_trace.json"
       for d in /tmp/ptrace/prefill-*; do run prefill_trace 60 python3 bench/trace_summary.py "$d" --top 24 --steps 1; done ;;
    thp) run thp 120 python3 bench/thp_check.py --gib 4 ;;  # the host's THP mode, the pool's huge-page share (~30 s)
    cpu-ports)  # AVX-512 instruction costs on one host core and the int4 loop's mix (~20 s)
       gcc -O2 -march=native -pthread -o /tmp/cpu_ports bench/cpu_ports.c && run cpu_ports 60 taskset -c 1 /tmp/cpu_ports ;;
    cpu-threads)  # does a core's rate hold as threads are added? topology, register-only loops on 1..16
       # threads and CPU pairs, then the int4 / bf16 calls at 1 2 4 8 15 threads (~3 min)
       { lscpu; echo "thread siblings:"; cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | sort | uniq -c; } \
         > "$OUT/cpu_topology.log" 2>&1; grep -i "model name\|thread(s)\|core(s)\|socket\|numa\|mhz" "$OUT/cpu_topology.log"
       gcc -O2 -march=native -pthread -o /tmp/cpu_ports bench/cpu_ports.c && run cpu_ports_threads 90 /tmp/cpu_ports --threads
       run cpu_threads 300 python3 bench/host_runtime.py --no-gpu --tiers amx --calls 10 --threads ${THREADS:-1 2 4 8 15} \
         --out "$OUT/cpu_threads.json" ;;
    prefill-b2b)  # prefill, 8K tokens, both shapes, bf16: 4 calls back to back under the profiler, idle between them (~2 min)
       run prefill_b2b 200 python3 bench/kernels.py --only prefill --shapes 2048x512 4096x2048 --dtypes bf16 \
         --tokens 8192 --iters 3 --profile /tmp/pb2b --profile-b2b 4 --out "$OUT/prefill_b2b.json"
       for d in /tmp/pb2b/b2b-*; do run prefill_b2b 60 python3 bench/trace_summary.py "$d" --top 12 --steps 4; done ;;
    prefill-ncu)  # Nsight Compute counters of the prefill kernels, 8K tokens, both shapes, random and one expert (~3 min)
       NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
       if [ -z "$NCU" ]; then echo "no ncu on this machine" | tee "$OUT/prefill_ncu.log"; else
         for cfg in "2048x512" "4096x2048" "2048x512 --one-expert" "4096x2048 --one-expert"; do
           run prefill_ncu 150 "$NCU" -k regex:mosaic_prefill -c 2 --section SpeedOfLight \
             --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
             python3 bench/prefill_counters.py --shape $cfg
         done
       fi ;;
    prefill-sizes)  # prefill b2b, bf16, both shapes, 1K / 8K / 16K tokens (~3 min)
       run prefill_sizes 300 python3 bench/kernels.py --only prefill --shapes 2048x512 4096x2048 --dtypes bf16 \
         --tokens 1024 8192 16384 --iters 5 --out "$OUT/prefill_sizes.json" ;;
    prefill-split)  # prefill, 8K, both shapes, bf16: gate+up vs down kernel times, random routing and one expert (~3 min)
       for r in routed one; do
         flag=""; [ $r = one ] && flag=--one-expert
         run "prefill_split_$r" 200 python3 bench/kernels.py --only prefill --shapes 2048x512 4096x2048 --dtypes bf16 \
           --tokens 8192 --iters 5 --profile /tmp/psplit_$r $flag \
           --out "$OUT/prefill_split_$r.json"
       done ;;
    decode-units-b1|decode-units-b4)  # 40 layers, trace, 37%, warm: lru-split bg fills vs + unit split, lru-fill (~6 min)
       b=${s##*-b}
       run "decode_units_b$b" 420 python3 bench/decode.py --layers 40 --batches $b --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --unit-split --no-sweep --no-online --steps 32 --warmup 24 \
         --out "$OUT/decode_units_b$b.json" ;;
    tests-units)  # the unit split's GPU tests: the partial fill, unit starts through the handshake, offload vs resident
       run gpu_tests_units 200 python3 -m pytest -q -m gpu tests/host/test_cuda.py tests/experts/test_offload_cuda.py \
         -k "units or unit_split or unit_starts or background" ;;
    tests-plan)  # the fused plan against the jnp plan on the GPU, and the offload path that runs it (~2.5 min)
       run gpu_tests_plan 240 python3 -m pytest -q -m gpu tests/experts/test_plan_fused.py tests/experts/test_offload_cuda.py ;;
    decode-plan-b1|decode-plan-b4)  # 40 layers, trace, 37%, warm: lru-split with the fused plan vs the jnp plan, lru-fill (~4.5 min)
       b=${s##*-b}
       run "decode_plan_b$b" 420 python3 bench/decode.py --layers 40 --batches $b --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --plan-ablation scatter --no-sweep --no-online --steps 32 --warmup 24 \
         --out "$OUT/decode_plan_b$b.json" ;;
    tests-offload) run gpu_tests_offload 200 python3 -m pytest -q -m gpu tests/experts/test_offload_cuda.py tests/host/test_cuda.py ;;
    kernels) run kernels 240 python3 bench/kernels.py --tokens 1024 8192 --ragged --iters 5 --out "$OUT/kernels.json" ;;
    tune) run tune_decode 150 python3 bench/kernels.py --only decode --shapes 2048x512 --dtypes bf16 --decode-tokens 1 8 \
            --tune-decode --iters 3 --out "$OUT/tune_decode.json"
          run tune_prefill 150 python3 bench/kernels.py --only prefill --shapes 2048x512 --dtypes bf16 --tokens 8192 \
            --tune-prefill 2048x512 --iters 3 --out "$OUT/tune_prefill.json" ;;
    decode) run decode 480 python3 bench/decode.py --layers 40 --batches 1 4 --routing trace \
              --fractions 0.37 0.11 --policies lru-split lru-fill --no-sweep --steps 24 --warmup 24 \
              --out "$OUT/decode.json" ;;
    tests-units-pallas)  # the decode GEMV with per-route units compiled on the H200, and the CUDA unit split (~1.5 min)
       run gpu_tests_units 200 python3 -m pytest -q -m gpu tests/pallas/test_decode_gemv.py \
         tests/experts/test_offload_cuda.py tests/experts/test_pallas_cuda.py -k "compiled or unit or pallas" ;;
    decode-pallas-b1)  # 40 layers, b1, 37%: lru-split with the jnp GEMV vs the Pallas GEMV, with and without the
       # unit split, lru-fill (~5 min)
       run decode_pallas_b1 420 python3 bench/decode.py --layers 40 --batches 1 --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --unit-split --kernel-ablation pallas --no-sweep --no-online --steps 24 \
         --warmup 24 --out "$OUT/decode_pallas_b1.json" ;;
    tests-served)  # session 25: the CPU-branch counters (cuda.channel_served, OffloadExperts.cpu_served) on the GPU
       run tests_served 240 python3 -m pytest -q -m gpu tests/host/test_cuda.py tests/experts/test_offload_cuda.py \
         -k "submit_collect or equals_resident" ;;
    decode-b1-workers)  # session 25: b1 / 37% with the CPU serve time per job, and the same executable on other
       # worker pools (N workers : spin us; the default is 12 on the H200 host), round robin with it; $WORKER_BATCHES (~4 min a batch)
       run decode_b1_workers 540 python3 bench/decode.py --layers 40 --batches ${WORKER_BATCHES:-1} --routing trace \
         --fractions 0.37 --policies lru-split lru-fill --no-sweep --no-online --steps ${WORKER_STEPS:-32} --warmup 24 \
         --worker-variants ${WORKER_VARIANTS:-14:2000 13:2000 11:2000} --out "$OUT/decode_b1_workers.json" ;;
    cpu-down-rows)  # session 27: the CPU kernel table (both shapes and formats, the best tier) per down item rows
       # (the default and $DOWN_ROWS; ~1.5 min)
       run cpu_down_rows 200 python3 bench/host_runtime.py --no-gpu --knob-variants ${DOWN_ROWS:-down_rows=16} \
         --out "$OUT/cpu_down_rows.json" ;;
    cpu-int4)  # session 28: the CPU kernel tests (every tier), then the int4 table on the AMX and AVX-512 tiers with
       # the q15 / VPDPBUSD loop as by default, never (0) and always (64), and per core
       # ($INT4_TIERS, $INT4_KNOBS, $INT4_FORMATS, INT4_PER_CORE= to skip the per-core table, $INT4_SHARED: token counts
       # all routed to the same experts, session 29; $INT4_TRACE: token counts routed by the synthetic trace, session 30;
       # ~4 min)
       run cpu_tests_int4 150 python3 -m pytest -q tests/host/test_kernels.py tests/host/test_q15.py
       run cpu_int4 300 python3 bench/host_runtime.py --no-gpu --formats ${INT4_FORMATS:-int4} --tiers ${INT4_TIERS:-amx avx512bf16} \
         --calls 20 ${INT4_PER_CORE---per-core} --knob-variants ${INT4_KNOBS:-int4_vnni_tokens=0 int4_vnni_tokens=64} \
         ${INT4_SHARED:+--shared-tokens $INT4_SHARED} ${INT4_TRACE:+--trace-tokens $INT4_TRACE} --out "$OUT/cpu_int4.json" ;;
    int4-repack)  # session 33: bench/int4_repack.cc (the int4 layout with rows in SIMD lanes, a probe), then the runtime's
       # int4 table (default q15 and the q8 form; exactly 8 tokens per expert; 8 tokens by the trace), then the probe
       # again: the host's drift falls on both (~4 min)
       g++ -O2 -march=native -pthread -o /tmp/int4_repack bench/int4_repack.cc > "$OUT/int4_repack_build.log" 2>&1
       run int4_repack 120 /tmp/int4_repack --calls ${REPACK_CALLS:-200} --prefetch ${REPACK_PREFETCH:-0,2048} \
         --act-bits ${REPACK_BITS:-8,15}
       run cpu_int4 300 python3 bench/host_runtime.py --no-gpu --formats int4 --tiers amx --calls 20 \
         --knob-variants int4_act_bits=8 --shared-tokens 8 --trace-tokens 8 --out "$OUT/cpu_int4.json"
       run int4_repack_again 120 /tmp/int4_repack --calls ${REPACK_CALLS:-200} --prefetch ${REPACK_PREFETCH:-0,2048} \
         --act-bits ${REPACK_BITS:-8,15} ;;
    ih-quick)  # session 38, for a short device budget: the ih pool's GPU tests (fills, offload = resident), its
       # fill rate, the CPU tests of the transposed down (every tier, AMX too), the unit windows (12 workers) (~3 min)
       run gpu_tests_down_ih 150 python3 -m pytest -q -m gpu tests/host/test_cuda_down_ih.py \
         tests/experts/test_offload_cuda.py -k "ih or transposes"
       run fill_layout 60 python3 bench/fill_layout.py --rows 1 8 --rounds 3 --out "$OUT/fill_layout.json"
       run cpu_tests_down_ih 60 python3 -m pytest -q tests/host/test_down_layout.py
       run unit_windows_ih 100 python3 bench/unit_windows.py --workers 12 --calls 200 --starts 0 160 192 256 \
         --down-layouts hi ih --out "$OUT/unit_windows_ih_12.json" ;;
    tests-down-ih)  # session 38: the transposed down's CUDA fills (whole, units, background) = the hi pool's, bit for
       # bit, then the fill rate of both layouts against the cudaMemcpy ceiling (~1.5 min)
       run gpu_tests_down_ih 300 python3 -m pytest -q -m gpu tests/host/test_cuda_down_ih.py tests/host/test_cuda.py \
         tests/experts/test_offload_cuda.py
       run fill_layout 120 python3 bench/fill_layout.py --out "$OUT/fill_layout.json" ;;
    down-layout)  # session 37: bench/down_layout.cc (a probe: the down matrix stored [I, H] for the unit split's CPU
       # window, the gate/up and down rows in one round; rows vs units vs interleaved), 15 and 16 threads, 1 and 2
       # tokens, prefetch 0 / 2048 B; then the runtime's own call on the same windows (bench/unit_windows.py) (~2 min)
       g++ -O2 -march=native -pthread -o /tmp/down_layout bench/down_layout.cc > "$OUT/down_layout_build.log" 2>&1
       for dl_threads in 15 16; do for dl_tokens in 1 2; do for dl_pf in 0 2048; do
         run down_layout 60 /tmp/down_layout --threads $dl_threads --tokens $dl_tokens --prefetch $dl_pf \
           --calls ${DL_CALLS:-400} --starts ${DL_STARTS:-0,160,192,256} --experts 1,2
       done; done; done
       run unit_windows 150 python3 bench/unit_windows.py --calls 400 --starts 0 160 192 256 --out "$OUT/unit_windows.json" ;;
    down-ih)  # session 38: the transposed down bank (HostPool down_layout="ih"): the CPU kernel tests (every tier, AMX
       # too), then the runtime's call on unit windows of an hi and an ih pool, round robin, $IH_WORKERS (12 15) workers
       # (~1 min each)
       run cpu_tests_down_ih 150 python3 -m pytest -q tests/host/test_down_layout.py tests/host/test_kernels.py
       for dw in ${IH_WORKERS:-12 15}; do
         run unit_windows_ih 150 python3 bench/unit_windows.py --workers $dw --calls 400 --starts 0 128 160 192 256 \
           --down-layouts hi ih --out "$OUT/unit_windows_ih_$dw.json"
       done ;;
    unit-windows)  # session 27: the CPU kernel tests (every tier, incl. AMX), then the CPU call on unit windows
       # under the defaults and each of $WINDOW_KNOBS, round robin (~1 min)
       run cpu_tests_windows 150 python3 -m pytest -q tests/host/test_kernels.py
       run unit_windows 150 python3 bench/unit_windows.py --workers ${WINDOW_WORKERS:-12} --calls 400 \
         --starts 0 128 192 256 --knob-variants ${WINDOW_KNOBS:-tile_prefetch=on down_rows=16,window_prefetch=off} \
         --out "$OUT/unit_windows.json" ;;
    decode-b1-knobs)  # session 27: b1 / 37%, the same executable under the CPU kernels' knobs $KNOBS, round robin
       # with the defaults ($KNOB_STEPS, $KNOB_BATCHES; ~3 min a batch)
       run decode_b1_knobs 540 python3 bench/decode.py --layers 40 --batches ${KNOB_BATCHES:-1} --routing trace \
         --fractions 0.37 \
         --policies lru-split lru-fill --no-sweep --no-online --steps ${KNOB_STEPS:-48} --warmup 24 \
         --knob-variants ${KNOBS:-tile_prefetch=on down_rows=16,window_prefetch=off} --out "$OUT/decode_b1_knobs.json" ;;
    decode-sched)  # session 31: b1 / 37% with each run's CPU time per thread group (bench/thread_cpu.py), XLA's
       # default CUDA scheduling, then XLA's host waits under TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=$SCHED (default
       # blocking_sync; spin, yield); both with 14 workers round robin against the default ($SCHED_STEPS; ~7 min)
       run decode_sched_default 280 python3 bench/decode.py --layers 40 --batches 1 --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --no-sweep --no-online --steps ${SCHED_STEPS:-48} --warmup 24 \
         --worker-variants 14:2000 --out "$OUT/decode_sched_default.json"
       run decode_sched_env 280 env TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=${SCHED:-blocking_sync} python3 bench/decode.py \
         --layers 40 --batches 1 --routing trace --fractions 0.37 --policies lru-split --no-sweep --no-online \
         --steps ${SCHED_STEPS:-48} --warmup 24 --worker-variants 14:2000 --out "$OUT/decode_sched_env.json" ;;
    tests-host-plan)  # session 35: the host plan's GPU tests (publish, checked collect, offload = resident) (~2 min)
       run tests_host_plan 300 python3 -m pytest -q -m gpu tests/experts/test_offload_cuda.py tests/host/test_cuda.py \
         ${HP_TESTS:+-k "$HP_TESTS"} ;;
    decode-ih)  # session 38: b1 / 37%, 40 layers, trace: lru-split on a pool of each down layout, one process each
       # ($IH_ORDER, default "ih hi"; $IH_STEPS; $IH_ARGS, e.g. --no-resident on an H100; ~2.5 min a layout)
       for dl in ${IH_ORDER:-ih hi}; do
         run decode_ih 280 python3 bench/decode.py --layers 40 --batches ${IH_BATCHES:-1} --routing trace \
           --fractions 0.37 --policies lru-split --no-sweep --no-online --steps ${IH_STEPS:-48} --warmup 24 \
           --down-layout $dl ${IH_ARGS:-} --out "$OUT/decode_ih_$dl.json"
       done ;;
    decode-host-plan|decode-plan-publish)  # sessions 35 / 40: 40 layers, trace, 37%: lru-split with the host plan off and
       # on / with the submit kernel vs the plan kernel publishing, fresh backends round robin ($HP_ or $PP_ BATCHES,
       # default 1; STEPS; ARGS, e.g. --no-resident on an H100; PROFILE=1 adds the kernels and the layer phases; ~4 min
       # a batch)
       if [ "$s" = decode-host-plan ]; then
         n=decode_host_plan abl=--host-plan-ablation b=${HP_BATCHES:-1} st=${HP_STEPS:-48} ex=${HP_ARGS:-} pr=${HP_PROFILE:-}
       else
         n=decode_plan_publish abl=--plan-publish-ablation b=${PP_BATCHES:-1} st=${PP_STEPS:-48} ex=${PP_ARGS:-} \
           pr=${PP_PROFILE:-}
       fi
       run $n 560 python3 bench/decode.py --layers 40 --batches $b --routing trace --fractions 0.37 --policies lru-split \
         --no-sweep --no-online --steps $st --warmup 24 $abl $ex ${pr:+--profile /tmp/${n}_prof} --out "$OUT/$n.json"
       if [ -n "$pr" ]; then  # each run's kernels, and its layer call phase by phase
         run $n 60 python3 bench/trace_summary.py /tmp/${n}_prof --top 16
         run $n 60 python3 bench/layer_timeline.py /tmp/${n}_prof
       fi ;;
    tests-stamps)  # session 41: the handshake's GPU tests (the two-half submit, the stamps), offload = resident (~2 min)
       run tests_stamps 300 python3 -m pytest -q -m gpu tests/host/test_cuda.py tests/experts/test_offload_cuda.py \
         ${ST_TESTS:+-k "$ST_TESTS"} ;;
    decode-stamps)  # session 41: 40 layers, trace, 37%: lru-split's layer calls cut at the handshake's stamps
       # ($ST_BATCHES, default 1; $ST_STEPS; $ST_ARGS, e.g. --no-resident on an H100; ~3 min a batch)
       run decode_stamps 420 python3 bench/decode.py --layers 40 --batches ${ST_BATCHES:-1} --routing trace \
         --fractions 0.37 --policies lru-split --no-sweep --no-online --steps ${ST_STEPS:-48} --warmup 24 --stamps \
         ${ST_ARGS:-} --out "$OUT/decode_stamps.json" ;;
    tests-beside)  # session 42: the fill beside the GEMV (OffloadExperts fill_beside) on the GPU, then the CUDA
       # offload and handshake tests under XLA's concurrent command-buffer scheduling (~4 min)
       run tests_beside 200 python3 -m pytest -q -m gpu tests/experts/test_offload_cuda.py -k fill_beside
       FTJAX_XLA_CB_SCHEDULING=CONCURRENT run tests_concurrent 300 python3 -m pytest -q -m gpu \
         tests/host/test_cuda.py tests/experts/test_offload_cuda.py ${BS_TESTS:+-k "$BS_TESTS"} ;;
    decode-beside)  # session 42: b1 / 37% / trace under concurrent scheduling: lru-split with the fill beside the
       # GEMV ($BS_BLOCKS blocks, stamped), then the fill after the submit against beside with each of
       # $BS_ABLATION blocks, round robin ($BS_ARGS, e.g. --no-resident on an H100; BS_SWEEP= for the fill-fraction sweep;
       # an H100 holds two 37% backends at once: BS_ABLATION=32; the hits in the beside call, under XLA's default
       # scheduling: BS_SCHEDULING=off BS_ARGS="--fill-beside-gemv --no-resident"; ~4 min)
       FTJAX_XLA_CB_SCHEDULING=${BS_SCHEDULING:-CONCURRENT} run decode_beside 480 python3 bench/decode.py --layers 40 \
         --batches ${BS_BATCHES:-1} --routing trace --fractions 0.37 --policies lru-split ${BS_SWEEP---no-sweep} --no-online \
         --steps ${BS_STEPS:-48} --warmup 24 --stamps --fill-beside ${BS_BLOCKS:-32} \
         --fill-beside-ablation ${BS_ABLATION:-32 16 0} ${BS_ARGS:-} --out "$OUT/decode_beside.json" ;;
    tests-plan-publish)  # session 40: the fused plan's GPU tests (staged lists, publish), offload = resident, handshake
       run tests_plan_publish 300 python3 -m pytest -q -m gpu tests/experts/test_plan_fused.py \
         tests/experts/test_offload_cuda.py tests/host/test_cuda.py ${PP_TESTS:+-k "$PP_TESTS"} ;;
    decode-b1-granule)  # session 26: the unit split's step, the default (8 units) against $GRANULES (default 32: a
       # cache line of a bf16 down row), fresh backends round robin, b1 / 37% ($GRANULE_BATCHES; ~5 min a batch)
       run decode_b1_granule 560 python3 bench/decode.py --layers 40 --batches ${GRANULE_BATCHES:-1} --routing trace \
         --fractions 0.37 --policies lru-split --no-sweep --no-online --steps ${GRANULE_STEPS:-48} --warmup 24 \
         --granule-ablation ${GRANULES:-32} --out "$OUT/decode_b1_granule.json" ;;
    decode-timeline)  # 40 layers, b1, 37%, profiled: lru-split, the unit split, the Pallas GEMV with and without it;
       # then each run's layer call phase by phase (bench/layer_timeline.py) and its kernels (~6 min)
       run decode_timeline 480 python3 bench/decode.py --layers 40 --batches 1 --routing trace --fractions 0.37 \
         --policies lru-split --unit-split --kernel-ablation pallas --no-sweep --no-online --steps 24 \
         --warmup 24 --profile /tmp/tl_prof --out "$OUT/decode_timeline.json"
       run decode_timeline 60 python3 bench/layer_timeline.py /tmp/tl_prof
       run decode_timeline 60 python3 bench/trace_summary.py /tmp/tl_prof --top 16 ;;
    fill-units)  # the in-step fills (whole expert, the unit split's units [0, u)) alone and beside a background
       # fill on the side stream (~1 min)
       run fill_units 150 python3 bench/fill_units.py --out "$OUT/fill_units.json" ;;
    tests-yield)  # the transfer words and the background yield on the GPU (~1.5 min)
       run gpu_tests_yield 200 python3 -m pytest -q -m gpu tests/host/test_cuda.py tests/experts/test_offload_cuda.py \
         -k "yield or transfer or unit_split or background" ;;
    decode-yield-b1)  # 40 layers, b1, 37%: lru-split (the default) under every background yield mode, same
       # executable, round robin (4 rounds of $YIELD_STEPS / 4 steps per mode; ~3 min)
       run decode_yield_b1 330 python3 bench/decode.py --layers 40 --batches ${YIELD_BATCHES:-1} --routing trace \
         --fractions 0.37 --policies lru-split --yield-ablation --no-sweep --no-online --steps ${YIELD_STEPS:-96} \
         --warmup 24 --out "$OUT/decode_yield_b1.json" ;;
    decode-units-default-b4)  # 40 layers, b4, 37%: lru-split with the library default (units where it can) vs whole
       # experts deferred vs units explicitly (~3.5 min)
       run decode_units_default_b4 300 python3 bench/decode.py --layers 40 --batches 4 --routing trace --fractions 0.37 \
         --policies lru-split --unit-split --whole-split --no-sweep --no-online --steps 16 --warmup 16 \
         --out "$OUT/decode_units_default_b4.json" ;;
    decode-ablations)  # 40 layers, trace, 37%: every policy in one process (lru-split, all-fill, all-CPU, static),
       # batch 1 and 4 (~8-9 min)
       run decode_ablations 575 python3 bench/decode.py --layers 40 --batches ${ABL_BATCHES:-1 4} --routing trace \
         --fractions 0.37 --policies lru-split lru-fill cpu static --no-sweep --no-online --steps 24 --warmup 24 \
         --out "$OUT/decode_ablations.json" ;;
    decode-profile) run decode_profile 360 python3 bench/decode.py --layers 40 --batches 1 4 --routing trace \
              --fractions 0.37 --policies lru-split lru-fill --no-sweep --no-online --steps 16 --warmup 24 \
              --profile /tmp/prof --out "$OUT/decode_profile.json"
       run trace_summary 45 python3 bench/trace_summary.py /tmp/prof --top 12 ;;
    decode-profile8)  # 8 layers, batch 1, 37%, warm caches: GPU kernels per step of resident / lru-split / lru-fill
       # (where the ~40-65 us per layer beyond the transfers goes, RESULTS session 7; ~3 min)
       run decode_profile8 240 python3 bench/decode.py --layers 8 --batches 1 --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --no-sweep --no-online --steps 32 --warmup 24 --profile /tmp/prof8 \
         --out "$OUT/decode_profile8.json"
       run trace_summary8 60 python3 bench/trace_summary.py /tmp/prof8 --top 30 ;;
    decode-profile40)  # 40 layers, batch 1, 37%, warm: where the per-layer cost beyond the transfers goes (~5 min)
       run decode_profile40 330 python3 bench/decode.py --layers 40 --batches 1 --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --no-sweep --no-online --steps 32 --warmup 24 --profile /tmp/prof40 \
         --out "$OUT/decode_profile40.json"
       run trace_summary40 90 python3 bench/trace_summary.py /tmp/prof40 --top 30 ;;
    kernels-profile)  # decode GEMV, Qwen bf16, 1-8 tokens: the scan's per-call time and the kernels' own (~2 min)
       run kernels_profile 200 python3 bench/kernels.py --only decode --shapes 2048x512 --dtypes bf16 \
         --decode-tokens 1 2 4 8 --iters 5 --profile /tmp/kprof --out "$OUT/kernels_profile.json"
       run kernels_profile 60 python3 bench/trace_summary.py /tmp/kprof --top 8 --steps 64 ;;
    overlap)  # can a fill run beside other GPU work in one jitted step, per fill block count? (~3 min)
       run overlap 240 python3 bench/overlap.py --layers 40 --blocks ${OVERLAP_BLOCKS:-0 16 32} --profile /tmp/ov --out "$OUT/overlap.json"
       run overlap 60 python3 bench/trace_summary.py /tmp/ov --top 6 --steps 3 ;;
    row-gather)  # can prefill kernel 1 gather its own x rows? one TMA per row vs one per tile, checked (~1 min)
       run row_gather 120 python3 bench/row_gather.py --tokens 8192 --out "$OUT/row_gather.json" ;;
    prefill-glue)  # the prefill kernels' XLA glue alone: row gather and combine forms vs the copy ceiling (~1 min)
       run prefill_glue 120 python3 bench/prefill_glue.py --tokens 8192 --out "$OUT/prefill_glue.json" ;;
    prefill-profile)  # prefill, 8K tokens, both shapes, bf16: the Mosaic GPU kernels alone vs the call (~2 min)
       run prefill_profile 200 python3 bench/kernels.py --only prefill --shapes 2048x512 4096x2048 --dtypes bf16 \
         --tokens 8192 --iters 5 --profile /tmp/pprof --out "$OUT/prefill_profile.json"
       run prefill_profile 60 python3 bench/trace_summary.py /tmp/pprof --top 24 --steps 1 ;;
    decode-hlo) run decode_hlo 240 python3 bench/decode.py --layers 8 --batches 1 4 --routing trace --fractions 0.37 \
              --policies lru-split lru-fill --no-sweep --online-warmup 48 --steps 16 --warmup 16 --hlo-stats \
              --out "$OUT/decode_hlo.json" ;;
    decode-sync) run decode_sync 150 python3 bench/decode.py --layers 8 --batches 1 --routing trace --fractions 0.37 \
              --policies lru-split lru-fill --no-sweep --online-warmup 48 --steps 16 --warmup 16 --sync \
              --out "$OUT/decode_sync.json" ;;
    decode-b4) run decode_b4 480 python3 bench/decode.py --layers 40 --batches 4 --routing trace \
              --fractions 0.37 0.11 --policies lru-split lru-fill --steps 16 --warmup 24 --out "$OUT/decode_b4.json" ;;
    decode-xla)  # why a one-graph decode step costs 0.2-0.4 ms of host time per layer (RESULTS, session 5)
       a="--layers 8 --batches 1 --routing trace --fractions 0.37 --policies lru-split --no-sweep --no-online --steps 16 --warmup 16 --sync --no-stable-io"  # closest to session 6 call 1 (which also fed the routing per step)
       run decode_xla_log 150 env TF_CPP_MIN_LOG_LEVEL=0 \
         TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd_executor=1,command_buffer_cmd=1 \
         python3 bench/decode.py $a --out "$OUT/decode_xla_log.json"
       grep -oE "(updated_allocs|Updated|Record|record)[^,;]{0,80}" "$OUT/decode_xla_log.log" | sed 's/[0-9]\+/N/g' | sort | uniq -c | sort -rn | head -20
       run decode_xla_fixed 120 python3 bench/decode.py $a --fixed-inputs --out "$OUT/decode_xla_fixed.json"
       for m in SKIP_TEMP SKIP_PROFILED; do
         run "decode_xla_$m" 120 env XLA_FLAGS=--xla_gpu_command_buffer_update_mode=$m python3 bench/decode.py $a \
           --out "$OUT/decode_xla_$m.json"
       done ;;
    decode-modes)  # XLA's command-buffer update modes (VMM-stable temp / profiled parameter addresses), 8 layers
       # (40 layers: 3 runs did not reach their table in 160 s each, session 6)
       run calibrate 120 python3 -m ftjax calibrate --window-gib 2
       a="--layers 8 --batches 1 --routing trace --fractions 0.37 --policies lru-split lru-fill --no-sweep --no-online --steps 32 --warmup 24"
       for m in ALWAYS_UPDATE SKIP_TEMP SKIP_PROFILED; do
         run "decode_mode_$m" 100 env XLA_FLAGS=--xla_gpu_command_buffer_update_mode=$m python3 bench/decode.py $a \
           --out "$OUT/decode_mode_$m.json"
       done ;;
    decode-b1|decode-b1-nostable)  # 40 layers, batch 1, 37%; -nostable: the --no-stable-io ablation
       flag=""; [ $s = decode-b1-nostable ] && flag=--no-stable-io
       run "${s//-/_}" 360 python3 bench/decode.py --layers 40 --batches 1 --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --no-sweep --online-warmup 128 --steps 32 --warmup 24 $flag --out "$OUT/${s//-/_}.json" ;;
    decode-xla2)  # SKIP_TEMP (ftjax default): commands XLA still re-records per step, stable step buffers vs not
       for io in stable no-stable-io; do
         flag=""; [ $io = no-stable-io ] && flag=--no-stable-io
         run "decode_xla2_$io" 150 env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 \
           python3 bench/decode.py --layers 8 --batches 1 --routing trace --fractions 0.37 --policies lru-split lru-fill \
           --no-sweep --no-online --steps 16 --warmup 16 $flag --out "$OUT/decode_xla2_$io.json"
         log="$OUT/decode_xla2_$io.log"
         grep -oE "num_commands=[0-9]+; updated_allocs=[0-9]+" "$log" | sort | uniq -c
         grep -oE "Updated [0-9]+ commands in [0-9]+ [^ ]+ \(skipped [0-9]+" "$log" | \
           awk '{n[$2]++; t[$2]+=$5; k[$2]+=$8} END {for (c in n) printf "%s commands: %d updates, mean %.0f us, mean skipped %.0f\n", c, n[c], t[c]/n[c], k[c]/n[c]}'
         echo "executions: $(grep -c 'Execute command buffer' "$log")"
         rm -f "$log"
       done ;;
    decode-dense)  # 40 layers, b1, 37%, warm: the plan's other update forms (--plan-impl), one process each
       for impl in ${PLAN_IMPLS:-mixed dense}; do  # --no-online: ~250 s per process (one-batch decode-b1 ~265 s)
         run "decode_plan_$impl" 280 python3 bench/decode.py --layers 40 --batches 1 --routing trace --fractions 0.37 \
           --policies lru-split lru-fill --no-sweep --no-online --steps 32 --warmup 24 --plan-impl $impl \
           --out "$OUT/decode_plan_$impl.json"
       done ;;
    decode-warm-b1|decode-warm-b4)  # session 7 call 3, one batch per step: trace, 37%, warm, online row + sweep
       b=${s##*-b}  # (call 3 ran both batches in 417 s; each process now also times the resident engine, ~+65 s)
       run "decode_warm_b$b" 400 python3 bench/decode.py --layers 40 --batches $b --routing trace --fractions 0.37 \
         --policies lru-split lru-fill --steps 32 --warmup 24 --online-warmup 128 --out "$OUT/decode_warm_b$b.json" ;;
    decode-text-defer-b1|decode-text-defer-b4)  # text routing, 37%, warm: lru-split with background fills vs without
       b=${s##*-b}
       run "decode_text_defer_b$b" 400 python3 bench/decode.py --layers 40 --batches $b --routing text --tokenizer "$tok" \
         --fractions 0.37 --policies lru-split lru-fill --defer both --no-sweep --no-online --steps 32 --warmup 24 \
         --out "$OUT/decode_text_defer_b$b.json" ;;
    decode-text-b1|decode-text-b4)  # session 7 call 4, one batch per step: text routing, 37% and 11% (~300 s each)
       b=${s##*-b}
       run "decode_text_b$b" 400 python3 bench/decode.py --layers 40 --batches $b --routing text --tokenizer "$tok" \
         --fractions 0.37 0.11 --policies lru-split lru-fill --no-sweep --no-online --steps 32 --warmup 24 \
         --out "$OUT/decode_text_b$b.json" ;;
    decode-more) run decode_more 540 python3 bench/decode.py --layers 40 --batches 4 1 --routing text trace \
              --tokenizer "$tok" --fractions 0.11 --policies lru-split lru-fill static --no-sweep \
              --steps 24 --warmup 24 --out "$OUT/decode_more.json" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
