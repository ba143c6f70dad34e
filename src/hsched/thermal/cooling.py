"""CRAC/ACU cooling and PUE.

    CoP(T_sup) = 0.0068 T^2 + 0.0008 T + 0.458      (HP Labs chilled-water CRAC, T in degC)
    P_cooling  = P_IT / CoP(T_sup)
    PUE        = (P_IT + P_cooling + P_other) / P_IT

A warmer supply makes the CRAC more efficient, which is why keeping the hottest inlet just at the
redline (instead of over-cooling the whole room for one hot spot) lowers PUE.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def cop(t_supply_c: ArrayLike) -> float | np.ndarray:
    """Coefficient of performance of the CRAC at supply temperature ``t_supply_c`` (degC)."""
    if isinstance(t_supply_c, float):  # a room's state (the guard: twice a batch): the same float operations
        return float(0.0068 * t_supply_c * t_supply_c + 0.0008 * t_supply_c + 0.458)
    t = np.asarray(t_supply_c, dtype=np.float64)
    out = 0.0068 * t * t + 0.0008 * t + 0.458
    return float(out) if out.ndim == 0 else out


def cooling_power(p_it_w: ArrayLike, t_supply_c: ArrayLike) -> float | np.ndarray:
    """Electrical power (W) the CRAC needs to remove ``p_it_w`` watts of heat."""
    if isinstance(p_it_w, float) and isinstance(t_supply_c, float):
        return float(p_it_w / cop(t_supply_c))
    out = np.asarray(p_it_w, dtype=np.float64) / cop(t_supply_c)
    return float(out) if out.ndim == 0 else out


def pue(p_it: ArrayLike, p_cooling: ArrayLike, p_other: ArrayLike = 0.0) -> float | np.ndarray:
    """Power usage effectiveness; ``p_it`` must be > 0 (PUE is undefined for an unpowered room)."""
    if isinstance(p_it, float) and isinstance(p_cooling, float) and isinstance(p_other, float):
        if not p_it > 0:
            raise ValueError(f"p_it must be > 0 W, got {p_it!r}")
        return float((p_it + p_cooling + p_other) / p_it)
    it = np.asarray(p_it, dtype=np.float64)
    if np.any(~(it > 0)):
        raise ValueError(f"p_it must be > 0 W, got {p_it!r}")
    out = (it + np.asarray(p_cooling, dtype=np.float64) + np.asarray(p_other, dtype=np.float64)) / it
    return float(out) if out.ndim == 0 else out
