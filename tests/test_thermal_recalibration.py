"""The thermal service as the authority on the room model: sensor readings → online refit → published versions
→ the placers' guard (docs/thermal.md, "Online recalibration"). Real Redis, real gRPC servers in-process."""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.cli import main as cli_main
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import load_fleet
from hsched.state.keys import Keys
from hsched.thermal.datacenter import room_for
from hsched.thermal.published import GROUP, ModelFollower, ModelStore, ScanAssembler
from hsched.thermal.readings import Reading, load_readings, parse_reading, synthetic_readings
from hsched.thermal.refit import Scans, fit, from_json, recalibrate, rmse_k, to_json, zone_data
from hsched.thermal.zonal import ZonalRecirculation
from hsched.v1 import common_pb2, placer_pb2, placer_pb2_grpc, thermal_pb2, thermal_pb2_grpc
from tests import inprocess
from tests.conftest import SMALL_FLEET

DC = "cheap"  # 2 racks x 2 servers (nodes 0, 1: rack 0), 24 cores each, supply 20 °C, redline 27 °C


def cheap():
    return next(dc for dc in load_fleet(SMALL_FLEET).datacenters if dc.name == DC)


# -- the fit: by hand ------------------------------------------------------------------------------------------

def test_fit_recovers_a_hand_computed_two_zone_coupling() -> None:
    # two zones of one server each, a = b = 1: rise = W @ P; scans P = (100, 0), (0, 100), (100, 100), (50, 150)
    w = np.array([[0.02, 0.01], [0.005, 0.03]])
    op = ZonalRecirculation.from_dense(np.zeros((2, 2)))
    p = np.array([[100.0, 0.0], [0.0, 100.0], [100.0, 100.0], [50.0, 150.0]])
    rise = p @ w.T  # (2.0, 0.5), (1.0, 3.0), (3.0, 3.5), (2.5, 4.75)
    assert rise == pytest.approx(np.array([[2.0, 0.5], [1.0, 3.0], [3.0, 3.5], [2.5, 4.75]]))
    got = fit(op, Scans(p, rise), ridge=0.0, prior_weight=0.0)  # the plain least-squares fit
    assert got.to_dense() == pytest.approx(w, abs=1e-12)
    assert rmse_k(got, Scans(p, rise)) == pytest.approx(0.0, abs=1e-12)


def test_the_current_model_weighs_as_prior_scans_by_hand() -> None:
    # one zone, a = b = 1, current W = 0.01; one scan q = 100 with u = 2 (W = 0.02 alone). The prior is one scan
    # q = 100 (lam^2 = 1 * 100^2) with u = 0.01 * 100 = 1: min (100 w - 2)^2 + (100 w - 1)^2 → w = 300 / 20000
    op = ZonalRecirculation.from_dense([[0.01]])
    got = fit(op, Scans(np.array([[100.0]]), np.array([[2.0]])), ridge=0.0, prior_weight=1.0)
    assert got.to_dense()[0, 0] == pytest.approx(0.015, abs=1e-12)
    # two zones at a steady load: the scans fix W @ q only; the prior keeps the rest of the current model
    cur = np.array([[0.02, 0.01], [0.01, 0.02]])
    steady = Scans(np.full((10, 2), 100.0), np.tile(cur @ [100.0, 100.0], (10, 1)))
    assert fit(ZonalRecirculation.from_dense(cur), steady, ridge=0.0).to_dense() == pytest.approx(cur, abs=1e-12)


def test_zone_rise_is_the_least_squares_value_over_a_zones_servers() -> None:
    # one zone of two servers with a = (1, 2), b = (1, 1): q = P0 + P1 = 300; rises (3, 6) → u = (3 + 12) / 5 = 3
    op = ZonalRecirculation([0, 0], [1.0, 2.0], [1.0, 1.0], [[0]], [[0.01]])
    q, u = zone_data(op, Scans(np.array([[100.0, 200.0]]), np.array([[3.0, 6.0]])))
    assert q.tolist() == [[300.0]] and u[0, 0] == pytest.approx(3.0)


def test_refit_of_a_zonal_room_finds_the_hot_rack_and_keeps_the_profiles() -> None:
    op = room_for(cheap()).recirc
    truth = op.with_self_coupling_scaled(0, 6.0)
    rng = np.random.default_rng(1)
    p = rng.uniform(100, 300, (60, op.n))
    rise = np.stack([truth.matvec(x) for x in p]) + rng.normal(0, 0.05, (60, op.n))
    verdict = recalibrate(op, Scans(p, rise))  # (the current model weighs as 0.01 of the 45 scans fitted on)
    assert verdict.accepted, verdict.detail
    strongest = truth.w[:2].max()  # rack 0's own coupling, 6x the geometry's
    assert verdict.model.w[:2] == pytest.approx(truth.w[:2], abs=0.05 * strongest)
    assert verdict.model.a.tolist() == op.a.tolist() and verdict.model.b.tolist() == op.b.tolist()
    assert verdict.rmse_new_k < 0.1 < verdict.rmse_current_k
    again = from_json(to_json(verdict.model))  # the published form is the operator
    assert again.to_dense() == pytest.approx(verdict.model.to_dense(), abs=0)


