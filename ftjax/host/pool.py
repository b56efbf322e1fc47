"""``HostPool``: the routed-expert pool in host RAM, owned by the C++ runtime.

One 2 MiB-aligned allocation per bank (``gate_up [N, 2I, H]``, ``down [N, H, I]``, flat id
``l*E + e``), exposed as numpy views that the FTW loader fills in place; after the fill the pool is
pinned and device-mapped where a CUDA GPU is present, and never written again. FFI calls name the
pool by its integer ``id``.

``down_layout`` says how the down bank stores each expert's ``[H, I]`` matrix: ``"hi"`` as it is (torch's
orientation), ``"ih"`` transposed, ``[N, I, H]`` in memory (unit ``i``'s down column as a row: the unit
split's CPU window ``[u, I)`` is then whole rows, read in one pass with the same units' gate/up rows; f32 and
bf16 pools only). Either way ``bank("down")`` is the ``[N, H, I]`` matrix (for ``"ih"`` a strided view of
the transposed memory) and the GPU cache's slots hold ``[H, I]`` (the CUDA fills transpose).
"""
from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from ftjax import _host
from ftjax.host import quant

log = logging.getLogger(__name__)

FORMATS = ("f32", "bf16", "int4")
DOWN_LAYOUTS = ("hi", "ih")
_NP = {"f32": np.dtype(np.float32), "bf16": quant.BF16}
_FORMAT_OF_DTYPE = {np.dtype(np.float32): "f32", quant.BF16: "bf16"}


