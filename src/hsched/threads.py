"""One BLAS thread per serving process, set before numpy loads its BLAS.

OpenBLAS (numpy's wheels), MKL and OpenMP read their thread counts from the environment once, when the library
is loaded, i.e. when numpy or torch is first imported; numpy has no call to change it afterwards (threadpoolctl
has one, but is not a dependency). A service's decisions are matrix-vector products (the thermal guard's
recirculation matrix) and small matmuls: a second BLAS thread saves no wall time and its spin-waits take CPU
from the stack's other processes (bestfit with the thermal guard at 5,000 servers, bench/engine_cpu.py
--servers 5000 --blas-threads 1 vs 2: 1.2-1.3× the CPU per placement with two on a busy 2-core machine, 1.9×
in issue 16's measurement; docs/operations.md). So every service's `__main__` calls `serve_blas_on_one_thread` before it imports
anything else: that covers `hsched up` and compose, which both start `python -m services.<name>`. torch's own
intra-op threads are held by hsched.rl.checkpoint.serve_on_one_thread where a model is loaded.

This module must import nothing that imports numpy.
"""

from __future__ import annotations

import ctypes
import os

BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def serve_blas_on_one_thread() -> None:
    """Set the BLAS/OpenMP thread counts to 1 where the environment does not already set them (an operator's
    value wins). Effective only before numpy (or torch) is imported in this process."""
    for name in BLAS_THREAD_VARS:
        os.environ.setdefault(name, "1")


def openblas_threads() -> int | None:
    """The thread count of the OpenBLAS this process has loaded (numpy's wheels bundle one as scipy_openblas);
    None if none is loaded or it is not one whose count this knows how to ask (Linux only)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]})
    except OSError:
        return None
    for path in paths:
        lib = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                       "openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(lib, symbol):
                return int(getattr(lib, symbol)())
    return None