def test_refit_of_a_dense_room_is_the_dense_calibration() -> None:
    rng = np.random.default_rng(2)
    truth = rng.uniform(0, 0.01, (5, 5))
    p = rng.uniform(100, 300, (40, 5))
    verdict = recalibrate(ZonalRecirculation.from_dense(np.full((5, 5), 0.002)), Scans(p, p @ truth.T),
                          prior_weight=0.0)
    assert verdict.accepted and verdict.model._dense is not None
    assert verdict.model.to_dense() == pytest.approx(truth, abs=1e-6)


def test_refit_refuses_constant_loads_and_fits_no_better_than_the_current_model() -> None:
    op = room_for(cheap()).recirc
    same = Scans(np.full((24, op.n), 200.0), np.stack([op.matvec(np.full(op.n, 200.0))] * 24))
    v = recalibrate(op, same)
    assert not v.accepted and v.reason == "ill_conditioned" and v.condition > 1e8
    idle_rack = Scans(np.where(op.zone == 1, 0.0, 200.0) * np.ones((24, 1)), same.rise_k)
    assert recalibrate(op, idle_rack).reason == "ill_conditioned"  # rack 1 never dissipates: inf
    rng = np.random.default_rng(3)
    p = rng.uniform(100, 300, (24, op.n))
    agrees = Scans(p, np.stack([op.matvec(x) for x in p]) + rng.normal(0, 0.05, (24, op.n)))
    v = recalibrate(op, agrees)  # readings the current model already explains: nothing to gain
    assert not v.accepted and v.reason == "not_better"
    assert recalibrate(op, Scans(p[:3], agrees.rise_k[:3])).reason == "too_few_scans"
    steady = np.full((40, op.n), 200.0) + rng.normal(0, 4.0, (40, op.n))  # a steady load, noisy power readings
    noisy = Scans(steady, np.stack([op.matvec(x) for x in steady]) + rng.normal(0, 0.1, (40, op.n)))
    assert recalibrate(op, noisy).reason == "not_better"  # noise fitted is not published


# -- readings: validation --------------------------------------------------------------------------------------

GOOD = {"datacenter": DC, "sample": "s1", "node": 2, "inlet_c": 21.5, "outlet_c": 30.0, "supply_c": 20.0,
        "unix_ms": 1_700_000_000_000}


def test_a_good_reading_parses_and_round_trips_the_stream() -> None:
    r = parse_reading(GOOD, n=4)
    assert r == Reading(DC, "s1", 2, 21.5, 30.0, 20.0, 1_700_000_000_000, None)
    assert parse_reading(json.loads(r.to_stream()["r"]), datacenter=DC, n=4) == r
    assert parse_reading({**GOOD, "node": "cheap-r01-s00"}, nodes={"cheap-r01-s00": 2}).node == 2


@pytest.mark.parametrize(("change", "field"), [
    ({"inlet_c": "warm"}, "inlet_c"), ({"inlet_c": math.nan}, "inlet_c"), ({"supply_c": 500}, "supply_c"),
    ({"outlet_c": 21.0}, "outlet_c"), ({"node": -1}, "node"), ({"node": 4}, "node"), ({"node": "x"}, "node"),
    ({"node": 1.5}, "node"), ({"sample": ""}, "sample"), ({"sample": "x" * 200}, "sample"),
    ({"unix_ms": -5}, "unix_ms"), ({"power_w": -1}, "power_w"), ({"colour": "red"}, "colour"),
    ({"datacenter": None}, "datacenter"), ({"datacenter": 3}, "datacenter")])
def test_a_bad_reading_names_its_field(change: dict, field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        parse_reading({**GOOD, **change}, "f.jsonl:3", nodes={}, n=4)
    assert exc.value.field == f"f.jsonl:3.{field}"


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["datacenter", "sample", "node", "inlet_c", "outlet_c", "supply_c",
                                        "unix_ms", "power_w", "extra"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)), max_size=9))
def test_any_mapping_is_a_valid_reading_or_a_validation_error_naming_a_field(raw: dict) -> None:
    try:
        r = parse_reading(raw, "x", n=4)
    except ValidationError as exc:
        assert exc.field.startswith("x.") and exc.field[2:] in {*raw, "datacenter", "sample", "node", "inlet_c",
                                                                 "outlet_c", "supply_c"}
        return
    assert 0 <= r.node < 4 and -20 <= r.supply_c <= r.inlet_c <= r.outlet_c <= 100
    assert isinstance(r.node, int) and isinstance(r.unix_ms, int) and 0 < r.unix_ms <= 253_402_300_799_999


