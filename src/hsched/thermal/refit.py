"""Online recalibration of a room's recirculation model from sensor scans (pure NumPy; the Redis side is
hsched.thermal.published, the loop the thermal service runs).

The served operator is ``D[i, j] = a_i b_j W[z_i, z_j]`` (hsched.thermal.zonal). The receiver and source
profiles ``a``, ``b`` come from the geometry and stay; what the scans refit is the zone coupling ``W``. With
``q_r = sum_{j in r} b_j P_j`` a zone's escaped heat and ``u_r`` its rise before ``a`` (the least-squares
value over its servers, ``sum a_i rise_i / sum a_i^2``), the model says ``u = W q`` per scan: exactly the
dense problem of ``calibrate_recirculation`` one level up, so that fit (non-negative ridge least squares) is
used as is, on zones instead of servers. A dense model (``ZonalRecirculation.from_dense``: one server per
zone, a = b = 1) is the case of one server per zone: the same code fits the full n x n matrix.

The fitted W is kept on the model's neighbour lists (the couplings within reach); what the fit puts on pairs
beyond the reach is dropped (the served model has no far coupling either). A candidate is rejected when the
scans cannot determine it (the zone sources' Gram matrix, column-scaled as in the fit, has a condition number
above ``max_condition``: a zone that never dissipates, loads that never vary) or when it predicts held-out
scans no better than the current model (its inlet RMSE must be below ``(1 - min_gain)`` times the current one,
and the per-scan improvement ``min_t`` standard errors from zero). The fit is pulled towards the current model
by ``prior_weight`` scans' worth of pseudo-scans of it (``prior_scans``): what the scans do not determine (a
steady load determines only ``W @ q_mean``) stays as it was instead of becoming whatever the noise says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .recirculation import calibrate_recirculation
from .zonal import ZonalRecirculation

FloatArray = NDArray[np.float64]
MAX_CONDITION = 1e8
MIN_SCANS = 20  # five held out at least
MIN_GAIN = 0.05  # a new version must cut the held-out inlet RMSE by at least 5 %
HOLDOUT_EVERY = 4  # every 4th scan (by arrival) is held out of the fit and judges it
RIDGE = 1e-6  # relative, as calibrate_recirculation's
PRIOR_WEIGHT = 0.01  # the current model weighs as a hundredth of a scan (prior_scans; bench/thermal_refit.py)
MIN_T = 3.0  # the held-out improvement must be this many standard errors from zero (per-scan paired)


@dataclass(frozen=True)
class Scans:
    """S complete scans of one room: per scan and server the power (W) and the inlet rise over the supply (K)."""

    power_w: FloatArray  # (S, n)
    rise_k: FloatArray  # (S, n)

    @classmethod
    def from_readings(cls, supply_c: FloatArray, inlet_c: FloatArray, outlet_c: FloatArray, metered_w: FloatArray,
                      k_per_w: float) -> Scans:
        """From (S,) supplies and (S, n) inlets, outlets and metered powers (NaN = not metered: the energy
        balance ``(T_out - T_in) / k_per_w``, k_per_w = 1 / (m_dot c_p))."""
        balance = (outlet_c - inlet_c) / k_per_w
        power = np.where(np.isnan(metered_w), balance, metered_w)
        return cls(np.maximum(power, 0.0), inlet_c - supply_c[:, None])

    def split(self, every: int = HOLDOUT_EVERY) -> tuple[Scans, Scans]:
        """(fit, held out): every ``every``-th scan is held out."""
        held = np.zeros(len(self.power_w), dtype=bool)
        held[every - 1::every] = True
        return Scans(self.power_w[~held], self.rise_k[~held]), Scans(self.power_w[held], self.rise_k[held])


def zone_data(op: ZonalRecirculation, scans: Scans) -> tuple[FloatArray, FloatArray]:
    """(q, u), each (S, R): the zones' escaped heat per scan and their rise before ``a`` (least squares over a
    zone's servers; a zone whose servers all have a = 0 draws nothing and gets 0)."""
    r = op.n_zones
    q = np.stack([np.bincount(op.zone, weights=op.b * p, minlength=r) for p in scans.power_w])
    a2 = np.bincount(op.zone, weights=op.a * op.a, minlength=r)
    num = np.stack([np.bincount(op.zone, weights=op.a * rise, minlength=r) for rise in scans.rise_k])
    u = np.divide(num, a2, out=np.zeros_like(num), where=a2 > 0)
    return q, u


