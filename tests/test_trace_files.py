"""Trace files given as `--trace PATH` that cannot be used: a bad record, a gzip stream cut short, bytes that are not
UTF-8, a pod list without pods. Each is one line naming the file (with its line and field where there is one) and
the rule, exit 2 and nothing written, for `hsched eval` and `hsched train` alike; and any random corruption of a
valid trace file either loads into valid tasks or is that one line."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.cli import main
from hsched.domain.errors import ValidationError
from hsched.traces.catalog import resolve_trace, trace_jobs

HERE = Path(__file__).parent
SMALL = str(HERE / "fleets" / "small.yaml")
SWF = HERE / "traces" / "small.swf"
OPENB = HERE / "traces" / "small_openb.csv"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _line_of(lines: list[str], start: str) -> int:
    return next(i for i, line in enumerate(lines, 1) if line.startswith(start))


def bad_field(tmp: Path) -> tuple[Path, str]:
    lines = _lines(OPENB)  # line 3: pod-001,8000,32000,1,250,,LS,Running,59,1579,59
    lines[2] = lines[2].replace("pod-001,8000,", "pod-001,abc,")
    path = tmp / "bad_field.csv"
    path.write_text("".join(lines))
    return path, f"{path}:3: cpu_milli: must be a whole number in 0..9223372036854775807 (got 'abc')"


def short_record(tmp: Path) -> tuple[Path, str]:
    lines = _lines(SWF)
    n = _line_of(lines, "3 ")
    lines[n - 1] = "3 139 0\n"
    path = tmp / "short.swf"
    path.write_text("".join(lines))
    return path, f"{path}:{n}: has 3 fields, an SWF record 18 (got '3 139 0')"


def cut_gzip(source: Path, name: str) -> Callable[[Path], tuple[Path, str]]:
    def make(tmp: Path) -> tuple[Path, str]:
        packed = gzip.compress(source.read_bytes(), mtime=0)
        path = tmp / name
        path.write_bytes(packed[:len(packed) // 2])
        return path, f"{path}: is truncated: the gzip stream ends before its end-of-stream marker"
    return make


def not_utf8(tmp: Path) -> tuple[Path, str]:
    lines = [line.encode() for line in _lines(OPENB)]
    lines[39] = lines[39].replace(b"pod-", "pöd-".encode("latin-1"))
    path = tmp / "latin1.csv"
    path.write_bytes(b"".join(lines))
    return path, f"{path}:40: is not UTF-8 text (byte {len(b''.join(lines[:39])) + 1})"


def header_only(tmp: Path) -> tuple[Path, str]:
    path = tmp / "header.csv"
    path.write_text(_lines(OPENB)[0])
    return path, f"{path}: holds no pods (a header line only)"


EVAL_FLAGS = ("--seeds", "1", "--quick", "--tasks", "1000")  # more tasks than the fixtures have: read to the end


@pytest.mark.parametrize(("make", "command"), [
    (bad_field, ("eval", "stage1")),
    (bad_field, ("train", "ddpg", "--steps", "1000")),
    (short_record, ("eval", "stage1")),
    (short_record, ("train", "double-dqn", "--steps", "2000")),
    (cut_gzip(SWF, "cut.swf.gz"), ("eval", "stage1")),
    (cut_gzip(OPENB, "cut.csv.gz"), ("eval", "gpu")),
    (not_utf8, ("eval", "gpu")),
    (header_only, ("eval", "gpu")),
    (header_only, ("eval", "stage1")),
], ids=["field-eval", "field-train", "short-eval", "short-train", "cut-swf", "cut-openb", "utf8", "empty-gpu",
        "empty-stage1"])
def test_a_bad_trace_file_is_one_line_naming_it_exit_2_and_nothing_written(tmp_path: Path, capsys, make,
                                                                           command: tuple[str, ...]) -> None:
    path, expected = make(tmp_path)
    out = tmp_path / "out"
    flags = (*EVAL_FLAGS, "--out", str(out)) if command[0] == "eval" else ("--out", str(out / "m.pt"), "--quiet")
    assert main([*command, "--fleet", SMALL, "--trace", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [f"hsched: {expected}"]
    assert not out.exists()


SOURCES = {"small.swf": SWF.read_bytes(), "small_openb.csv": OPENB.read_bytes(),
           "small.swf.gz": gzip.compress(SWF.read_bytes(), mtime=0),
           "small_openb.csv.gz": gzip.compress(OPENB.read_bytes(), mtime=0)}
PIECES = st.lists(st.sampled_from([bytes([b]) for b in b"0123456789,-.e ;\n\t\"|aA"] + [b"\xff", b"\xc3", b"\x00"]),
                  max_size=6).map(b"".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SOURCES)),
       edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 8), st.one_of(PIECES, st.binary(max_size=4))),
                      min_size=1, max_size=4))
def test_a_corrupted_trace_loads_valid_tasks_or_is_one_line_naming_the_file(tmp_path: Path, name: str,
                                                                           edits: list[tuple[int, int, bytes]]) -> None:
    data = SOURCES[name]  # a .gz file's compressed bytes are what is corrupted
    for at, cut, insert in edits:
        at %= len(data) + 1
        data = data[:at] + insert + data[at + cut:]
    path = tmp_path / name
    path.write_bytes(data)
    try:
        jobs = trace_jobs(resolve_trace(str(path)))
    except ValidationError as exc:
        message = str(exc)
        assert message.startswith(f"{path}") and "\n" not in message and "\r" not in message, message
        return
    assert jobs
    for _, task in jobs:
        task.validate()
