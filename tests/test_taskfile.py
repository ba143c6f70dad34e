"""Declarative task files (`hsched submit -f`, hsched.taskfile): the parser against the gateway's rules (hypothesis,
no stack), then the real CLI as a subprocess against a real stack: re-running a file submits nothing twice, a file
with one bad document submits nothing and names the document and the field."""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.domain.errors import ValidationError
from hsched.domain.resources import Resources
from hsched.domain.task import MAX_RUNTIME_S, PRIORITY_CLASSES, NetworkRequirements, TaskSpec
from hsched.taskfile import derive_request_id, load_submit_file, task_to_mapping
from hsched.yamlfile import YamlDumper
from tests.test_cli import assert_one_line_error, run_cli

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tasks.yaml"

# -- the parser, without a stack -----------------------------------------------------------------------------------

_label = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?\Z")
_finite = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)


@st.composite
def valid_specs(draw) -> TaskSpec:
    gpus = draw(st.integers(0, 8))
    resources = Resources(
        cpu_milli=draw(st.integers(1 if gpus == 0 else 0, 10**6)), memory_mib=draw(st.integers(0, 10**7)),
        disk_mib=draw(st.integers(0, 10**7)), bandwidth_mbps=draw(st.integers(0, 10**5)), gpu_count=gpus,
        gpu_core_percent=draw(st.integers(1, 100)) if gpus else 0,
        gpu_memory_mib=draw(st.integers(0, 10**5)) if gpus else 0)
    return TaskSpec(
        resources=resources, runtime_s=draw(st.floats(0, MAX_RUNTIME_S, allow_nan=False)), tenant=draw(_label),
        name=draw(st.one_of(st.just(""), _label)),
        request_id=draw(st.one_of(st.just(""), st.from_regex(r"\A[A-Za-z0-9._:-]{1,40}\Z"))),
        priority=draw(st.integers(-1000, 1000)), replicas=draw(st.integers(1, 256)), data_size_mb=draw(_finite),
        entry_vertex=draw(st.one_of(st.just(""), _label)),
        network=NetworkRequirements(draw(_finite), draw(_finite), draw(st.floats(0, 100))),
        gpu_models=tuple(draw(st.lists(st.from_regex(r"\A[A-Z][A-Z0-9]{0,7}\Z"), max_size=3))) if gpus else (),
        priority_class=draw(st.sampled_from(PRIORITY_CLASSES)),
        queue_timeout_s=draw(st.floats(0, MAX_RUNTIME_S, allow_nan=False)))


def _unique(specs: list[TaskSpec]) -> bool:
    keys = [(s.tenant, s.request_id) for s in specs if s.request_id]
    return len(keys) == len(set(keys))


def write(path: Path, docs: list, shape: str) -> None:
    """The specs as one mapping, a list, a `---` stream or JSON (a list)."""
    if shape == "stream":
        path.write_text(yaml.dump_all(docs, Dumper=YamlDumper, sort_keys=False))
    elif shape == "json":
        path.write_text(json.dumps(docs))
    else:
        path.write_text(yaml.dump(docs[0] if shape == "one" else docs, Dumper=YamlDumper, sort_keys=False))


def where(shape: str, i: int, n: int) -> str:
    """A spec's YAML path: none for a file's only mapping (a one-document stream is one), else its index."""
    return "" if shape == "one" or (shape == "stream" and n == 1) else f"[{i}]"


@settings(max_examples=30, deadline=None)
@given(st.lists(valid_specs(), min_size=1, max_size=4).filter(_unique), st.sampled_from(["one", "list", "stream",
                                                                                          "json"]))
