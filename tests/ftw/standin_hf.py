"""Test-only stand-in for ``ftjax.ftw.hf.HFCheckpoint`` (docs/internals.md), used by conftest.py
only while the real module does not exist. Reads the tiny checkpoints of tiny_hf.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ftjax.config import load_hf_config
from tiny_hf import hf_name, read_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class HFCheckpoint:
    def __init__(self, path):
        self.path = Path(path)
        self.config = load_hf_config(self.path)
        self.prefix = "model.language_model." if self.config.model_type == "qwen3_5_moe" else "model."
        index = self.path / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
        self._tensors = {}
        for f in files:
            self._tensors.update(read_safetensors(self.path / f))
        self.tokenizer_files = [self.path / f for f in TOKENIZER_FILES if (self.path / f).exists()]
        self.source = {"dir": str(self.path), "files": files}

    def dense_tensors(self):
        from ftjax.models.params import param_shapes

        for name, shape in param_shapes(self.config).items():
            yield name, np.asarray(self._tensors[hf_name(name, self.prefix)]).reshape(shape)

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        p = f"{self.prefix}layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in self._tensors:
            return {"gate_up": np.asarray(self._tensors[p + "gate_up_proj"][e]),
                    "down": np.asarray(self._tensors[p + "down_proj"][e])}
        gate, up = self._tensors[f"{p}{e}.gate_proj.weight"], self._tensors[f"{p}{e}.up_proj.weight"]
        return {"gate_up": np.concatenate([gate, up]), "down": np.asarray(self._tensors[f"{p}{e}.down_proj.weight"])}
