"""Helpers the serving tests import (a module of its own: ``from conftest import`` finds whichever
test directory's conftest was imported first when several directories are collected together)."""
from __future__ import annotations

import time

from ftjax.serve.stubs import ServeUnavailableError, load

try:
    load()
    STUBS_ERROR = None
except ServeUnavailableError as e:  # grpc missing, or ftjax built without grpcio-tools
    STUBS_ERROR = str(e)

REAL_MAX_LEN = 128
REAL_SLOTS = 4


def wait_idle(client, timeout: float = 2.0) -> dict:
    """Stats once no slot is active and nothing is queued; fails after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s["active_slots"] == 0 and s["queued"] == 0:
            return s
        if time.monotonic() > end:
            raise AssertionError(f"slots still busy after {timeout}s: {s}")
        time.sleep(0.01)
