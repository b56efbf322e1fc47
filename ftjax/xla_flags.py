"""XLA options ftjax sets before JAX starts its backends (imported by ``ftjax/__init__`` ahead of jax).

The decode step is one CUDA graph (an XLA command buffer). Before each launch XLA re-records every
command whose buffers moved since the last launch, and its temp buffer (where most intermediates
live) moves between steps: on the H200 that re-recorded ~416 of 447 commands of an 8-layer step in
~1.4 ms of host time per step (RESULTS.md, session 6). ``--xla_gpu_command_buffer_update_mode=SKIP_TEMP``
gives the temp buffer a stable virtual address (XLA's VMM allocator, which it then uses for the whole
process): the same 8-layer step ran at 1.6x (lru-split) and 1.3x (lru-fill) the tokens/s of the
default mode (40 layers: within noise of an earlier default-mode run, not yet compared in one session;
the other moving buffers are what ``make_step_fns(stable_io=True)`` keeps in place).

``FTJAX_XLA_UPDATE_MODE`` chooses: ``SKIP_TEMP`` (default), ``SKIP_PROFILED`` or ``ALWAYS_UPDATE``
(XLA's default); ``off`` leaves XLA_FLAGS alone. A mode already in XLA_FLAGS always wins. jaxlib
builds before 0.11.2 are left alone (0.10.2 aborts on the unknown flag).

``FTJAX_XLA_CB_SCHEDULING`` sets ``--xla_gpu_command_buffer_scheduling_mode`` the same way: how XLA orders a
command buffer's commands. XLA's default, ``LHS``, runs them one after the other in its schedule's order;
``CONCURRENT`` makes a graph of them from their buffer conflicts, so commands that share no buffer run side by
side (what ``OffloadExperts(fill_beside=True)`` needs for its fill to run beside the GEMV); ``SERIALIZE``.
Default ``off``: XLA's own choice.
"""
from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

FLAG = "--xla_gpu_command_buffer_update_mode"
MODES = ("SKIP_TEMP", "SKIP_PROFILED", "ALWAYS_UPDATE")
ENV = "FTJAX_XLA_UPDATE_MODE"
DEFAULT_MODE = "SKIP_TEMP"
MIN_JAXLIB = (0, 11, 2)
SCHEDULING_FLAG = "--xla_gpu_command_buffer_scheduling_mode"
SCHEDULING_MODES = ("CONCURRENT", "LHS", "SERIALIZE")
SCHEDULING_ENV = "FTJAX_XLA_CB_SCHEDULING"
DEFAULT_SCHEDULING = "off"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def installed_jaxlib() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


def apply_update_mode(environ: MutableMapping[str, str] | None = None, jaxlib_version: str | None = None) -> str | None:
    """Add the command-buffer update mode to ``XLA_FLAGS`` in ``environ`` (default ``os.environ``).

    Returns the mode now in effect through XLA_FLAGS (the user's, or the one added), None when XLA is
    left at its default. Raises ValueError for an unknown ``FTJAX_XLA_UPDATE_MODE``.
    """
    return _apply(environ, jaxlib_version, FLAG, ENV, MODES, DEFAULT_MODE)


def apply_scheduling_mode(environ: MutableMapping[str, str] | None = None,
                          jaxlib_version: str | None = None) -> str | None:
    """``--xla_gpu_command_buffer_scheduling_mode`` from ``FTJAX_XLA_CB_SCHEDULING`` (as `apply_update_mode`):
    the mode in effect through XLA_FLAGS, None when XLA is left at its default."""
    return _apply(environ, jaxlib_version, SCHEDULING_FLAG, SCHEDULING_ENV, SCHEDULING_MODES, DEFAULT_SCHEDULING)


def _apply(environ, jaxlib_version, flag: str, env_name: str, modes: tuple, default: str) -> str | None:
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    m = re.search(re.escape(flag) + r"=(\w+)", flags)
    if m:
        return m.group(1)
    want = env.get(env_name, default).strip()
    if want.lower() == "off":
        return None
    if want not in modes:
        raise ValueError(f"{env_name}={want!r}: expected one of {modes} or 'off'")
    version = jaxlib_version if jaxlib_version is not None else installed_jaxlib()
    if version is None or _version_tuple(version) < MIN_JAXLIB:
        return None
    env["XLA_FLAGS"] = f"{flags} {flag}={want}".strip()
    return want
