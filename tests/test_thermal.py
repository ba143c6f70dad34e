"""hsched.thermal: every expected number below is worked out by hand in the comment beside it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from hsched.domain.cluster import ClusterState, GpuShare, Part
from hsched.domain.fleet import load_fleet, parse_fleet
from hsched.domain.resources import MILLI
from hsched.thermal import (
    RoomGeometry,
    RoomModel,
    ThermalParams,
    calibrate_recirculation,
    cooling_power,
    cop,
    gpu_power,
    pue,
    rack_outlet_mean,
    recirculation_from_geometry,
    server_power,
)
from hsched.thermal.datacenter import load_arrays, room_for
from hsched.thermal.guard import LoadDelta, RoomGuard, newly_hot, shifted
from tests.conftest import SMALL_FLEET

# A 2-server room with round numbers: m_dot * c_p = 0.05 * 1000 = 50 W/K.
D2 = np.array([[0.010, 0.002], [0.003, 0.020]])
P2 = ThermalParams(air_mass_flow_kg_s=0.05, cp_air=1000.0)


def room2(**params: object) -> RoomModel:
    base = {"air_mass_flow_kg_s": 0.05, "cp_air": 1000.0}
    return RoomModel(D2, ThermalParams(**{**base, **params}), p_idle_w=100.0, p_full_w=300.0, total_cores=24)


# ---------------------------------------------------------------- power, CoP, PUE


def test_eq5_server_power() -> None:
    assert server_power(12, 24, 100.0, 300.0) == pytest.approx(200.0)  # 100 + 200 * 12/24
    # 0, 6, 24 of 24 busy -> 100, 100 + 200/4 = 150, 300
    np.testing.assert_allclose(server_power(np.array([0, 6, 24]), 24, 100.0, 300.0), [100.0, 150.0, 300.0])
    # a server without cores must not divide by zero: utilisation 0 -> P_idle
    out = server_power(np.array([0, 8]), np.array([0, 16]), 100.0, 300.0)
    np.testing.assert_allclose(out, [100.0, 200.0])  # 100; 100 + 200 * 8/16


def test_gpu_power() -> None:
    # 2 cards, one 100 % and one 50 % busy: 2*50 + (250-50)*1.5 = 100 + 300 = 400 W; no GPUs -> 0 W
    np.testing.assert_allclose(gpu_power(np.array([1.5, 0.0]), np.array([2, 0]), 50.0, 250.0), [400.0, 0.0])


def test_cop_cooling_pue() -> None:
    assert cop(20.0) == pytest.approx(3.194)  # 0.0068*400 + 0.0008*20 + 0.458 = 2.72 + 0.016 + 0.458
    assert cop(15.0) == pytest.approx(2.0)  # 0.0068*225 + 0.012 + 0.458 = 1.53 + 0.012 + 0.458
    assert cooling_power(3194.0, 20.0) == pytest.approx(1000.0)  # 3194 / 3.194
    assert pue(1000.0, 500.0, 50.0) == pytest.approx(1.55)  # (1000 + 500 + 50) / 1000
    with pytest.raises(ValueError, match="p_it"):
        pue(0.0, 10.0)
    with pytest.raises(ValueError, match="p_it"):
        pue(0.0, 10.0, 0.0)
    # Python floats take a scalar path: the same floats (and type) as the array formula
    rng = np.random.default_rng(6)
    for t, it, other in zip(rng.uniform(10, 30, 200), rng.uniform(1, 1e7, 200), rng.uniform(0, 1e5, 200), strict=True):
        t, it, other = float(t), float(it), float(other)
        arr = np.asarray(t)
        assert cop(t) == float(0.0068 * arr * arr + 0.0008 * arr + 0.458) and type(cop(t)) is float
        cool = cooling_power(it, t)
        assert cool == float(np.asarray(it) / cop(arr)) and type(cool) is float
        assert pue(it, cool, other) == float((np.asarray(it) + np.asarray(cool) + np.asarray(other)) / np.asarray(it))


# ---------------------------------------------------------------- room model by hand


def test_fixed_supply_room_by_hand() -> None:
    s = room2().evaluate(np.array([12, 24]))
    np.testing.assert_allclose(s.power_w, [200.0, 300.0])  # eq.5
    # D @ P = [0.010*200 + 0.002*300, 0.003*200 + 0.020*300] = [2.6, 6.6] -> inlet 20 + that
    np.testing.assert_allclose(s.inlet_c, [22.6, 26.6])
    # outlet = inlet + P / 50 W/K = inlet + [4, 6]
    np.testing.assert_allclose(s.outlet_c, [26.6, 32.6])
    assert s.t_supply_c == 20.0 and s.max_inlet_c == pytest.approx(26.6)
    assert s.it_power_w == pytest.approx(500.0)
    assert s.cooling_power_w == pytest.approx(500.0 / 3.194)  # 156.544...
    assert s.other_power_w == pytest.approx(25.0)  # 5 % of 500
    assert s.pue == pytest.approx(1.0 + 1.0 / 3.194 + 0.05)  # 1.36309
    assert s.hot_servers.size == 0 and not s.redline_exceeded
    with pytest.raises(ValueError):
        s.inlet_c[0] = 0.0  # states are immutable


def test_fixed_supply_reports_hot_servers() -> None:
    # T_sup 21: full load -> D @ [300, 300] = [3.6, 6.9] -> inlet [24.6, 27.9]; only server 1 > 27
    s = room2(t_supply_c=21.0).evaluate(np.array([24, 24]))
    np.testing.assert_allclose(s.inlet_c, [24.6, 27.9])
    assert s.hot_servers.tolist() == [1] and s.redline_exceeded


def test_redline_control_by_hand() -> None:
    # full load: max(D @ P) = 6.9 -> T_sup = 27 - 6.9 = 20.1, hottest inlet exactly 27 (not "hot")
    s = room2(supply_mode="redline").evaluate(np.array([24, 24]))
    assert s.t_supply_c == pytest.approx(20.1)
    np.testing.assert_allclose(s.inlet_c, [23.7, 27.0])
    assert s.hot_servers.size == 0
    # CoP(20.1) = 0.0068*404.01 + 0.0008*20.1 + 0.458 = 2.747268 + 0.01608 + 0.458 = 3.221348
    assert s.cooling_power_w == pytest.approx(600.0 / 3.221348)
    # idle: max(D @ [100, 100]) = 2.3 -> 24.7, capped by t_supply_max_c = 24
    assert room2(supply_mode="redline").evaluate(np.zeros(2)).t_supply_c == pytest.approx(24.7)
    assert room2(supply_mode="redline", t_supply_max_c=24.0).evaluate(np.zeros(2)).t_supply_c == 24.0
    # full load with t_min = 22 > 20.1: supply stuck at 22, inlet [25.6, 28.9], redline exceeded
    s = room2(supply_mode="redline", t_supply_min_c=22.0).evaluate(np.array([24, 24]))
    assert s.t_supply_c == 22.0
    np.testing.assert_allclose(s.inlet_c, [25.6, 28.9])
    assert s.hot_servers.tolist() == [1] and s.redline_exceeded


def test_gpu_term_in_room() -> None:
    m = RoomModel(D2, P2, gpu_count=[0, 2], gpu_idle_w=50.0, gpu_full_w=250.0)
    s = m.evaluate(np.array([12, 24]), gpu_busy=np.array([0.0, 1.5]))
    np.testing.assert_allclose(s.power_w, [200.0, 700.0])  # 300 + 2*50 + 200*1.5
    # inlet 0 = 20 + 0.010*200 + 0.002*700 = 23.4
    assert s.inlet_c[0] == pytest.approx(23.4)


def test_predict_applies_delta() -> None:
    m = room2()
    # +12 cores on server 0: P = [300, 300] -> inlet 20 + [3.6, 6.9]
    for delta in ({0: 12}, np.array([12, 0])):
        np.testing.assert_allclose(m.predict(np.array([12, 24]), delta).inlet_c, [23.6, 26.9])
    with pytest.raises(ValueError, match="delta_cores"):
        m.predict(np.array([12, 24]), {1: 1})  # server 1 would have 25 of 24 cores
    with pytest.raises(ValueError, match="delta_cores"):
        m.predict(np.array([12, 24]), {5: 1})


def test_rack_outlet_mean_by_hand() -> None:
    m = RoomModel(np.zeros((4, 4)), P2)
    s = m.evaluate(np.array([0, 24, 0, 12]))  # P = [100, 300, 100, 200]; no recirculation
    # outlet = 20 + P/50 = [22, 26, 22, 24] -> racks of 2: [24, 23]
    np.testing.assert_allclose(rack_outlet_mean(s, 2), [24.0, 23.0])
    with pytest.raises(ValueError, match="servers_per_rack"):
        rack_outlet_mean(s, 3)


@pytest.mark.parametrize("mode", ["fixed", "redline"])
def test_max_inlet_if_added_matches_brute_force(mode: str) -> None:
    geo = RoomGeometry(n_racks=4, racks_per_row=2, servers_per_rack=5)
    m = RoomModel.from_geometry(geo, ThermalParams(supply_mode=mode, t_supply_min_c=0.0))
    rng = np.random.default_rng(1)
    busy = rng.integers(0, 17, m.n).astype(float)
    extra_cores = 8
    fast = m.max_inlet_if_added(busy, m.added_power_w(extra_cores))
    t_sup_now = m.evaluate(busy).t_supply_c
    for k in range(m.n):
        s = m.predict(busy, {k: extra_cores})
        # at the CURRENT supply temperature (identical to s.t_supply_c in fixed mode)
        assert fast[k] == pytest.approx(t_sup_now + s.max_inlet_c - s.t_supply_c, abs=1e-12)
    assert m.added_power_w(8)[0] == pytest.approx(200.0 * 8 / 24)  # eq.5 slope


def reference_headroom(m: RoomModel, busy: np.ndarray, gpu: np.ndarray | None = None) -> np.ndarray:
    """The definition: min over the servers i that k heats of (redline - T_sup - rise_i) / D[i, k]."""
    p = m.params
    slack = p.redline_c - (p.t_supply_c if p.supply_mode == "fixed" else p.t_supply_min_c) - m.d @ m.power(busy, gpu)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(m.d > 0, slack[:, None] / m.d, np.inf).min(axis=0)


def test_headroom_by_hand() -> None:
    # room2 at 6 and 12 busy cores: P = 150, 200 W; rise = D @ P = [1.9, 4.45] K; slack = 7 - rise = [5.1, 2.55]
    # server 0 heats i=0 (0.010 K/W) and i=1 (0.003): min(5.1 / 0.010, 2.55 / 0.003) = 510 W
    # server 1: min(5.1 / 0.002, 2.55 / 0.020) = 127.5 W
    assert room2().headroom_w([6, 12]) == pytest.approx([510.0, 127.5])


@pytest.mark.parametrize("redline_c", [22.0, 27.0, 40.0])  # hot rows, some, none
def test_headroom_matches_the_definition_with_hot_rows_and_idle_columns(redline_c: float) -> None:
    rng = np.random.default_rng(2)
    d = rng.random((30, 30)) * 2e-3
    d[d < 1e-3] = 0.0
    d[:, 3] = 0.0  # server 3 heats nobody: unbounded headroom
    m = RoomModel(d, ThermalParams(redline_c=redline_c))
    for scale in (0.2, 1.0):
        busy = rng.random(30) * 24 * scale
        fast, ref = m.headroom_w(busy), reference_headroom(m, busy)
        assert np.isinf(fast[3]) and np.array_equal(np.isinf(fast), np.isinf(ref))
        assert fast[np.isfinite(ref)] == pytest.approx(ref[np.isfinite(ref)], rel=1e-12)


def test_power_of_is_eq5_without_the_checks() -> None:
    m = RoomModel(D2, P2, p_idle_w=[100, 80], p_full_w=[300, 250], total_cores=[24, 0], gpu_count=[2, 0],
                  gpu_idle_w=30.0, gpu_full_w=250.0)
    busy, gpu = np.array([6.0, 0.0]), np.array([1.5, 0.0])
    # server 0: 100 + 200 * 6 / 24 + 2 * 30 + 220 * 1.5 = 540 W; server 1 has no cores: idle 80 W
    assert m.power_of(busy, gpu) == pytest.approx([540.0, 80.0])
    assert m.power_of(busy, gpu) == pytest.approx(m.power(busy, gpu))


@pytest.mark.parametrize("margin_k", [None, 0.02])  # the fleet's redline, or one just above the idle room
async def test_room_guard_is_the_thermal_service_rule_on_the_placer_state(margin_k: float | None) -> None:
    """RoomGuard.check (the placer: its state already holds the batch) == the thermal service's rule (the state
    at the ledger plus the deltas), and the headroom it hands on is the exact one (kept incrementally)."""
    dc = load_fleet(None).datacenter("kansas-city")  # GPU servers of the openb cluster
    room = room_for(dc)
    if margin_k is not None:  # fixed supply (the fleet's CRAC follows the redline), redline just above idle
        servers = {"p_idle_w": room.p_idle_w, "p_full_w": room.p_full_w, "total_cores": room.total_cores,
                   "gpu_count": room.gpu_count, "gpu_idle_w": room.gpu_idle_w, "gpu_full_w": room.gpu_full_w}
        fixed = dataclasses.replace(room.params, supply_mode="fixed", t_supply_c=20.0)
        redline = RoomModel(room.recirc, fixed, **servers).evaluate(np.zeros(room.n)).max_inlet_c + margin_k
        room = RoomModel(room.recirc, dataclasses.replace(fixed, redline_c=redline), **servers)
    state = ClusterState(dc)
    guard = RoomGuard(room, state)
    rng = np.random.default_rng(4)
    t = state.table
    vetoes = 0
    for step in range(60):
        deltas = []
        for j in range(rng.integers(1, 4)):
            k = int(rng.integers(state.n))
            cpu = int(min(state.free_cpu[k], rng.integers(0, 16) * MILLI))
            card = int(rng.integers(max(1, t.gpu_count[k])))
            pct = int(min(state.gpu_free_core[k, card], rng.choice([0, 25, 50, 100]))) if t.gpu_count[k] else 0
            state.apply(f"t{step}-{j}", (Part(0, 0, k, cpu, 0, 0, 0, (GpuShare(card, pct, 0),) if pct else ()),))
            deltas.append(LoadDelta(k, cpu, pct / 100.0))
        cpu_before, gpu_before = shifted(state.busy_cpu(), state.busy_gpu_percent(), deltas, sign=-1)
        before = room.evaluate(cpu_before / MILLI, gpu_before / 100.0)
        after = room.evaluate(*load_arrays(state))
        check = await guard.check(deltas)
        assert check.max_inlet_before_c == pytest.approx(before.max_inlet_c, abs=1e-9)
        assert check.max_inlet_after_c == pytest.approx(after.max_inlet_c, abs=1e-9)
        assert check.pue_before == pytest.approx(before.pue) and check.pue_after == pytest.approx(after.pue)
        assert check.nodes_over_redline == newly_hot(before, after) and check.ok == (not check.nodes_over_redline)
        exact = room.headroom_w(*load_arrays(state))
        assert check.headroom_exact and check.headroom_w == pytest.approx(exact, rel=1e-9)
        vetoes += not check.ok
    assert (await guard.headroom()) == pytest.approx(room.headroom_w(*load_arrays(state)))
    assert vetoes if margin_k is not None else not vetoes


async def test_room_guard_prices_only_moved_nodes_with_the_same_floats() -> None:
    """The guard re-prices only nodes whose free CPU or GPU cores moved since its last call: after allocations,
    releases and direct writes to the free arrays, its power, rise and headroom are the bytes of a guard that
    prices every node each time."""

    class PricesAll(RoomGuard):
        def _sync(self):
            power = self._power()
            if self._tracker is None:
                self._tracker = self.room.tracker(power)
            else:
                self._tracker.set_power(power)
            return self._tracker

    for name in ("kansas-city", "chicago"):
        dc = load_fleet(None).datacenter(name)
        room = room_for(dc)
        state = ClusterState(dc)
        guard, full = RoomGuard(room, state), PricesAll(room, state)
        rng = np.random.default_rng(5)
        t = state.table
        for step in range(40):
            for j in range(int(rng.integers(1, 6))):
                k = int(rng.integers(state.n))
                cpu = int(min(state.free_cpu[k], rng.integers(0, 8) * MILLI))
                card = int(rng.integers(max(1, t.gpu_count[k])))
                pct = int(min(state.gpu_free_core[k, card], rng.choice([0, 25, 100]))) if t.gpu_count[k] else 0
                state.apply(f"t{step}-{j}", (Part(0, 0, k, cpu, 0, 0, 0, (GpuShare(card, pct, 0),) if pct else ()),))
            if step % 3 == 2:
                for task in list(state.allocations)[::2]:
                    state.release(task)
            if step % 10 == 9:  # most of the room at once (the tracker's full resync)
                state.free_cpu[:] = (t.cpu_milli * rng.random(state.n)).astype(state.free_cpu.dtype)
            deltas = [LoadDelta(int(rng.integers(state.n)), 1000, 0.0)]
            a, b = await guard.check(deltas), await full.check(deltas)
            assert guard._tracker.power.tobytes() == full._tracker.power.tobytes() == room.power_of(
                *load_arrays(state)).tobytes()
            assert guard._tracker.rise().tobytes() == full._tracker.rise().tobytes()
            assert a == dataclasses.replace(b, headroom_w=a.headroom_w)
            assert a.headroom_w.tobytes() == b.headroom_w.tobytes()


# ---------------------------------------------------------------- geometry


def test_geometry_formula_by_hand() -> None:
    # 2 racks x 1 slot, 1 m apart, slot 1 m tall: horizontal e^0 / e^-1, receiver e^-(1-0.5),
    # source z/H = 0.5 (source_base 0), no row-end boost -> K ∝ [[1, e^-1], [e^-1, 1]]; every column
    # sums to (1 + e^-1) so D = 0.2 / (0.05*1000) * K / (1 + e^-1)
    geo = RoomGeometry(
        n_racks=2, racks_per_row=2, servers_per_rack=1, rack_width_m=1.0, slot_height_m=1.0,
        horizontal_decay_m=1.0, vertical_decay_m=1.0, source_base=0.0, row_end_boost=0.0,
        recirc_fraction=0.2, air_mass_flow_kg_s=0.05, cp_air=1000.0,
    )  # fmt: skip
    e = math.exp(-1.0)
    expected = 0.004 / (1 + e) * np.array([[1.0, e], [e, 1.0]])  # [[0.0029242, 0.0010758], ...]
    np.testing.assert_allclose(recirculation_from_geometry(geo), expected, rtol=1e-12)


def test_geometry_vertical_and_row_end_terms_by_hand() -> None:
    common = {"slot_height_m": 1.0, "rack_width_m": 1.0, "horizontal_decay_m": 1.0, "vertical_decay_m": 1.0}
    # 1 rack x 2 slots (H = 2, z = 0.5, 1.5): receiver e^-1.5 : e^-0.5 = 1 : e, source z/H = 0.25 : 0.75.
    # K = r_i s_j; column sums s_j (e^-1.5 + e^-0.5), mean 0.5 (e^-1.5 + e^-0.5), so
    # D = 0.004 * [1/(1+e), e/(1+e)]^T [0.5, 1.5] and the sources recirculate 10 % and 30 % of their heat
    geo = RoomGeometry(
        n_racks=1, racks_per_row=1, servers_per_rack=2, source_base=0.0, row_end_boost=0.0,
        recirc_fraction=0.2, air_mass_flow_kg_s=0.05, cp_air=1000.0, **common,
    )  # fmt: skip
    e = math.e
    expected = 0.004 * np.outer([1 / (1 + e), e / (1 + e)], [0.5, 1.5])  # [[0.000538, 0.001614], ...]
    d = recirculation_from_geometry(geo)
    np.testing.assert_allclose(d, expected, rtol=1e-12)
    np.testing.assert_allclose(d.sum(axis=0) * 50.0, [0.1, 0.3])
    # 3 racks in a row, 1 slot, boost 1: end racks (d_end 0) get factor 2, the middle 1 + e^-1, so
    # D[0, 1] / D[1, 1] = (e^-1 * 2) / (1 * (1 + e^-1)) = 2 / (e + 1) = 0.5379
    geo = RoomGeometry(
        n_racks=3, racks_per_row=3, servers_per_rack=1, source_base=1.0, row_end_boost=1.0, **common
    )
    d = recirculation_from_geometry(geo)
    assert d[0, 1] / d[1, 1] == pytest.approx(2 / (e + 1))


def test_default_geometry_properties() -> None:
    geo = RoomGeometry()
    d = recirculation_from_geometry(geo)
    assert d.shape == (672, 672) and np.all(d >= 0)
    # mean recirculated fraction per source = recirc_fraction; every source well below 1
    frac = d.sum(axis=0) * geo.air_mass_flow_kg_s * geo.cp_air
    assert frac.mean() == pytest.approx(0.2) and frac.max() < 0.5
    full = 20.0 + d @ np.full(672, 300.0)
    idle = 20.0 + d @ np.full(672, 100.0)
    by_rack = full.reshape(16, 42)
    assert np.all(by_rack[:, -1] > by_rack[:, 0] + 3.0)  # top-of-rack hot spots in every rack
    assert np.all(np.diff(by_rack, axis=1) > 0)  # monotone up the rack
    assert np.all(full > idle)
    assert 27.0 <= full.max() <= 32.0 and 20.0 <= full.min() <= 21.0
    assert 22.0 <= idle.max() <= 24.0
    # recirculation decays with distance: top of rack 3 gets more from rack 3 than from 4, than from 7
    top = 3 * 42 + 41
    assert d[top, 3 * 42 + 41] > d[top, 4 * 42 + 41] > d[top, 7 * 42 + 41] > 0


def test_full_size_room_pue() -> None:
    m = RoomModel.from_geometry()
    s = m.evaluate(np.full(672, 24))
    assert s.it_power_w == pytest.approx(672 * 300.0)  # 201.6 kW
    assert s.pue == pytest.approx(1.0 + 1.0 / 3.194 + 0.05)  # fixed 20 degC: PUE does not depend on D
    assert 27.0 <= s.max_inlet_c <= 32.0 and s.redline_exceeded
    # redline mode must cool harder than 20 degC at full load (hot spot above 27) and relax when idle
    r = RoomModel.from_geometry(params=ThermalParams(supply_mode="redline"))
    assert r.evaluate(np.full(672, 24)).t_supply_c < 20.0 < r.evaluate(np.zeros(672)).t_supply_c
    assert r.evaluate(np.full(672, 24)).max_inlet_c == pytest.approx(27.0)


# ---------------------------------------------------------------- calibration


def _samples(d: np.ndarray, s: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    powers = rng.uniform(100.0, 300.0, size=(s, d.shape[0]))
    t_sup = rng.uniform(18.0, 22.0, size=s)
    inlet = t_sup[:, None] + powers @ d.T + rng.normal(0.0, noise, size=powers.shape)
    return powers, inlet, t_sup


def test_calibration_recovers_known_d() -> None:
    d_true = recirculation_from_geometry(RoomGeometry(n_racks=2, racks_per_row=2, servers_per_rack=3))
    powers, inlet, t_sup = _samples(d_true, 40, 0.0, seed=2)
    d_fit, rmse = calibrate_recirculation(powers, inlet, t_sup)
    np.testing.assert_allclose(d_fit, d_true, atol=1e-8)
    assert rmse < 1e-8
    # 0.02 K sensor noise, 400 samples: entries within 2e-4 K/W (entries themselves are up to ~1e-3)
    powers, inlet, t_sup = _samples(d_true, 400, 0.02, seed=3)
    d_fit, rmse = calibrate_recirculation(powers, inlet, t_sup)
    assert np.all(d_fit >= 0)
    assert np.abs(d_fit - d_true).max() < 2e-4
    assert 0.015 < rmse < 0.025  # about the noise level


def test_calibration_enforces_non_negativity() -> None:
    # a sparse D (true zeros) with 0.05 K noise and a scalar supply: plain least squares goes negative,
    # the constrained fit must not, and must stay close to the truth
    d_true = np.array([[0.004, 0.0, 0.0], [0.0, 0.006, 0.001], [0.0, 0.0, 0.008]])
    rng = np.random.default_rng(4)
    powers = rng.uniform(100.0, 300.0, size=(30, 3))
    inlet = 20.0 + powers @ d_true.T + rng.normal(0.0, 0.05, size=powers.shape)
    unconstrained = np.linalg.lstsq(powers, inlet - 20.0, rcond=None)[0].T
    assert unconstrained.min() < 0  # the constraint really binds in this case
    d_fit, rmse = calibrate_recirculation(powers, inlet, 20.0)
    assert np.all(d_fit >= 0)
    assert np.abs(d_fit - d_true).max() < 1e-3
    assert rmse < 0.06


def test_calibration_rejects_bad_input() -> None:
    p = np.full((5, 3), 200.0)
    with pytest.raises(ValueError, match="inlet_temps"):
        calibrate_recirculation(p, np.zeros((5, 2)), 20.0)
    with pytest.raises(ValueError, match="t_supply"):
        calibrate_recirculation(p, np.zeros((5, 3)), np.zeros(4))
    with pytest.raises(ValueError, match="powers"):
        calibrate_recirculation(np.zeros(3), np.zeros(3), 20.0)
    with pytest.raises(ValueError, match=r"powers: need at least n=3 samples"):
        calibrate_recirculation(p[:2], np.zeros((2, 3)), 20.0, ridge=0.0)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"supply_mode": "auto"}, "supply_mode"),
        ({"t_supply_min_c": 25.0, "t_supply_max_c": 20.0}, "t_supply_min_c"),
        ({"air_mass_flow_kg_s": 0.0}, "air_mass_flow_kg_s"),
        ({"cp_air": -1.0}, "cp_air"),
        ({"p_other_fraction": -0.1}, "p_other_fraction"),
        ({"redline_c": float("nan")}, "redline_c"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ThermalParams(**kwargs)  # type: ignore[arg-type]


def test_invalid_geometry_and_room_inputs() -> None:
    with pytest.raises(ValueError, match="recirc_fraction"):
        RoomGeometry(recirc_fraction=1.0)
    with pytest.raises(ValueError, match="vertical_decay_m"):
        RoomGeometry(vertical_decay_m=0.0)
    with pytest.raises(ValueError, match="d must be a square"):
        RoomModel(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="d must be finite and non-negative"):
        RoomModel(-D2)
    with pytest.raises(ValueError, match="busy_cores"):
        room2().evaluate(np.array([25, 0]))
    with pytest.raises(ValueError, match="busy_cores"):
        room2().evaluate(np.array([1, 2, 3]))


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.45])
def test_the_fleet_files_recirc_fraction_sets_the_mean_inlet_rise(fraction: float) -> None:
    """At a uniform load the mean inlet rise is recirc_fraction × P / (ṁ c_p) (the model's scale, docs/thermal.md):
    a room parameterised in the fleet file (`room: {recirc_fraction: …}`) is served with exactly that scale."""
    data = yaml.safe_load(Path(SMALL_FLEET).read_text())
    data["datacenters"][0]["room"] = {"recirc_fraction": fraction}
    dc = parse_fleet(data).datacenters[0]
    room = room_for(dc)
    busy = room.total_cores / 2  # every server half busy: the same power everywhere
    state = room.evaluate(busy)
    p = float(state.power_w[0])
    assert np.allclose(state.power_w, p)
    rise = state.inlet_c - room.params.t_supply_c
    assert float(rise.mean()) == pytest.approx(fraction * p / (room.params.air_mass_flow_kg_s * room.params.cp_air),
                                               rel=1e-9)