def condition(q: FloatArray) -> float:
    """The condition number of the fit's column-scaled Gram matrix (inf when a zone never dissipates)."""
    col = np.linalg.norm(q, axis=0)
    if np.any(col == 0):
        return float("inf")
    qs = q / col
    return float(np.linalg.cond(qs.T @ qs))


def coupling(op: ZonalRecirculation) -> FloatArray:
    """The (R, R) zone coupling ``W + m`` (zone r's rise before a per watt of zone q's escaped heat)."""
    return op._full_coupling() + op.m[: op.n_zones, None]


def prior_scans(op: ZonalRecirculation, q: FloatArray, weight: float) -> tuple[FloatArray, FloatArray]:
    """R pseudo-scans saying what ``op`` says: zone k alone dissipating ``lam_k`` gives rises ``W[:, k] lam_k``.
    With ``lam_k^2 = weight * mean_s q_sk^2`` they weigh as ``weight`` real scans: appended to the data, they
    pull the fit towards ``op`` in the directions the scans do not determine (a steady load determines only
    ``W @ q_mean``), and the least-squares fit stays ``calibrate_recirculation`` unchanged (non-negative)."""
    r = op.n_zones
    energy = np.mean(q * q, axis=0) if len(q) else np.zeros(r)
    if not np.any(energy > 0):
        energy = np.ones(r)
    lam = np.sqrt(weight * np.where(energy > 0, energy, energy[energy > 0].mean()))
    return np.diag(lam), (coupling(op) * lam[None, :]).T


def fit(op: ZonalRecirculation, scans: Scans, ridge: float = RIDGE, prior_weight: float = PRIOR_WEIGHT
        ) -> ZonalRecirculation:
    """The operator with W refitted to the scans (``calibrate_recirculation`` on zones, with ``prior_weight``
    scans' worth of ``op`` itself: ``prior_scans``), on ``op``'s profiles and neighbour lists."""
    q, u = zone_data(op, scans)
    if prior_weight > 0:
        qp, up = prior_scans(op, q, prior_weight)
        q, u = np.vstack([q, qp]), np.vstack([u, up])
    w_full = calibrate_recirculation(q, u, 0.0, ridge=ridge).d  # (R, R): row r = what zone r's inlets draw
    r = op.n_zones
    nbr = op.nbr[:r]
    pad = nbr == r  # the sentinel zone
    w = np.where(pad, 0.0, w_full[np.arange(r)[:, None], np.where(pad, 0, nbr)])
    dense = None
    if op._dense is not None:  # a dense room stays dense: one server per zone, every zone a neighbour
        dense = np.zeros((r, r))
        dense[np.repeat(np.arange(r), nbr.shape[1])[~pad.ravel()], nbr[~pad]] = w[~pad]
        dense.flags.writeable = False
    return ZonalRecirculation(op.zone, op.a, op.b, np.where(pad, -1, nbr), w, 0.0, dense=dense)


def rmse_k(op: ZonalRecirculation, scans: Scans) -> float:
    """Root-mean-square inlet error (K) of the model over the scans' servers."""
    pred = np.stack([op.matvec(p) for p in scans.power_w])
    return float(np.sqrt(np.mean((pred - scans.rise_k) ** 2)))


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str  # "" | ill_conditioned | not_better | too_few_scans
    detail: str  # one line for the log
    model: ZonalRecirculation | None = None
    condition: float = float("nan")
    rmse_current_k: float = float("nan")
    rmse_new_k: float = float("nan")
    scans: int = 0


