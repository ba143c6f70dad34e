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


def reference_server_headroom(op: ZonalRecirculation, s: np.ndarray) -> np.ndarray:
    """server_headroom as written before its constants were cached (np.where over every quotient)."""
    r = op.n_zones
    den = op.src_w[:r] + op.m[op.src_zones[:r]]
    with np.errstate(divide="ignore", invalid="ignore"):
        near = np.where(den > 0, s[op.src_zones[:r]] / den, np.inf).min(axis=1, initial=np.inf)
        far_ratio = np.where(op.m[:r] > 0, s[:r] / op.m[:r], np.inf)
    ok = s[:r] > 0
    far = np.full(r, far_ratio[ok].min() if ok.any() else np.inf)
    hot = np.flatnonzero(~ok & np.isfinite(far_ratio))
    if hot.size:
        cand = hot[np.argsort(far_ratio[hot], kind="stable")[: op.src_zones.shape[1] + 1]]
        near_to = (op.src_zones[:r, :, None] == cand[None, None, :]).any(axis=1)
        far = np.minimum(far, np.where(near_to, np.inf, far_ratio[cand][None, :]).min(axis=1))
    near = np.minimum(near, far)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(op.b > 0, near[op.zone] / op.b, np.inf)


@settings(max_examples=150, deadline=None)
@given(op=operators(), data=st.data())
def test_server_headroom_is_bit_for_bit_the_uncached_formula(op: ZonalRecirculation, data) -> None:
    """Zone slacks of any sign, infinite ones too: the same floats as the formula before the cache."""
    slack = st.one_of(st.floats(-5.0, 5.0), st.just(np.inf), st.just(0.0))
    s = np.array(data.draw(st.lists(slack, min_size=op.n_zones + 1, max_size=op.n_zones + 1)))
    s[-1] = np.inf
    assert op.server_headroom(s).tobytes() == reference_server_headroom(op, s).tobytes()


def test_server_headroom_of_the_fleet_rooms_is_the_uncached_formula() -> None:
    fleet = load_fleet(None)
    rng = np.random.default_rng(3)
    for name in ("chicago", "kansas-city"):
        op = room_for(fleet.datacenter(name)).recirc
        for _ in range(20):
            s = rng.normal(1.0, 1.0, op.n_zones + 1)
            s[rng.random(op.n_zones + 1) < 0.1] = np.inf
            s[-1] = np.inf
            assert op.server_headroom(s).tobytes() == reference_server_headroom(op, s).tobytes()


def test_a_dense_matrix_is_served_exactly() -> None:
    d = recirculation_from_geometry(RoomGeometry(n_racks=3, racks_per_row=3, servers_per_rack=4))
    op = ZonalRecirculation.from_dense(d)
    p = np.linspace(100.0, 300.0, op.n)
    np.testing.assert_allclose(op.matvec(p), d @ p, rtol=1e-12)
    np.testing.assert_allclose(op.headroom(d @ p, 7.0), brute_headroom(d, d @ p, 7.0), rtol=1e-12)
    assert op.to_dense() is d or np.array_equal(op.to_dense(), d)


# The served model's fit to the dense one in a long room (bench/thermal_scale.py prints it at 5,040 and 10,080
# servers: random loads max 0.003 K, whole racks at random full or idle max 0.034 K); the bounds leave room.
FIT_RANDOM_K = 0.01
FIT_SKEWED_K = 0.05


def fit_errors(op: ZonalRecirculation, d: np.ndarray, loads: np.ndarray) -> np.ndarray:
    return np.abs(np.array([op.matvec(x) for x in loads]) - loads @ d.T)


def test_the_default_room_fits_within_the_reach_so_it_is_the_dense_model() -> None:
    g = RoomGeometry()  # 2 rows of 8 racks: 4.2 m long, 4.4 m corner to corner, within the 6 m reach
    d = recirculation_from_geometry(g)
    op = ZonalRecirculation.from_geometry(g)
    assert not op.m.any() and op.nbr.shape[1] == g.n_racks
    np.testing.assert_allclose(op.to_dense(), d, rtol=1e-10)
    frac = op.column_sums() * g.air_mass_flow_kg_s * g.cp_air  # the mean share of heat that recirculates
    assert frac.mean() == pytest.approx(g.recirc_fraction, rel=1e-9)


@pytest.mark.parametrize("far", ["fold", "mean"])
def test_a_reach_shorter_than_the_room_is_exact_at_a_uniform_load_and_close_otherwise(far: str) -> None:
    g = RoomGeometry()
    d = recirculation_from_geometry(g)
    op = ZonalRecirculation.from_geometry(g, reach_m=3.6, far=far)  # the row ends are 4.2 m apart
    assert op.m.any() == (far == "mean")
    uniform = np.full((1, g.n_servers), 250.0)
    assert fit_errors(op, d, uniform).max() <= 1e-9  # what the fit makes exact
    loads = np.random.default_rng(7).uniform(100.0, 300.0, (20, g.n_servers))
    err = fit_errors(op, d, loads)
    assert 0 < err.max() <= 0.05 and err.mean() <= 0.002