@pytest.mark.parametrize(("change", "message"), [
    # integer fields are typed as a task file's (hsched.taskfile): an int, or its text in a CSV; never 1.0 or 1e30
    ({"node": 1.0}, "node: must be an integer (got 1.0)"),
    ({"node": "1.0"}, "node: must be a server index (an integer >= 0) (got '1.0')"),
    ({"node": True}, "node: must be an integer (got True)"),
    ({"node": -1}, "node: must be in 0..4294967295 (got -1)"),  # LoadDelta.node_index: uint32
    ({"node": "²"}, "node: must be a server index (an integer >= 0) (got '²')"),  # str.isdigit() says it is one
    ({"unix_ms": 1e30}, "unix_ms: must be an integer (got 1e+30)"),
    ({"unix_ms": 1.7e12}, "unix_ms: must be an integer (got 1700000000000.0)"),
    ({"unix_ms": "1.7e12"}, "unix_ms: must be an integer (got '1.7e12')"),
    ({"unix_ms": 10**30}, "unix_ms: must be in -9223372036854775808..9223372036854775807 (got "
                          "1000000000000000000000000000000)"),  # int64, as TaskEvent.unix_ms
    ({"unix_ms": 253_402_300_800_000}, "unix_ms: must be a unix time in ms, in 1..253402300799999 (1970 to the "
                                       "year 9999) (got 253402300800000)"),  # 10000-01-01T00:00:00Z
    ({"unix_ms": "0"}, "unix_ms: must be a unix time in ms, in 1..253402300799999 (1970 to the year 9999) "
                       "(got '0')"),
    ({"unix_ms": "9" * 5000}, "unix_ms: must be an integer of at most 4300 digits (got '999999999"),
    # the inlet is the supply plus recirculated exhaust: never below the supply
    ({"supply_c": 21.6}, "supply_c: must be <= inlet_c (21.5 °C): the inlet air is the supply air plus "
                         "recirculated exhaust (got 21.6)"),
    ({"supply_c": "30", "outlet_c": 40}, "supply_c: must be <= inlet_c (21.5 °C)"),
])
def test_a_reading_refuses_non_integers_absurd_times_and_a_supply_above_the_inlet(change: dict, message) -> None:
    with pytest.raises(ValidationError) as exc:
        parse_reading({**GOOD, **change}, "f.jsonl:3", n=4)
    assert str(exc.value).startswith(f"f.jsonl:3.{message}"), str(exc.value)


@pytest.mark.parametrize(("change", "got"), [
    ({"node": "3"}, {"node": 3}), ({"node": " +3 "}, {"node": 3}),  # a CSV's text
    ({"unix_ms": "1700000000001"}, {"unix_ms": 1_700_000_000_001}), ({"unix_ms": 1}, {"unix_ms": 1}),
    ({"unix_ms": 253_402_300_799_999}, {"unix_ms": 253_402_300_799_999}),  # 9999-12-31T23:59:59.999Z
    ({"supply_c": 21.5}, {"supply_c": 21.5})])  # no recirculation at all: the inlet is the supply
def test_a_reading_takes_integers_as_text_and_the_edges_of_its_rules(change: dict, got: dict) -> None:
    r = parse_reading({**GOOD, **change}, n=4)
    assert {k: getattr(r, k) for k in got} == got


def test_synthetic_readings_are_valid_readings_even_where_noise_crosses_the_supply() -> None:
    """The simulated sensors' scans go through parse_reading on the stream: noise must not make an inlet read
    below the supply (no recirculation: inlet = supply, and half the noisy inlets would)."""
    rng = np.random.default_rng(3)
    readings = synthetic_readings(DC, "s", 20.0, np.full(64, 20.0), np.full(64, 200.0), 0.01, 0.5, rng,
                                  unix_ms=1_700_000_000_000)
    assert min(r.inlet_c for r in readings) == readings[0].supply_c  # the noise did cross it, and was clipped
    for r in readings:
        assert parse_reading(json.loads(r.to_stream()["r"]), datacenter=DC, n=64) == r


def test_a_file_of_readings_is_validated_line_by_line(tmp_path) -> None:
    good = tmp_path / "r.csv"
    good.write_text("datacenter,sample,node,inlet_c,outlet_c,supply_c\ncheap,a,0,21,28,20\ncheap,a,1,22,30,20\n")
    assert [r.node for r in load_readings(good)] == [0, 1]
    bad = tmp_path / "r.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "outlet_c": 1}) + "\n")
    with pytest.raises(ValidationError, match=r"r.jsonl:2.outlet_c: must be >= inlet_c"):
        load_readings(bad)
    headless = tmp_path / "h.csv"
    headless.write_text("dc,node\ncheap,0\n")
    with pytest.raises(ValidationError, match="header"):
        load_readings(headless)


