"""The served recirculation operator: zonal, linear, O(n) memory and O(n) per product.

    D[i, j] = a_i * b_j * (W[z_i, z_j] + m[z_i])          T_in = T_sup + D @ P

Servers are grouped into zones (racks); ``a_i`` is how strongly server i's inlet draws recirculated air
(its height in the rack, its rack's place in the row), ``b_j`` how much of server j's exhaust escapes over
the rack, ``W`` a sparse non-negative zone-to-zone coupling: each rack with its neighbours, the racks of its
own row and of the rows across the aisles within ``reach_m``. ``m`` is an optional room-wide term per
receiving zone (the part of the recirculated air that has mixed into the room before it comes back, drawn
in proportion to the whole room's escaped heat); the served default has none.

Physical assumptions (those of ``recirculation_from_geometry``, which is exactly this form with a full W):

- recirculation is local: the plume over a rack decays with horizontal distance (``horizontal_decay_m``,
  1.2 m = two racks), so a rack's inlets draw from the racks within ``reach_m`` only — default 5 decay
  lengths (6 m: ten racks either way along the row, fewer across the aisle), where the dense coupling has
  fallen to e^-5 = 0.7 % of a rack's own. The dense model's tail beyond the reach (under 1 % of a rack's
  recirculated heat in a long row) is folded into the near couplings (``far="fold"``): they are scaled up
  per receiving rack so that its rise at a uniform load is the dense model's exactly. The error is the
  tail's share of an uneven load; a load change beyond the reach does not move an inlet at all, so a hot
  inlet only restricts placements within reach of it. ``far="mean"`` keeps the tail as the room-wide
  ``m[r]`` instead (the mean far coupling, also exact at a uniform load): a little closer to the dense
  model at a shorter reach, but every placement then warms every inlet, as in the dense model;
- the vertical profile (top slots draw most) and the exhaust escape profile do not depend on the pair of
  racks, so they factor into ``a`` and ``b``;
- ``W`` and ``m`` are in K/W after the scale that makes the mean share of a server's heat that recirculates
  ``recirc_fraction`` — the dense model's scale, computed at the rack level.

The fit's error against the dense model is printed by ``bench/thermal_scale.py`` (docs/thermal.md). A room
that fits within the reach (the default 16-rack room: rows of 4.2 m) is the dense model exactly.

Costs, with R zones and M neighbours per zone: memory O(n + R*M); ``matvec`` O(n + R*M); a load change on
one server moves the rack-level rise of M zones (and the room-wide sum, O(1): ``RiseTracker.add``); the
exact headroom of every server from the rack-level state O(n + R*M). A dense matrix is the degenerate case
of one server per zone and all zones neighbours (``from_dense``): same code, O(n^2).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .recirculation import RoomGeometry, geometry_factors

FloatArray = NDArray[np.float64]
_CHUNK = 256  # zone rows at a time when a construction step is O(R^2) scalars: memory stays O(n)
REACH_DECAY_LENGTHS = 5.0  # default reach: the dense coupling is down to e^-5 = 0.7 % of a rack's own there


class ZonalRecirculation:
    """``D[i, j] = a_i b_j (W[z_i, z_j] + m[z_i])`` with W as padded neighbour lists; see the module docstring.

    ``zone`` (n,) zone of each server, ``a``/``b`` (n,) >= 0, ``nbr`` (R, M) int: the source zones that
    zone r's inlets draw from (-1 = padding), ``w`` (R, M) >= 0 their couplings (K/W before a and b),
    ``m`` >= 0 (scalar or (R,)) zone r's coupling to every zone, on top of W.
    """

    def __init__(self, zone: ArrayLike, a: ArrayLike, b: ArrayLike, nbr: ArrayLike, w: ArrayLike,
                 m: float | ArrayLike = 0.0, dense: FloatArray | None = None) -> None:
        self.zone = np.asarray(zone, dtype=np.intp)
        self.a = np.asarray(a, dtype=np.float64)
        self.b = np.asarray(b, dtype=np.float64)
        nbr = np.asarray(nbr, dtype=np.intp)
        w = np.asarray(w, dtype=np.float64)
        n = self.n = self.zone.shape[0]
        if self.zone.ndim != 1 or n < 1 or self.a.shape != (n,) or self.b.shape != (n,):
            raise ValueError(f"zone, a and b must be (n,) vectors with n >= 1, got {self.zone.shape}, "
                             f"{self.a.shape}, {self.b.shape}")
        if nbr.ndim != 2 or nbr.shape != w.shape:
            raise ValueError(f"nbr and w must be (zones, neighbours) arrays of one shape, got {nbr.shape}, {w.shape}")
        r = self.n_zones = nbr.shape[0]
        if self.zone.min() < 0 or self.zone.max() >= r:
            raise ValueError(f"zone must be in [0, {r}) (one nbr row per zone)")
        if nbr.size and (nbr.min() < -1 or nbr.max() >= r):
            raise ValueError(f"nbr must hold zone indices in [0, {r}) or -1 for padding")
        for name, v in (("a", self.a), ("b", self.b), ("w", w)):
            if not np.all(np.isfinite(v)) or np.any(v < 0):
                raise ValueError(f"{name} must be finite and >= 0")
        m = np.broadcast_to(np.asarray(m, dtype=np.float64), (r,)) if np.ndim(m) == 0 else np.asarray(m, float)
        if m.shape != (r,) or not np.all(np.isfinite(m)) or np.any(m < 0):
            raise ValueError(f"m must be a scalar or an ({r},) vector, finite and >= 0")
        srt = np.sort(np.where(nbr < 0, -1 - np.arange(nbr.shape[1]), nbr), axis=1)
        if np.any(srt[:, 1:] == srt[:, :-1]):
            raise ValueError("nbr must not list a zone twice in one row")
        self.m = np.append(m, 0.0)  # (R + 1,): the sentinel zone draws nothing
        self._dense = dense  # the matrix this operator was built from (from_dense), returned by to_dense
        # padding points at a sentinel zone R: no servers, no load, infinite slack
        pad = nbr < 0
        self.nbr = np.where(pad, r, nbr)
        self.w = np.where(pad, 0.0, w)
        # transpose: for source zone q, the receiving zones and their couplings (one placement's column)
        rows = np.repeat(np.arange(r), self.nbr.shape[1])[~pad.ravel()]
        cols = self.nbr.ravel()[~pad.ravel()]
        vals = self.w.ravel()[~pad.ravel()]
        order = np.lexsort((rows, cols))
        rows, cols, vals = rows[order], cols[order], vals[order]
        counts = np.bincount(cols, minlength=r)
        width = int(counts.max()) if counts.size and counts.max() > 0 else 1
        slot = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
        self.src_zones = np.full((r + 1, width), r, dtype=np.intp)
        self.src_w = np.zeros((r + 1, width))
        self.src_zones[cols, slot] = rows
        self.src_w[cols, slot] = vals
        # per zone: the largest and smallest positive a (an inlet's rise is a_i x its zone's rise)
        self.a_hi = np.zeros(r + 1)
        np.maximum.at(self.a_hi, self.zone, self.a)
        self.a_lo = np.full(r + 1, np.inf)
        pos = self.a > 0
        np.minimum.at(self.a_lo, self.zone[pos], self.a[pos])
        self._full = self._full_coupling() if self.nbr.shape[1] >= r > 0 else None
        # server_headroom's constants (the guard's check runs it every batch): the near-pair denominators
        # W[r, q] + m_r and where they and m, b are positive
        self._hd_src = self.src_zones[:r]
        self._hd_den = self.src_w[:r] + self.m[self._hd_src]
        self._hd_den_pos = self._hd_den > 0
        self._hd_m_pos = self.m[:r] > 0
        self._hd_b_pos = self.b > 0

    def _full_coupling(self) -> FloatArray | None:
        """W as an (R, R) matrix when every zone neighbours every zone: one BLAS product instead of a gather."""
        full = np.zeros((self.n_zones + 1, self.n_zones + 1))
        np.add.at(full, (np.repeat(np.arange(self.n_zones), self.nbr.shape[1]), self.nbr.ravel()), self.w.ravel())
        return full[: self.n_zones, : self.n_zones]

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, d: ArrayLike) -> ZonalRecirculation:
        """One server per zone, ``W = D``: the exact operator of any non-negative (n, n) matrix."""
        d = np.array(d, dtype=np.float64)
        n = d.shape[0]
        d.flags.writeable = False
        return cls(np.arange(n), np.ones(n), np.ones(n), np.tile(np.arange(n), (n, 1)), d, 0.0, dense=d)

    @classmethod
    def from_geometry(cls, geometry: RoomGeometry | None = None, reach_m: float | None = None,
                      far: str = "fold") -> ZonalRecirculation:
        """The zonal model of ``recirculation_from_geometry``'s room without its n x n matrix: racks are the zones
        and the racks within ``reach_m`` (default ``REACH_DECAY_LENGTHS`` x ``horizontal_decay_m``) their
        neighbours. With F_r = sum_{q far} K_rq B_q (rack r's far-field rise at a uniform load before a; K the
        dense coupling, ``B_q = sum_{j in q} b_j``): ``far="fold"`` gives the near pairs
        ``K_rq (1 + F_r / sum_{q near} K_rq B_q)`` and no far term; ``far="mean"`` gives them ``K_rq - m_r`` and
        every pair ``m_r = F_r / sum_{q far} B_q``. Either way rack r's rise at a uniform load is the dense
        model's. O(R^2) scalars in chunks of rows (R = racks), never more than O(n) memory."""
        g = geometry or RoomGeometry()
        reach = REACH_DECAY_LENGTHS * g.horizontal_decay_m if reach_m is None else float(reach_m)
        if not reach >= 0:
            raise ValueError(f"reach_m must be >= 0, got {reach_m!r}")
        if far not in ("mean", "fold"):
            raise ValueError(f"far must be 'mean' or 'fold', got {far!r}")
        rack, xr, yr, a, b = geometry_factors(g)
        r = g.n_racks
        a_sum = np.bincount(rack, weights=a, minlength=r)
        b_sum = np.bincount(rack, weights=b, minlength=r)
        # pass 1: the dense model's scale (mean column sum of the kernel) and the neighbour lists
        colsum, nbrs = 0.0, []
        for lo in range(0, r, _CHUNK):
            dist = np.hypot(xr[lo:lo + _CHUNK, None] - xr[None, :], yr[lo:lo + _CHUNK, None] - yr[None, :])
            colsum += float(a_sum[lo:lo + _CHUNK] @ np.exp(-dist / g.horizontal_decay_m) @ b_sum)
            nbrs.extend(np.flatnonzero(row <= reach) for row in dist)
        scale = g.recirc_fraction / (g.air_mass_flow_kg_s * g.cp_air) / (colsum / g.n_servers)
        # pass 2: per receiving rack, its far-field rise at a uniform load over the room's escaped heat
        m, phi = np.zeros(r), np.zeros(r)
        for lo in range(0, r, _CHUNK):
            dist = np.hypot(xr[lo:lo + _CHUNK, None] - xr[None, :], yr[lo:lo + _CHUNK, None] - yr[None, :])
            m[lo:lo + _CHUNK] = np.where(dist > reach, scale * np.exp(-dist / g.horizontal_decay_m), 0.0) @ b_sum
            phi[lo:lo + _CHUNK] = (dist > reach) @ b_sum
        # near pairs get W = K - m_r and every pair m_r: at a uniform load the far rise is m_r * phi_r, so
        # m_r is the b-weighted mean far coupling (0 when the reach covers the room)
        far_rise = m.copy()
        m = np.divide(m, phi, out=np.zeros(r), where=phi > 0)
        width = max(len(x) for x in nbrs)
        nbr = np.full((r, width), -1, dtype=np.intp)
        w = np.zeros((r, width))
        for i, q in enumerate(nbrs):
            nbr[i, : len(q)] = q
            kernel = scale * np.exp(-np.hypot(xr[i] - xr[q], yr[i] - yr[q]) / g.horizontal_decay_m)
            if far == "fold":  # no far coupling: the near ones scaled up to carry the far rise at a uniform load
                w[i, : len(q)] = kernel * (1.0 + far_rise[i] / float(kernel @ b_sum[q]))
            else:
                w[i, : len(q)] = np.maximum(kernel - m[i], 0.0)  # m[i] is a mean of farther, smaller couplings
        return cls(rack, a, b, nbr, w, 0.0 if far == "fold" else m)

    def head(self, n: int) -> ZonalRecirculation:
        """The operator of the first ``n`` servers (a partly filled room: empty slots draw nothing)."""
        if not 1 <= n <= self.n:
            raise ValueError(f"n must be in [1, {self.n}], got {n}")
        if n == self.n:
            return self
        nbr = np.where(self.nbr == self.n_zones, -1, self.nbr)
        dense = None if self._dense is None else self._dense[:n, :n]
        return ZonalRecirculation(self.zone[:n], self.a[:n], self.b[:n], nbr, self.w, self.m[:-1], dense)

    def with_self_coupling_scaled(self, zone: int, factor: float) -> ZonalRecirculation:
        """This room with zone `zone`'s inlets drawing `factor` times its own exhaust (a hot rack whose
        recirculation the geometry underestimates): the model sensor readings can contradict, in tests and
        bench/thermal_refit.py."""
        r = self.n_zones
        nbr = self.nbr[:r]
        w = self.w[:r].copy()
        w[zone, list(nbr[zone]).index(zone)] *= factor
        return ZonalRecirculation(self.zone, self.a, self.b, np.where(nbr == r, -1, nbr), w)

    # -- products ------------------------------------------------------------------------------------------
    def zone_sources(self, power: FloatArray) -> FloatArray:
        """(R + 1,) escaped heat per zone, sum of b_j P_j (the last entry is the padding sentinel, 0)."""
        return np.bincount(self.zone, weights=self.b * power, minlength=self.n_zones + 1)

    def zone_rise(self, q: FloatArray) -> FloatArray:
        """(R + 1,) near-field rise per zone before a: sum_q W[r, q] src_q (without the room-wide term)."""
        if self._full is not None:
            u = np.zeros(self.n_zones + 1)
            u[: self.n_zones] = self._full @ q[: self.n_zones]
            return u
        u = np.einsum("rm,rm->r", self.w, q[self.nbr])
        return np.append(u, 0.0)

    def matvec(self, power: ArrayLike) -> FloatArray:
        """``D @ P`` (K), O(n + R*M)."""
        q = self.zone_sources(np.asarray(power, dtype=np.float64))
        return self.a * (self.zone_rise(q) + self.m * q.sum())[self.zone]

    def rise_of(self, servers: ArrayLike, dp: ArrayLike) -> FloatArray:
        """``D[:, servers] @ dp``: the rise a few servers' power changes cause, O(n + len(servers) * M)."""
        servers = np.asarray(servers, dtype=np.intp)
        dq = self.b[servers] * np.asarray(dp, dtype=np.float64)
        u = np.zeros(self.n_zones + 1)
        for z, v in zip(self.zone[servers], dq, strict=True):
            u[self.src_zones[z]] += self.src_w[z] * v  # a zone appears once per list: no lost updates
        return self.a * (u + self.m * float(dq.sum()))[self.zone]

    def column(self, k: int) -> FloatArray:
        """``D[:, k]`` as a dense vector (tests, small rooms)."""
        return self.rise_of([k], [1.0])

    def column_sums(self) -> FloatArray:
        """``D.sum(axis=0)``: per source, the rise it adds over all inlets per watt (K/W), O(n + R*M)."""
        a_zone = np.bincount(self.zone, weights=self.a, minlength=self.n_zones + 1)
        per_zone = np.einsum("qm,qm->q", self.src_w, a_zone[self.src_zones])
        return self.b * (per_zone[self.zone] + float(a_zone @ self.m))

    def to_dense(self) -> FloatArray:
        """The (n, n) matrix (O(n^2): tests, the MILP of small rooms and the fit's reference only)."""
        if self._dense is not None:
            return self._dense
        full = self._full if self._full is not None else self._full_coupling()
        return self.a[:, None] * self.b[None, :] * (full[self.zone][:, self.zone] + self.m[self.zone][:, None])

    # -- headroom ------------------------------------------------------------------------------------------
    def headroom(self, rise: ArrayLike, limit: float) -> FloatArray:
        """Per server k, the extra watts k alone may draw before an inlet it heats has ``rise > limit``:
        ``min_i (limit - rise_i) / D[i, k]`` over the i with D[i, k] > 0 (inf if none), exact for any ``rise``."""
        slack = limit - np.asarray(rise, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.where(self.a > 0, slack / self.a, np.inf)
        s = np.full(self.n_zones + 1, np.inf)
        np.minimum.at(s, self.zone, per)
        return self.server_headroom(s)

    def server_headroom(self, s: FloatArray) -> FloatArray:
        """Headroom per server from the zone slacks ``s_r = min_{i in r} slack_i / a_i`` ((R + 1,), sentinel inf):
        ``min_r s_r / (b_k (W[r, z_k] + m_r))``, the near zones from the transposed lists, the others via m_r."""
        r = self.n_zones
        # np.divide(..., where=) divides only where the np.where form's condition holds: the same quotients
        near = np.divide(s[self._hd_src], self._hd_den, out=np.full(self._hd_den.shape, np.inf),
                         where=self._hd_den_pos).min(axis=1, initial=np.inf)
        far_ratio = np.divide(s[:r], self.m[:r], out=np.full(r, np.inf), where=self._hd_m_pos)
        # A zone with s_r > 0 that is near k gives s_r / (W + m_r) <= s_r / m_r (W >= 0): counting it among the far
        # ones as well does not change the min. A hot zone (s_r <= 0) must not: s_r / m_r < s_r / (W + m_r).
        ok = s[:r] > 0
        far = np.full(r, far_ratio[ok].min() if ok.any() else np.inf)
        hot = np.flatnonzero(~ok & np.isfinite(far_ratio))
        if hot.size:
            # for each k: the smallest hot ratio of a zone not near it — among the M + 1 smallest, one is not
            cand = hot[np.argsort(far_ratio[hot], kind="stable")[: self.src_zones.shape[1] + 1]]
            near_to = (self.src_zones[:r, :, None] == cand[None, None, :]).any(axis=1)
            far = np.minimum(far, np.where(near_to, np.inf, far_ratio[cand][None, :]).min(axis=1))
        near = np.minimum(near, far)
        return np.divide(near[self.zone], self.b, out=np.full(self.n, np.inf), where=self._hd_b_pos)

    def tracker(self, power: ArrayLike) -> RiseTracker:
        return RiseTracker(self, power)


class RiseTracker:
    """``D @ P`` kept up to date as servers' power changes: per zone, so one change costs O(M), not O(n).

    State: the escaped heat per zone q, the near-field rise per zone U = W q and the room's escaped heat
    g = sum(q); the rise of server i is ``a_i (U[z_i] + m[z_i] g)``. `set_power` recomputes P from the caller's truth and applies
    only the servers that changed; every `RESYNC_EVERY` changes it recomputes from scratch (no drift).
    """

    RESYNC_EVERY = 4096

    def __init__(self, op: ZonalRecirculation, power: ArrayLike) -> None:
        self.op = op
        self.resync(power)

    def resync(self, power: ArrayLike | None = None) -> None:
        if power is not None:
            self.power = np.array(power, dtype=np.float64)
            if self.power.shape != (self.op.n,):
                raise ValueError(f"power must have shape ({self.op.n},), got {self.power.shape}")
        self._q = self.op.zone_sources(self.power)
        self._u = self.op.zone_rise(self._q)
        self._g = float(self._q.sum())
        self._changes = 0
        self._rise: FloatArray | None = None

    def copy(self) -> RiseTracker:
        out = object.__new__(RiseTracker)
        out.__dict__.update(self.__dict__)
        out.power, out._q, out._u = self.power.copy(), self._q.copy(), self._u.copy()
        return out

    def add(self, k: int, dp: float) -> None:
        """Server k draws ``dp`` more watts: its zone's sources, the zones it heats and the room-wide term move."""
        op = self.op
        self.power[k] += dp
        dq = op.b[k] * dp
        z = op.zone[k]
        self._q[z] += dq
        self._u[op.src_zones[z]] += op.src_w[z] * dq  # padding lands on the sentinel zone
        self._g += dq
        self._rise = None
        self._changes += 1
        if self._changes >= self.RESYNC_EVERY:
            self.resync()

    def set_power(self, power: FloatArray) -> None:
        """Bring the state to ``power`` by the changed servers only (a full recompute if most changed)."""
        changed = np.flatnonzero(power != self.power)
        if changed.size * 4 > self.op.n:
            self.resync(power)
            return
        for k in changed:
            self.add(int(k), float(power[k] - self.power[k]))
        self.power[changed] = power[changed]  # exact, whatever the rounding of the sums

    def rise(self) -> FloatArray:
        """``D @ P`` per server (K), O(n) once per change."""
        if self._rise is None:
            self._rise = self.op.a * (self._u + self.op.m * self._g)[self.op.zone]
        return self._rise

    def max_rise(self) -> float:
        """Largest inlet rise, O(R): a >= 0, so per zone it is the largest a times the zone's rise."""
        return float(np.max(self.op.a_hi[:-1] * (self._u[:-1] + self.op.m[:-1] * self._g)))

    def headroom(self, limit: float) -> FloatArray:
        """``op.headroom(self.rise(), limit)`` from the zone state: zone slacks in O(R), then O(n + R*M)."""
        op = self.op
        lo = op.a_hi if limit >= 0 else op.a_lo  # min_i limit / a_i over a zone's inlets
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(op.a_hi > 0, limit / lo - (self._u + op.m * self._g), np.inf)
        s[-1] = np.inf
        return op.server_headroom(s)
