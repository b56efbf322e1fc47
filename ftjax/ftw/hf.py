"""Read Hugging Face safetensors checkpoints into ftjax's internal names (docs/internals.md).

``HFCheckpoint(dir)`` handles single-file and sharded checkpoints, the ``model.language_model.``
prefix of multimodal Qwen3.5 checkpoints (vision and MTP tensors are skipped), per-expert or fused
expert tensors, tied embeddings, and Qwen3-Next's per-key-head interleaved ``in_proj_qkvz`` /
``in_proj_ba`` (converted to the flat Qwen3.5 layout). Every error names the file and the tensor.
"""
from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open

from ftjax.config import ModelConfig, load_hf_config
from ftjax.models.params import param_shapes

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja")
SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
# Checkpoint prefix -> canonical prefix (text-only ``model.`` naming).
PREFIX_MAP = (("model.language_model.", "model."), ("language_model.model.", "model."),
              ("language_model.lm_head.", "lm_head."))
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtypes numpy cannot name; read from the raw bytes instead.
RAW_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
              "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}

_ATTN = {k: f"self_attn.{k}.weight" for k in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
_GDN = {"in_proj_qkv": "in_proj_qkv.weight", "in_proj_z": "in_proj_z.weight", "in_proj_b": "in_proj_b.weight",
        "in_proj_a": "in_proj_a.weight", "conv1d": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log",
        "norm": "norm.weight", "out_proj": "out_proj.weight"}
_MOE = {"router": "gate.weight", "shared_gate_proj": "shared_expert.gate_proj.weight",
        "shared_up_proj": "shared_expert.up_proj.weight", "shared_down_proj": "shared_expert.down_proj.weight",
        "shared_expert_gate": "shared_expert_gate.weight"}
_NEXT_FUSED = {"in_proj_qkv": "in_proj_qkvz.weight", "in_proj_z": "in_proj_qkvz.weight",
               "in_proj_b": "in_proj_ba.weight", "in_proj_a": "in_proj_ba.weight"}


class CheckpointError(ValueError):
    """A checkpoint ftjax cannot read: names the file and the tensor."""


def canonical_name(name: str) -> str | None:
    """Checkpoint tensor name -> text-model name (``model.layers.N...``), or None for skipped tensors."""
    if name.startswith(SKIP_PREFIXES):
        return None
    for old, new in PREFIX_MAP:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def hf_source_name(internal: str, cfg: ModelConfig) -> str:
    """The canonical HF tensor that holds internal parameter ``internal``."""
    top = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    if internal in top:
        return top[internal]
    _, i, *rest = internal.split(".")
    p = f"model.layers.{i}."
    if rest == ["input_norm"]:
        return p + "input_layernorm.weight"
    if rest == ["post_attn_norm"]:
        return p + "post_attention_layernorm.weight"
    group, leaf = rest
    if group == "attn":
        return p + _ATTN[leaf]
    if group == "gdn":
        fused = cfg.flavour == "qwen3_next" and leaf in _NEXT_FUSED
        return p + "linear_attn." + (_NEXT_FUSED if fused else _GDN)[leaf]
    return p + "mlp." + _MOE[leaf]


def split_qwen3_next_qkvz(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``in_proj_qkvz [Hk*(2dk + 2r*dv), H]``, per key head ``[q | k | v (r*dv) | z (r*dv)]`` ->
    flat ``in_proj_qkv [all q | all k | all v]`` and ``in_proj_z``; value head ``j*r + i`` belongs to key head j."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    g = w.reshape(hk, 2 * dk + 2 * r * dv, w.shape[-1])
    q, k = g[:, :dk], g[:, dk:2 * dk]
    v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
    flat = lambda a: a.reshape(-1, w.shape[-1])  # noqa: E731
    return np.concatenate([flat(q), flat(k), flat(v)]), flat(z)


def split_qwen3_next_ba(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``in_proj_ba [Hk*2r, H]``, per key head ``[b (r) | a (r)]`` -> ``in_proj_b [Hv, H]``, ``in_proj_a [Hv, H]``."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    g = w.reshape(hk, 2 * r, w.shape[-1])
    return g[:, :r].reshape(-1, w.shape[-1]), g[:, r:].reshape(-1, w.shape[-1])


class HFCheckpoint:
    """A Hugging Face checkpoint directory, read tensor by tensor (nothing is loaded up front)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self.path} does not exist")
        self.config: ModelConfig = load_hf_config(self.path)
        self._where: dict[str, tuple[str, str]] = {}  # canonical name -> (file name, name in file)
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, tuple[dict, int]] = {}  # file -> (header, offset of the data)
        self.files = self._index()
        self.fused_experts = self._expert_layout()
        self._check_complete()
        self.tokenizer_files = [self.path / f for f in TOKENIZER_FILES if (self.path / f).is_file()]
        self.source = {"format": "hf-safetensors", "dir": str(self.path.resolve()), "files": self.files,
                       "model_type": self.config.model_type, "flavour": self.config.flavour,
                       "experts": "fused" if self.fused_experts else "per_expert",
                       "dtypes": sorted(self._dtypes())}

    # ---------------------------------------------------------------------------------- indexing
    def _index(self) -> list[str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.path / f).is_file():
                    raise CheckpointError(f"{index} lists shard {f!r}, which is missing from {self.path}")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files and no {INDEX_FILE} in {self.path}")
        for f in files:
            for name in self._open(f).keys():
                canon = canonical_name(name)
                if canon is None:
                    continue
                if canon in self._where:
                    raise CheckpointError(f"tensor {canon!r} appears in both {self._where[canon][0]} and {f}")
                self._where[canon] = (f, name)
        return files

    def _open(self, fname: str):
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(str(self.path / fname), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{self.path / fname}: cannot open as safetensors ({e})") from e
        return self._handles[fname]

    def _expert_layout(self) -> bool:
        fused = [f"model.layers.{i}.mlp.experts.gate_up_proj" in self._where for i in range(self.config.num_layers)]
        if any(fused) and not all(fused):
            raise CheckpointError(f"{self.path}: experts are fused in some layers and per-expert in others")
        return all(fused)

    def _required(self) -> list[str]:
        cfg = self.config
        names = {hf_source_name(n, cfg) for n in param_shapes(cfg)}
        if cfg.tie_word_embeddings:
            names.discard("lm_head.weight")
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}.mlp.experts."
            if self.fused_experts:
                names.update({p + "gate_up_proj", p + "down_proj"})
            else:
                names.update(f"{p}{e}.{w}_proj.weight" for e in range(cfg.num_experts) for w in ("gate", "up", "down"))
        return sorted(names)

    def _check_complete(self) -> None:
        required = self._required()
        missing = [n for n in required if n not in self._where]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(f"{self.path} ({', '.join(self.files)}): missing tensors {shown}")
        extra = sorted(set(self._where) - set(required) - {"lm_head.weight"})
        extra = [n for n in extra if not n.endswith(IGNORED_SUFFIXES)]
        if extra:
            log.warning("%s: ignoring %d unknown tensors, e.g. %s", self.path, len(extra), extra[:3])

    def _dtypes(self) -> set[str]:
        out = set()
        for f in self.files:
            out.update(h["dtype"] for k, h in self._header(f)[0].items() if k != "__metadata__")
        return out

    # ---------------------------------------------------------------------------------- reading
    def _header(self, fname: str) -> tuple[dict, int]:
        if fname not in self._headers:
            with open(self.path / fname, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                self._headers[fname] = (json.loads(fh.read(n)), 8 + n)
        return self._headers[fname]

    def _read_raw(self, fname: str, name: str, index: int | None) -> np.ndarray:
        """Read a tensor (or its ``index``-th leading slice) from the raw bytes: dtypes numpy lacks."""
        header, data_start = self._header(fname)
        info = header[name]
        if info["dtype"] not in RAW_DTYPES:
            raise CheckpointError(f"{self.path / fname}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dt, shape = RAW_DTYPES[info["dtype"]], tuple(info["shape"])
        start = data_start + info["data_offsets"][0]
        if index is not None:
            shape = shape[1:]
            start += index * int(np.prod(shape)) * dt.itemsize
        count = int(np.prod(shape))
        arr = np.fromfile(self.path / fname, dtype=np.uint8, count=count * dt.itemsize, offset=start)
        if arr.size != count * dt.itemsize:
            raise CheckpointError(f"{self.path / fname}: tensor {name!r} is truncated")
        return arr.view(dt).reshape(shape)

    def _get(self, canon: str, index: int | None = None) -> np.ndarray:
        if canon not in self._where:
            raise CheckpointError(f"{self.path} ({', '.join(self.files)}): missing tensor {canon!r}")
        fname, name = self._where[canon]
        try:
            if index is None:
                return self._open(fname).get_tensor(name)
            return np.asarray(self._open(fname).get_slice(name)[index])
        except TypeError:  # numpy has no bfloat16/float8: safetensors cannot build the array
            return self._read_raw(fname, name, index)

    def _checked(self, canon: str, arr: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
        if tuple(arr.shape) != tuple(shape):
            fname = self._where.get(canon, ("?",))[0]
            raise CheckpointError(f"{self.path / fname}: tensor {canon!r} ({what}) has shape {tuple(arr.shape)}, "
                                  f"expected {tuple(shape)}")
        return arr

    # ---------------------------------------------------------------------------------- public API
    def dense_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every non-expert tensor as ``(internal name, array in the checkpoint dtype)``."""
        cfg = self.config
        for name, shape in param_shapes(cfg).items():
            canon = hf_source_name(name, cfg)
            if name == "lm_head" and cfg.tie_word_embeddings:
                canon = "model.embed_tokens.weight"
            leaf = name.rsplit(".", 1)[-1]
            arr = self._get(canon)
            if canon.endswith("in_proj_qkvz.weight"):
                qkv_shape = (2 * cfg.gdn_key_dim + 2 * cfg.gdn_value_dim, cfg.hidden_size)
                arr = split_qwen3_next_qkvz(self._checked(canon, arr, qkv_shape, name), cfg)[leaf == "in_proj_z"]
            elif canon.endswith("in_proj_ba.weight"):
                ba_shape = (2 * cfg.linear_num_value_heads, cfg.hidden_size)
                arr = split_qwen3_next_ba(self._checked(canon, arr, ba_shape, name), cfg)[leaf == "in_proj_a"]
            elif leaf == "conv1d" and arr.ndim == 3:
                arr = self._checked(canon, arr, (shape[0], 1, shape[1]), name)[:, 0, :]
            yield name, np.ascontiguousarray(self._checked(canon, arr, shape, name))

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        """Routed expert ``e`` of ``layer``: ``{"gate_up": [2I, H] (gate rows first), "down": [H, I]}``."""
        cfg = self.config
        if not (0 <= layer < cfg.num_layers and 0 <= e < cfg.num_experts):
            raise IndexError(f"expert ({layer}, {e}) out of range: {cfg.num_layers} layers x {cfg.num_experts} experts")
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        p = f"model.layers.{layer}.mlp.experts."
        if self.fused_experts:
            for name, shape in ((p + "gate_up_proj", (cfg.num_experts, 2 * I, H)),
                                (p + "down_proj", (cfg.num_experts, H, I))):
                fname, raw = self._where[name]
                got = tuple(self._header(fname)[0][raw]["shape"])
                if got != shape:
                    raise CheckpointError(f"{self.path / fname}: tensor {name!r} has shape {got}, expected {shape}")
            return {"gate_up": self._get(p + "gate_up_proj", e), "down": self._get(p + "down_proj", e)}
        names = {w: f"{p}{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
        gate = self._checked(names["gate"], self._get(names["gate"]), (I, H), "gate_proj")
        up = self._checked(names["up"], self._get(names["up"]), (I, H), "up_proj")
        down = self._checked(names["down"], self._get(names["down"]), (H, I), "down_proj")
        return {"gate_up": np.concatenate([gate, up]), "down": down}
