"""Paper 003 §2.2 as a Gymnasium environment: place the subtasks of a job stream on the servers of one DC room.

The simulation (paper 003 §3.2.1's "IT system", with the thermal surrogate in the loop)
-----------------------------------------------------------------------------------------
* Jobs arrive at their submit times (event-driven clock, seconds of trace time). On arrival a job is cut by
  the library's `split_task` (paper 003: > 24 cores → subtasks of <= 8 cores) and its subtasks join one FCFS
  queue. A job that no server could ever hold is rejected on arrival (counted, never queued).
* Each `step` decides the subtask at the head of the queue. Action k in 1..n places it on server k-1;
  action 0 places nothing now. Placements take no time. A placed subtask runs the job's runtime from its own
  placement (paper 003 decouples subtasks; each runs on one server) and its completion frees its cores.
* Action 0 (and an action whose server has no room, see below) advances the clock to the next completion,
  processing the arrivals due before it, so the subtask can fit later. With nothing running it advances to
  the next arrival; with neither left it changes nothing (the step limit then truncates the episode).
* When the queue runs empty after a placement the clock runs on to the next arrival (completions on the way).
  The episode terminates when every job has arrived and every subtask is placed; it is truncated after
  `max_steps` decisions.
* **An action on a server without room** (resources, or the thermal headroom with `thermal_mask=True`) is
  treated as action 0 and penalised with `RewardConfig.invalid_penalty`. `action_masks()` and
  `info["action_mask"]` (bool, n+1, index 0 always True) give maskable agents the feasible set; they are
  computed with the same `ClusterState.feasible` (and headroom) test the placer's `plan()` uses.

Thermal surrogate in the loop, incrementally
--------------------------------------------
The env keeps per-server IT power P (eq.5) and the recirculation rise ``D @ P`` in the room's `RiseTracker`
(hsched.thermal.zonal). A load change of c cores on server k changes P_k by ``c`` × the eq.5 slope
(`RoomModel.added_power_w`) and the rise by one column ``D[:, k] · ΔP_k`` (O(M) at the rack level);
`RoomModel.state_from(P, rise)` then gives inlets, outlets, supply temperature, cooling power and PUE with the
library's formulas (``evaluate`` is the same call after the full product). Every `RESYNC_EVERY` load changes P
and the rise are recomputed from scratch, so rounding never accumulates.

Reward (eq.12), per decision, constants in `RewardConfig`
----------------------------------------------------------
    placed on server k:  r = r_job − overheat_penalty · [T_in,k > φ_T] − overload_penalty · [u_k > φ_u]
    action 0:            r = defer_reward
    no room on k:        r = defer_reward − invalid_penalty        (and it acts as action 0)

T_in,k and u_k are the chosen server's inlet temperature and CPU utilisation (busy/total cores) right after
the placement; with ``temperature_scope="any"`` the temperature term looks at the hottest inlet of the room
instead. φ_T defaults to the DC's redline (27 °C in the default fleet), φ_u to 0.8 (paper 003 §3.2.4).

Observation (Box float32, shape 2n + 2)
---------------------------------------
``[u_0 … u_{n-1},  θ_0 … θ_{n-1},  demand,  queue]`` with u_i = busy/total cores of server i, θ_i the
normalised inlet ``(T_in,i − T_ref) / (φ_T − T_ref)`` clipped to [-2, 4] (T_ref = the room's nominal supply
temperature, so 0 = supply air, 1 = at φ_T), demand = the head subtask's cores / the largest server's cores
(0 when the queue is empty), queue = queued subtasks / n clipped to [0, 1].

Job stream
----------
Default: the LLNL Thunder log (`data/pwa_swf/LLNL-Thunder-2007-1.1-cln.swf.gz`), paper 003 §3.2.2's split
`split=(2000, 3000, 500)`: jobs [0, 2000) warm the room up, ``phase="train"`` plays jobs [2000, 5000),
``phase="eval"`` jobs [5000, 5500); ``offset`` shifts the phase slice by that many jobs (the evaluation uses
it per seed). The warm-up jobs are placed by a fixed heuristic (`warmup_policy`, default round robin) at
`reset`, so every episode and every policy starts from the same warmed-up room; the phase jobs are shifted in
time to arrive right after the last warm-up job, keeping their own inter-arrival gaps (for "train" with
offset 0 that shift is zero: it is the trace's own continuation). The warmed-up state is computed once and
cached. With ``episode_jobs`` smaller than the phase slice, each reset plays a window of that many jobs at a
start drawn from the env's seeded RNG (``options={"start": i}`` picks it). ``jobs=`` (and ``warmup_jobs=``)
replace the trace: the jobs are used with their own submit times.

`run_policy(env, policy)` lets a library heuristic (a `NodePolicy`) act through the same
`hsched.policies.placement.plan` → `select()` code the placer serves with, or any callable
``(obs, action_mask) -> action``, and returns the episode's metrics (`DcPlacementEnv.episode_metrics`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import gymnasium as gym
import numpy as np

from hsched.domain.cluster import ClusterState, Part
from hsched.domain.fleet import DataCenter, load_fleet
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec
from hsched.policies.base import NodePolicy
from hsched.policies.heuristics import make_policy
from hsched.policies.placement import Outcome, part_power_w, plan, split_task
from hsched.thermal import RoomModel, ThermalState, rack_outlet_mean
from hsched.thermal.datacenter import room_for
from hsched.thermal.zonal import RiseTracker

if TYPE_CHECKING:
    from hsched.traces.catalog import TraceRef

ENV_ID = "hsched/DcPlacement-v0"
DEFAULT_DC = "chicago"  # a CPU room of the default fleet: 16 racks × 42 1U servers × 24 cores (paper 003)
THUNDER = "pwa_swf/LLNL-Thunder-2007-1.1-cln.swf.gz"
PAPER_SPLIT = (2000, 3000, 500)  # warm-up, train, eval jobs (paper 003 §3.2.2)
RESYNC_EVERY = 20_000  # load changes between exact recomputations of P and D @ P
INLET_OBS_RANGE = (-2.0, 4.0)
TEMP_TOL_K = (
    1e-9  # as the library's redline test: an inlet exactly at φ_T (redline-mode supply) is not over it
)
_MAX_DEFAULT_STEPS_PER_SUBTASK = 4


@dataclass(frozen=True, slots=True)
class Job:
    submit_s: float
    spec: TaskSpec


@dataclass(frozen=True)
class RewardConfig:
    """Eq.12's constants (paper 003 does not publish its values; these are ours)."""

    r_job: float = 1.0  # a subtask placed on a server
    overheat_penalty: float = 2.0  # inlet above φ_T
    overload_penalty: float = 0.5  # utilisation above φ_u
    phi_t: float | None = None  # °C; None = the DC's redline
    phi_u: float = 0.8  # paper 003: overload threshold
    defer_reward: float = 0.0  # action 0: nothing placed, no r_job
    invalid_penalty: float = 1.0  # a server without room was chosen (then treated as action 0)
    temperature_scope: str = "server"  # "server": the chosen server's inlet; "any": the hottest inlet

    def __post_init__(self) -> None:
        if self.temperature_scope not in ("server", "any"):
            raise ValueError(f"temperature_scope must be 'server' or 'any', got {self.temperature_scope!r}")


