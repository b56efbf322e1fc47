"""bench/decode.py's command line: the runs, rows and ablations it takes, and the settings they share."""
from __future__ import annotations

import argparse
from pathlib import Path

from ftjax.experts.plan import PLAN_IMPLS, VICTIM_METHODS

TOKENIZER = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "qwen3-tokenizer"  # --tokenizer
POLICIES = ("lru-split", "lru-fill", "cpu", "static")
SWEEP = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9)  # the fill fractions of the sweep against the q* rule


def parser(description: str, out: Path) -> argparse.ArgumentParser:
    """The benchmark's arguments; ``out``: --out's default (the JSON of every row)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--routing", nargs="+", default=["trace", "text"], choices=["trace", "text"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.37, 0.11])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=96)
    ap.add_argument("--layers", type=int, default=40, help="fewer layers for a quick check")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-online", action="store_true", help="skip the 'split online' row (online split tuner)")
    ap.add_argument("--online-warmup", type=int, default=256,
                    help="steps the online tuner runs before the 'split online' row is timed")
    ap.add_argument("--hlo-stats", action="store_true", help="print the compiled decode step's top-level ops "
                    "(command buffers vs ops launched one by one)")
    ap.add_argument("--unfused-handshake", dest="fused_handshake", action="store_false",
                    help="CPU-branch submit/collect through memcpy nodes (the fused kernels are the default)")
    ap.add_argument("--sync", action="store_true",
                    help="wait for each step's logits before the next (a serving loop that samples every token); "
                         "default: steps dispatched back to back, the host running ahead of the GPU")
    ap.add_argument("--fixed-inputs", action="store_true",
                    help="trace routing: pass the same token and n_new device buffers every step (session 6's "
                         "experiment; it changes nothing unless --no-stable-io, as stable_io stages the inputs)")
    ap.add_argument("--no-stable-io", dest="stable_io", action="store_false",
                    help="ablation: fresh token/n_new/logits buffers every step (make_step_fns(stable_io=False)), so "
                         "XLA re-records the commands that use them before each launch")
    ap.add_argument("--plan-impl", default="fused", choices=PLAN_IMPLS,
                    help="how the plan updates its state (plan_layer's impl; same results; fused: one native call)")
    ap.add_argument("--plan-ablation", choices=PLAN_IMPLS,
                    help="also a 'split plan IMPL' row: lru-split with the plan by this impl (e.g. scatter, the jnp "
                         "plan, against the fused default)")
    ap.add_argument("--victims-by", choices=tuple(VICTIM_METHODS),
                    help="how the plan ranks the LRU victims (plan_layer's victims_by; same slots); default: the "
                         "backend's choice for the platform and cache size (default_victims_by: rank on the GPU)")
    ap.add_argument("--defer", choices=("on", "off", "both"), default="on",
                    help="lru-split's background fills (OffloadExperts defer_fills; on is the library default on "
                         "the GPU): on, off, or both: the lru-split row without them and a 'split bg-fills' row "
                         "with them")
    ap.add_argument("--whole-split", action="store_true",
                    help="also a 'split whole' row: lru-split with background fills of whole experts (OffloadExperts "
                         "unit_split=False; the library default splits by units where it can)")
    ap.add_argument("--unit-split", action="store_true",
                    help="also a 'split units' row: lru-split with background fills and the fills of a call split "
                         "by intermediate units (OffloadExperts unit_split; bf16/f32 pools)")
    ap.add_argument("--yield-ablation", action="store_true",
                    help="lru-split again (same executable) under every background yield mode (OffloadExperts."
                         "background_yield: what the background fill pauses for), round robin in ROUNDS rounds")
    ap.add_argument("--kernel-ablation", choices=("pallas",),
                    help="also a 'split pallas' row: lru-split with the Pallas decode GEMV as its GPU expert kernel "
                         "(OffloadExperts kernel='pallas'; the other rows and T_gpu use jnp), and with --unit-split a "
                         "'split units pallas' row")
    ap.add_argument("--granule-ablation", nargs="+", type=int, default=[], metavar="UNITS",
                    help="also lru-split with the unit split's step set to UNITS (OffloadExperts unit_granule; the "
                         "default: 8 units for bf16/f32): each a backend of its own, timed round robin with a "
                         "second default backend ('split granule default'), every one on its own copy of the trace")
    ap.add_argument("--no-resident", action="store_true",
                    help="skip the resident runs (a GPU that cannot hold the whole pool, e.g. the H100 at 40 layers): "
                         "no T_gpu and no roofline (printed as nan), the policies' rows only")
    ap.add_argument("--host-plan-ablation", action="store_true",
                    help="also lru-split with the host plan off and on (OffloadExperts host_plan: the CPU branch's "
                         "tasks decided on the host from the router's output, cpp/host_plan.h): two fresh backends, "
                         "round robin, each on its own copy of the trace")
    ap.add_argument("--plan-publish-ablation", action="store_true",
                    help="also lru-split with the CPU branch submitted by a submit kernel after the plan kernel and "
                         "by the plan kernel itself before its victims (OffloadExperts plan_publish): two fresh "
                         "backends, round robin, each on its own copy of the trace")
    ap.add_argument("--fill-beside", type=int, default=None, metavar="BLOCKS",
                    help="every lru-split backend with OffloadExperts(fill_beside=True, fill_beside_blocks=BLOCKS): "
                         "the in-step fill and the filled routes in one call that the GEMV does not wait for (it "
                         "runs beside it under FTJAX_XLA_CB_SCHEDULING=CONCURRENT; 0: the default fill's grid)")
    ap.add_argument("--fill-beside-gemv", action="store_true",
                    help="with --fill-beside (and in --fill-beside-ablation's beside rows): the beside call also "
                         "computes the hit routes, its fill on a side stream (OffloadExperts fill_beside_gemv)")
    ap.add_argument("--fill-beside-ablation", type=int, nargs="+", default=None, metavar="BLOCKS",
                    help="also lru-split with the fill after the submit (the default) and beside the GEMV with each "
                         "of BLOCKS fill blocks: fresh backends, round robin, each on its own copy of the trace")
    ap.add_argument("--down-layout", choices=("hi", "ih"), default="hi",
                    help="the host pool's down bank (HostPool down_layout): hi as torch's [H, I], ih stored transposed "
                    "(the unit split's CPU window is whole rows, read with gate/up's in one pass)")
    ap.add_argument("--tokenizer", default=str(TOKENIZER), help="the real Qwen3 tokenizer (routing text)")
    ap.add_argument("--worker-variants", nargs="*", default=[], metavar="N:SPIN_US",
                    help="also run lru-split with the CPU worker pool reconfigured (N workers, -1 = default; "
                    "spin SPIN_US before sleeping), e.g. 12:2000: the same executable, round robin with the "
                    "default pool (every setting sees the same stretch of the routing)")
    ap.add_argument("--knob-variants", nargs="+", default=[], metavar="KNOB=V[,KNOB=V]",
                    help="also run lru-split with the CPU kernels' knobs set (ftjax.host.kernel_knobs: gate_up_rows, "
                         "down_rows, prefetch_bytes, short_row_bytes, window_prefetch=on/off, tile_prefetch=on/off), "
                         "e.g. down_rows=32 window_prefetch=off: the same executable, round robin with the defaults")
    ap.add_argument("--profile", metavar="DIR", help="also capture a profiler trace of 3 steps of each run "
                    "(perfetto JSON under DIR/<routing>-b<B>-<policy>-<cache>; summarise with bench/trace_summary.py)")
    ap.add_argument("--stamps", action="store_true", help="after lru-split's timed run, cut its layer calls at the "
                    "handshake's stamps (bench/layer_stamps.py) and print where a call's time goes")
    ap.add_argument("--out", default=str(out))
    return ap