def test_replay_cli_refuses_a_bad_file_with_exit_2_and_writes_nothing(tmp_path, capsys, private_runtime_dir) -> None:
    bad = tmp_path / "r.jsonl"
    bad.write_text(json.dumps({**GOOD, "datacenter": "nowhere"}) + "\n")
    assert cli_main(["thermal", "replay", str(bad), "--fleet", SMALL_FLEET]) == 2
    assert "r.jsonl:1.datacenter: is not a data center of the fleet" in capsys.readouterr().err


def test_replay_cli_dry_run_validates_names_and_writes_nothing(tmp_path, capsys, private_runtime_dir) -> None:
    good = tmp_path / "r.csv"
    good.write_text("datacenter,sample,node,inlet_c,outlet_c,supply_c,power_w\n"
                    "cheap,a,cheap-r01-s00,21,28,20,\ncheap,a,3,22,30,20,250\n")
    assert cli_main(["thermal", "replay", str(good), "--fleet", SMALL_FLEET, "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "2 valid readings, 1 scans (nothing written: --dry-run)" in out.out
    # 2 of cheap's 4 servers: the service would drop the scan, so the replay says so
    assert "warning: 1 scan(s) of cheap miss some of its 4 servers" in out.err
    good.write_text("datacenter,sample,node,inlet_c,outlet_c,supply_c\n"
                    + "".join(f"cheap,a,{n},21,28,20\n" for n in range(4)))
    assert cli_main(["thermal", "replay", str(good), "--fleet", SMALL_FLEET, "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err
    good.write_text("datacenter,sample,node,inlet_c,outlet_c,supply_c\ncheap,a,cheap-r09-s00,21,28,20\n")
    assert cli_main(["thermal", "replay", str(good), "--fleet", SMALL_FLEET, "--dry-run"]) == 2
    assert "r.csv:2.node: is not a server of this data center" in capsys.readouterr().err


def _keys_under(redis_url: str, prefix: str) -> list[bytes]:
    import redis as syncredis

    return sorted(syncredis.Redis.from_url(redis_url).scan_iter(match=f"{prefix}:*", count=1000))


def test_replay_cli_refuses_a_prefix_holding_no_deployment_and_writes_nothing(
        tmp_path, capsys, private_runtime_dir, monkeypatch, redis_url, prefix) -> None:
    """A mistyped --prefix wrote "4 readings ... written to <typo>:dc:cheap:readings", exit 0: streams nobody
    reads. Every deployment has its epoch marker (hsched.state.epoch); without it the replay writes nothing."""
    import redis as syncredis

    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({**GOOD, "node": i}) + "\n" for i in range(4)))
    monkeypatch.setenv("REDIS_URL", redis_url)
    typo = f"{prefix}:typo"  # under the fixture's prefix, so that a write the test catches is deleted with it
    assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET, "--prefix", typo]) == 2
    err = capsys.readouterr().err
    assert err == (f"hsched: --prefix: must name an hsched deployment: Redis at {redis_url} holds no {typo}:epoch "
                   f"(`hsched up` or a deployment's first service writes it); nothing written (got '{typo}')\n"), err
    assert _keys_under(redis_url, prefix) == []

    syncredis.Redis.from_url(redis_url).set(Keys(prefix).epoch, "e")  # a deployment's marker
    assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET, "--prefix", prefix]) == 0
    assert f"4 readings of 1 scans written to {prefix}:dc:{DC}:readings" in capsys.readouterr().out
    assert syncredis.Redis.from_url(redis_url).xlen(Keys(prefix).readings(DC)) == 4


@pytest.mark.parametrize(("line", "expected"), [
    ({"node": 3, "unix_ms": 1e30}, "r.jsonl:4.unix_ms: must be an integer (got 1e+30)"),
    ({"node": 3.0}, "r.jsonl:4.node: must be an integer (got 3.0)"),
    ({"node": 3, "supply_c": 22.0}, "r.jsonl:4.supply_c: must be <= inlet_c (21.5 °C)"),
])
def test_replay_cli_refuses_a_bad_last_line_in_one_line_and_writes_nothing_of_the_file(
        tmp_path, capsys, private_runtime_dir, monkeypatch, redis_url, prefix, line, expected) -> None:
    import redis as syncredis

    syncredis.Redis.from_url(redis_url).set(Keys(prefix).epoch, "e")
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({**GOOD, "node": i}) + "\n" for i in range(3)) + json.dumps({**GOOD, **line}))
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET, "--prefix", prefix]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hsched: {expected}") and len(err.splitlines()) == 1, err
    assert _keys_under(redis_url, prefix) == [Keys(prefix).epoch.encode()]