def format_of(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype not in _FORMAT_OF_DTYPE:
        raise ValueError(f"no host-pool format for dtype {dtype}; valid: float32, bfloat16 (or int4 by quantizing)")
    return _FORMAT_OF_DTYPE[dtype]


class HostPool:
    """Expert banks of one model in host memory. ``format`` is "f32", "bf16" or "int4"; ``down_layout``
    "hi" or "ih" (the module's docstring)."""

    def __init__(self, n_experts: int, hidden: int, inter: int, format: str = "bf16", down_layout: str = "hi"):
        if format not in FORMATS:
            raise ValueError(f"host pool format {format!r} unknown; valid: {FORMATS}")
        if down_layout not in DOWN_LAYOUTS:
            raise ValueError(f"down layout {down_layout!r} unknown; valid: {DOWN_LAYOUTS}")
        if format == "int4" and down_layout != "hi":
            raise ValueError("int4 pools keep down as [H, I] (its groups of 32 run along I): down_layout='ih' needs "
                             "an f32 or bf16 pool")
        self._h = _host.HostPool(int(n_experts), int(hidden), int(inter), format, down_layout)
        self.format = format
        self.down_layout = down_layout
        self.n_experts, self.hidden, self.inter = int(n_experts), int(hidden), int(inter)

    @property
    def id(self) -> int:
        return self._h.id

    @property
    def total_bytes(self) -> int:
        return self._h.total_bytes

    @property
    def pinned(self) -> bool:
        return self._h.pinned

    def expert_bytes(self, bank: str) -> int:
        return self._h.expert_bytes(bank)

    def shape(self, bank: str) -> tuple[int, int, int]:
        if bank == "gate_up":
            return (self.n_experts, 2 * self.inter, self.hidden)
        if bank == "down":
            return (self.n_experts, self.hidden, self.inter)
        raise KeyError(f"expert bank {bank!r} unknown; valid: gate_up, down")

    def stored_shape(self, bank: str) -> tuple[int, int, int]:
        """The bank's shape as it lies in memory: ``shape(bank)``, except a transposed down's ``[N, I, H]``."""
        n, rows, cols = self.shape(bank)
        return (n, cols, rows) if self._transposed(bank) else (n, rows, cols)

    def _transposed(self, bank: str) -> bool:
        return bank == "down" and self.down_layout == "ih"

    def raw(self, bank: str) -> np.ndarray:
        """Writable uint8 view ``[N, expert_bytes]`` (keeps the pool alive)."""
        self.shape(bank)
        return self._h.bank(bank)

    def bank(self, bank: str) -> np.ndarray:
        """Typed view ``[N, rows, cols]`` of an f32/bf16 bank (the FTW loader fills these); a transposed down's
        is a strided view (``stored(bank)`` is the memory as it lies)."""
        view = self.stored(bank)
        return view.swapaxes(1, 2) if self._transposed(bank) else view

    def stored(self, bank: str) -> np.ndarray:
        """Typed, C-contiguous view ``stored_shape(bank)`` of an f32/bf16 bank."""
        if self.format == "int4":
            raise ValueError("int4 banks have no single typed view; use int4_parts(bank)")
        return self.raw(bank).view(_NP[self.format]).reshape(self.stored_shape(bank))

    def int4_parts(self, bank: str) -> tuple[np.ndarray, np.ndarray]:
        """Views ``(packed uint8 [N, rows, cols/2], scales bf16 [N, rows, cols/32])`` of an int4 bank."""
        if self.format != "int4":
            raise ValueError(f"int4_parts needs an int4 pool, this one is {self.format}")
        _, rows, cols = self.shape(bank)
        return quant.split_rows(self.raw(bank), rows, cols)

    def fill(self, banks: Mapping[str, np.ndarray]) -> "HostPool":
        """Copy float banks in (quantizing for an int4 pool); for tests and synthetic pools."""
        for name in ("gate_up", "down"):
            src = np.asarray(banks[name])
            if src.shape != self.shape(name):
                raise ValueError(f"bank {name!r} has shape {src.shape}, the pool expects {self.shape(name)}")
            if self.format == "int4":
                packed, scales = self.int4_parts(name)
                for lo in range(0, self.n_experts, 64):  # bounded temporaries
                    packed[lo:lo + 64], scales[lo:lo + 64] = quant.quantize_int4(src[lo:lo + 64])
            elif self._transposed(name):
                dst = self.stored(name)
                for lo in range(0, self.n_experts, 64):  # a blocked transpose, bounded temporaries
                    dst[lo:lo + 64] = src[lo:lo + 64].swapaxes(1, 2)
            else:
                self.bank(name)[...] = src
        return self

    @classmethod
    def from_banks(cls, banks: Mapping[str, np.ndarray], format: str | None = None,
                   down_layout: str = "hi") -> "HostPool":
        gu = np.asarray(banks["gate_up"])
        n, two_i, h = gu.shape
        return cls(n, h, two_i // 2, format or format_of(gu.dtype), down_layout).fill(banks)

    def allocator(self):
        """``alloc(bank, shape, dtype) -> view`` for ``ftjax.ftw.load.load_store(bank_allocator=...)`` (a transposed
        down's view is strided: the loader transposes each chunk into it)."""
        def alloc(name: str, shape, dtype) -> np.ndarray:
            if tuple(shape) != self.shape(name) or format_of(dtype) != self.format:
                raise ValueError(f"bank {name!r} of the store is {np.dtype(dtype)}{tuple(shape)}, the pool "
                                 f"holds {self.format}{self.shape(name)}")
            return self.bank(name)
        return alloc

    def page_backing(self) -> dict:
        """How the banks are backed, from ``/proc/self/smaps``: ``{"resident": bytes, "huge": bytes}``
        over the banks' address ranges (``huge``: transparent huge pages, ``AnonHugePages``). The
        pool asks for huge pages (``madvise``); whether it gets them is the OS's setting
        (``/sys/kernel/mm/transparent_hugepage/enabled``). Zeros where smaps cannot be read."""
        ranges = []
        for name in ("gate_up", "down"):
            view = self.raw(name)
            ranges.append((view.ctypes.data, view.ctypes.data + view.nbytes))
        return smaps_backing(ranges)

    def pin(self) -> None:
        """Register the filled pool as pinned, device-mapped memory (needs a CUDA build and GPU)."""
        self._h.pin()

    def pin_if_cuda(self) -> bool:
        """Pin when this build has CUDA and a GPU is visible; return whether it is pinned."""
        if not self.pinned and _host.cuda_built() and _host.cuda_device_count() > 0:
            self.pin()
        return self.pinned

    def close(self) -> None:
        """Unregister the pool id (FFI calls naming it then fail); memory is freed once no view is left."""
        self._h.close()

    def __repr__(self) -> str:
        return (f"HostPool(id={self.id}, n_experts={self.n_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"format={self.format!r}, down_layout={self.down_layout!r}, {self.total_bytes / 2**30:.2f} GiB, pinned={self.pinned})")


def smaps_backing(ranges, smaps: str = "/proc/self/smaps") -> dict:
    """``{"resident": bytes, "huge": bytes}`` of the mappings in ``smaps`` overlapping the address
    ``ranges`` ``[(lo, hi), ...]``, each mapping's figures scaled by its overlapped share."""
    total = {"resident": 0, "huge": 0}
    try:
        lines = open(smaps).read().splitlines()
    except OSError:
        return total
    share = 0.0
    for line in lines:
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header: "lo-hi perms ..."
            lo, hi = (int(v, 16) for v in head.split("-"))
            covered = sum(max(0, min(hi, b) - max(lo, a)) for a, b in ranges)
            share = covered / (hi - lo) if hi > lo else 0.0
        elif share and head in ("Rss:", "AnonHugePages:"):
            kib = int(line.split()[1])
            total["resident" if head == "Rss:" else "huge"] += int(kib * 1024 * share)
    return total


def load_store_into_pool(path, *, pin: bool = True, down_layout: str = "hi", **load_kwargs):
    """``ftjax.ftw.load_store`` with the expert banks read straight into a new ``HostPool`` (of ``down_layout``).

    The pool is pinned after the fill where a CUDA GPU is present (``pin``). Returns
    ``(LoadedModel, HostPool)``; ``LoadedModel.experts`` are views into the pool.
    """
    from ftjax.ftw.load import load_store, open_store

    _, man, cfg = open_store(path)
    dtypes = {man["experts"]["banks"][b]["dtype"] for b in ("gate_up", "down")}
    if len(dtypes) != 1:
        raise ValueError(f"expert banks of {path} have different dtypes {sorted(dtypes)}; a host pool holds one")
    fmt = format_of(np.dtype(quant.BF16 if dtypes == {"bfloat16"} else dtypes.pop()))
    pool = HostPool(cfg.num_layers * cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, fmt, down_layout)
    model = load_store(path, bank_allocator=pool.allocator(), **load_kwargs)
    if pin:
        pool.pin_if_cuda()
    return model, pool
