"""``ftjax`` command line: convert, generate, demo, info, serve, batch.

Bad input (unknown model type, missing files, prompt over the context, bad sampling values, a
missing or corrupt store) prints one line ``ftjax: error: ...`` and exits with code 2. Heavy imports
(JAX) happen inside the commands so ``--help`` is instant.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

EXIT_USAGE = 2
DEFAULT_PROMPT = "The lighthouse keeper"


class CLIError(Exception):
    """A user-facing error: printed as ``ftjax: error: <message>``, exit code 2."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from ftjax.ftw.manifest import StoreError

    return (CLIError, ValueError, OSError, KeyError, StoreError)


# ---------------------------------------------------------------------------------------- helpers
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"most tokens to generate (>= 1; default {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.7, metavar="T",
                   help="softmax temperature, >= 0; 0 = greedy (default 0.7)")
    g.add_argument("--top-k", type=int, default=20, metavar="K",
                   help="sample among the K most likely tokens, >= 0; 0 = off (default 20)")
    g.add_argument("--top-p", type=float, default=0.8, metavar="P",
                   help="nucleus sampling mass, in (0, 1]; 1 = off (default 0.8)")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed, in [0, 2**32-1] (default 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (repeatable); eos tokens always stop")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message with the model's chat template")
    g.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    g.add_argument("--no-think", action="store_true",
                   help="with --chat: render enable_thinking=false (an empty <think></think> block)")
    g.add_argument("--max-len", type=_positive_int, metavar="N",
                   help="context length to allocate (default: min(4096, max_position_embeddings))")
    add_expert_args(p)


def add_expert_args(p: argparse.ArgumentParser) -> None:
    """``--policy`` and ``--vram-gib`` (the expert runtime's user knobs)."""
    from ftjax.experts.policies import POLICIES

    g = p.add_argument_group("experts")
    g.add_argument("--policy", choices=sorted(POLICIES), default=None,
                   help="expert placement: lru-split (LRU cache + bandwidth-adaptive miss split), lru-fill, "
                   "cpu, static, resident (default: all experts resident; lru-split with --vram-gib)")
    g.add_argument("--vram-gib", type=float, default=None, metavar="G",
                   help="GPU memory for the expert cache in GiB (default: the whole expert pool)")
    g.add_argument("--fixed-split", action="store_true",
                   help="lru-split: keep the calibrated fill fraction (no online refinement from step times)")
    g.add_argument("--expert-kernel", choices=("jnp", "pallas"), default="jnp",
                   help="device-side expert code: jnp (gather/ragged dots) or pallas (Mosaic GPU kernels, "
                   "bf16 weights; Hopper)")
    g.add_argument("--no-background-fills", dest="background_fills", action="store_false", default=None,
                   help="lru-split on the GPU: fill every miss of a decode call in that call (default: a call "
                   "the CPU serves faster computes its misses there and fills them beside the next step)")
    g.add_argument("--no-unit-split", dest="unit_split", action="store_false", default=None,
                   help="lru-split on the GPU with background fills: defer whole experts (default with the jnp "
                   "kernel: a deferred call fills its experts' first units now and the CPU computes the rest)")
    g.add_argument("--down-layout", choices=("hi", "ih"), default=None,
                   help="the host expert pool's down bank: hi (torch's [H, I], default) or ih (stored transposed: "
                   "the CPU's share of a split expert reads whole rows, gate/up and down in one pass)")


def _sampling_params(args):
    from ftjax.engine.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_tokens=args.max_tokens, stop=tuple(args.stop))


def _prompt_text(tokenizer, args, prompt: str) -> str:
    if not args.chat:
        return prompt
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         enable_thinking=False if args.no_think else None)


def _load_store(path: str):
    from ftjax.ftw import load_store

    p = Path(path)
    if not p.exists():
        raise CLIError(f"model directory {p} does not exist")
    return load_store(p)