def test_replay_cli_without_an_answering_redis_is_one_line_exit_1(tmp_path, capsys, private_runtime_dir,
                                                                  monkeypatch) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hsched thermal replay: Redis at redis://127.0.0.1:1/0: ") and len(err.splitlines()) == 1
    assert err.endswith("Connection refused; nothing written\n"), err


def test_replay_cli_losing_redis_while_writing_is_one_line_exit_1(tmp_path, capsys, private_runtime_dir, monkeypatch,
                                                                  redis_url, prefix) -> None:
    import redis as syncredis

    from hsched.thermal import readings as readings_module

    def lost(*args, **kwargs):
        raise syncredis.ConnectionError("Connection reset by peer")

    syncredis.Redis.from_url(redis_url).set(Keys(prefix).epoch, "e")
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setattr(readings_module, "write_readings", lost)
    assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET, "--prefix", prefix]) == 1
    err = capsys.readouterr().err
    assert err == (f"hsched thermal replay: Redis at {redis_url}: Connection reset by peer; readings before the "
                   "failure may be written (replaying the file again records no scan twice)\n"), err


HEADER = b"datacenter,sample,node,inlet_c,outlet_c,supply_c\n"


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("bin.jsonl", b"\xff\xfe\x00garbage", "bin.jsonl:1: is not UTF-8 text (byte 0)"),
    ("late.csv", HEADER + b"cheap,a,0,21,28,20\ncheap,\xe9,1,21,28,20\n", "late.csv:3: is not UTF-8 text (byte 74)"),
    ("deep.jsonl", b"[" * 100_000 + b"\n", "deep.jsonl:1: must be one JSON object per line (it nests too deep)"),
    ("long.jsonl", json.dumps(GOOD).encode() + b"\n" + b"1" * 5000 + b"\n",
     "long.jsonl:2: must be one JSON object per line (a number of more than 4300 digits)"),
    ("big.csv", HEADER + b"cheap,a,0,21,28,20\ncheap," + b"x" * 200_000 + b",1,21,28,20\n",
     "big.csv:3: must be CSV (field larger than field limit (131072))"),
    ("wide.csv", HEADER.replace(b"\n", b",colour\n") + b"cheap,a,0,21,28,20,red,extra\n",
     "wide.csv:2: has 8 fields, the header 7"),
    ("blank.csv", HEADER + b"\n\ncheap,a,0,21,10,20\n", "blank.csv:4.outlet_c: must be >= inlet_c"),
])
def test_replay_cli_refuses_a_file_it_cannot_read_in_one_line_naming_it(tmp_path, capsys, private_runtime_dir, name,
                                                                        content, expected) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hsched: {expected}") and len(err.splitlines()) == 1, err


READINGS = {"r.jsonl": "".join(json.dumps({**GOOD, "node": i}) + "\n" for i in range(4)).encode(),
            "r.csv": HEADER + b"".join(b"cheap,a,%d,21,28,20\n" % i for i in range(4))}


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(READINGS)),
       edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 8),
                                st.one_of(st.binary(max_size=4), st.text(',:"{}[]0123456789.-e\n ', max_size=6).map(
                                    str.encode))), min_size=1, max_size=4))
def test_a_corrupted_file_of_readings_loads_or_is_one_line_naming_it(tmp_path_factory, name, edits) -> None:
    data = READINGS[name]
    for at, cut, insert in edits:
        at %= len(data) + 1
        data = data[:at] + insert + data[at + cut:]
    path = tmp_path_factory.mktemp("r") / name
    path.write_bytes(data)
    try:
        readings = load_readings(path)
    except ValidationError as exc:
        assert str(exc).startswith(name) and "\n" not in str(exc) and "\r" not in str(exc), str(exc)
        return
    assert readings and all(0 <= r.node and r.inlet_c <= r.outlet_c for r in readings)


# -- readings → scans: exactly once ----------------------------------------------------------------------------

async def _write(redis, keys: Keys, readings: list[Reading]) -> None:
    for r in readings:
        await redis.xadd(keys.readings(r.datacenter), r.to_stream())


def _scan(sample: str, n: int = 4) -> list[Reading]:
    return [Reading(DC, sample, i, 21.0 + i, 28.0 + i, 20.0, 1_700_000_000_000) for i in range(n)]


