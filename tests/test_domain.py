"""hsched.domain: request validation (every rule names its field), the task wire dict, fleet YAML loading
(every broken variant names its YAML path) and the node table layout — expected values worked out by hand."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.domain.errors import FleetError, ValidationError
from hsched.domain.fleet import load_fleet, parse_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import MAX_RUNTIME_S, NetworkRequirements, TaskSpec, task_from_dict, task_to_dict
from hsched.policies.placement import split_task

SMALL_FLEET = Path(__file__).resolve().parent / "fleets" / "small.yaml"
RESOURCE_FIELDS = ("cpu_milli", "memory_mib", "disk_mib", "bandwidth_mbps", "gpu_count", "gpu_core_percent",
                   "gpu_memory_mib")
NETWORK_FIELDS = ("max_latency_ms", "max_jitter_ms", "max_loss_percent")
# Every field path TaskSpec.validate may name (gpu_models[i] is matched by pattern).
SPEC_FIELD_PATHS = {"request_id", "tenant", "name", "priority", "replicas", "runtime_s", "data_size_mb",
                    "gpu_models", *(f"resources.{f}" for f in RESOURCE_FIELDS),
                    *(f"network.{f}" for f in NETWORK_FIELDS)}
CHEAP = parse_fleet(yaml.safe_load(SMALL_FLEET.read_text())).datacenter("cheap")  # 4 nodes × 24 cores
ABILENE_POPS = {"Atlanta", "Chicago", "Denver", "Houston", "Indianapolis", "Kansas City", "Los Angeles", "New York",
                "Seattle", "Sunnyvale", "Washington DC"}


def small_fleet_dict() -> dict:
    return yaml.safe_load(SMALL_FLEET.read_text())


def spec(**overrides: object) -> TaskSpec:
    """A valid 2-core task; override any field to break one rule."""
    base: dict = {"resources": Resources(cpu_milli=2000, memory_mib=1024), "runtime_s": 60.0}
    base.update(overrides)
    return TaskSpec(**base)  # type: ignore[arg-type]


def assert_invalid(thing: TaskSpec | Resources, field: str, rule_fragment: str) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        thing.validate()
    err = info.value
    assert err.field == field
    assert str(err).startswith(f"{field}: ")
    assert rule_fragment in err.rule
    return err


def fleet_error(data: dict) -> FleetError:
    with pytest.raises(FleetError) as info:
        parse_fleet(data)
    err = info.value
    assert str(err).startswith(f"{err.field}: ")  # the message leads with the YAML path
    return err


# ------------------------------------------------------------------------------------------------------------
# Resources.validate


def test_valid_resources_pass() -> None:
    Resources(cpu_milli=500).validate()
    Resources(gpu_count=1, gpu_core_percent=100, gpu_memory_mib=0).validate()  # a GPU-only task is fine
    Resources(cpu_milli=1, gpu_count=2, gpu_core_percent=1, gpu_memory_mib=4096).validate()


@pytest.mark.parametrize("name", RESOURCE_FIELDS)
def test_resources_non_integer_names_the_field(name: str) -> None:
    r = Resources(**{"cpu_milli": 1000, name: 1.5})
    err = assert_invalid(r, f"resources.{name}", "must be an integer")
    assert err.value == 1.5


def test_resources_bool_is_not_an_integer() -> None:
    assert_invalid(Resources(cpu_milli=True), "resources.cpu_milli", "must be an integer")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", RESOURCE_FIELDS)
def test_resources_negative_names_the_field(name: str) -> None:
    r = Resources(**{"cpu_milli": 1000, name: -1})
    assert_invalid(r, f"resources.{name}", "must be >= 0")


def test_resources_must_request_cpu_or_gpu() -> None:
    err = assert_invalid(Resources(memory_mib=512), "resources.cpu_milli", "must request CPU (> 0) or at least one GPU")
    assert str(err) == "resources.cpu_milli: a task must request CPU (> 0) or at least one GPU (got 0)"


@pytest.mark.parametrize("pct", [0, 101])
def test_gpu_core_percent_out_of_range(pct: int) -> None:
    assert_invalid(Resources(cpu_milli=1000, gpu_count=1, gpu_core_percent=pct), "resources.gpu_core_percent",
                   "must be in 1..100 when gpu_count > 0")


@pytest.mark.parametrize("kw", [{"gpu_core_percent": 50}, {"gpu_memory_mib": 1024}])
def test_gpu_slice_without_gpu_count_names_gpu_count(kw: dict) -> None:
    assert_invalid(Resources(cpu_milli=1000, **kw), "resources.gpu_count", "must be > 0 when a GPU core percent")


def test_resources_prefix_is_used_in_the_path() -> None:
    with pytest.raises(ValidationError) as info:
        Resources(cpu_milli=-5).validate("task.per_replica")
    assert info.value.field == "task.per_replica.cpu_milli"


# ------------------------------------------------------------------------------------------------------------
# TaskSpec.validate


def test_valid_spec_passes() -> None:
    spec(request_id="req-1:a.b_c", tenant="team-a.b_c", name="x" * 253, priority=-1000, replicas=256,
         runtime_s=MAX_RUNTIME_S, data_size_mb=0.0,
         network=NetworkRequirements(1.0, 2.0, 100.0),
         resources=Resources(cpu_milli=1000, gpu_count=1, gpu_core_percent=50), gpu_models=("T4", "V100")).validate()


@pytest.mark.parametrize(("overrides", "field", "fragment"), [
    ({"request_id": "has space"}, "request_id", "1-128 characters"),
    ({"request_id": "a" * 129}, "request_id", "at most 128 characters"),
    ({"tenant": "Team"}, "tenant", "DNS-1123 label"),
    ({"tenant": "-a"}, "tenant", "DNS-1123 label"),
    ({"tenant": ""}, "tenant", "DNS-1123 label"),
    ({"tenant": "a" * 64}, "tenant", "at most 63 characters"),
    ({"name": "n" * 254}, "name", "at most 253"),
    ({"priority": 1001}, "priority", "-1000..1000"),
    ({"priority": -1001}, "priority", "-1000..1000"),
    ({"resources": Resources(cpu_milli=-1)}, "resources.cpu_milli", ">= 0"),
    ({"replicas": 0}, "replicas", "1..256"),
    ({"replicas": 257}, "replicas", "1..256"),
    ({"runtime_s": -0.5}, "runtime_s", "finite number >= 0"),
    ({"runtime_s": float("nan")}, "runtime_s", "finite number >= 0"),
    ({"runtime_s": float("inf")}, "runtime_s", "finite number >= 0"),
    ({"runtime_s": float("-inf")}, "runtime_s", "finite number >= 0"),
    ({"runtime_s": MAX_RUNTIME_S + 1}, "runtime_s", "one year"),
    ({"data_size_mb": -0.5}, "data_size_mb", "finite number >= 0"),
    ({"data_size_mb": float("nan")}, "data_size_mb", "finite number >= 0"),
    ({"network": NetworkRequirements(max_latency_ms=-1.0)}, "network.max_latency_ms", "finite number >= 0"),
    ({"network": NetworkRequirements(max_jitter_ms=float("inf"))}, "network.max_jitter_ms", "finite number"),
    ({"network": NetworkRequirements(max_loss_percent=100.5)}, "network.max_loss_percent", "<= 100"),
    ({"resources": Resources(cpu_milli=1000, gpu_count=1, gpu_core_percent=10), "gpu_models": ("T4", "")},
     "gpu_models[1]", "non-empty model name"),
    ({"resources": Resources(cpu_milli=1000, gpu_count=1, gpu_core_percent=10), "gpu_models": ("x" * 65,)},
     "gpu_models[0]", "at most 64 characters"),
    ({"resources": Resources(cpu_milli=1000, gpu_count=1, gpu_core_percent=10), "gpu_models": ("T4",) * 17},
     "gpu_models", "at most 16 entries"),
    ({"entry_vertex": "v" * 129}, "entry_vertex", "at most 128 characters"),
    ({"gpu_models": ("T4",)}, "gpu_models", "only allowed when resources.gpu_count > 0"),
])
def test_spec_rule_names_its_field(overrides: dict, field: str, fragment: str) -> None:
    assert_invalid(spec(**overrides), field, fragment)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.just(0.0), st.just(-0.0),
                 st.sampled_from([MAX_RUNTIME_S, MAX_RUNTIME_S + 1e-3, 5e-324, -5e-324])))
def test_runtime_s_is_valid_exactly_when_finite_and_in_0_to_a_year(runtime_s: float) -> None:
    """0 is valid (runs until released); negative, NaN, infinite and past a year are refused naming the field."""
    s = spec(runtime_s=runtime_s)
    if math.isfinite(runtime_s) and 0 <= runtime_s <= MAX_RUNTIME_S:
        s.validate()
    else:
        assert_invalid(s, "runtime_s", "finite number >= 0")


@pytest.mark.parametrize(("name", "value"), [("replicas", 1.5), ("replicas", True), ("priority", 0.5)])
def test_spec_integer_fields_reject_non_integers(name: str, value: object) -> None:
    # replicas=1.5 used to validate, and then spec.total / split_task produced fractional (or crashing) parts.
    assert_invalid(spec(**{name: value}), name, "must be an integer")


def test_spec_reports_the_first_broken_field_in_wire_order() -> None:
    # tenant comes before replicas and runtime_s on the wire: it is the one reported
    assert_invalid(spec(tenant="BAD", replicas=0, runtime_s=-1.0), "tenant", "DNS-1123")
    assert_invalid(spec(replicas=0, runtime_s=-1.0), "replicas", "1..256")


def _is_spec_field(field: str) -> bool:
    return field in SPEC_FIELD_PATHS or re.fullmatch(r"gpu_models\[\d+\]", field) is not None


INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
NUMBER = st.one_of(st.integers(-3, 300), st.integers(0, 300).map(float), st.floats(-5, 300), INT64,
                   st.floats(allow_nan=True, allow_infinity=True))
WILD = {  # per field: values of any kind of int/float (or string for the text fields)
    **{f"resources.{f}": NUMBER for f in RESOURCE_FIELDS}, **{f"network.{f}": NUMBER for f in NETWORK_FIELDS},
    "runtime_s": NUMBER, "priority": NUMBER, "replicas": NUMBER, "data_size_mb": NUMBER,
    "tenant": st.sampled_from(["Team", "", "-a", "a" * 64]), "name": st.just("n" * 254),
    "request_id": st.sampled_from(["bad id", "x" * 129]),
    "gpu_models": st.lists(st.sampled_from(["T4", "", "m" * 65]), min_size=1, max_size=3).map(tuple),
}


@st.composite
def random_specs(draw: st.DrawFn) -> TaskSpec:
    """A valid spec with 1-2 of its fields replaced by random ints/floats (or bad strings)."""
    values: dict = {"resources.cpu_milli": draw(st.integers(1, 50_000)), "runtime_s": 60.0, "replicas": 2}
    wild = draw(st.lists(st.sampled_from(sorted(WILD)), min_size=1, max_size=2, unique=True))
    values.update({name: draw(WILD[name]) for name in wild})
    res = {k.split(".")[1]: v for k, v in values.items() if k.startswith("resources.")}
    net = {k.split(".")[1]: v for k, v in values.items() if k.startswith("network.")}
    top = {k: v for k, v in values.items() if "." not in k}
    return TaskSpec(resources=Resources(**res), network=NetworkRequirements(**net), **top)


@settings(max_examples=50, deadline=None)
@given(random_specs())
def test_any_spec_validates_or_names_one_of_its_fields(s: TaskSpec) -> None:
    try:
        s.validate()
    except ValidationError as err:  # anything else (TypeError, OverflowError...) fails the test
        assert _is_spec_field(err.field), err.field
        assert str(err).startswith(f"{err.field}: ")
        return
    # A spec that validates is usable: integer totals, and its CPU parts split into integer amounts.
    total = s.total
    assert all(type(getattr(total, f)) is int for f in RESOURCE_FIELDS)
    parts = split_task(s, CHEAP)
    assert sum(p.demand.cpu_milli for p in parts) == total.cpu_milli


FINITE = st.floats(min_value=0, max_value=1e9, allow_nan=False)


@st.composite
def valid_specs(draw: st.DrawFn) -> TaskSpec:
    gpus = draw(st.integers(0, 8))
    return TaskSpec(
        resources=Resources(draw(st.integers(1, 10**7)), draw(st.integers(0, 10**7)), draw(st.integers(0, 10**7)),
                            draw(st.integers(0, 10**5)), gpus, draw(st.integers(1, 100)) if gpus else 0,
                            draw(st.integers(0, 80_000)) if gpus else 0),
        runtime_s=draw(st.one_of(st.just(0.0), st.floats(min_value=0, max_value=MAX_RUNTIME_S))),
        tenant=draw(st.from_regex(r"[a-z0-9]([a-z0-9._-]{0,10}[a-z0-9])?", fullmatch=True)),
        name=draw(st.text(max_size=20)), request_id=draw(st.from_regex(r"[A-Za-z0-9._:-]{0,20}", fullmatch=True)),
        priority=draw(st.integers(-1000, 1000)), replicas=draw(st.integers(1, 256)), data_size_mb=draw(FINITE),
        entry_vertex=draw(st.sampled_from(["", "s", "Kansas City"])),
        network=NetworkRequirements(draw(FINITE), draw(FINITE), draw(st.floats(0, 100))),
        gpu_models=tuple(draw(st.lists(st.sampled_from(["T4", "V100M32"]), max_size=2))) if gpus else ())


@settings(max_examples=50, deadline=None)
@given(valid_specs())
def test_task_dict_round_trip_through_json(s: TaskSpec) -> None:
    s.validate()
    d = json.loads(json.dumps(task_to_dict(s)))  # the ledger stores deferred tasks as JSON
    assert task_from_dict(d) == s


def test_task_to_dict_layout() -> None:
    s = spec(resources=Resources(1, 2, 3, 4, 5, 6, 7), network=NetworkRequirements(8.0, 9.0, 10.0),
             gpu_models=("T4",), replicas=3)
    d = task_to_dict(s)
    assert d["resources"] == [1, 2, 3, 4, 5, 6, 7]
    assert d["network"] == [8.0, 9.0, 10.0]
    assert d["gpu_models"] == ["T4"] and d["replicas"] == 3


# ------------------------------------------------------------------------------------------------------------
# Fleet YAML


def test_default_fleet_loads_paper_scale() -> None:
    fleet = load_fleet()
    assert len(fleet.datacenters) == 11
    assert fleet.wan.scheduler_vertex == "scheduler"
    assert set(fleet.wan.vertices) == ABILENE_POPS | {"scheduler"}
    assert fleet.wan.entry_vertices[0] == "scheduler"  # the scheduler vertex is always an entry vertex
    cpu_rooms = [dc for dc in fleet.datacenters if all(p.gpu_count == 0 for p in dc.pools)]
    assert len(cpu_rooms) == 8
    for dc in cpu_rooms:
        assert [(p.count, p.cpu_milli) for p in dc.pools] == [(672, 24_000)]  # 16 racks × 42 = 672 slots
        assert dc.layout.slots == 672 and dc.node_count == 672
        assert dc.vertex in ABILENE_POPS
    assert {dc.vertex for dc in fleet.datacenters} == ABILENE_POPS  # one DC per PoP


def test_small_fleet_parses() -> None:
    fleet = parse_fleet(small_fleet_dict())
    assert [dc.name for dc in fleet.datacenters] == ["cheap", "near", "gpu"]
    gpu = fleet.datacenter("gpu")
    assert gpu.thermal == {"supply_mode": "redline", "redline_c": 27.0}
    assert gpu.pools[0].capacity == Resources(32_000, 256 * 1024, 1000 * 1024, 10_000, 2, 100, 16 * 1024)
    # 4 nodes × 32 cores = 128 000 milli-cores, 4 × 2 = 8 GPUs
    total = gpu.capacity_total()
    assert (total.cpu_milli, total.gpu_count) == (128_000, 8)
    assert fleet.datacenter("cheap").effective_split_threshold_milli == 24_000  # the largest node


def _set(data: dict, path: list, value: object) -> dict:
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(("path", "value", "field", "fragment"), [
    (["datacenters", 1, "prices", "cpu_core_hour"], -0.01, "datacenters[1].prices.cpu_core_hour", "must be >= 0"),
    (["datacenters", 1, "prices", "cpu_core_hour"], "cheap", "datacenters[1].prices.cpu_core_hour",
     "must be a finite number"),
    (["datacenters", 0, "node_pools", 0, "count"], 0, "datacenters[0].node_pools[0].count", "must be >= 1"),
    (["datacenters", 0, "node_pools", 0, "count"], 2.5, "datacenters[0].node_pools[0].count", "must be an integer"),
    (["datacenters", 0, "vertex"], "nowhere", "datacenters[0].vertex", "must name a vertex of wan"),
    (["datacenters", 0, "node_pools", 0, "count"], 5, "datacenters[0].node_pools",
     "hold 5 nodes but layout has only 2×2 = 4 slots"),
    (["datacenters", 1, "name"], "cheap", "datacenters[1].name", "duplicates another data center"),
    (["datacenters", 2, "node_pools", 0, "gpus", "model"], "", "datacenters[2].node_pools[0].gpus.model",
     "must be a non-empty string"),
    (["datacenters", 2, "node_pools", 0, "gpus", "model"], 4, "datacenters[2].node_pools[0].gpus.model",
     "must be a non-empty string"),
    (["datacenters", 2, "node_pools", 0, "gpus", "count"], 0, "datacenters[2].node_pools[0].gpus.count",
     "must be >= 1"),  # a gpus: block describing no card
    (["datacenters", 2, "node_pools", 0, "gpus", "idle_w"], 100, "datacenters[2].node_pools[0].gpus.full_w",
     "must be >= gpus.idle_w"),  # as p_full_w / p_idle_w
    (["datacenters", 0, "layout", "rows"], 3, "datacenters[0].layout.rows", "must divide layout.racks"),
    (["wan", "links", 0, "b"], "zz", "wan.links[0].b", "must name a vertex"),
    (["wan", "scheduler_vertex"], "zz", "wan.scheduler_vertex", "must name a vertex ('a', 'b', 'c', 's')"),
    (["version"], 2, "version", "must be 1"),
])
def test_broken_fleet_names_the_yaml_path(path: list, value: object, field: str, fragment: str) -> None:
    err = fleet_error(_set(small_fleet_dict(), path, value))
    assert err.field == field
    assert fragment in err.rule


def test_unknown_key_is_reported_as_a_typo() -> None:
    data = small_fleet_dict()
    data["datacenters"][0]["layot"] = data["datacenters"][0]["layout"]
    err = fleet_error(data)
    assert err.field == "datacenters[0].layot"
    assert err.rule == "is not a known field (typo?)"


def test_unknown_nested_key_is_reported_with_its_path() -> None:
    data = small_fleet_dict()
    data["datacenters"][2]["node_pools"][0]["gpus"]["modle"] = "T4"
    assert fleet_error(data).field == "datacenters[2].node_pools[0].gpus.modle"


def test_missing_required_field() -> None:
    data = small_fleet_dict()
    del data["datacenters"][1]["prices"]["memory_gib_hour"]
    err = fleet_error(data)
    assert (err.field, err.rule) == ("datacenters[1].prices.memory_gib_hour", "is required")


@pytest.mark.parametrize(("block", "dc", "given", "field", "fragment"), [
    ("thermal", 2, {"redline_cc": 27.0}, "datacenters[2].thermal.redline_cc", "is not a known field"),
    ("thermal", 2, {"supply_mode": "cold"}, "datacenters[2].thermal.supply_mode", "must be 'fixed' or 'redline'"),
    ("thermal", 2, {"redline_c": float("nan")}, "datacenters[2].thermal.redline_c", "finite temperature"),
    ("thermal", 2, {"redline_c": "hot"}, "datacenters[2].thermal.redline_c", "must be a finite number"),
    ("thermal", 2, {"t_supply_min_c": 30.0}, "datacenters[2].thermal.t_supply_min_c", "must be <= t_supply_max_c"),
    ("thermal", 2, {"air_mass_flow_kg_s": 0}, "datacenters[2].thermal.air_mass_flow_kg_s", "must be > 0"),
    # supply air at or above the redline: every inlet past it, the DC served and bounced every Submit
    ("thermal", 0, {"t_supply_c": 30.0}, "datacenters[0].thermal.t_supply_c", "must be below redline_c"),
    ("thermal", 2, {"supply_mode": "redline", "t_supply_min_c": 27.0}, "datacenters[2].thermal.t_supply_min_c",
     "must be below redline_c"),
    ("room", 0, {"recirc_fractoin": 0.3}, "datacenters[0].room.recirc_fractoin", "is not a known field"),
    ("room", 0, {"n_racks": 4}, "datacenters[0].room.n_racks", "is not a known field"),  # the layout's, not room's
    ("room", 0, {"recirc_fraction": 1.0}, "datacenters[0].room.recirc_fraction", "must be in [0, 1)"),
    ("room", 0, {"recirc_fraction": "high"}, "datacenters[0].room.recirc_fraction", "must be a finite number"),
    ("room", 0, {"horizontal_decay_m": 0}, "datacenters[0].room.horizontal_decay_m", "must be > 0 and finite"),
    ("room", 0, {"vertical_decay_m": float("inf")}, "datacenters[0].room.vertical_decay_m", "must be > 0 and finite"),
    ("room", 0, {"row_end_boost": -0.1}, "datacenters[0].room.row_end_boost", "must be >= 0"),
    ("room", 0, {"source_base": 2}, "datacenters[0].room.source_base", "must be in [0, 1]"),
])
def test_thermal_and_room_bad_field_names_its_path(block: str, dc: int, given: dict, field: str,
                                                   fragment: str) -> None:
    data = small_fleet_dict()
    data["datacenters"][dc][block] = given
    err = fleet_error(data)
    assert err.field == field
    assert fragment in err.rule


@pytest.mark.parametrize(("where", "key", "value", "rule"), [
    ("vertices", "lat", 200.0, "must be <= 90"), ("vertices", "lat", -90.5, "must be >= -90"),
    ("vertices", "lon", 181.0, "must be <= 180"), ("links", "loss_percent", 150.0, "must be <= 100"),
    # a path's sum of 1e308 ms links was inf, its network cost NaN, ranked first
    ("links", "latency_ms", 1e308, "must be <= 60000.0"), ("links", "jitter_ms", 6e4 + 1, "must be <= 60000.0"),
    ("links", "distance_km", 1e300, "must be <= 100000.0"),
])
def test_wan_values_out_of_their_physical_range_are_named(where: str, key: str, value: float, rule: str) -> None:
    data = small_fleet_dict()
    data["wan"][where][0][key] = value
    err = fleet_error(data)
    assert (err.field, err.rule) == (f"wan.{where}[0].{key}", rule)


def test_room_fields_reach_the_recirculation_geometry() -> None:
    from hsched.thermal.datacenter import geometry_for

    data = small_fleet_dict()
    data["datacenters"][0]["room"] = {"recirc_fraction": 0.35, "horizontal_decay_m": 2.4, "rack_width_m": 0.8}
    fleet = parse_fleet(data)
    g = geometry_for(fleet.datacenters[0])
    assert (g.recirc_fraction, g.horizontal_decay_m, g.rack_width_m) == (0.35, 2.4, 0.8)
    assert geometry_for(fleet.datacenters[1]).recirc_fraction == 0.2  # unset: the default


def test_x_keys_are_yaml_anchor_holders_not_typos() -> None:
    data = small_fleet_dict()
    data["x-anything"] = {"foo": 1}
    assert parse_fleet(data).name == "small"


def test_load_fleet_reports_invalid_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [1\n")
    with pytest.raises(FleetError) as info:
        load_fleet(bad)
    assert info.value.field == "<yaml>"


# ------------------------------------------------------------------------------------------------------------
# NodeTable layout


def test_node_table_of_small_gpu_dc_by_hand() -> None:
    t = parse_fleet(small_fleet_dict()).datacenter("gpu").node_table()
    # 4 nodes on 2 racks × 2 slots, rack-major: node i -> rack i // 2, slot i % 2
    assert t.names == ("gpu-r00-s00", "gpu-r00-s01", "gpu-r01-s00", "gpu-r01-s01")
    np.testing.assert_array_equal(t.rack, [0, 0, 1, 1])
    np.testing.assert_array_equal(t.slot, [0, 1, 0, 1])
    np.testing.assert_array_equal(t.cpu_milli, [32_000] * 4)  # 32 cores
    np.testing.assert_array_equal(t.memory_mib, [262_144] * 4)  # 256 GiB × 1024
    np.testing.assert_array_equal(t.disk_mib, [1_024_000] * 4)  # 1000 GiB × 1024
    np.testing.assert_array_equal(t.bandwidth_mbps, [10_000] * 4)  # the default
    np.testing.assert_array_equal(t.gpu_count, [2] * 4)
    np.testing.assert_array_equal(t.gpu_memory_mib, [[16_384, 16_384]] * 4)  # 16 GiB per T4
    np.testing.assert_array_equal(t.gpu_core_percent, [[100, 100]] * 4)
    assert t.gpu_model == ("T4",) * 4
    np.testing.assert_array_equal(t.gpu_idle_w, [20.0] * 4)
    np.testing.assert_array_equal(t.gpu_full_w, [70.0] * 4)
    np.testing.assert_array_equal(t.p_idle_w, [100.0] * 4)


def test_node_table_mixed_pools_zero_missing_cards() -> None:
    data = small_fleet_dict()
    data["datacenters"][2]["node_pools"] = [
        {"name": "two", "count": 1, "cpu_cores": 8, "memory_gib": 32, "gpus": {"count": 2, "model": "T4", "memory_gib": 16}},
        {"name": "cpu", "count": 2, "cpu_cores": 4, "memory_gib": 8},
        {"name": "one", "count": 1, "cpu_cores": 8, "memory_gib": 32, "gpus": {"count": 1, "model": "P100", "memory_gib": 12}},
    ]
    t = parse_fleet(data).datacenter("gpu").node_table()
    np.testing.assert_array_equal(t.pool, [0, 1, 1, 2])  # node-pool order
    np.testing.assert_array_equal(t.gpu_count, [2, 0, 0, 1])
    # 2 columns (the widest node); a card that does not exist is 0 in both card arrays
    np.testing.assert_array_equal(t.gpu_memory_mib, [[16_384, 16_384], [0, 0], [0, 0], [12_288, 0]])
    np.testing.assert_array_equal(t.gpu_core_percent, [[100, 100], [0, 0], [0, 0], [100, 0]])
    assert t.gpu_model == ("T4", "", "", "P100")
    np.testing.assert_array_equal(t.cpu_milli, [8_000, 4_000, 4_000, 8_000])



def test_a_trailing_newline_breaks_every_name_rule() -> None:
    """`$` also matches before a final newline: the validators anchor with `\\Z`, so `acme\\n` is no tenant."""
    from hsched.jobs import validate_job
    from hsched.security.tokens import TokensFileError, parse_tokens
    from hsched.state.redis import _checked_word
    from hsched.v1 import common_pb2 as pb

    for field in ("tenant", "request_id"):
        with pytest.raises(ValidationError, match=f"^{field}: "):
            TaskSpec(Resources(100), 1.0, **{field: "acme\n"}).validate()
    stage = pb.StageSpec(name="s0\n", tasks=1, runtime_s=1, resources=pb.Resources(cpu_milli=100))
    with pytest.raises(ValidationError, match=r"job\.stages\[0\]\.name"):
        validate_job(pb.JobSpec(name="j", stages=[stage]))
    entry = {"name": "ci\n", "tenant": "acme", "sha256": "0" * 64}
    with pytest.raises(TokensFileError, match=r"tokens\[0\]\.name"):
        parse_tokens({"version": 1, "tokens": [entry]})
    with pytest.raises(ValueError, match="ACL user"):
        _checked_word("ACL user", "hsched\n")
