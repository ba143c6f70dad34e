"""The redline guard: is a load change safe for the room? One rule, used by the placer before it commits
a batch (in-process, ``RoomGuard``) and by the thermal service's Predict.

A change is refused when it leaves some server's inlet past the redline *and* raised that inlet: a release
next to an already-hot server, or a placement elsewhere that does not heat it, is not refused for it.

Loads are integer milli-cores and GPU core-percent, as in the ledger, so sums stay exact (no 64.000001 > 64).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from hsched.domain.cluster import ClusterState, count_per_row, row_sums
from hsched.domain.resources import MILLI
from hsched.thermal.room import RoomModel, ThermalState
from hsched.thermal.zonal import RiseTracker

RISE_EPS_K = 1e-9


@dataclass(frozen=True, slots=True)
class LoadDelta:
    node: int
    cpu_milli: int
    gpu_busy: float  # whole-card equivalents


@dataclass(frozen=True, slots=True)
class ThermalCheck:
    ok: bool
    max_inlet_before_c: float
    max_inlet_after_c: float
    pue_before: float
    pue_after: float
    t_supply_c: float
    redline_c: float
    nodes_over_redline: tuple[int, ...] = ()
    headroom_w: np.ndarray | None = None  # per node, after the change (see RoomModel.headroom_w)
    headroom_exact: bool = True  # False: a conservative bound (never above the exact headroom)
    model_version: int = 0  # the room model's published version (0 = the fleet's default model)


def newly_hot(before: ThermalState, after: ThermalState) -> tuple[int, ...]:
    """Servers past the redline after the change whose inlet rise the change increased (the veto)."""
    rise_before = before.inlet_c - before.t_supply_c
    rise_after = after.inlet_c - after.t_supply_c
    return tuple(int(i) for i in after.hot_servers if rise_after[i] > rise_before[i] + RISE_EPS_K)


def shifted(cpu_milli: np.ndarray, gpu_percent: np.ndarray, deltas: Iterable[LoadDelta],
            sign: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Copies of the per-node loads with `deltas` added (sign=1) or taken away (sign=-1)."""
    cpu, gpu = cpu_milli.copy(), gpu_percent.copy()
    for d in deltas:
        cpu[d.node] += sign * d.cpu_milli
        gpu[d.node] += sign * round(d.gpu_busy * 100)
    return cpu, gpu


class RoomGuard:
    """The placer's pre-commit check, in-process: the DC's room model over the placer's own ClusterState.

    The placer is the single writer of its DC's ledger, so its state is the truth at every step of a batch;
    asking the thermal service instead would add a hop and a wait for that service to fold the ledger.
    ``check`` is called with the batch already folded into the state: ``deltas`` lead back to the ledger.

    The rise ``D @ P`` is kept by the room's ``RiseTracker``: each call recomputes P from the state (O(n), so
    it never drifts from the truth) and moves the rise by the servers whose power changed (O(M) each, M the
    zones a rack heats). The headroom it returns is always exact: from the zone state, O(n + R*M).
    """

    def __init__(self, room: RoomModel, state: ClusterState, version: int = 0) -> None:
        self.room = room
        self.state = state
        self.version = version  # the published model version `room` is (hsched.thermal.published)
        self._tracker: RiseTracker | None = None
        self._seen: tuple[np.ndarray, np.ndarray] | None = None  # the free CPU and GPU cores the tracker prices

    def _power(self) -> np.ndarray:
        s = self.state
        return self.room.power_of(s.busy_cpu() / MILLI, s.busy_gpu_percent() / 100.0)

    def _sync(self) -> RiseTracker:
        """The tracker at the state's power. Power is a function of a node's free CPU and GPU cores, so only the
        nodes where those moved since the last call are priced again (elementwise: the same floats as pricing
        all of them); at 5,000 GPU hosts that is a third of the check's cost saved."""
        s = self.state
        if self._tracker is None or self._seen is None:
            self._tracker = self.room.tracker(self._power())
            self._seen = (s.free_cpu.copy(), s.gpu_free_core.copy())
            return self._tracker
        cpu, gpu = self._seen
        moved = s.free_cpu != cpu
        if gpu.shape[1]:
            moved |= count_per_row(s.gpu_free_core != gpu) > 0
        nodes = np.flatnonzero(moved)
        if nodes.size:
            cpu[nodes], gpu[nodes] = s.free_cpu[nodes], s.gpu_free_core[nodes]
            t, room = s.table, self.room
            busy_gpu = row_sums(t.gpu_core_percent[nodes]) - row_sums(s.gpu_free_core[nodes])
            power = self._tracker.power.copy()  # == the last full price of every node (set_power keeps it exact)
            power[nodes] = room.power_of((t.cpu_milli[nodes] - s.free_cpu[nodes]) / MILLI, busy_gpu / 100.0, nodes)
            self._tracker.set_power(power)
        return self._tracker

    async def headroom(self, min_ledger_id: str = "") -> np.ndarray:
        return self._sync().headroom(self.room.rise_limit_k)

    async def now(self, min_ledger_id: str = "") -> ThermalCheck:
        """The room as the state holds it now (before = after; no headroom: a view, not a decision)."""
        power = self._power()
        s = self.room.state_from(power, self.room.rise(power))
        return ThermalCheck(True, s.max_inlet_c, s.max_inlet_c, s.pue, s.pue, s.t_supply_c, self.room.params.redline_c,
                            model_version=self.version)

    async def check(self, deltas: list[LoadDelta], min_ledger_id: str = "") -> ThermalCheck:
        room = self.room
        tracker = self._sync()
        power, rise = tracker.power.copy(), tracker.rise()
        # The state before differs on the changed nodes only, priced with eq.5's slopes.
        change = np.zeros(room.n)
        for d in deltas:
            change[d.node] += (room.watts_per_core[d.node] * d.cpu_milli / MILLI
                               + room.watts_per_gpu[d.node] * round(d.gpu_busy * 100) / 100.0)
        nodes = np.flatnonzero(change)
        before = room.state_from(power - change, rise - room.recirc.rise_of(nodes, change[nodes]))
        after = room.state_from(power, rise)
        worse = newly_hot(before, after)
        return ThermalCheck(not worse, before.max_inlet_c, after.max_inlet_c, before.pue, after.pue,
                            after.t_supply_c, room.params.redline_c, worse, tracker.headroom(room.rise_limit_k),
                            model_version=self.version)