async def test_a_scan_is_recorded_once_across_a_crash_and_a_replay(redis, prefix) -> None:
    keys = Keys(prefix)
    first = ScanAssembler(redis, keys, DC, 4)
    await first.recover()
    await _write(redis, keys, _scan("a")[:3])
    await first.poll(block_ms=100)  # three of four readings: pending in the group, nothing recorded
    assert first.pending and await redis.xlen(keys.scans(DC)) == 0
    del first  # killed: its memory is gone, its readings are in the group's pending list
    second = ScanAssembler(redis, keys, DC, 4)
    await second.recover()
    assert set(second.pending["a"].rows) == {0, 1, 2}
    await _write(redis, keys, _scan("a")[3:])
    await second.poll(block_ms=100)
    assert await redis.xlen(keys.scans(DC)) == 1 and second.counts.applied == 1 and not second.pending
    assert (await redis.xpending(keys.readings(DC), GROUP))["pending"] == 0
    await _write(redis, keys, _scan("a"))  # the same scan replayed: acknowledged, not counted again
    await second.poll(block_ms=100)
    assert await redis.xlen(keys.scans(DC)) == 1 and second.counts.duplicate == 1
    assert (await redis.xpending(keys.readings(DC), GROUP))["pending"] == 0
    await redis.xadd(keys.readings(DC), {"r": "not json"})
    await second.poll(block_ms=100)
    assert second.counts.invalid == 1 and (await redis.xpending(keys.readings(DC), GROUP))["pending"] == 0


async def test_publishing_is_monotonic_and_a_lost_race_publishes_nothing(redis, prefix) -> None:
    keys = Keys(prefix)
    op = room_for(cheap()).recirc
    store = ModelStore(redis, keys, DC)
    assert (await store.latest()).version == 0
    assert await store.publish(0, op, {"k": 1}) == 1
    assert await store.publish(0, op, {"k": 2}) is None  # replaced version 0, which is gone
    assert await store.publish(1, op.with_self_coupling_scaled(0, 2.0), {"k": 3}) == 2
    latest = await store.latest(op.n)
    assert latest.version == 2 and latest.meta == {"k": 3}
    assert [int(f[b"version"]) for _, f in await redis.xrange(keys.model_versions(DC))] == [1, 2]
    seen = []
    follower = ModelFollower(redis, keys, DC, op.n, lambda p: seen.append(p.version), block_ms=100)
    await follower.load()
    task = asyncio.create_task(follower.run())
    try:
        await store.publish(2, op, {})
        for _ in range(100):
            if seen[-1] == 3:
                break
            await asyncio.sleep(0.05)
        assert seen == [2, 3]
    finally:
        task.cancel()
    await redis.set(keys.epoch, "someone-else")
    wrong_epoch = ModelStore(redis, keys, DC, epoch="ours")
    with pytest.raises(Exception, match="epoch"):
        await wrong_epoch.publish(3, op, {})
    assert (await store.latest()).version == 3


# -- the whole flow ---------------------------------------------------------------------------------------------

def place(task_id: str, cores: int) -> placer_pb2.PlaceRequest:
    return placer_pb2.PlaceRequest(task_id=task_id, task=common_pb2.TaskSpec(
        resources=common_pb2.Resources(cpu_milli=cores * 1000, memory_mib=1024), runtime_s=600, data_size_mb=10))