def paired_t(current: ZonalRecirculation, new: ZonalRecirculation, held: Scans) -> float:
    """How many standard errors the per-scan drop in mean squared inlet error (current minus new) is from 0 over
    the held-out scans (a scan's servers share its supply reading: the scan is the unit, not the server)."""
    d = np.array([np.mean((current.matvec(p) - r) ** 2) - np.mean((new.matvec(p) - r) ** 2)
                  for p, r in zip(held.power_w, held.rise_k, strict=True)])
    if len(d) < 2:
        return float("nan")
    se = float(np.std(d, ddof=1)) / np.sqrt(len(d))
    return float(np.mean(d)) / se if se > 0 else (float("inf") if np.mean(d) > 0 else 0.0)


def recalibrate(current: ZonalRecirculation, scans: Scans, min_scans: int = MIN_SCANS,
                max_condition: float = MAX_CONDITION, min_gain: float = MIN_GAIN, holdout_every: int = HOLDOUT_EVERY,
                ridge: float = RIDGE, prior_weight: float = PRIOR_WEIGHT, min_t: float = MIN_T) -> Verdict:
    """Fit on the scans not held out; accept only a well-conditioned fit that beats ``current`` on the held-out
    scans by ``min_gain`` and significantly (``min_t`` standard errors, ``paired_t``)."""
    s = len(scans.power_w)
    if s < max(min_scans, holdout_every):
        return Verdict(False, "too_few_scans", f"{s} complete scans, {max(min_scans, holdout_every)} needed", scans=s)
    train, held = scans.split(holdout_every)
    cond = condition(zone_data(current, train)[0])
    if not cond <= max_condition:
        return Verdict(False, "ill_conditioned", f"the scans' zone loads do not determine the couplings "
                       f"(condition number {cond:.3g} > {max_condition:.3g}: the load has not varied enough)",
                       condition=cond, scans=s)
    new = fit(current, train, ridge, prior_weight)
    before, after = rmse_k(current, held), rmse_k(new, held)
    t = paired_t(current, new, held)
    if not (after < (1.0 - min_gain) * before and t >= min_t):
        return Verdict(False, "not_better", f"held-out inlet RMSE {after:.4f} K vs {before:.4f} K for the current "
                       f"model (needs < {(1 - min_gain) * before:.4f} K, and an improvement {min_t:g} standard "
                       f"errors from 0 over the {len(held.power_w)} held-out scans: {t:.2f})",
                       None, cond, before, after, s)
    return Verdict(True, "", f"held-out inlet RMSE {after:.4f} K vs {before:.4f} K for the current model",
                   new, cond, before, after, s)


# -- the published form ---------------------------------------------------------------------------------------

def to_json(op: ZonalRecirculation) -> str:
    """The operator as published (every array, so a placer needs nothing else to rebuild it)."""
    r = op.n_zones
    nbr = np.where(op.nbr[:r] == r, -1, op.nbr[:r])
    return json.dumps({"n": op.n, "zone": op.zone.tolist(), "a": op.a.tolist(), "b": op.b.tolist(),
                       "nbr": nbr.tolist(), "w": op.w[:r].tolist(), "m": op.m[:r].tolist(),
                       "dense": op._dense is not None}, separators=(",", ":"))


def from_json(text: str | bytes) -> ZonalRecirculation:
    """The operator of ``to_json`` (ValueError when it is not one)."""
    try:
        p = json.loads(text)
        op = ZonalRecirculation(p["zone"], p["a"], p["b"], p["nbr"], p["w"], p["m"])
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a published recirculation model ({exc})") from None
    if p.get("dense"):
        return ZonalRecirculation.from_dense(op.to_dense())
    return op
