"""Serving processes hold numpy's BLAS to one thread (hsched.threads): set before numpy loads it, in every
service's __main__, unless the operator's environment says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsched.threads import BLAS_THREAD_VARS

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("placer", "thermal", "selector", "gateway")

# What a service's __main__ does, then the imports of the placer's and the thermal service's code (numpy, torch,
# the thermal model), then the thread count the loaded OpenBLAS reports.
PROBE = """
from hsched.threads import serve_blas_on_one_thread
serve_blas_on_one_thread()
import services.placer.server, services.thermal.server
import numpy as np
from hsched.threads import openblas_threads
np.ones((64, 64)) @ np.ones(64)
print(openblas_threads())
"""


def probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in BLAS_THREAD_VARS}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**clean, **env}, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_a_service_process_runs_one_blas_thread():
    assert probe() == "1"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenBLAS runs one thread anyway")
def test_the_operators_thread_count_wins():
    assert probe(OPENBLAS_NUM_THREADS="2") == "2"


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_sets_it_before_it_imports_anything_else(service):
    lines = [line for line in (ROOT / "services" / service / "__main__.py").read_text().splitlines() if line]
    assert lines[:2] == ["from hsched.threads import serve_blas_on_one_thread",
                         "serve_blas_on_one_thread()  # before anything imports numpy (hsched.threads)"]