def rack_of(reply: placer_pb2.PlaceResponse) -> set[int]:
    return {a.node_index // 2 for a in reply.assignments}


async def test_readings_contradicting_the_model_change_the_placement_and_name_the_version(
        redis, redis_url, prefix, tmp_path, monkeypatch, private_runtime_dir) -> None:
    from services.placer import server as placer_server
    from services.thermal import server as thermal_server

    common = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix]
    thermal_argv = [*common, "--recalibrate-period-s", "0.2"]
    async with inprocess.service(thermal_server, thermal_argv, tmp_path / "thermal.port") as thermal_target, \
            inprocess.service(placer_server, [*common, "--datacenter", DC, "--thermal", thermal_target],
                              tmp_path / "placer.port") as placer_target, \
            grpc.aio.insecure_channel(placer_target) as pch, grpc.aio.insecure_channel(thermal_target) as tch:
        placer = placer_pb2_grpc.PlacerStub(pch)
        thermal = thermal_pb2_grpc.ThermalStub(tch)
        # rack 1 half full (one 13-core task per node); rack 0 empty: a 24-core task fits on rack 0 only
        fillers = [await placer.Place(place(f"fill{i}", 13), timeout=10) for i in range(4)]
        assert all(r.outcome == placer_pb2.PLACE_OUTCOME_PLACED for r in fillers)
        for i, r in enumerate(fillers):
            if rack_of(r) == {0}:
                await placer.Release(placer_pb2.PlacerReleaseRequest(task_id=f"fill{i}"), timeout=10)
        before = await placer.Place(place("probe0", 24), timeout=10)
        assert before.outcome == placer_pb2.PLACE_OUTCOME_PLACED and rack_of(before) == {0}
        assert before.thermal.model_version == 0
        assert any(n.startswith("thermal model version 0 (the default model") for n in before.notes)
        await placer.Release(placer_pb2.PlacerReleaseRequest(task_id="probe0"), timeout=10)

        # the room's sensors: rack 0 recirculates its own exhaust 6x more than the geometry says
        dc = cheap()
        room = room_for(dc)
        truth = room.recirc.with_self_coupling_scaled(0, 6.0)
        rng = np.random.default_rng(7)
        k_per_w = 1.0 / (room.params.air_mass_flow_kg_s * room.params.cp_air)
        lines = []
        for s in range(24):
            power = rng.uniform(100.0, 300.0, room.n)
            lines += synthetic_readings(DC, f"scan-{s}", 20.0, 20.0 + truth.matvec(power), power, k_per_w, 0.05, rng,
                                        unix_ms=1_700_000_000_000 + s)
        path = tmp_path / "readings.jsonl"
        path.write_text("".join(json.dumps({"datacenter": DC, **json.loads(r.to_stream()["r"])}) + "\n"
                                for r in lines))
        monkeypatch.setenv("REDIS_URL", redis_url)
        assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET, "--prefix", prefix]) == 0

        keys = Keys(prefix)
        for _ in range(300):
            if await redis.hget(keys.model(DC), "version") == b"1":
                break
            await asyncio.sleep(0.1)
        assert await redis.hget(keys.model(DC), "version") == b"1"
        predicted = await thermal.Predict(thermal_pb2.PredictRequest(datacenter=DC), timeout=10)
        assert predicted.model_version == 1  # the service serves what it published

        after = None
        for i in range(100):  # the placer adopts it between batches, once its follower has seen it
            after = await placer.Place(place(f"probe{i + 1}", 24), timeout=10)
            if any(n.startswith("thermal model version 1") for n in after.notes):
                break
            await placer.Release(placer_pb2.PlacerReleaseRequest(task_id=f"probe{i + 1}"), timeout=10)
            await asyncio.sleep(0.1)
        assert any(n.startswith("thermal model version 1 (published by the thermal service)") for n in after.notes)
        # the same request: rack 0 is now too hot for it, and nothing else fits
        assert after.outcome != placer_pb2.PLACE_OUTCOME_PLACED, after
        assert not after.assignments


async def test_simulated_sensors_of_the_default_model_feed_scans_and_publish_nothing(
        redis, redis_url, prefix, tmp_path, caplog) -> None:
    """The local stack's emitter: scans of the default model at the ledger's (steady) load plus noise. The refit
    runs on them and is rejected (the model already explains them, or the steady load cannot tell the racks'
    couplings apart): the served version stays 0, and the log says why."""
    from services.thermal import server as thermal_server

    caplog.set_level("INFO", logger="hsched.thermal.online")
    argv = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--emit-readings",
            "--emit-period-s", "0.05", "--recalibrate-period-s", "0.2"]
    keys = Keys(prefix)
    async with inprocess.service(thermal_server, argv, tmp_path / "thermal.port"):
        for _ in range(600):
            if await redis.xlen(keys.scans(DC)) >= 16 and "refit on 1" in caplog.text:
                break
            await asyncio.sleep(0.05)
        assert await redis.xlen(keys.scans(DC)) >= 16
        assert "refit on 1" in caplog.text and "rejected" in caplog.text, caplog.text[-2000:]
    assert await redis.hget(keys.model(DC), "version") is None  # nothing published: version 0