def test_valid_specs_round_trip_through_a_file(specs, shape):
    specs = specs[:1] if shape == "one" else specs
    docs = [task_to_mapping(s) for s in specs]
    for d in docs:  # an absent request_id is what derives one, as "" does
        if not d["request_id"]:
            del d["request_id"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tasks.yaml"
        write(path, docs, shape)
        loaded = load_submit_file(path)
        again = load_submit_file(path)
    assert loaded.job is None and [t.where for t in loaded.tasks] == [where(shape, i, len(specs)) for i in range(len(specs))]
    for i, (spec, doc, task) in enumerate(zip(specs, docs, loaded.tasks, strict=True)):
        expected_id = spec.request_id or derive_request_id(path, i, doc)
        assert task.spec == replace(spec, request_id=expected_id)
        assert task.derived_id == (not spec.request_id)
    assert [t.spec.request_id for t in again.tasks] == [t.spec.request_id for t in loaded.tasks]  # stable


# (field path, a strategy of values the gateway refuses, words its rule has)
INVALID = [
    ("resources.cpu_milli", st.integers(min_value=-(2**31), max_value=-1), "must be >= 0"),
    ("resources.memory_mib", st.floats(allow_nan=False).filter(lambda x: x != int(x) if math.isfinite(x) else True),
     "must be an integer"),
    ("resources.gpu_count", st.text(max_size=5), "must be an integer"),
    ("replicas", st.one_of(st.just(0), st.integers(257, 2**32 - 1)), "must be in 1..256"),
    # past the wire type's range (replicas is a uint32, memory_mib an int64): the type's bounds, both right
    ("replicas", st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32)), "must be in 0..4294967295"),
    ("resources.memory_mib", st.one_of(st.integers(max_value=-2**63 - 1), st.integers(min_value=2**63)),
     "must be in -9223372036854775808..9223372036854775807"),
    ("priority", st.integers(1001, 2**31 - 1), "must be in -1000..1000"),
    ("runtime_s", st.one_of(st.floats(max_value=-1e-9), st.just(math.nan), st.just(math.inf),
                            st.floats(min_value=MAX_RUNTIME_S + 1, allow_infinity=False)), "finite number >= 0"),
    ("runtime_s", st.text(max_size=5), "must be a number"),
    ("data_size_mb", st.floats(max_value=-1e-9), "must be a finite number >= 0"),
    ("tenant", st.from_regex(r"\A[A-Z_][a-zA-Z]{0,8}\Z"), "DNS-1123"),
    ("request_id", st.from_regex(r"\A[a-z]{0,5}[ /#][a-z]{0,5}\Z"), "[A-Za-z0-9._:-]"),
    ("priority_class", st.text(min_size=1, max_size=10).filter(lambda s: s not in PRIORITY_CLASSES), "online"),
    ("network.max_loss_percent", st.floats(min_value=100.001, allow_infinity=False), "must be <= 100"),
    ("network.max_latency_ms", st.floats(max_value=-1e-9), ">= 0"),
    ("queue_timeout_s", st.floats(max_value=-1e-9), ">= 0"),
    ("name", st.integers(), "must be a string"),
    ("stage", st.just("extract"), "set by the gateway"),
    ("colour", st.just("blue"), "not a TaskSpec field"),
]


