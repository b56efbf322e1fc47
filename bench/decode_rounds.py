"""Round-robin timing for `bench/decode.py`: one run under several settings (or several runs), rounds of a few
steps each in turn so that every setting sees the same stretch of the routing, and the CPU kernel knob settings
of --knob-variants."""
from __future__ import annotations

from ftjax.host import kernel_knobs, knob_variants, set_kernel_knobs

# the CPU expert call's own times per call (us; expert_call_time_totals): whole call, setup, per round wall
# and the caller's wait for the other threads
CALL_TIMES = ("total_us", "setup_us", "layouts_us", "phase1_us", "phase1_wait_us", "phase2_us", "phase2_wait_us")


ROUNDS = 4  # interleaved(): rounds of the round robin


def interleaved(run, settings: dict, rounds: int, steps: int, warmup: int) -> dict:
    """Time ``run`` under each of ``settings`` (name -> a function that applies it) in ``rounds`` rounds of
    ``steps // rounds`` steps each (``warmup`` untimed steps after every switch), round robin, so that every
    setting sees the same stretch of the routing; the rounds' figures combined per setting."""
    return round_robin({name: (run, apply) for name, apply in settings.items()}, rounds, steps, warmup)


def round_robin(entries: dict, rounds: int, steps: int, warmup: int) -> dict:
    """`interleaved` over (run, apply) pairs per name: several runs (e.g. differently compiled backends, each
    stepping its own copy of the trace, so each sees the same stretches), or one run under several settings."""
    per = max(1, steps // rounds)
    parts = {name: [] for name in entries}
    for _ in range(rounds):
        for name, (run, apply) in entries.items():
            apply()
            parts[name].append(run.timed(warmup, per))
    out = {}
    for name, rs in parts.items():
        run = entries[name][0]
        n = per * len(rs)
        sec = sum(r["step_ms"] for r in rs) * per / 1e3
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731  (equal steps per round)
        out[name] = {"tok_s": run.batch * n / sec, "step_ms": sec / n * 1e3, "warm_steps": run.warm_steps,
                     "rounds": len(rs), "round_tok_s": [r["tok_s"] for r in rs],
                     **{k: mean(k) for k in ("dispatch_ms", "miss_rate", "misses_per_step", "fills_per_layer",
                                             "cpu_per_layer", "deferred_per_layer", "cpu_jobs_per_step",
                                             "cpu_serve_ms", "cpu_us_per_job", "cpu_mb_per_job", "cpu_gbps",
                                             *(f"call_{k}" for k in CALL_TIMES))}}
    return out


def knob_settings(specs: list[str]) -> dict:
    """`interleaved` settings for --knob-variants: 'split knobs default' (the CPU kernel knobs as they are now)
    and one per spec ('down_rows=32,window_prefetch=off'), each setting its knobs and the others back to the
    defaults. A bad spec or value exits here, before any work."""
    default = kernel_knobs()
    try:
        variants = knob_variants(specs)
    except ValueError as e:
        raise SystemExit(f"--knob-variants: {e}") from None
    return {"split knobs default": lambda: set_kernel_knobs(**default),
            **{f"split {spec}": (lambda v=v: set_kernel_knobs(**v)) for spec, v in variants.items()}}


def fill_beside_variants(blocks: list, gemv: bool) -> dict:
    """--fill-beside-ablation's backends: name -> OffloadExperts keywords over the run's own. The fill after the
    submit (the default) turns the fill beside off whole (fill_beside_gemv needs it); one beside backend per
    block count, each with the hits in its call when ``gemv``."""
    return {"split fill after": {"fill_beside": False, "fill_beside_gemv": False},
            **{f"split beside {n}": {"fill_beside": True, "fill_beside_blocks": n, "fill_beside_gemv": gemv}
               for n in blocks}}


VARIANT_FLAGS = ("--granule-ablation", "--fill-beside-ablation")  # a backend per value given, and the default's


def round_robin_backends(args) -> dict:
    """Flag -> how many lru-split backends (each with its own expert cache) its round robin holds at once."""
    counts = {"--granule-ablation": 1 + len(args.granule_ablation) if args.granule_ablation else 0,
              "--host-plan-ablation": 2 if args.host_plan_ablation else 0,
              "--plan-publish-ablation": 2 if args.plan_publish_ablation else 0,
              "--fill-beside-ablation": 1 + len(args.fill_beside_ablation) if args.fill_beside_ablation else 0}
    return {flag: n for flag, n in counts.items() if n}


def check_round_robins_fit(counts: dict, cache_bytes: int, device) -> None:
    """Stop before any timing when a round robin's backends cannot be held on ``device`` at once (their caches
    of ``cache_bytes`` each against 90% of what its allocator has left), instead of an out-of-memory error
    minutes into the run. Devices without memory figures (CPU) are not checked."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return
    room = 0.9 * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    for flag, n in counts.items():
        if n * cache_bytes > room:
            fit = int(room // cache_bytes)
            hint = (f"pass at most {max(fit - 1, 0)} variant(s)" if flag in VARIANT_FLAGS  # (the default's backend
                    else "run it on a GPU with more memory")  # is always one of them; the others are fixed pairs)
            raise SystemExit(f"{flag}: its round robin holds {n} backends at once, {n} x {cache_bytes / 2**30:.1f} GiB "
                             f"of expert cache; {device.device_kind} has room for {room / 2**30:.1f} GiB "
                             f"({fit} backends): {hint}")
