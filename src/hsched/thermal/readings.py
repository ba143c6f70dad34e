"""Sensor readings of a room: the schema, its validation, files of real readings and the Redis stream.

One reading is one server's inlet and outlet temperature in one scan of the room (docs/thermal.md, "Sensor
telemetry"). Readings of one scan share a ``sample`` id; the thermal service assembles a scan once every
server of the DC has a reading in it and fits the recirculation model on such scans (hsched.thermal.online).

Power comes from the energy balance across the server, ``P = m_dot c_p (T_out - T_in)`` with the room's air
flow per server, unless the reading carries a metered ``power_w``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsched.domain.errors import ValidationError
from hsched.domain.limits import int_field
from hsched.v1 import common_pb2, thermal_pb2

TEMP_MIN_C, TEMP_MAX_C = -20.0, 100.0  # a sensor value outside this is a broken sensor, not a room
# 9999-12-31T23:59:59.999Z, the last millisecond a four-digit year (and Python's datetime) names: a reading's
# time is a unix time in ms, and an int64 on the wire as every hsched time is (TaskEvent.unix_ms)
UNIX_MS_MAX = 253_402_300_799_999
_INT_TEXT = re.compile(r"[+-]?[0-9]+\Z")  # an integer as CSV (text only) writes it; ASCII digits only
SAMPLE_MAX_LEN = 128
FIELDS = ("datacenter", "sample", "node", "inlet_c", "outlet_c", "supply_c", "unix_ms", "power_w")
REQUIRED = ("datacenter", "sample", "node", "inlet_c", "outlet_c", "supply_c")


@dataclass(frozen=True, slots=True)
class Reading:
    datacenter: str
    sample: str  # the scan this reading belongs to (readings of one scan share it)
    node: int  # server index in the DC (rack-major, as in the fleet's node table)
    inlet_c: float
    outlet_c: float
    supply_c: float  # the CRAC supply air temperature at the scan
    unix_ms: int
    power_w: float | None = None  # metered power; None = from the energy balance

    def to_stream(self) -> dict[str, str]:
        """The stream entry's fields (the datacenter is the stream's key)."""
        body: dict[str, Any] = {"sample": self.sample, "node": self.node, "inlet_c": self.inlet_c,
                                "outlet_c": self.outlet_c, "supply_c": self.supply_c, "unix_ms": self.unix_ms}
        if self.power_w is not None:
            body["power_w"] = self.power_w
        return {"r": json.dumps(body, separators=(",", ":"))}


def _where(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _temperature(raw: Mapping[str, Any], name: str, where: str) -> float:
    value = raw.get(name)
    try:
        t = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValidationError(_where(where, name), "must be a temperature in °C (a number)", value) from None
    if not (math.isfinite(t) and TEMP_MIN_C <= t <= TEMP_MAX_C):
        raise ValidationError(_where(where, name), f"must be finite and within [{TEMP_MIN_C:g}, {TEMP_MAX_C:g}] °C",
                              value)
    return t


def parse_reading(raw: Mapping[str, Any], where: str = "", datacenter: str | None = None,
                  nodes: Mapping[str, int] | None = None, n: int | None = None) -> Reading:
    """One reading from a mapping (a JSON object, a CSV row, a stream entry's body): ValidationError names the
    field and the rule. ``datacenter`` fills a missing datacenter (a stream's readings); ``nodes`` resolves a
    node given by name; ``n`` bounds the index (the DC's server count)."""
    if not isinstance(raw, Mapping):
        raise ValidationError(where or "reading", "must be an object with the fields " + ", ".join(REQUIRED), raw)
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValidationError(_where(where, unknown[0]), "is not a reading field (known: " + ", ".join(FIELDS) + ")")
    dc = raw.get("datacenter", datacenter)
    for name in REQUIRED:
        if (dc if name == "datacenter" else raw.get(name)) in (None, ""):
            raise ValidationError(_where(where, name), "is required")
    if not isinstance(dc, str):
        raise ValidationError(_where(where, "datacenter"), "must be a data center name (text)", dc)
    sample = raw["sample"]
    if not isinstance(sample, str | int) or isinstance(sample, bool) or len(str(sample)) > SAMPLE_MAX_LEN:
        raise ValidationError(_where(where, "sample"), f"must be a scan id of at most {SAMPLE_MAX_LEN} characters",
                              sample)
    node = _node(raw["node"], _where(where, "node"), nodes, n)
    inlet, outlet, supply = (_temperature(raw, f, where) for f in ("inlet_c", "outlet_c", "supply_c"))
    if outlet < inlet:
        raise ValidationError(_where(where, "outlet_c"), f"must be >= inlet_c ({inlet:g} °C): a server heats its air",
                              raw["outlet_c"])
    if supply > inlet:
        raise ValidationError(_where(where, "supply_c"), f"must be <= inlet_c ({inlet:g} °C): the inlet air is the "
                              "supply air plus recirculated exhaust", raw["supply_c"])
    unix_ms = raw.get("unix_ms")
    if unix_ms in (None, ""):
        unix_ms = int(time.time() * 1000)
    else:
        unix_ms = _integer(unix_ms, _where(where, "unix_ms"), common_pb2.TaskEvent, "unix_ms")
        if not 0 < unix_ms <= UNIX_MS_MAX:
            raise ValidationError(_where(where, "unix_ms"), f"must be a unix time in ms, in 1..{UNIX_MS_MAX} "
                                  "(1970 to the year 9999)", raw["unix_ms"])
    power = raw.get("power_w")
    if power in (None, ""):
        power = None
    else:
        try:
            power = float(power)
        except (TypeError, ValueError):
            raise ValidationError(_where(where, "power_w"), "must be a number of watts", power) from None
        if not (math.isfinite(power) and power >= 0):
            raise ValidationError(_where(where, "power_w"), "must be finite and >= 0 W", raw["power_w"])
    return Reading(dc, str(sample), node, inlet, outlet, supply, unix_ms, power)


def _integer(value: Any, where: str, message: Any, name: str) -> int:
    """An integer field, typed as a task file types its own (`int_field`, with the range of the protobuf field
    `name` of `message`: the like of it on the wire): an int, never 4.0, 1e3 or true; or, since CSV has only
    text, the text of one ("4", not "4.0")."""
    if isinstance(value, str) and _INT_TEXT.match(value.strip()):
        try:
            value = int(value.strip())
        except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits): no field's range
            raise ValidationError(where, f"must be an integer of at most {sys.get_int_max_str_digits()} digits",
                                  value) from None
    return int_field(where, value, message, name)


def _node(value: Any, where: str, nodes: Mapping[str, int] | None, n: int | None) -> int:
    if isinstance(value, str) and not _INT_TEXT.match(value.strip()):
        if nodes is None:
            raise ValidationError(where, "must be a server index (an integer >= 0)", value)
        if value not in nodes:
            raise ValidationError(where, "is not a server of this data center", value)
        return nodes[value]
    idx = _integer(value, where, thermal_pb2.LoadDelta, "node_index")  # a server index on the thermal wire
    if n is not None and idx >= n:
        raise ValidationError(where, f"must be < {n}, the data center's server count", value)
    return idx


def reading_from_stream(datacenter: str, fields: Mapping[Any, Any], n: int) -> Reading:
    """A stream entry's reading (ValidationError for an entry that is not one)."""
    body = fields.get(b"r", fields.get("r"))
    try:
        raw = json.loads(body)
    except (TypeError, ValueError):
        raise ValidationError("r", "must be a JSON object (docs/thermal.md, Sensor telemetry)", body) from None
    return parse_reading(raw, datacenter=datacenter, n=n)


def load_readings(path: str | Path, resolve: Any = None) -> list[Reading]:
    """Every reading of a file: JSON lines (``.jsonl``/``.json``, one object a line) or CSV with a header
    (``.csv``). ``resolve(datacenter) -> (names -> index, n)`` checks the datacenter and the node against a
    fleet (None: unchecked). The first bad line raises ValidationError naming it and the field."""
    path = Path(path)
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as exc:
        raise ValidationError("file", f"cannot be read ({exc.strerror})", str(path)) from None
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValidationError(f"{path.name}:{line}", f"is not UTF-8 text (byte {exc.start})") from None
    rows = _csv_rows(text, path.name) if path.suffix.lower() == ".csv" else _json_lines(text, path.name)
    out = []
    for line, raw in rows:
        where = f"{path.name}:{line}"
        nodes, n = None, None
        if resolve is not None and isinstance(raw, Mapping) and isinstance(raw.get("datacenter"), str):
            nodes, n = resolve(raw["datacenter"], f"{where}.datacenter")
        out.append(parse_reading(raw, where, nodes=nodes, n=n))
    if not out:
        raise ValidationError(path.name, "holds no readings")
    return out


def _csv_rows(text: str, name: str) -> Iterator[tuple[int, Any]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        missing = [f for f in REQUIRED if f not in (reader.fieldnames or [])]
        if missing:
            raise ValidationError(f"{name}: header", "must name the columns " + ", ".join(REQUIRED)
                                  + f" (missing {', '.join(missing)})")
        for row in reader:
            if None in row:  # DictReader's key for the fields beyond the header's
                raise ValidationError(f"{name}:{reader.line_num}", f"has {len(reader.fieldnames) + len(row[None])} "
                                      f"fields, the header {len(reader.fieldnames)}")
            yield reader.line_num, {k: v for k, v in row.items() if v not in (None, "")}
    except csv.Error as exc:
        raise ValidationError(f"{name}:{reader.reader.line_num}", f"must be CSV ({exc})") from None


def _json_lines(text: str, name: str) -> Iterator[tuple[int, Any]]:
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except (ValueError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "it nests too deep" if isinstance(
                exc, RecursionError) else f"a number of more than {sys.get_int_max_str_digits()} digits"
            raise ValidationError(f"{name}:{i}", f"must be one JSON object per line ({why})") from None
        yield i, raw


def write_readings(redis, stream_of: Any, readings: Sequence[Reading], maxlen: int, chunk: int = 1000) -> int:
    """XADD the readings (synchronous client) in pipelined chunks; ``stream_of(dc)`` names each DC's stream."""
    for lo in range(0, len(readings), chunk):
        with redis.pipeline(transaction=False) as pipe:
            for r in readings[lo:lo + chunk]:
                pipe.xadd(stream_of(r.datacenter), r.to_stream(), maxlen=maxlen, approximate=True)
            pipe.execute()
    return len(readings)


def synthetic_readings(datacenter: str, sample: str, supply_c: float, inlet_c: np.ndarray, power_w: np.ndarray,
                       k_per_w: float, noise_k: float, rng: np.random.Generator, unix_ms: int | None = None
                       ) -> list[Reading]:
    """A scan of a room the model describes: ``inlet_c`` and ``power_w`` per server, with Gaussian sensor noise
    of ``noise_k`` on every temperature (the inlet never reads below the supply, the outlet never below the
    inlet: what parse_reading takes)."""
    n = len(inlet_c)
    unix_ms = unix_ms or int(time.time() * 1000)
    inlet = inlet_c + rng.normal(0.0, noise_k, n)
    outlet = np.maximum(inlet_c + power_w * k_per_w + rng.normal(0.0, noise_k, n), inlet)
    supply = float(np.clip(supply_c + rng.normal(0.0, noise_k), TEMP_MIN_C, TEMP_MAX_C))
    inlet = np.clip(inlet, supply, TEMP_MAX_C)
    outlet = np.clip(outlet, inlet, TEMP_MAX_C)
    return [Reading(datacenter, sample, i, float(inlet[i]), float(outlet[i]), supply, unix_ms) for i in range(n)]
