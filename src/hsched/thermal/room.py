"""One data-center room: power -> inlet/outlet temperatures -> CRAC supply, cooling power, PUE.

    P      = eq.5 (+ GPU term)                       per server, W
    T_in   = T_sup + D @ P                           D: recirculation operator, K/W (hsched.thermal.zonal)
    T_out  = T_in + P / (m_dot * c_p)                m_dot: air mass flow through one server
    T_sup  = params.t_supply_c                       supply_mode "fixed"
           = clip(redline - max(D @ P), t_min, t_max) supply_mode "redline" (warmest safe supply)
    P_cool = P_IT / CoP(T_sup),  P_other = p_other_fraction * P_IT,  PUE = (P_IT + P_cool + P_other) / P_IT

In redline mode, when even ``t_supply_min_c`` cannot keep the hottest inlet at the redline, the
state says so (``redline_exceeded`` and ``hot_servers``) instead of pretending.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .cooling import cooling_power, pue
from .power import gpu_power, server_power
from .recirculation import (
    CP_AIR_J_PER_KG_K,
    DEFAULT_AIR_MASS_FLOW_KG_S,
    RoomGeometry,
    recirculation_from_geometry,
)
from .zonal import RiseTracker, ZonalRecirculation

FloatArray = NDArray[np.float64]
_EPS_K = 1e-9  # redline comparisons: an inlet placed exactly at the redline is not "hot"


@dataclass(frozen=True)
class ThermalParams:
    t_supply_c: float = 20.0  # fixed-mode supply (paper 003: ACUs at 20 degC)
    supply_mode: str = "fixed"  # "fixed" | "redline"
    redline_c: float = 27.0  # ASHRAE recommended maximum inlet
    t_supply_min_c: float = 10.0  # redline-mode bounds of the CRAC set point
    t_supply_max_c: float = 27.0
    air_mass_flow_kg_s: float = DEFAULT_AIR_MASS_FLOW_KG_S  # per server
    cp_air: float = CP_AIR_J_PER_KG_K  # J/(kg K)
    p_other_fraction: float = 0.05  # lighting, UPS and distribution losses, as a share of IT power

    def __post_init__(self) -> None:
        if self.supply_mode not in ("fixed", "redline"):
            raise ValueError(f"supply_mode must be 'fixed' or 'redline', got {self.supply_mode!r}")
        for name in ("t_supply_c", "redline_c", "t_supply_min_c", "t_supply_max_c"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite temperature, got {getattr(self, name)!r}")
        if self.t_supply_min_c > self.t_supply_max_c:
            raise ValueError(
                f"t_supply_min_c must be <= t_supply_max_c, got {self.t_supply_min_c} > {self.t_supply_max_c}"
            )
        # supply air at or above the redline puts every inlet past it: the room could take no load at all
        coolest = ("t_supply_c", self.t_supply_c) if self.supply_mode == "fixed" else ("t_supply_min_c",
                                                                                        self.t_supply_min_c)
        if coolest[1] >= self.redline_c:
            raise ValueError(f"{coolest[0]} must be below redline_c ({self.redline_c}) in {self.supply_mode} supply "
                             f"mode: every inlet would pass the redline, got {coolest[1]}")
        for name in ("air_mass_flow_kg_s", "cp_air"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.p_other_fraction >= 0:
            raise ValueError(f"p_other_fraction must be >= 0, got {self.p_other_fraction!r}")


@dataclass(frozen=True)
class ThermalState:
    power_w: FloatArray  # per server
    inlet_c: FloatArray
    outlet_c: FloatArray
    t_supply_c: float
    it_power_w: float
    cooling_power_w: float
    other_power_w: float
    pue: float
    max_inlet_c: float
    hot_servers: NDArray[np.intp]  # indices with inlet > redline
    redline_exceeded: bool  # True when any inlet is above the redline (in redline mode: even at t_min)


def _per_server(value: ArrayLike, n: int, name: str) -> FloatArray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a scalar or have shape ({n},), got {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    return arr


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False  # ThermalState is immutable all the way down
    return arr


class RoomModel:
    """Vectorised thermal surrogate of one room with n servers.

    ``d`` is the recirculation operator: a ``ZonalRecirculation`` (rooms from a geometry: O(n) memory and
    per product) or any non-negative (n, n) matrix (its exact one-server-per-zone operator, O(n^2)).
    """

    def __init__(
        self,
        d: ArrayLike | ZonalRecirculation,
        params: ThermalParams | None = None,
        p_idle_w: ArrayLike = 100.0,
        p_full_w: ArrayLike = 300.0,
        total_cores: ArrayLike = 24,
        gpu_count: ArrayLike | None = None,
        gpu_idle_w: ArrayLike = 0.0,
        gpu_full_w: ArrayLike = 0.0,
    ) -> None:
        if not isinstance(d, ZonalRecirculation):
            dense = np.array(d, dtype=np.float64)
            if dense.ndim != 2 or dense.shape[0] != dense.shape[1] or dense.shape[0] < 1:
                raise ValueError(f"d must be a square (n, n) matrix, got shape {dense.shape}")
            if not np.all(np.isfinite(dense)) or np.any(dense < 0):
                raise ValueError("d must be finite and non-negative (K/W)")
            d = ZonalRecirculation.from_dense(dense)
        self.recirc = d
        n = self.n = d.n
        self.params = params or ThermalParams()
        self.p_idle_w = _per_server(p_idle_w, n, "p_idle_w")
        self.p_full_w = _per_server(p_full_w, n, "p_full_w")
        if np.any(self.p_full_w < self.p_idle_w):
            raise ValueError("p_full_w must be >= p_idle_w for every server")
        self.total_cores = _per_server(total_cores, n, "total_cores")
        self.gpu_count = _per_server(0 if gpu_count is None else gpu_count, n, "gpu_count")
        self.gpu_idle_w = _per_server(gpu_idle_w, n, "gpu_idle_w")
        self.gpu_full_w = _per_server(gpu_full_w, n, "gpu_full_w")
        self._k_per_w = 1.0 / (self.params.air_mass_flow_kg_s * self.params.cp_air)  # outlet rise per W
        # Eq.5 and the GPU term are affine in the load; their coefficients, from the formulas themselves,
        # let callers with valid loads skip the checks (`power_of`) and price a change per server in O(1).
        self.idle_power_w = self.power(np.zeros(n))
        self.watts_per_core = self.added_power_w(1.0)
        self.watts_per_gpu = gpu_power(1.0, 0.0, self.gpu_idle_w, self.gpu_full_w)  # per whole busy card

    @classmethod
    def from_geometry(
        cls, geometry: RoomGeometry | None = None, params: ThermalParams | None = None, *, dense: bool = False,
        reach_m: float | None = None, **servers: ArrayLike
    ) -> RoomModel:
        """Room whose D is the zonal model of the layout (``ZonalRecirculation.from_geometry``), or with
        ``dense`` the O(n^2) reference ``recirculation_from_geometry``; ``servers`` go to ``__init__``."""
        if dense:
            return cls(recirculation_from_geometry(geometry), params, **servers)
        return cls(ZonalRecirculation.from_geometry(geometry, reach_m), params, **servers)

    @property
    def d(self) -> FloatArray:
        """D as an (n, n) matrix: O(n^2), for small rooms (tests, the MILP of hsched.optimum) only."""
        return self.recirc.to_dense()

    def rise(self, power: FloatArray) -> FloatArray:
        """``D @ power`` (K): the inlet rise over the supply air, O(n) for a zonal room."""
        return self.recirc.matvec(power)

    def tracker(self, power: FloatArray) -> RiseTracker:
        """``D @ P`` maintained per load change (O(M) each) with its headroom: see ``RiseTracker``."""
        return self.recirc.tracker(power)

    @property
    def rise_limit_k(self) -> float:
        """The largest safe rise over the supply: redline minus the fixed supply, or in redline mode minus the
        coldest set point the CRAC can reach (below it the redline cannot be held)."""
        p = self.params
        return p.redline_c - (p.t_supply_c if p.supply_mode == "fixed" else p.t_supply_min_c)

    # -- power ---------------------------------------------------------------------------------
    def power(self, busy_cores: ArrayLike, gpu_busy: ArrayLike | None = None) -> FloatArray:
        """Per-server power (W); ``gpu_busy`` is the per-server sum of per-card busy fractions."""
        busy = _per_server(busy_cores, self.n, "busy_cores")
        if np.any(busy > self.total_cores):
            raise ValueError(
                f"busy_cores must be <= total_cores (server {int(np.argmax(busy > self.total_cores))})"
            )
        p = server_power(busy, self.total_cores, self.p_idle_w, self.p_full_w)
        gb = _per_server(0.0 if gpu_busy is None else gpu_busy, self.n, "gpu_busy")
        if np.any(gb > self.gpu_count):
            raise ValueError("gpu_busy must be <= gpu_count (a card is at most 100 % busy)")
        return p + gpu_power(gb, self.gpu_count, self.gpu_idle_w, self.gpu_full_w)

    def power_of(self, busy_cores: FloatArray, gpu_busy: FloatArray, nodes: NDArray[np.intp] | None = None) -> FloatArray:
        """``power()`` for loads known to be valid (folded from a ledger): no checks, four vector operations;
        with ``nodes``, the loads are those servers' (elementwise: the same floats as the full vector's there)."""
        if nodes is not None:
            return self.idle_power_w[nodes] + self.watts_per_core[nodes] * busy_cores + self.watts_per_gpu[nodes] * gpu_busy
        return self.idle_power_w + self.watts_per_core * busy_cores + self.watts_per_gpu * gpu_busy

    def added_power_w(self, cores: ArrayLike) -> FloatArray:
        """Extra watts each server would draw with ``cores`` more busy cores (eq.5 slope)."""
        c = np.broadcast_to(np.asarray(cores, dtype=np.float64), (self.n,))
        return server_power(c, self.total_cores, 0.0, self.p_full_w - self.p_idle_w)  # eq.5 above idle

    # -- thermal -------------------------------------------------------------------------------
    def _supply(self, max_rise: float) -> float:
        p = self.params
        if p.supply_mode == "fixed":
            return p.t_supply_c
        # warmest set point that keeps the hottest inlet at the redline: a warmer supply means a higher CoP
        return float(np.clip(p.redline_c - max_rise, p.t_supply_min_c, p.t_supply_max_c))

    def evaluate(self, busy_cores: ArrayLike, gpu_busy: ArrayLike | None = None) -> ThermalState:
        power = self.power(busy_cores, gpu_busy)
        return self.state_from(power, self.rise(power))

    def state_from(self, power: FloatArray, rise: FloatArray) -> ThermalState:
        """The state for per-server ``power`` (W, as from ``power()``) whose recirculation rise ``D @ power`` (K)
        the caller already has: an incremental caller (hsched.envs.dc, the guard) keeps it up to date per load
        change (``tracker``) instead of the full product. Inputs are not re-validated, and
        ``power`` becomes the state's read-only ``power_w`` (pass a copy of an array you keep writing)."""
        t_sup = self._supply(float(rise.max()))
        inlet = t_sup + rise
        outlet = inlet + power * self._k_per_w
        it = float(power.sum())
        cool = float(cooling_power(it, t_sup))
        other = self.params.p_other_fraction * it
        hot = np.flatnonzero(inlet > self.params.redline_c + _EPS_K)
        return ThermalState(
            power_w=_frozen(power),
            inlet_c=_frozen(inlet),
            outlet_c=_frozen(outlet),
            t_supply_c=t_sup,
            it_power_w=it,
            cooling_power_w=cool,
            other_power_w=other,
            pue=float(pue(it, cool, other)),
            max_inlet_c=float(inlet.max()),
            hot_servers=_frozen(hot),
            redline_exceeded=bool(hot.size),
        )

    def max_inlet_if_added(
        self, busy_cores: ArrayLike, extra_power_w_per_server: ArrayLike, gpu_busy: ArrayLike | None = None
    ) -> FloatArray:
        """For every candidate k: the room's max inlet (degC) if server k alone drew ``extra[k]`` more watts.

        ``out[k] = T_sup + max_i((D @ P)_i + D[i, k] * extra[k])``, one (n, n) pass. The supply
        temperature is the CURRENT one (that of ``evaluate(busy_cores)``): in fixed mode it never
        changes; in redline mode the CRAC would react by lowering it, so a value above the redline
        means "this placement would force colder supply air (higher cooling power)". O(n^2): small rooms.
        """
        power = self.power(busy_cores, gpu_busy)
        extra = np.broadcast_to(np.asarray(extra_power_w_per_server, dtype=np.float64), (self.n,))
        rise = self.rise(power)
        t_sup = self._supply(float(rise.max()))
        buf = np.multiply(self.d, extra[None, :])  # buf[i, k] = D[i, k] * extra[k]
        buf += rise[:, None]
        return t_sup + buf.max(axis=0)

    def headroom_w(self, busy_cores: ArrayLike, gpu_busy: ArrayLike | None = None) -> FloatArray:
        """For every server k: the extra watts k alone may draw before some inlet passes the redline.

        ``out[k] = min_i (redline - T_sup - (D @ P)_i) / D[i, k]`` over the i that k heats (D[i, k] > 0),
        with T_sup the fixed supply, or in redline mode the coldest set point the CRAC can reach (below
        it the redline cannot be held). Negative: some inlet k heats is already past the redline. The
        placer masks every server whose added power exceeds its headroom — exact for one placement;
        the placer re-checks a batch of placements together with ``predict``.
        """
        return self.headroom_for_rise(self.rise(self.power(busy_cores, gpu_busy)))

    def headroom_for_rise(self, rise: FloatArray) -> FloatArray:
        """``headroom_w`` for a state whose recirculation rise ``D @ P`` (K) the caller already has: O(n) zonal."""
        return self.recirc.headroom(rise, self.rise_limit_k)

    def predict(
        self,
        busy_cores: ArrayLike,
        delta_cores: Mapping[int, float] | ArrayLike,
        gpu_busy: ArrayLike | None = None,
        delta_gpu_busy: Mapping[int, float] | ArrayLike | None = None,
    ) -> ThermalState:
        """State after a hypothetical load change; deltas are {server: change} or per-server arrays."""
        busy = _per_server(busy_cores, self.n, "busy_cores") + self._delta(delta_cores, "delta_cores")
        if np.any(busy < 0) or np.any(busy > self.total_cores):
            raise ValueError("delta_cores must keep every server within 0 <= busy_cores <= total_cores")
        gb = None
        if gpu_busy is not None or delta_gpu_busy is not None:
            gb = _per_server(0.0 if gpu_busy is None else gpu_busy, self.n, "gpu_busy")
            if delta_gpu_busy is not None:
                gb = gb + self._delta(delta_gpu_busy, "delta_gpu_busy")
            if np.any(gb < 0) or np.any(gb > self.gpu_count):
                raise ValueError("delta_gpu_busy must keep every server within 0 <= gpu_busy <= gpu_count")
        return self.evaluate(busy, gb)

    def _delta(self, delta: Mapping[int, float] | ArrayLike, name: str) -> FloatArray:
        if isinstance(delta, Mapping):
            out = np.zeros(self.n)
            for k, v in delta.items():  # a placement touches a handful of servers, not n
                if not 0 <= int(k) < self.n:
                    raise ValueError(f"{name}: server index {k} out of range [0, {self.n})")
                out[int(k)] += float(v)
            return out
        arr = np.asarray(delta, dtype=np.float64)
        if arr.shape != (self.n,) or not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} must be a mapping or a finite ({self.n},) array, got shape {arr.shape}")
        return arr


def rack_outlet_mean(state: ThermalState, servers_per_rack: int) -> FloatArray:
    """Mean outlet temperature (degC) per rack; servers are indexed rack-major."""
    n = state.outlet_c.shape[0]
    if servers_per_rack < 1 or n % servers_per_rack:
        raise ValueError(f"servers_per_rack must be >= 1 and divide n={n}, got {servers_per_rack}")
    return state.outlet_c.reshape(-1, servers_per_rack).mean(axis=1)