@lru_cache(maxsize=4)
def thunder_jobs(count: int, path: str | TraceRef = THUNDER) -> tuple[Job, ...]:
    """The first `count` jobs of an SWF log in the data dir (default LLNL Thunder), or of any trace
    (`hsched.traces.catalog.TraceRef`: e.g. `--trace` with `--cores-per-proc`), as `Job`s."""
    from hsched.traces import data_dir
    from hsched.traces.catalog import TraceRef, trace_jobs

    ref = path if isinstance(path, TraceRef) else TraceRef(Path(path).name, "swf", data_dir() / path)
    jobs = tuple(Job(t, spec) for t, spec in trace_jobs(ref, limit=count, tenant="swf"))
    if len(jobs) < count:
        raise ValueError(f"{ref.path.name} has only {len(jobs)} jobs, {count} needed")
    return jobs


def _as_job(j: Job | tuple[float, TaskSpec]) -> Job:
    return j if isinstance(j, Job) else Job(float(j[0]), j[1])


@dataclass
class _Warm:
    """The state after the warm-up (cached; restored by every reset)."""

    clock: float
    free: tuple[np.ndarray, ...]
    allocations: dict
    running: list
    rise: RiseTracker  # P and D @ P
    seq: int


_WARM_CACHE: OrderedDict[Any, _Warm] = OrderedDict()
_WARM_CACHE_SIZE = 4


