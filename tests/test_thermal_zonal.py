"""The zonal recirculation operator (hsched.thermal.zonal): hand values, incremental == full, fit to the dense model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.domain.fleet import load_fleet
from hsched.thermal import RoomGeometry, RoomModel, recirculation_from_geometry
from hsched.thermal.datacenter import room_for
from hsched.thermal.zonal import ZonalRecirculation

# Two racks of two servers, both racks neighbours of each other, plus a room-wide term.
TINY = dict(zone=[0, 0, 1, 1], a=[1.0, 2.0, 1.0, 1.0], b=[1.0, 1.0, 2.0, 1.0],
            nbr=[[0, 1], [1, 0]], w=[[0.01, 0.005], [0.01, 0.005]], m=0.001)


def tiny() -> ZonalRecirculation:
    return ZonalRecirculation(**TINY)


def brute_headroom(d: np.ndarray, rise: np.ndarray, limit: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, (limit - rise)[:, None] / d, np.inf).min(axis=0)


def test_tiny_room_by_hand() -> None:
    op = tiny()
    # W[0] = (0.01 from zone 0, 0.005 from zone 1); W[1] = (0.01 from 1, 0.005 from 0): symmetric here
    p = np.array([100.0, 200.0, 100.0, 0.0])
    # escaped heat per zone: b*P summed: zone 0 = 100 + 200 = 300, zone 1 = 2*100 + 0 = 200; all = 500
    # zone rises: U0 = 0.01*300 + 0.005*200 = 4, U1 = 0.01*200 + 0.005*300 = 3.5; room-wide 0.001*500 = 0.5
    # rise_i = a_i (U + 0.5)
    np.testing.assert_allclose(op.matvec(p), [4.5, 9.0, 4.0, 4.0], rtol=1e-12)
    # D[:, 0] = a * b_0 * (W[z, 0] + m) = [1, 2, 1, 1] * [0.011, 0.011, 0.006, 0.006]
    np.testing.assert_allclose(op.column(0), [0.011, 0.022, 0.006, 0.006], rtol=1e-12)
    np.testing.assert_allclose(op.to_dense()[:, 2], [0.012, 0.024, 0.022, 0.022], rtol=1e-12)
    # limit 10 K: slack = [5.5, 1, 6, 6]; zone slacks min(slack / a) = [0.5, 6]
    # k=0: min(0.5 / 0.011, 6 / 0.006) = 45.45...; k=2 (b = 2): min(0.5 / 0.012, 6 / 0.022) = 41.66...
    # k=3: min(0.5 / 0.006, 6 / 0.011) = 83.33...
    np.testing.assert_allclose(op.headroom(op.matvec(p), 10.0), [0.5 / 0.011, 0.5 / 0.011, 0.5 / 0.012, 0.5 / 0.006],
                               rtol=1e-12)
    t = op.tracker(p)
    t.add(3, 100.0)  # zone 1 gains 100 W escaped: U0 += 0.5, U1 += 1, room-wide += 0.1
    np.testing.assert_allclose(t.rise(), [5.1, 10.2, 5.1, 5.1], rtol=1e-12)
    assert t.max_rise() == pytest.approx(10.2)
    np.testing.assert_allclose(op.column_sums(), op.to_dense().sum(axis=0), rtol=1e-12)


def test_bad_operators_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="w must be finite and >= 0"):
        ZonalRecirculation(**{**TINY, "w": [[0.01, -1.0], [0.01, 0.005]]})
    with pytest.raises(ValueError, match="m must be"):
        ZonalRecirculation(**{**TINY, "m": -0.1})
    with pytest.raises(ValueError, match="zone must be in"):
        ZonalRecirculation(**{**TINY, "zone": [0, 0, 1, 2]})
    with pytest.raises(ValueError, match="twice"):
        ZonalRecirculation(**{**TINY, "nbr": [[0, 0], [1, 0]]})
    with pytest.raises(ValueError, match="reach_m"):
        ZonalRecirculation.from_geometry(RoomGeometry(), reach_m=-1.0)


@st.composite
def operators(draw):
    n_zones = draw(st.integers(1, 5))
    n = draw(st.integers(1, 12))
    zone = np.array(draw(st.lists(st.integers(0, n_zones - 1), min_size=n, max_size=n)))
    coef = st.one_of(st.just(0.0), st.floats(0.01, 3.0))
    a = np.array(draw(st.lists(coef, min_size=n, max_size=n)))
    b = np.array(draw(st.lists(coef, min_size=n, max_size=n)))
    width = draw(st.integers(1, n_zones))
    nbr = np.full((n_zones, width), -1)
    for r in range(n_zones):
        chosen = draw(st.lists(st.integers(0, n_zones - 1), unique=True, max_size=width))
        nbr[r, : len(chosen)] = chosen
    w = np.array(draw(st.lists(st.lists(st.one_of(st.just(0.0), st.floats(1e-4, 0.05)), min_size=width,
                                        max_size=width), min_size=n_zones, max_size=n_zones)))
    m = draw(st.one_of(st.just(0.0), st.floats(1e-5, 0.01)))
    return ZonalRecirculation(zone, a, b, nbr, w, m)


@settings(max_examples=150, deadline=None)
@given(op=operators(), data=st.data())
def test_incremental_updates_equal_a_full_recompute(op: ZonalRecirculation, data) -> None:
    """Any sequence of per-server power changes (one at a time or a whole new power vector) leaves the tracker's
    rise, max rise and headroom equal to the full product and the brute-force headroom of the dense matrix."""
    n = op.n
    watts = st.floats(0.0, 400.0)
    power = np.array(data.draw(st.lists(watts, min_size=n, max_size=n)))
    t = op.tracker(power)
    d = op.to_dense()
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            k = data.draw(st.integers(0, n - 1))
            new = data.draw(watts)
            t.add(k, new - power[k])
            power[k] = new
        else:
            power = power.copy()
            for k in data.draw(st.lists(st.integers(0, n - 1), max_size=n)):
                power[k] = data.draw(watts)
            t.set_power(power)
        rise = d @ power
        np.testing.assert_allclose(t.rise(), rise, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(op.matvec(power), rise, rtol=1e-9, atol=1e-9)
        assert t.max_rise() == pytest.approx(rise.max(), rel=1e-9, abs=1e-9)
        # a limit that leaves some inlets hot and some not (and, drawn low, all hot)
        limit = data.draw(st.floats(-1.0, float(rise.max()) * 1.5 + 1.0))
        expected = brute_headroom(d, rise, limit)
        np.testing.assert_allclose(op.headroom(rise, limit), expected, rtol=1e-7, atol=1e-6)
        np.testing.assert_allclose(t.headroom(limit), expected, rtol=1e-7, atol=1e-6)
    nodes = np.array(data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)), dtype=np.intp)
    dp = np.linspace(1.0, 2.0, nodes.size)
    np.testing.assert_allclose(op.rise_of(nodes, dp), d[:, nodes] @ dp, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(op.column_sums(), d.sum(axis=0), rtol=1e-9, atol=1e-12)


def test_a_dense_matrix_is_served_exactly() -> None:
    d = recirculation_from_geometry(RoomGeometry(n_racks=3, racks_per_row=3, servers_per_rack=4))
    op = ZonalRecirculation.from_dense(d)
    p = np.linspace(100.0, 300.0, op.n)
    np.testing.assert_allclose(op.matvec(p), d @ p, rtol=1e-12)
    np.testing.assert_allclose(op.headroom(d @ p, 7.0), brute_headroom(d, d @ p, 7.0), rtol=1e-12)
    assert op.to_dense() is d or np.array_equal(op.to_dense(), d)


# Fit to the dense model on the default room (16 racks of 42 in 2 rows of 8): bench/thermal_scale.py prints
# the measured figures (max 0.014 K, mean 0.0008 K); the bound here leaves room for other loads.
FIT_MAX_K = 0.05
FIT_MEAN_K = 0.005


def test_fit_to_the_dense_model_on_the_default_room_is_within_the_stated_bound() -> None:
    g = RoomGeometry()
    d = recirculation_from_geometry(g)
    op = ZonalRecirculation.from_geometry(g)
    rng = np.random.default_rng(7)
    p = rng.uniform(100.0, 300.0, (40, g.n_servers))
    p[:10] = 300.0  # the hottest room too
    err = np.abs(np.array([op.matvec(x) for x in p]) - p @ d.T)
    assert err.max() <= FIT_MAX_K and err.mean() <= FIT_MEAN_K
    assert err.max() > 0  # something is cut off: the reach (3.6 m) is shorter than the room (4.2 m rows)
    # reaching across the whole room it is the dense model itself
    whole = ZonalRecirculation.from_geometry(g, reach_m=100.0)
    assert not whole.m.any()
    np.testing.assert_allclose(whole.to_dense(), d, rtol=1e-10)
    # the mean share of heat that recirculates is kept (the scale is the dense model's)
    frac = op.column_sums() * g.air_mass_flow_kg_s * g.cp_air
    assert frac.mean() == pytest.approx(g.recirc_fraction, rel=0.01)


def test_a_large_room_is_linear_in_memory_and_close_to_dense() -> None:
    """2 rows of 60 racks (5,040 servers): neighbour lists stay short; a slice of rows checks against dense."""
    g = RoomGeometry(n_racks=120, racks_per_row=60)
    op = ZonalRecirculation.from_geometry(g)
    assert op.nbr.shape[1] <= 25  # racks within 3.6 m: 13 in the row, 11 across the aisle
    assert op.nbr.nbytes + op.w.nbytes + op.src_zones.nbytes + op.src_w.nbytes < 8 * 4 * 121 * 25
    p = np.full(g.n_servers, 200.0)
    rise = op.matvec(p)
    dense_op = ZonalRecirculation.from_geometry(g, reach_m=1e9)  # full rack coupling, (R, R): the dense model
    err = np.abs(dense_op.matvec(p) - rise)
    assert err.max() <= FIT_MAX_K


def test_room_for_serves_the_zonal_model() -> None:
    dc = load_fleet(None).datacenter("chicago")
    room = room_for(dc)
    assert isinstance(room.recirc, ZonalRecirculation) and room.recirc.n_zones == dc.layout.racks
    assert room.n == RoomGeometry().n_servers  # the default room
    dense = RoomModel(recirculation_from_geometry(RoomGeometry()), room.params, p_idle_w=room.p_idle_w,
                      p_full_w=room.p_full_w, total_cores=room.total_cores)
    busy = room.total_cores / 2
    diff = np.abs(room.evaluate(busy).inlet_c - dense.evaluate(busy).inlet_c)
    assert 0 < diff.max() <= FIT_MAX_K