async def test_a_placer_asking_the_service_names_the_services_version(redis, redis_url, prefix, tmp_path) -> None:
    """--thermal-guard service: the thermal service checks with the version it serves, and says which."""
    from services.placer import server as placer_server
    from services.thermal import server as thermal_server

    common = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix]
    async with inprocess.service(thermal_server, [*common, "--recalibrate-period-s", "0.1"],
                                 tmp_path / "thermal.port") as thermal_target, \
            inprocess.service(placer_server, [*common, "--datacenter", DC, "--thermal", thermal_target,
                                              "--thermal-guard", "service"], tmp_path / "placer.port") as target, \
            grpc.aio.insecure_channel(target) as pch, grpc.aio.insecure_channel(thermal_target) as tch:
        placer = placer_pb2_grpc.PlacerStub(pch)
        thermal = thermal_pb2_grpc.ThermalStub(tch)
        first = await placer.Place(place("a", 2), timeout=10)
        assert first.thermal.model_version == 0 and "thermal model version 0" in " ".join(first.notes)
        op = room_for(cheap()).recirc
        assert await ModelStore(redis, Keys(prefix), DC).publish(0, op.with_self_coupling_scaled(0, 2.0), {}) == 1
        for _ in range(100):
            if (await thermal.Predict(thermal_pb2.PredictRequest(datacenter=DC), timeout=10)).model_version == 1:
                break
            await asyncio.sleep(0.05)
        second = await placer.Place(place("b", 2), timeout=10)
        assert second.thermal.model_version == 1
        assert any(n.startswith("thermal model version 1 (published") for n in second.notes)
        # bad input is INVALID_ARGUMENT naming the field (a NaN or 1e308 was INTERNAL with a server traceback)
        for request, field in ((thermal_pb2.PredictRequest(datacenter=DC, deltas=[thermal_pb2.LoadDelta(
                                    node_index=0, gpu_busy=float("nan"))]), "deltas[0].gpu_busy"),
                               (thermal_pb2.PredictRequest(datacenter=DC, deltas=[thermal_pb2.LoadDelta(
                                    node_index=0, gpu_busy=1e308)]), "deltas[0].gpu_busy"),
                               (thermal_pb2.PredictRequest(datacenter=DC, min_ledger_id="garbage"), "min_ledger_id")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await thermal.Predict(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}:"), err.value.details()


# -- real processes: kill -9, a Redis restart, a stack's placer following the versions -------------------------

def truth_scans(count: int, seed: int = 7) -> list[list[Reading]]:
    """Scans of the `cheap` room as if rack 0 recirculated 6x its own exhaust (random loads, 0.05 K noise)."""
    room = room_for(cheap())
    truth = room.recirc.with_self_coupling_scaled(0, 6.0)
    rng = np.random.default_rng(seed)
    k_per_w = 1.0 / (room.params.air_mass_flow_kg_s * room.params.cp_air)
    out = []
    for s in range(count):
        power = rng.uniform(100.0, 300.0, room.n)
        out.append(synthetic_readings(DC, f"scan-{seed}-{s}", 20.0, 20.0 + truth.matvec(power), power, k_per_w,
                                      0.05, rng, unix_ms=1_700_000_000_000 + s))
    return out


@pytest.mark.slow
def test_scans_survive_kill_9_and_a_redis_restart_and_a_stack_placer_follows_the_versions(tmp_path, monkeypatch):
    import time

    from hsched.stack import Stack, StackConfig
    from hsched.state.redis import connect_sync
    from hsched.thermal.published import READINGS_MAXLEN
    from hsched.thermal.readings import write_readings

    def wait(cond, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    scans = truth_scans(26)
    config = StackConfig(fleet_path=SMALL_FLEET, gateway_port=0, metrics=False, state_dir=str(tmp_path / "state"),
                         log_level="INFO", redis_appendfsync="always",
                         extra_env={"HSCHED_THERMAL_RECALIBRATE_PERIOD_S": "0.5", "HSCHED_GPU_RESERVE": "0"})
    with Stack(config) as stack:
        keys = Keys(stack.config.prefix)
        r = connect_sync(stack.redis_url)

        def write(readings):
            write_readings(r, keys.readings, readings, READINGS_MAXLEN)

        def pending() -> int:
            return r.xpending(keys.readings(DC), GROUP)["pending"]

        write(scans[0][:3])  # three of the scan's four readings: pending in the group
        wait(lambda: pending() == 3, "the thermal service did not read the readings")
        stack.kill("thermal")  # SIGKILL with a scan half assembled in memory
        stack.restart("thermal")
        write(scans[0][3:])
        wait(lambda: r.xlen(keys.scans(DC)) == 1 and pending() == 0, "the scan was not assembled after the restart")
        write(scans[0] + scans[1][:3])  # a replay of the recorded scan, and the next one half
        wait(lambda: pending() == 3, "the replay was not acknowledged")
        assert r.xlen(keys.scans(DC)) == 1
        stack.redis.kill()
        stack.redis.start()  # same port, same data dir: the AOF is replayed
        write(scans[1][3:])
        wait(lambda: r.xlen(keys.scans(DC)) == 2 and pending() == 0, "no scan after the Redis restart")
        assert stack.services["thermal"].alive

        path = tmp_path / "readings.jsonl"
        path.write_text("".join(json.dumps({"datacenter": DC, **json.loads(x.to_stream()["r"])}) + "\n"
                                for scan in scans[2:] for x in scan))
        monkeypatch.setenv("REDIS_URL", stack.redis_url)
        assert cli_main(["thermal", "replay", str(path), "--fleet", SMALL_FLEET, "--prefix", stack.config.prefix]) == 0
        wait(lambda: r.hget(keys.model(DC), "version") == b"1", "version 1 was not published")
        assert r.xlen(keys.scans(DC)) == 26  # every scan once
        log = stack.log_dir / f"placer-{DC}.log"
        # an idle placer adopts it too (it swaps models between batches, and a new version makes a batch of its
        # own): its gauge, compared with the service's, no longer lags until the next Place
        wait(lambda: "thermal model version 1 replaces version 0" in log.read_text(errors="replace"),
             "the idle placer did not adopt version 1", timeout_s=60)
