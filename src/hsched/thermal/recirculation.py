"""Heat-recirculation matrix D (K/W): ``T_in = T_sup + D @ P`` — the dense reference model.

Rooms are served by its zonal form (hsched.thermal.zonal: the same kernel with racks as zones, couplings only
between racks within reach plus a fitted room-wide term, O(n) memory and work); this n x n matrix is what that
form is fitted to and checked against (bench/thermal_scale.py, docs/thermal.md).

``D[i, j]`` is the inlet temperature rise of server i per watt dissipated by server j. It is the
usual linear abstraction of a CFD room model (Tang et al., "abstract heat flow model"): in a
raised-floor room with ceiling return, a fraction of each server's hot exhaust does not reach the
return but spills over the top of the racks (and around row ends) into the cold aisle, where it is
drawn in mostly by the top slots of the same and nearby racks.

Geometry model (``recirculation_from_geometry``). Servers are indexed rack-major,
``i = rack * servers_per_rack + slot`` (slot 0 at the bottom); rack r stands in row
``r // racks_per_row`` at position ``r % racks_per_row``. For server i::

    x_i = position * rack_width_m                  (along the row)
    y_i = row * row_spacing_m                      (across the aisle)
    z_i = (slot + 0.5) * slot_height_m,  H = servers_per_rack * slot_height_m

and the kernel and matrix are::

    K[i, j] = exp(-hypot(x_i - x_j, y_i - y_j) / horizontal_decay_m)    nearby racks get more
            * exp(-(H - z_i) / vertical_decay_m)                          receivers near the rack top
            * (source_base + (1 - source_base) * z_j / H)                 high exhaust escapes more
            * (1 + row_end_boost * exp(-d_end_i / horizontal_decay_m))    air wraps round row ends
    D = recirc_fraction / (m_dot * c_p) * K / mean_j(sum_i K[i, j])

with ``d_end_i`` the distance of i's rack from the nearer end of its row. Because a receiver's inlet
mixes ``D[i, j] * m_dot * c_p`` of source j's heat, ``sum_i D[i, j] * m_dot * c_p`` is the fraction of
j's heat that recirculates instead of returning to the ACUs; the normalisation makes its mean over
sources equal ``recirc_fraction`` (0.2 by default; individual sources stay well below 1).

With the defaults (16 racks as 2 rows of 8, 42 slots, m_dot = 0.03 kg/s) and T_sup = 20 degC,
all servers at 300 W give inlets of 20.05 .. 30.3 degC and at 100 W 20.02 .. 23.4 degC; the
recirculated fraction per source ranges 0.11 .. 0.29.

Calibration (``calibrate_recirculation``) fits D from S samples by non-negative ridge least squares,
row by row ``min ||P d_i - (T_in,i - T_sup)||^2 + ridge' ||d_i||^2, d_i >= 0`` (all rows at once,
closed form first, then accelerated projected gradient if the constraint binds; NumPy only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

DEFAULT_AIR_MASS_FLOW_KG_S = 0.03  # ~53 CFM per 1U server: a 10 K rise across it at 300 W
CP_AIR_J_PER_KG_K = 1005.0


# The fields a fleet file may set per data center (`room:`, hsched.domain.fleet); the rest come from its layout
# (racks, rows, servers per rack, slot height) and thermal block (air flow, c_p).
ROOM_FIELDS = ("rack_width_m", "row_spacing_m", "horizontal_decay_m", "vertical_decay_m", "source_base",
               "row_end_boost", "recirc_fraction")


@dataclass(frozen=True)
class RoomGeometry:
    """Room layout and recirculation-model parameters (defaults: paper 003 setup, 16 x 42 1U)."""

    n_racks: int = 16
    racks_per_row: int = 8
    servers_per_rack: int = 42
    rack_width_m: float = 0.6  # centre-to-centre spacing of racks in a row
    row_spacing_m: float = 1.2  # front-to-front distance of rows sharing a cold aisle
    slot_height_m: float = 0.04445  # 1U
    horizontal_decay_m: float = 1.2  # ~2 racks: the recirculated plume stays local
    vertical_decay_m: float = 0.35  # bottom third of a rack sees little recirculated air
    source_base: float = 0.5  # relative escape of bottom exhaust vs top exhaust (1.0)
    row_end_boost: float = 0.5  # extra recirculation at the racks on the ends of a row
    recirc_fraction: float = 0.2  # mean share of a server's heat that recirculates
    air_mass_flow_kg_s: float = DEFAULT_AIR_MASS_FLOW_KG_S
    cp_air: float = CP_AIR_J_PER_KG_K

    def __post_init__(self) -> None:
        for name in ("n_racks", "racks_per_row", "servers_per_rack"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in (
            "rack_width_m",
            "row_spacing_m",
            "slot_height_m",
            "horizontal_decay_m",
            "vertical_decay_m",
            "air_mass_flow_kg_s",
            "cp_air",
        ):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)!r}")
        if not 0.0 <= self.source_base <= 1.0:
            raise ValueError(f"source_base must be in [0, 1], got {self.source_base!r}")
        if not 0 <= self.row_end_boost < math.inf:
            raise ValueError(f"row_end_boost must be >= 0 and finite, got {self.row_end_boost!r}")
        if not 0.0 <= self.recirc_fraction < 1.0:
            raise ValueError(f"recirc_fraction must be in [0, 1), got {self.recirc_fraction!r}")

    @property
    def n_servers(self) -> int:
        return self.n_racks * self.servers_per_rack

    def server_coordinates(self) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
        """(x along the row, y across the aisle, z height of the slot centre) in metres, per server."""
        rack = np.repeat(np.arange(self.n_racks), self.servers_per_rack)
        slot = np.tile(np.arange(self.servers_per_rack), self.n_racks)
        x = (rack % self.racks_per_row) * self.rack_width_m
        y = (rack // self.racks_per_row) * self.row_spacing_m
        z = (slot + 0.5) * self.slot_height_m
        return x.astype(np.float64), y.astype(np.float64), z


def geometry_factors(
    g: RoomGeometry,
) -> tuple[NDArray[np.intp], NDArray[np.float64], NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """(rack of each server, x and y of each rack, receiver factor a_i, source factor b_j): the kernel is
    ``K[i, j] = exp(-dist(rack_i, rack_j) / horizontal_decay_m) * a_i * b_j`` (module docstring)."""
    height = g.servers_per_rack * g.slot_height_m
    rack = np.repeat(np.arange(g.n_racks), g.servers_per_rack)
    z = (np.tile(np.arange(g.servers_per_rack), g.n_racks) + 0.5) * g.slot_height_m
    racks = np.arange(g.n_racks)
    pos = racks % g.racks_per_row
    xr = (pos * g.rack_width_m).astype(np.float64)
    yr = ((racks // g.racks_per_row) * g.row_spacing_m).astype(np.float64)
    # the last row may be shorter when n_racks is not a multiple of racks_per_row
    row_len = np.minimum(g.racks_per_row, g.n_racks - (racks // g.racks_per_row) * g.racks_per_row)
    d_end = (np.minimum(pos, row_len - 1 - pos) * g.rack_width_m)[rack]
    receiver = np.exp(-(height - z) / g.vertical_decay_m) * (
        1.0 + g.row_end_boost * np.exp(-d_end / g.horizontal_decay_m)
    )
    source = g.source_base + (1.0 - g.source_base) * z / height
    return rack, xr, yr, receiver, source


def recirculation_from_geometry(geometry: RoomGeometry | None = None) -> NDArray[np.float64]:
    """Build the n x n recirculation matrix D (K/W) from the layout; see the module docstring. The dense
    reference: rooms are served by its zonal form (hsched.thermal.zonal), O(n) instead of O(n^2)."""
    g = geometry or RoomGeometry()
    rack, xr, yr, receiver, source = geometry_factors(g)
    x, y = xr[rack], yr[rack]
    horizontal = np.exp(-np.hypot(x[:, None] - x[None, :], y[:, None] - y[None, :]) / g.horizontal_decay_m)
    kernel = horizontal * receiver[:, None] * source[None, :]
    scale = g.recirc_fraction / (g.air_mass_flow_kg_s * g.cp_air) / kernel.sum(axis=0).mean()
    return kernel * scale


class Calibration(NamedTuple):
    d: NDArray[np.float64]  # fitted recirculation matrix (K/W), non-negative
    rmse_k: float  # root-mean-square inlet residual over all samples and servers (K)


def calibrate_recirculation(
    powers: ArrayLike,
    inlet_temps: ArrayLike,
    t_supply: ArrayLike,
    ridge: float = 1e-9,
    max_iter: int = 500,
    tol: float = 1e-7,
) -> Calibration:
    """Fit a non-negative D from S samples: ``powers`` (S, n) W, ``inlet_temps`` (S, n) degC and
    ``t_supply`` (scalar or (S,)) degC.

    ``ridge`` is relative: the penalty is ``ridge * trace(P^T P) / n`` so it is unit-free. With
    ``ridge == 0`` at least n samples are needed; with ridge > 0 any S >= 1 gives a (regularised) fit.
    ``max_iter``/``tol`` bound the projected-gradient refinement, used only when the closed-form fit
    has negative entries (672 servers, 1 500 noisy samples: ~5 s, RMSE within 0.1 % of 2 000 iterations).
    """
    p = np.asarray(powers, dtype=np.float64)
    t_in = np.asarray(inlet_temps, dtype=np.float64)
    t_sup = np.asarray(t_supply, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 1:
        raise ValueError(f"powers must be a 2-D (samples, servers) array, got shape {p.shape}")
    s, n = p.shape
    if t_in.shape != p.shape:
        raise ValueError(f"inlet_temps must have the shape of powers {p.shape}, got {t_in.shape}")
    if t_sup.ndim > 1 or (t_sup.ndim == 1 and t_sup.shape[0] != s):
        raise ValueError(f"t_supply must be a scalar or a ({s},) vector, got shape {t_sup.shape}")
    if not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge!r}")
    if ridge == 0 and s < n:
        raise ValueError(f"powers: need at least n={n} samples when ridge == 0, got {s}")
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(t_in)) and np.all(np.isfinite(t_sup))):
        raise ValueError("powers, inlet_temps and t_supply must be finite")

    rise = t_in - (t_sup[:, None] if t_sup.ndim == 1 else t_sup)  # (S, n)
    # Jacobi scaling (column norms) keeps the problem well scaled; d >= 0 is invariant under it
    col = np.linalg.norm(p, axis=0)
    col[col == 0] = 1.0
    ps = p / col
    gram = ps.T @ ps
    gram[np.diag_indices(n)] += ridge * np.trace(gram) / n
    rhs = ps.T @ rise  # (n, n): column i is the right-hand side of row i of D
    try:
        d = np.linalg.solve(gram, rhs).T
    except np.linalg.LinAlgError:
        d = np.linalg.lstsq(gram, rhs, rcond=None)[0].T
    if d.min() < 0:
        d = _nonneg_rows(gram, rhs.T, np.maximum(d, 0.0), max_iter, tol)
    d = d / col[None, :]
    rmse = float(np.sqrt(np.mean((p @ d.T - rise) ** 2)))
    return Calibration(d, rmse)


def _nonneg_rows(
    gram: NDArray[np.float64], rhs: NDArray[np.float64], d0: NDArray[np.float64], max_iter: int, tol: float
) -> NDArray[np.float64]:
    """FISTA on all rows at once: minimise 0.5 d G d^T - rhs d^T per row, subject to d >= 0."""
    step = 1.0 / np.linalg.eigvalsh(gram)[-1]
    d, y, t = d0, d0.copy(), 1.0
    for _ in range(max_iter):
        d_new = np.maximum(y - step * (y @ gram - rhs), 0.0)
        t_new = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * t * t))
        y = d_new + ((t - 1.0) / t_new) * (d_new - d)
        done = np.linalg.norm(d_new - d) <= tol * max(np.linalg.norm(d_new), 1e-300)
        d, t = d_new, t_new
        if done:
            break
    return d