@settings(max_examples=60, deadline=None)
@given(st.lists(valid_specs(), min_size=1, max_size=4).filter(_unique), st.data())
def test_an_invalid_value_is_refused_naming_its_document_and_field(specs, data):
    field, values, words = data.draw(st.sampled_from(INVALID))
    bad = data.draw(st.integers(0, len(specs) - 1))
    docs = [task_to_mapping(s) for s in specs]
    doc = docs[bad]
    *parents, key = field.split(".")
    for p in parents:
        doc = doc[p]
    doc[key] = data.draw(values)
    shape = data.draw(st.sampled_from(["list", "stream"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tasks.yaml"
        write(path, docs, shape)
        with pytest.raises(ValidationError) as info:
            load_submit_file(path)
    at = where(shape, bad, len(specs))
    expected = f"{at}.{field}" if at else field
    assert info.value.field == expected, str(info.value)
    assert words in info.value.rule and str(info.value).startswith(f"{path}: {expected}: ")


def test_files_that_are_neither_tasks_nor_a_job(tmp_path):
    f = tmp_path / "x.yaml"
    for text, field, words in [
        ("", str(f), "no task spec"),
        ("[]\n", str(f), "no task spec"),
        ("name: [\n", str(f), "not valid YAML"),
        ("- 3\n", "[0]", "mapping of TaskSpec"),
        ("runtime_s: 1\n", "resources", "is required"),
        ("resources: {cpu_milli: 1}\n", "runtime_s", "is required"),
        ("resources: {cpu_milli: 1}\nruntime_s: 1\n---\nname: j\nstages: []\n", "[1].stages",
         "a DAG job must be the whole file: its one top-level mapping, not an item of a list nor one of several"),
        ("- name: j\n  stages: []\n", "[0].stages", "its one top-level mapping, not an item of a list"),
        ("- {resources: {cpu_milli: 1}, runtime_s: 1, request_id: a}\n"
         "- {resources: {cpu_milli: 2}, runtime_s: 1, request_id: a}\n", "[1].request_id", "unique"),
        ("resources: {cpu_milli: 1}\nruntime_s: 1\ngpu_models: [T4]\n", "gpu_models", "gpu_count > 0"),
        ("resources: {cpu_milli: 1, gpu_count: 3000000000}\nruntime_s: 1\n", "resources.gpu_count",
         "must be in -2147483648..2147483647"),
        ("a: " + "[" * 10_000 + "]" * 10_000 + "\n", str(f), "nests deeper than 32 levels (line 1)"),
        ("resources: {cpu_milli: 1}\nruntime_s: 1\ntenant: 2020-13-45\n", str(f),
         "'2020-13-45' on line 3 is not a valid timestamp (month must be in 1..12)"),
    ]:
        f.write_text(text)
        with pytest.raises(ValidationError) as info:
            load_submit_file(f)
        assert info.value.field == field and words in str(info.value), (text, str(info.value))
    with pytest.raises(ValidationError) as info:
        load_submit_file(tmp_path / "missing.yaml")
    assert info.value.field == "-f"


# YAML's building blocks, with the ones PyYAML's reader failed on with a traceback: deep nesting (RecursionError),
# values its constructors cannot make (`2020-13-45` looks like a date: ValueError; an empty `!!float`: IndexError)
_YAML_TOKENS = st.sampled_from([
    "[", "]", "{", "}", ": ", ", ", "- ", "\n", "  ", "---\n", "? ", "<<: ", "&a ", "*a", "'", '"', "#", "!!int ",
    "!!float ", "!!timestamp ", "!!binary ", "!!set ", "!!omap ", "resources", "cpu_milli", "runtime_s", "name",
    "stages", "tasks", "x", "1", "-1", "1e400", "0x1F", ".nan", "null", "true", "2020-13-45", "2001-12-14", "9" * 30])


@settings(max_examples=300, deadline=None)
@given(st.lists(_YAML_TOKENS, max_size=40).map("".join))
def test_any_file_is_read_or_refused_naming_it_never_a_traceback(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.yaml"
        path.write_text(text)
        try:
            load_submit_file(path)
        except ValidationError as exc:
            assert str(exc).startswith(str(path)), str(exc)


def test_the_example_holds_three_tasks_one_of_them_gpu_and_a_job_file_is_still_a_job():
    loaded = load_submit_file(EXAMPLE)
    assert len(loaded.tasks) == 3 and [t.spec.resources.gpu_count for t in loaded.tasks] == [0, 2, 0]
    assert [t.derived_id for t in loaded.tasks] == [False, False, True]
    assert re.fullmatch(r"f-[0-9a-f]{32}", loaded.tasks[2].spec.request_id)
    job = load_submit_file(EXAMPLE.parent / "job.yaml")
    assert job.job is not None and job.job.name == "nightly-etl" and not job.tasks
    assert job.job.request_id == "nightly-etl-2026-11-24"  # its own, kept


def test_a_job_file_without_a_request_id_gets_one_derived_as_a_task_specs(tmp_path):
    """Else running the file twice ran the job twice (a task file's specs were already idempotent)."""
    f = tmp_path / "job.yaml"
    text = "name: v\nstages:\n - {name: a, tasks: 2, resources: {cpu_milli: 1000}, runtime_s: 10}\n"
    f.write_text(text)
    first = load_submit_file(f).job.request_id
    assert re.fullmatch(r"f-[0-9a-f]{32}", first) and load_submit_file(f).job.request_id == first
    assert first == derive_request_id(f, 0, yaml.safe_load(text))
    f.write_text(text.replace("tasks: 2", "tasks: 3"))  # an edited job is a new job
    assert load_submit_file(f).job.request_id != first


# -- the real CLI against a real stack -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_stack(redis_url):
    from tests.conftest import small_fleet_stack

    with small_fleet_stack(redis_url, "taskfile") as s:
        yield s


def table_rows(text: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()[1:]]


def listed_names(gw: list[str], env: dict) -> list[str]:
    """The names of every task the gateway lists (all pages of 1000)."""
    listed = run_cli("list", "-o", "json", "--limit", "1000", *gw, env=env)
    assert listed.returncode == 0, listed.stderr
    reply = json.loads(listed.stdout)
    assert "next_page_token" not in reply
    return [t["spec"].get("name", "") for t in reply.get("tasks", [])]


TASKS = """\
name: web
request_id: web-v1
replicas: 2
resources: {cpu_milli: 1000, memory_mib: 1024}
runtime_s: 0
---
name: train
request_id: train-v1
resources: {cpu_milli: 2000, memory_mib: 4096, gpu_count: 1, gpu_core_percent: 50, gpu_memory_mib: 4096}
gpu_models: [T4]
runtime_s: 600
entry_vertex: a
---
name: report
resources: {cpu_milli: 500, memory_mib: 512}
runtime_s: 60
"""


@pytest.mark.slow
def test_submit_f_twice_submits_nothing_twice(small_stack, tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    gw = ["--gateway", small_stack.gateway]
    f = tmp_path / "tasks.yaml"
    f.write_text(TASKS)
    first = run_cli("submit", "-f", str(f), *gw, env=env)
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stdout + first.stderr
    rows = table_rows(first.stdout)
    assert [(r[0], r[1], r[3], r[5]) for r in rows] == [("[0]", "web", "PLACED", "created"),
                                                          ("[1]", "train", "PLACED", "created"),
                                                          ("[2]", "report", "PLACED", "created")], first.stdout
    assert rows[1][4] == "gpu"  # the small fleet's only GPU DC
    second = run_cli("submit", "-f", str(f), *gw, "-o", "json", env=env)
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout)
    assert [a["result"] for a in again] == ["unchanged"] * 3
    assert [a["task"]["task_id"] for a in again] == [r[2] for r in rows]
    assert [a["request_id_derived"] for a in again] == [False, False, True]
    names = listed_names(gw, env)
    assert sorted(n for n in names if n in ("web", "train", "report")) == ["report", "train", "web"]  # once each


@pytest.mark.slow
def test_a_file_with_one_bad_document_submits_nothing(small_stack, tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    gw = ["--gateway", small_stack.gateway]
    f = tmp_path / "bad.yaml"
    f.write_text("name: good-one\nresources: {cpu_milli: 100}\nruntime_s: 5\n---\n"
                 "name: bad-one\nresources: {cpu_milli: 100, gpu_core_percent: 50}\nruntime_s: 5\n---\n"
                 "name: good-two\nresources: {cpu_milli: 100}\nruntime_s: 5\n")
    before = listed_names(gw, env)
    done = run_cli("submit", "-f", str(f), *gw, env=env)
    assert_one_line_error(done, 2, f"{f}: [1].resources.gpu_count: must be > 0")
    assert done.stdout == ""
    after = listed_names(gw, env)
    assert after == before and not set(after) & {"good-one", "bad-one", "good-two"}, after
    f.write_text(f.read_text().replace(", gpu_core_percent: 50", ""))  # the same file, fixed: all three go
    assert run_cli("submit", "-f", str(f), *gw, env=env).returncode == 0
    assert sorted(set(listed_names(gw, env)) - set(before)) == ["bad-one", "good-one", "good-two"]


@pytest.mark.slow
def test_a_rejected_task_exits_1_and_a_failed_call_stops_the_file(small_stack, tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    gw = ["--gateway", small_stack.gateway]
    f = tmp_path / "tasks.yaml"
    f.write_text("- {name: too-big, resources: {cpu_milli: 8000, gpu_count: 4, gpu_core_percent: 100}, runtime_s: 5}\n"
                 "- {name: fits, resources: {cpu_milli: 100}, runtime_s: 5}\n")
    done = run_cli("submit", "-f", str(f), *gw, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert [(r[1], r[3]) for r in table_rows(done.stdout)] == [("too-big", "REJECTED"), ("fits", "PLACED")]
    # an entry vertex the fleet does not have is the gateway's to refuse (it knows the fleet): the specs after it
    # are not sent, and the ones before it are shown
    f.write_text("- {name: before, resources: {cpu_milli: 100}, runtime_s: 5}\n"
                 "- {name: lost, resources: {cpu_milli: 100}, runtime_s: 5, entry_vertex: atlantis}\n"
                 "- {name: after, resources: {cpu_milli: 100}, runtime_s: 5}\n")
    done = run_cli("submit", "-f", str(f), *gw, env=env)
    assert_one_line_error(done, 1, "1 spec(s) after it not sent")
    assert "[1]" in done.stderr and "INVALID_ARGUMENT" in done.stderr and "entry_vertex" in done.stderr
    assert [r[1] for r in table_rows(done.stdout)] == ["before"]


def test_task_flags_with_a_file_are_refused_not_ignored(tmp_path):
    done = run_cli("submit", "-f", str(EXAMPLE), "--cpu", "2", "--gpus", "1", "--gateway", "127.0.0.1:1",
                   env={"XDG_RUNTIME_DIR": str(tmp_path)})  # nothing listens on port 1: exit 2 proves no call
    assert_one_line_error(done, 2, "-f: cannot be combined with --cpu, --gpus")
    bad = tmp_path / "tasks.yaml"
    bad.write_text("- {resources: {cpu_milli: 100}, runtime_s: 5}\n- {resources: {cpu_milli: 1.5}, runtime_s: 5}\n")
    done = run_cli("submit", "-f", str(bad), "--gateway", "127.0.0.1:1", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert_one_line_error(done, 2, f"{bad}: [1].resources.cpu_milli: must be an integer (got 1.5)")


@pytest.mark.parametrize("text, words", [
    ("a: " + "[" * 10_000 + "]" * 10_000 + "\n", "nests deeper than 32 levels"),
    ("name: x\nname: y\nresources: {cpu_milli: 1}\nruntime_s: 1\n", "duplicate key 'name' on line 2 (first on line 1)"),
])
def test_a_file_the_reader_refuses_is_one_line_naming_it(text, words, tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text(text)
    done = run_cli("submit", "-f", str(f), "--gateway", "127.0.0.1:1", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert_one_line_error(done, 2, f"{f}: {words}")


def test_a_repeated_key_is_refused_where_a_merge_may_override_one(tmp_path):
    """PyYAML keeps the last of a mapping's repeated keys silently; a `<<` merge's keys are meant to be overridden."""
    f = tmp_path / "x.yaml"
    for text, line, first in [
        ("resources: {cpu_milli: 1}\nruntime_s: 1\nresources:\n  cpu_milli: 2\n", 3, 1),
        ('- {name: a, "name": b, resources: {cpu_milli: 1}, runtime_s: 1}\n', 1, 1),  # quoted or not, one key
        ("name: j\nstages:\n  - {name: a, tasks: 1, runtime_s: 1, resources: {cpu_milli: 1, cpu_milli: 2}}\n", 3, 3),
    ]:
        f.write_text(text)
        with pytest.raises(ValidationError) as info:
            load_submit_file(f)
        assert info.value.field == str(f) and f"on line {line} (first on line {first})" in info.value.rule, text
    f.write_text("- &t {name: a, resources: {cpu_milli: 1}, runtime_s: 1}\n- {<<: *t, name: b}\n")
    assert [t.spec.name for t in load_submit_file(f).tasks] == ["a", "b"]


def test_printed_yaml_reads_back_strings_that_look_like_yaml12_numbers(tmp_path):
    """`0e0` is a valid tenant; PyYAML's own dumper writes it bare (a string in YAML 1.1) and the task file reader
    (YAML 1.2 numbers) would read a number: what the CLI prints as yaml must read back as it was."""
    from hsched.views import dump

    spec = TaskSpec(resources=Resources(cpu_milli=100), runtime_s=1.0, tenant="0e0", name="1e5")
    text = dump(task_to_mapping(spec), "yaml")
    assert "tenant: '0e0'" in text
    path = tmp_path / "task.yaml"
    path.write_text(text)
    (loaded,) = load_submit_file(path).tasks
    assert (loaded.spec.tenant, loaded.spec.name) == ("0e0", "1e5")


def test_a_job_printed_with_o_yaml_or_json_reads_back_as_a_job_file(tmp_path):
    """`hsched job get J -o yaml`'s spec fed to `submit -f` was refused: protobuf's JSON mapping writes int64
    fields (cpu_milli, memory_mib, ...) as strings. The views print them as numbers."""
    from hsched.v1 import common_pb2 as pb
    from hsched.views import as_dict, dump

    spec = pb.JobSpec(name="etl", request_id="r1", stages=[
        pb.StageSpec(name="a", tasks=2, runtime_s=5.0, resources=pb.Resources(cpu_milli=8000, memory_mib=2048)),
        pb.StageSpec(name="b", tasks=1, runtime_s=5.0, parents=["a"], resources=pb.Resources(
            cpu_milli=1000, memory_mib=1024, gpu_count=1, gpu_core_percent=100, gpu_memory_mib=4096))],
        gpu_models=["T4"])
    job = pb.Job(job_id="j1", spec=spec, created_unix_ms=1_796_666_579_154)
    printed = as_dict(job)
    assert printed["spec"]["stages"][0]["resources"] == {"cpu_milli": 8000, "memory_mib": 2048}
    assert printed["created_unix_ms"] == 1_796_666_579_154
    for fmt in ("yaml", "json"):
        path = tmp_path / f"job.{fmt}"
        path.write_text(dump(printed["spec"], fmt))
        assert load_submit_file(path).job == spec, fmt
