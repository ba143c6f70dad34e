"""Server power model (paper 003, eq.5) plus an optional per-card GPU term.

    P_server = P_idle + (P_full - P_idle) * busy_cores / total_cores          (eq.5)
    P_gpu    = gpu_count * P_gpu_idle + (P_gpu_full - P_gpu_idle) * sum_c busy_c

``busy_c`` is the busy fraction (0..1) of card c, so the GPU term only needs the per-server sum
of those fractions. Everything is elementwise on NumPy arrays (scalars broadcast).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray


def server_power(
    busy_cores: ArrayLike, total_cores: ArrayLike, p_idle_w: ArrayLike, p_full_w: ArrayLike
) -> NDArray[np.float64]:
    """Eq.5, elementwise. A server with ``total_cores == 0`` has utilisation 0 (draws P_idle)."""
    busy = np.asarray(busy_cores, dtype=np.float64)
    total = np.asarray(total_cores, dtype=np.float64)
    # divide only where there are cores, so a core-less (e.g. GPU-only bookkeeping) server never yields nan
    util = np.divide(busy, total, out=np.zeros(np.broadcast(busy, total).shape), where=total > 0)
    p_idle = np.asarray(p_idle_w, dtype=np.float64)
    return p_idle + (np.asarray(p_full_w, dtype=np.float64) - p_idle) * util


def gpu_power(
    gpu_busy_fraction_sum: ArrayLike, gpu_count: ArrayLike, gpu_idle_w: ArrayLike, gpu_full_w: ArrayLike
) -> NDArray[np.float64]:
    """GPU power per server; a server with ``gpu_count == 0`` (and busy sum 0) adds 0 W."""
    idle = np.asarray(gpu_idle_w, dtype=np.float64)
    return np.asarray(gpu_count, dtype=np.float64) * idle + (
        np.asarray(gpu_full_w, dtype=np.float64) - idle
    ) * np.asarray(gpu_busy_fraction_sum, dtype=np.float64)