def _run_generation(model, args, prompt: str, echo_prompt: bool = False) -> None:
    """Warm up (compile), generate, print the text on stdout and the statistics on stderr."""
    from ftjax.engine.generate import Generator

    params = _sampling_params(args)  # validate before the slow part
    if not prompt:
        raise CLIError("the prompt is empty")
    gen = Generator(model, batch=1, max_len=args.max_len, policy=args.policy, vram_gib=args.vram_gib,
                    online_split=not args.fixed_split, expert_kernel=args.expert_kernel,
                    background_fills=args.background_fills, unit_split=args.unit_split,
                    down_layout=args.down_layout)
    text = _prompt_text(gen.tokenizer, args, prompt)
    ids = gen.encode_prompt(text)
    if len(ids) > gen.max_len:
        raise CLIError(f"the prompt has {len(ids)} tokens, longer than the context of {gen.max_len} tokens "
                       f"(--max-len; the model allows {gen.cfg.max_position_embeddings})")
    t0 = time.perf_counter()
    gen.generate([ids], params.__class__(temperature=0.0, max_tokens=2))
    print(f"ftjax: compiled in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if echo_prompt and not args.chat:
        sys.stdout.write(prompt)
    if args.stream:
        stream = gen.stream(ids, params)
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        result = stream.result
        sys.stdout.write("\n")
    else:
        result = gen.generate([ids], params)[0]
        print(result.text)
    sys.stdout.flush()
    print(f"[prompt tokens: {result.prompt_tokens} | generated tokens: {len(result.token_ids)} "
          f"({result.finish_reason}) | TTFT: {result.ttft_s * 1000:.0f} ms | "
          f"decode: {result.decode_tok_s:.1f} tokens/s]", file=sys.stderr)
    _print_expert_stats(gen.engine.stats())


def _print_expert_stats(stats: dict) -> None:
    """The offloaded runtime's counters and the miss split in use (nothing when every expert is resident)."""
    ex, band = stats.get("experts", {}), stats.get("bandwidth") or {}
    if ex.get("num_slots") is None:
        return
    line = (f"[experts {ex['backend']}: {ex['num_slots']} slots | miss rate {ex['miss_rate']:.1%} | "
            f"fills {ex['fills']} | CPU experts {ex['cpu_experts']}")
    if band.get("b_pcie_gbps"):
        line += (f" | B_P {band['b_pcie_gbps']:.1f} GB/s, B_H {band['b_host_gbps']:.1f} GB/s "
                 f"({band['source']}), fill fraction {band['fill_fraction']:.3f}")
    print(line + "]", file=sys.stderr)


# --------------------------------------------------------------------------------------- commands
def cmd_convert(args) -> None:
    from ftjax.ftw import convert

    src, out = Path(args.hf_dir), Path(args.out_dir)
    if not src.is_dir():
        raise CLIError(f"HF checkpoint directory {src} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise CLIError(f"{out} exists and is not empty; pass --overwrite to replace it")
    t0 = time.perf_counter()
    convert(src, out, dtype=args.dtype, overwrite=args.overwrite, progress=not args.quiet)
    print(f"ftjax: wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def cmd_generate(args) -> None:
    _run_generation(_load_store(args.model), args, args.prompt)


def cmd_demo(args) -> None:
    from ftjax.demo import ensure_demo_model

    store = ensure_demo_model(args.cache_dir, force=args.rebuild)
    model = _load_store(str(store))
    print(f"ftjax: demo model {store} ({_describe(model.config)})", file=sys.stderr)
    _run_generation(model, args, args.prompt, echo_prompt=True)


def _describe(cfg) -> str:
    n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
    return (f"{cfg.model_type}, {cfg.num_layers} layers ({n_attn} attention, {n_lin} Gated DeltaNet), "
            f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}")


def cmd_info(args) -> None:
    import numpy as np

    from ftjax.ftw.load import open_store

    p = Path(args.model)
    if not p.exists():
        raise CLIError(f"model directory {p} does not exist")
    root, man, cfg = open_store(p)
    banks = man["experts"]["banks"]
    pool_bytes = sum(int(np.prod(b["shape"])) * _itemsize(b["dtype"]) for b in banks.values())
    dense_bytes = sum(int(np.prod(t["shape"])) * _itemsize(t["dtype"]) for t in man["tensors"].values())
    n_flat = cfg.num_flat_experts
    rows = [
        ("store", str(root)), ("model", _describe(cfg)), ("family / flavour", f"{cfg.family} / {cfg.flavour}"),
        ("hidden size", cfg.hidden_size), ("vocab size", cfg.vocab_size),
        ("attention heads", f"{cfg.num_heads} query / {cfg.num_kv_heads} kv, head_dim {cfg.head_dim}"),
        ("max position embeddings", cfg.max_position_embeddings),
        ("expert intermediate size", cfg.moe_intermediate_size),
    ]
    if cfg.shared_expert_intermediate_size:
        rows.append(("shared expert intermediate", cfg.shared_expert_intermediate_size))
    if cfg.linear_layers:
        rows.append(("Gated DeltaNet heads", f"{cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} value, "
                     f"dims {cfg.linear_key_head_dim}/{cfg.linear_value_head_dim}, conv {cfg.linear_conv_kernel_dim}"))
    rows += [
        ("expert pool", f"{n_flat} experts ({cfg.num_layers} x {cfg.num_experts}), {_gib(pool_bytes)} "
         f"({man['experts']['dtype']}, {_mib(pool_bytes / n_flat)} per expert)"),
        ("non-expert weights", f"{len(man['tensors'])} tensors, {_gib(dense_bytes)}"),
        ("eos token ids", list(cfg.eos_token_ids)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# ----------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftjax", description="FreeToken-style MoE inference on JAX: convert Hugging Face checkpoints "
        "to FTW stores, generate text, run the built-in demo model, serve over gRPC, run batch "
        "evaluations, calibrate the machine's fill and CPU-expert bandwidths. `ftjax COMMAND --help` "
        "explains each command.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details (INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("convert", help="convert a Hugging Face safetensors checkpoint to an FTW store",
                       description="Convert HF_DIR (config.json + *.safetensors + tokenizer files) to an FTW "
                       "store in OUT_DIR. The store is written to a temporary directory and renamed at the end.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write the FTW store")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="stored dtype (default bf16)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("generate", help="generate text from an FTW store",
                       description="Load the FTW store at --model (all experts resident) and continue PROMPT. "
                       "Prints the text on stdout and a line with prompt tokens, generated tokens, "
                       "time to first token and decode tokens/s on stderr.")
    p.add_argument("--model", required=True, metavar="DIR", help="FTW store directory (from `ftjax convert`)")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    _add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="build (once) the small demo model and generate with it",
                       description="Create the synthetic demo model (8 layers, 64 experts, Qwen3.5-MoE "
                       "architecture, random weights shaped by bigram statistics of a small corpus) in "
                       "the cache ($FTJAX_CACHE or ~/.cache/ftjax), then generate and print tokens/s.")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    p.add_argument("--rebuild", action="store_true", help="rebuild the demo model even if it is cached")
    p.add_argument("--cache-dir", metavar="DIR", help="cache directory (default $FTJAX_CACHE or ~/.cache/ftjax)")
    _add_sampling_args(p, max_tokens=64)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("info", help="summarise an FTW store: config and expert pool size",
                       description="Print the model config and the sizes of the expert pool and the "
                       "non-expert weights of an FTW store (reads only the manifest).")
    p.add_argument("--model", required=True, metavar="DIR", help="FTW store directory")
    p.set_defaults(func=cmd_info)

    from ftjax.batch import add_parser as add_batch_parser  # light imports: grpc/JAX load inside the commands
    from ftjax.serve.command import add_parser as add_serve_parser

    add_serve_parser(sub)
    add_batch_parser(sub)

    from ftjax.host import calibrate as calibrate_mod  # light: the native module loads on use

    p = sub.add_parser("calibrate", help="measure B_P (GPU fill) and B_H (CPU experts) for this machine",
                       description=calibrate_mod.__doc__.strip().split("\n\n")[0].replace("\n", " "))
    calibrate_mod.add_arguments(p)
    p.set_defaults(func=calibrate_mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except KeyboardInterrupt:
        print("ftjax: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f"ftjax: error: {' '.join(msg.split())}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