class DcPlacementEnv(gym.Env):
    """See the module docstring. Attributes worth reading: `cluster` (ClusterState), `room` (RoomModel),
    `state` (the current ThermalState), `util` (per-server CPU utilisation), `clock` (trace seconds).

    `dc`: a DataCenter or the name of one in the default fleet (default "chicago"). `supply_mode`: override
    the room's CRAC mode ("fixed" | "redline"). `room`: a RoomModel to use instead of `room_for(dc)` (e.g.
    one calibrated from measurements). `thermal_mask`: also mask servers whose added power exceeds their
    thermal headroom (the placer's guard; O(n²) per step, off by default: eq.12 penalises instead).
    `record_series`: keep per-event time series (`series`) for plots. Other options: module docstring.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        dc: DataCenter | str | None = None,
        *,
        jobs: Sequence[Job | tuple[float, TaskSpec]] | None = None,
        warmup_jobs: Sequence[Job | tuple[float, TaskSpec]] | None = None,
        phase: str = "train",
        split: tuple[int, int, int] = PAPER_SPLIT,
        offset: int = 0,
        episode_jobs: int | None = None,
        trace: str = THUNDER,
        warmup_policy: str = "rr",
        reward: RewardConfig | None = None,
        supply_mode: str | None = None,
        room: RoomModel | None = None,
        thermal_mask: bool = False,
        max_steps: int | None = None,
        record_series: bool = False,
        render_mode: str | None = None,
    ) -> None:
        if isinstance(dc, str) or dc is None:
            dc = load_fleet().datacenter(dc or DEFAULT_DC)
        if supply_mode is not None:  # e.g. "redline": the CRAC keeps the hottest inlet at the redline
            dc = dataclasses.replace(dc, thermal={**dc.thermal, "supply_mode": supply_mode})
        if phase not in ("train", "eval"):
            raise ValueError(f"phase must be 'train' or 'eval', got {phase!r}")
        self.dc = dc
        self.render_mode = render_mode
        self.reward_config = reward or RewardConfig()
        self.thermal_mask = thermal_mask
        self.record_series = record_series
        self.warmup_policy = warmup_policy
        self.cluster = ClusterState(dc)
        self.table = self.cluster.table
        if room is not None and supply_mode is not None:
            raise ValueError(
                "supply_mode applies to the room built from the DC; set it in the given room's params"
            )
        self.room: RoomModel = room if room is not None else room_for(dc)
        self._custom_room = room is not None
        self._warm_local: _Warm | None = None
        n = self.n = self.cluster.n
        if self.room.n != n:
            raise ValueError(f"room has {self.room.n} servers, the DC {n}")
        rc = self.reward_config
        self.phi_t = self.room.params.redline_c if rc.phi_t is None else float(rc.phi_t)
        self.phi_u = rc.phi_u
        self._slope = self.room.added_power_w(1.0)  # W per busy core (eq.5 slope), per server
        self._inv_cap = 1.0 / np.maximum(self.table.cpu_milli, 1)
        self._room_milli = float(self.table.cpu_milli.sum())
        self._max_cores = float(self.table.cpu_milli.max()) / MILLI
        self._t_ref = self.room.params.t_supply_c
        self._inlet_scale = 1.0 / max(self.phi_t - self._t_ref, 1e-9)
        spr = dc.layout.servers_per_rack
        self._racks_full = n % spr == 0
        self._spr = spr

        # the job stream: warm-up jobs, and the phase jobs an episode draws its window from
        self._trace_key: tuple | None = None
        if jobs is not None:
            self._warm_jobs = tuple(_as_job(j) for j in warmup_jobs or ())
            self._phase_jobs = tuple(_as_job(j) for j in jobs)
            self._rebase = False
        else:
            w, t, e = split
            if offset < 0 or min(w, t, e) < 0:
                raise ValueError(f"split and offset must be >= 0, got {split} and {offset}")
            start = (w if phase == "train" else w + t) + offset
            length = t if phase == "train" else e
            trace_jobs = thunder_jobs(start + length, trace)
            self._warm_jobs = trace_jobs[:w]
            self._phase_jobs = trace_jobs[start : start + length]
            self._gap_before = [
                trace_jobs[start + i].submit_s - trace_jobs[start + i - 1].submit_s if start + i > 0 else 0.0
                for i in range(length)
            ]
            self._rebase = True
            self._trace_key = (trace, w)
        if not self._phase_jobs:
            raise ValueError("the episode has no jobs (check split/phase or jobs=)")
        self.episode_jobs = min(episode_jobs or len(self._phase_jobs), len(self._phase_jobs))
        self._splits: dict[int, tuple[tuple[Resources, ...], bool]] = {}
        self.max_steps = (
            max_steps
            or _MAX_DEFAULT_STEPS_PER_SUBTASK * sum(len(self._split(j.spec)[0]) for j in self._phase_jobs)
            + 1000
        )

        self.action_space = gym.spaces.Discrete(n + 1)
        lo = np.concatenate([np.zeros(n), np.full(n, INLET_OBS_RANGE[0]), [0.0, 0.0]]).astype(np.float32)
        hi = np.concatenate([np.ones(n), np.full(n, INLET_OBS_RANGE[1]), [1.0, 1.0]])
        self.observation_space = gym.spaces.Box(lo, hi.astype(np.float32), dtype=np.float32)
        self._obs = np.zeros(2 * n + 2, dtype=np.float32)
        self._buf = np.empty(n)
        self._idle_power = self.room.power(np.zeros(n))
        self._fresh_episode_state()

    # -- job bookkeeping -------------------------------------------------------------------------------------

    def _split(self, spec: TaskSpec) -> tuple[tuple[Resources, ...], bool]:
        """(subtask demands, could every subtask ever fit on some server) for a job, cached by identity."""
        key = id(spec)
        hit = self._splits.get(key)
        if hit is None:
            demands = tuple(p.demand for p in split_task(spec, self.dc))
            fits = all(bool(self.cluster.could_ever_fit(d).any()) for d in set(demands))
            hit = self._splits[key] = (demands, fits)
        return hit

    def _fresh_episode_state(self) -> None:
        self.cluster = ClusterState(self.dc, self.table)
        self.clock = 0.0
        self._arrivals: list[tuple[float, float, TaskSpec]] = []  # (arrival time, runtime, spec), time order
        self._next_arrival = 0
        self._queue: deque[tuple[Resources, float]] = deque()  # (demand, runtime) of waiting subtasks
        self._running: list[tuple[float, int, int, int]] = []  # heap of (end time, alloc id, node, cpu milli)
        self._seq = 0
        self._tracker = self.room.tracker(self._idle_power)
        self._changes = 0
        self.placed = self.deferred = self.invalid = self.rejected = 0
        self.steps = 0
        self.reward_sum = 0.0
        self._refresh()
        self._reset_accumulators()

    def _reset_accumulators(self) -> None:
        self.episode_t0 = self._t_start = self._t_last = self.clock  # trace seconds at the first decision
        self._acc = [0.0] * 7  # ∫ pue, overloads, rack outlet, IT W, cooling W, max inlet, room CPU load dt
        self.series: dict[str, list[float]] = {
            k: [] for k in ("time_s", "pue", "mean_rack_outlet_c", "overloads", "max_inlet_c")
        }
        if self.record_series:
            self._record()

    # -- thermal and metrics ---------------------------------------------------------------------------------

    def _load_change(self, node: int, cpu_milli: int) -> None:
        self._tracker.add(node, float(self._slope[node]) * (cpu_milli / MILLI))
        self._changes += 1
        if self._changes % RESYNC_EVERY == 0:
            self._resync()

    def _resync(self) -> None:
        """Exact P and D @ P from the allocation state (what the incremental updates approximate to ~1e-12)."""
        self._tracker.resync(self.room.power(self.cluster.busy_cpu() / MILLI))

    def _refresh(self) -> None:
        """Thermal state and metrics after a load change (the library's formulas on the incremental rise)."""
        self.util = (self.table.cpu_milli - self.cluster.free_cpu) * self._inv_cap
        self.state: ThermalState = self.room.state_from(self._tracker.power.copy(), self._tracker.rise())
        s = self.state
        self.overloads = int(np.count_nonzero(self.util > self.phi_u))
        # the room's load (share of its cores busy) is what makes runs on different traces comparable
        self.cpu_load = 1.0 - float(self.cluster.free_cpu.sum()) / self._room_milli
        if self._racks_full:
            self.mean_rack_outlet_c = float(rack_outlet_mean(s, self._spr).mean())
        else:  # a partly filled room: mean over the racks that hold servers
            racks = np.bincount(self.table.rack, weights=s.outlet_c) / np.maximum(
                np.bincount(self.table.rack), 1
            )
            self.mean_rack_outlet_c = float(racks[np.bincount(self.table.rack) > 0].mean())

    def _current(self) -> tuple[float, ...]:
        s = self.state
        return (
            s.pue,
            float(self.overloads),
            self.mean_rack_outlet_c,
            s.it_power_w,
            s.cooling_power_w,
            s.max_inlet_c,
            self.cpu_load,
        )

    def _advance_clock(self, t: float) -> None:
        """Move the clock to t, integrating the piecewise-constant metrics over [last change, t]."""
        dt = t - self._t_last
        if dt > 0:
            for i, v in enumerate(self._current()):
                self._acc[i] += v * dt
            self._t_last = t
        if t > self.clock:
            self.clock = t

    def _record(self) -> None:
        s = self.series
        s["time_s"].append(self.clock)
        s["pue"].append(self.state.pue)
        s["mean_rack_outlet_c"].append(self.mean_rack_outlet_c)
        s["overloads"].append(float(self.overloads))
        s["max_inlet_c"].append(self.state.max_inlet_c)

    # -- events ----------------------------------------------------------------------------------------------

    def _next_arrival_time(self) -> float:
        return self._arrivals[self._next_arrival][0] if self._next_arrival < len(self._arrivals) else math.inf

    def _run_until(self, t: float) -> None:
        """Process every completion and arrival due at or before t, in time order (completions first on ties)."""
        while True:
            t_done = self._running[0][0] if self._running else math.inf
            t_arr = self._next_arrival_time()
            t_ev = min(t_done, t_arr)
            if t_ev > t:
                break
            self._advance_clock(t_ev)
            if t_done <= t_arr:
                while self._running and self._running[0][0] == t_done:
                    _, alloc, node, cpu = heapq.heappop(self._running)
                    self.cluster.release(alloc)
                    self._load_change(node, -cpu)
                self._refresh()
                if self.record_series:
                    self._record()
            else:
                while (
                    self._next_arrival < len(self._arrivals)
                    and self._arrivals[self._next_arrival][0] == t_arr
                ):
                    _, runtime, spec = self._arrivals[self._next_arrival]
                    self._next_arrival += 1
                    demands, fits = self._split(spec)
                    if not fits:
                        self.rejected += 1
                        continue
                    self._queue.extend((d, runtime) for d in demands)
        if t != math.inf:
            self._advance_clock(t)

    def _wait(self) -> None:
        """Action 0: run to the next completion (or, with nothing running, the next arrival)."""
        t = self._running[0][0] if self._running else self._next_arrival_time()
        if t != math.inf:
            self._run_until(t)

    def _until_work(self) -> None:
        """With an empty queue, run on to the next arrival (processing the completions before it)."""
        while not self._queue and self._next_arrival < len(self._arrivals):
            self._run_until(self._next_arrival_time())

    def _place(self, node: int) -> None:
        demand, runtime = self._queue.popleft()
        self._seq += 1
        self.cluster.apply(
            self._seq,
            (Part(0, 0, node, demand.cpu_milli, demand.memory_mib, demand.disk_mib, demand.bandwidth_mbps),),
        )
        heapq.heappush(self._running, (self.clock + runtime, self._seq, node, demand.cpu_milli))
        self._load_change(node, demand.cpu_milli)
        self._refresh()
        if self.record_series:
            self._record()

    def _decide(self, action: int) -> tuple[float, int]:
        """Apply one decision for the head subtask; returns (reward, node placed on or -1)."""
        rc = self.reward_config
        k = int(action)
        if not 0 <= k <= self.n:
            raise ValueError(f"action must be in 0..{self.n}, got {action!r}")
        if k and self._mask[k]:
            node = k - 1
            self._place(node)
            self.placed += 1
            hot = (
                self.state.inlet_c[node] if rc.temperature_scope == "server" else self.state.max_inlet_c
            ) > self.phi_t + TEMP_TOL_K
            reward = (
                rc.r_job - rc.overheat_penalty * hot - rc.overload_penalty * (self.util[node] > self.phi_u)
            )
            self._until_work()
        else:
            node = -1
            reward = rc.defer_reward
            if k:
                reward -= rc.invalid_penalty
                self.invalid += 1
            self.deferred += 1
            self._wait()
            self._until_work()
        self._mask = self._compute_mask()
        return float(reward), node

    def _head(self) -> tuple[Resources, float] | None:
        return self._queue[0] if self._queue else None

    def _compute_mask(self) -> np.ndarray:
        mask = np.zeros(self.n + 1, dtype=bool)
        mask[0] = True
        head = self._head()
        if head is not None:
            mask[1:] = self.cluster.feasible(head[0])
            if self.thermal_mask:
                mask[1:] &= part_power_w(self.cluster, head[0]) <= self.headroom_w()
        return mask

    def headroom_w(self) -> np.ndarray:
        """Per server, the extra IT power it may draw alone before an inlet passes the redline: recomputed from
        the allocation state (O(n) for a zonal room), so the mask never depends on the updates' rounding."""
        return self.room.headroom_w(self.cluster.busy_cpu() / MILLI)

    # -- warm-up ---------------------------------------------------------------------------------------------

    def _warm_key(self) -> tuple | None:
        """Key of the module-wide warm-up cache (trace jobs on a room built from the DC), else None."""
        if self._trace_key is None or self._custom_room:
            return None
        dc = self.dc
        thermal = dict(dc.thermal)
        if not self.thermal_mask:  # then the warm-up never looks at temperatures: only D's inputs matter
            thermal = {k: v for k, v in thermal.items() if k in ("air_mass_flow_kg_s", "cp_air")}
        return (
            *self._trace_key,
            dc.name,
            dc.layout,
            dc.pools,
            tuple(sorted(thermal.items())),
            self.warmup_policy,
            self.thermal_mask,
        )

    def _warm_up(self) -> _Warm:
        if self._warm_local is not None:
            return self._warm_local
        key = self._warm_key()
        if key is not None and key in _WARM_CACHE:
            _WARM_CACHE.move_to_end(key)
            self._warm_local = _WARM_CACHE[key]
            return self._warm_local
        self._fresh_episode_state()
        self._arrivals = [(j.submit_s, j.spec.runtime_s, j.spec) for j in self._warm_jobs]
        if self._arrivals:
            self.clock = self._t_last = self._arrivals[0][0]
            policy = make_policy(self.warmup_policy)
            self._until_work()
            self._mask = self._compute_mask()
            while self._queue:
                self._decide(self.policy_action(policy))
        warm = _Warm(
            self.clock,
            self.cluster.snapshot(),
            dict(self.cluster.allocations),
            list(self._running),
            self._tracker.copy(),
            self._seq,
        )
        if key is not None:
            _WARM_CACHE[key] = warm
            while len(_WARM_CACHE) > _WARM_CACHE_SIZE:
                _WARM_CACHE.popitem(last=False)
        self._warm_local = warm
        return warm

    def _restore(self, w: _Warm) -> None:
        self._fresh_episode_state()
        c = self.cluster
        (
            c.free_cpu[:],
            c.free_memory[:],
            c.free_disk[:],
            c.free_bandwidth[:],
            c.gpu_free_core[:],
            c.gpu_free_memory[:],
        ) = w.free
        c.allocations = dict(w.allocations)
        self._running = list(w.running)
        self._tracker = w.rise.copy()
        self._seq = w.seq
        self.clock = w.clock
        self._refresh()

    # -- gymnasium API ---------------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        total = len(self._phase_jobs)
        if "start" in options:
            start = int(options["start"])
            if not 0 <= start <= total - self.episode_jobs:
                raise ValueError(f"options['start'] must be in 0..{total - self.episode_jobs}, got {start}")
        elif self.episode_jobs < total:
            start = int(self.np_random.integers(0, total - self.episode_jobs + 1))
        else:
            start = 0
        warm = self._warm_up()
        self._restore(warm)
        window = self._phase_jobs[start : start + self.episode_jobs]
        shift = 0.0
        if self._rebase and self._warm_jobs:  # arrive right after the last warm-up job, own gaps kept
            shift = self._warm_jobs[-1].submit_s + self._gap_before[start] - window[0].submit_s
        self._arrivals = [(j.submit_s + shift, j.spec.runtime_s, j.spec) for j in window]
        self._next_arrival = 0
        if not self._warm_jobs:
            self.clock = self._arrivals[0][0]
        self._run_until(self.clock)
        self._until_work()
        self.episode_start = start
        self._reset_accumulators()
        self._mask = self._compute_mask()
        return self._observe(), self._info(-1)

    def step(self, action):
        reward, node = self._decide(action)
        self.steps += 1
        self.reward_sum += reward
        terminated = not self._queue and self._next_arrival >= len(self._arrivals)
        truncated = not terminated and self.steps >= self.max_steps
        return self._observe(), reward, terminated, truncated, self._info(node)

    def action_masks(self) -> np.ndarray:
        """Feasible actions for the head subtask (index 0, "not now", is always allowed)."""
        return self._mask.copy()

    def _observe(self) -> np.ndarray:
        n, obs = self.n, self._obs
        obs[:n] = self.util
        theta = np.subtract(self.state.inlet_c, self._t_ref, out=self._buf)
        theta *= self._inlet_scale
        np.minimum(np.maximum(theta, INLET_OBS_RANGE[0], out=theta), INLET_OBS_RANGE[1], out=theta)
        obs[n : 2 * n] = theta
        head = self._head()
        obs[2 * n] = head[0].cpu_milli / MILLI / self._max_cores if head is not None else 0.0
        obs[2 * n + 1] = min(len(self._queue) / n, 1.0)
        return obs.copy()

    def _info(self, node: int) -> dict[str, Any]:
        s = self.state
        return {
            "action_mask": self._mask.copy(),
            "node": node,
            "time_s": self.clock,
            "pue": s.pue,
            "overloads": self.overloads,
            "mean_rack_outlet_c": self.mean_rack_outlet_c,
            "max_inlet_c": s.max_inlet_c,
            "t_supply_c": s.t_supply_c,
            "it_power_w": s.it_power_w,
            "queue_length": len(self._queue),
            "placed": self.placed,
            "deferred": self.deferred,
            "invalid": self.invalid,
            "rejected": self.rejected,
        }

    # -- helpers for policy runners --------------------------------------------------------------------------

    def head_task(self) -> TaskSpec | None:
        """The head subtask as a single-part TaskSpec (what the placer would be asked to place), or None."""
        head = self._head()
        return None if head is None else TaskSpec(resources=head[0], runtime_s=head[1])

    def policy_action(self, policy: NodePolicy) -> int:
        """The action `policy` takes for the head subtask through the placer's own code: `plan()` (the
        `ClusterState.feasible` mask, the thermal headroom when `thermal_mask`, then `select()`)."""
        spec = self.head_task()
        if spec is None:
            return 0
        decision = plan(self.cluster, spec, policy, self.headroom_w() if self.thermal_mask else None)
        return decision.parts[0].node + 1 if decision.outcome is Outcome.PLACED else 0

    def episode_metrics(self) -> dict[str, float]:
        """Means over the episode so far: per decision (reward) and over simulated time (the rest)."""
        span = self._t_last - self._t_start
        now = self._current()
        avg = [a / span for a in self._acc] if span > 0 else list(now)
        return {
            "steps": self.steps,
            "placed": self.placed,
            "deferred": self.deferred,
            "invalid": self.invalid,
            "rejected": self.rejected,
            "reward_sum": self.reward_sum,
            "mean_reward": self.reward_sum / self.steps if self.steps else 0.0,
            "mean_pue": avg[0],
            "mean_overloads": avg[1],
            "mean_rack_outlet_c": avg[2],
            "mean_it_power_w": avg[3],
            "mean_cooling_power_w": avg[4],
            "mean_max_inlet_c": avg[5],
            "mean_cpu_load": avg[6],
            "sim_hours": span / 3600.0,
        }


def run_policy(
    env: gym.Env,
    policy: NodePolicy | Callable[[np.ndarray, np.ndarray], int],
    *,
    seed: int | None = None,
    options: dict | None = None,
) -> dict[str, float]:
    """Play one episode: a `NodePolicy` decides through `DcPlacementEnv.policy_action` (the placer's plan/select
    code), a callable gets ``(obs, action_mask)`` and returns the action. Returns `episode_metrics()`."""
    base: DcPlacementEnv = env.unwrapped  # type: ignore[assignment]
    obs, info = env.reset(seed=seed, options=options)
    is_node_policy = hasattr(policy, "scores") and hasattr(policy, "placed")
    done = False
    while not done:
        action = base.policy_action(policy) if is_node_policy else int(policy(obs, info["action_mask"]))
        obs, _, terminated, truncated, info = env.step(action)
        done = terminated or truncated
    return base.episode_metrics()


# The held-out evaluation protocol, shared by `hsched eval thermal` and the Double DQN trainer's own figures
# (here rather than in either, so the trainer never imports the evaluation report).
MODES = ("fixed", "redline")  # the CRAC modes every policy is scored in (a report names each from its room's params)
METRICS = (  # (key of run_policy's result, label, digits)
    ("mean_reward", "mean reward", 3),
    ("mean_pue", "mean PUE", 4),
    ("mean_overloads", "mean overloads", 2),
    ("mean_rack_outlet_c", "mean rack outlet °C", 3),
)
DELTAS = (("mean_pue", "%"), ("mean_overloads", "%"), ("mean_rack_outlet_c", "°C"))  # the Δ columns


def eval_env(mode: str, seed: int, split: tuple[int, int, int] = PAPER_SPLIT, dc: DataCenter | str = DEFAULT_DC,
             trace: str | TraceRef = THUNDER) -> DcPlacementEnv:
    """The held-out episode of `seed` in CRAC `mode` (jobs warm + train + seed·eval …); every policy plays it."""
    return DcPlacementEnv(
        dc, phase="eval", split=split, offset=seed * split[2], supply_mode=mode, record_series=True, trace=trace
    )


def trace_record(ref: TraceRef) -> dict[str, Any]:
    """How a model's metadata names the SWF log its DC env's jobs came from, so a report can tell whether the
    model saw its own trace: the file relative to the data dir when it is there (THUNDER's form), else its
    absolute path, with the scaling flags."""
    from hsched.traces import data_dir

    path = ref.path.resolve()
    try:
        name = path.relative_to(data_dir().resolve()).as_posix()
    except ValueError:
        name = str(path)
    return {"trace": name, "cores_per_proc": ref.cores_per_proc, "time_compression": ref.time_compression}


def same_trace(data: dict[str, Any], ref: TraceRef) -> bool:
    """Whether metadata `data` (`trace_record`'s keys; no scaling keys = unscaled) names the trace `ref`."""
    unscaled = {"cores_per_proc": 1, "time_compression": 1.0}
    return all(data.get(key, unscaled.get(key)) == value for key, value in trace_record(ref).items())


def delta_values(runs: list[dict[str, float]], refs: list[dict[str, float]], key: str, unit: str) -> list[float]:
    """Per-seed differences of metric `key` against the reference policy's runs on the same jobs: in % of the
    reference when `unit` is "%", else absolute."""
    return [
        percent_change(r[key], b[key]) if unit == "%" else r[key] - b[key] for r, b in zip(runs, refs, strict=True)
    ]


def percent_change(x: float, ref: float) -> float:
    return (x - ref) / ref * 100.0 if ref else math.nan


def _register() -> None:
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point="hsched.envs.dc:DcPlacementEnv")


_register()

__all__ = [
    "DEFAULT_DC",
    "ENV_ID",
    "PAPER_SPLIT",
    "DcPlacementEnv",
    "Job",
    "RewardConfig",
    "run_policy",
    "thunder_jobs",
]