def long_room() -> RoomGeometry:
    return RoomGeometry(n_racks=60, racks_per_row=30, servers_per_rack=10)  # 17.4 m rows, 600 servers


def test_the_served_model_of_a_long_room_is_close_to_dense_and_conservative_on_headroom() -> None:
    g = long_room()
    d = recirculation_from_geometry(g)
    op = ZonalRecirculation.from_geometry(g)
    assert not op.m.any() and op.nbr.shape[1] < g.n_racks  # sparse: racks beyond 6 m are not coupled
    rng = np.random.default_rng(3)
    assert fit_errors(op, d, np.full((1, g.n_servers), 300.0)).max() <= 1e-9
    assert fit_errors(op, d, rng.uniform(100.0, 300.0, (20, g.n_servers))).max() <= FIT_RANDOM_K
    rack = np.arange(g.n_servers) // g.servers_per_rack
    skewed = np.where(rng.random((20, g.n_racks))[:, rack] < 0.5, 300.0, 100.0)
    assert fit_errors(op, d, skewed).max() <= FIT_SKEWED_K
    # headroom: within 2 % of the dense model's, never above it (the folded tail only adds coupling nearby)
    p = rng.uniform(100.0, 300.0, g.n_servers)
    limit = float((d @ p).max()) + 0.5  # nothing hot yet
    ratio = op.headroom(op.matvec(p), limit) / brute_headroom(d, d @ p, limit)
    assert ratio.min() >= 0.98 and ratio.max() <= 1.0 + 1e-9


def test_a_hot_inlet_restricts_only_the_placements_within_reach() -> None:
    g = long_room()
    op = ZonalRecirculation.from_geometry(g)
    p = np.full(g.n_servers, 200.0)
    rise = op.matvec(p)
    hot = int(np.argmax(rise[: g.servers_per_rack]))  # top of rack 0, at the end of row 0
    limit = float(rise[hot]) - 0.1  # that inlet (and its like at the other row ends) past the limit
    head = op.headroom(rise, limit)
    x = (np.arange(g.n_servers) // g.servers_per_rack % g.racks_per_row) * g.rack_width_m
    y = (np.arange(g.n_servers) // g.servers_per_rack // g.racks_per_row) * g.row_spacing_m
    hot_racks = np.flatnonzero(rise > limit) // g.servers_per_rack
    dist = np.min(np.hypot(x[:, None] - (hot_racks % g.racks_per_row * g.rack_width_m)[None, :],
                           y[:, None] - (hot_racks // g.racks_per_row * g.row_spacing_m)[None, :]), axis=1)
    assert (head[dist <= 6.0] < 0).all() and (head[dist > 6.0] > 0).all()


def test_a_large_room_is_linear_in_memory() -> None:
    """2 rows of 120 racks (10,080 servers): short neighbour lists, no n x n anything."""
    g = RoomGeometry(n_racks=240, racks_per_row=120)
    op = ZonalRecirculation.from_geometry(g)
    assert op.nbr.shape[1] <= 45  # racks within 6 m: 21 in the row, 19 across each aisle
    arrays = sum(v.nbytes for v in vars(op).values() if isinstance(v, np.ndarray))
    assert arrays < 40 * g.n_servers * 8  # O(n): some forty floats per server, against 10,080 for dense
    rise = op.matvec(np.full(g.n_servers, 200.0))
    full = ZonalRecirculation.from_geometry(g, reach_m=1e9)  # the dense model, coupled per rack (R x R)
    assert np.abs(full.matvec(np.full(g.n_servers, 200.0)) - rise).max() <= 1e-9


def test_room_for_serves_the_zonal_model() -> None:
    dc = load_fleet(None).datacenter("chicago")
    room = room_for(dc)
    assert isinstance(room.recirc, ZonalRecirculation) and room.recirc.n_zones == dc.layout.racks
    assert room.n == RoomGeometry().n_servers  # the default room
    dense = RoomModel(recirculation_from_geometry(RoomGeometry()), room.params, p_idle_w=room.p_idle_w,
                      p_full_w=room.p_full_w, total_cores=room.total_cores)
    busy = room.total_cores / 2
    diff = np.abs(room.evaluate(busy).inlet_c - dense.evaluate(busy).inlet_c)
    assert diff.max() <= 1e-9  # the default room is within the reach
