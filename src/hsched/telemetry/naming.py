"""The naming rules every hsched_* metric family follows (docs/metrics.md), checked on a scrape.

``naming_problems(text, label_bounds)`` parses a Prometheus text exposition and returns one line per broken
rule (empty: all good). It is what tests/test_metrics_naming.py runs against every service of a live stack;
a Prometheus-backed check can feed it the same families.

Rules, for each family named hsched_*:
- a counter's samples end in ``_total``; a gauge's name does not;
- no ``percent``/``percentage`` in the name, and a ``_ratio`` is within [0, 1];
- a duration, temperature, power, memory or bandwidth carries its base unit (``_seconds``, ``_celsius``,
  ``_watts``, ``_bytes``, ``_bytes_per_second``);
- no empty label value;
- every label is in ``label_bounds`` and has at most that many distinct values in the family (a label with
  no bound, e.g. a task id, is a cardinality leak).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "hsched_"
# name word -> the unit suffix the name must end with
_UNITS = (
    (re.compile(r"latency|jitter|duration|_age_|_wait"), ("_seconds",)),
    (re.compile(r"inlet|supply|temperature"), ("_celsius",)),
    (re.compile(r"power"), ("_watts",)),
    (re.compile(r"memory"), ("_bytes", "_ratio")),
    (re.compile(r"bandwidth"), ("_bytes_per_second",)),
)


def naming_problems(text: str, label_bounds: Mapping[str, int]) -> list[str]:
    """Every rule broken by the hsched_* families of one scrape, one line each (see the module docstring)."""
    problems: list[str] = []
    for family in text_string_to_metric_families(text):
        name = family.name
        if not name.startswith(PREFIX):
            continue
        problems += _family_problems(name, family.type, family.samples, label_bounds)
    return problems


def _family_problems(name: str, kind: str, samples, label_bounds: Mapping[str, int]) -> list[str]:
    out = []
    if kind == "counter":
        out += [f"{s.name}: a counter sample must end in _total" for s in samples if not s.name.endswith("_total")]
    elif name.endswith("_total"):
        out.append(f"{name}: a {kind} must not end in _total (counters do)")
    if "percent" in name:
        out.append(f"{name}: no percent in a name (a 0-1 value is a _ratio)")
    if name.endswith("_ratio"):
        out += [f"{name}{s.labels}: ratio {s.value} outside [0, 1]" for s in samples if not 0 <= s.value <= 1]
    base = name.removesuffix("_total")
    for word, suffixes in _UNITS:
        if word.search(base) and not base.endswith(suffixes):
            out.append(f"{name}: must end in {' or '.join(suffixes)} (its base unit)")
    values: dict[str, set[str]] = {}
    for s in samples:
        for label, value in s.labels.items():
            if value == "":
                out.append(f"{name}: empty value of label {label!r}")
            values.setdefault(label, set()).add(value)
    for label, seen in sorted(values.items()):
        bound = label_bounds.get(label)
        if bound is None:
            out.append(f"{name}: label {label!r} has no cardinality bound")
        elif len(seen) > bound:
            out.append(f"{name}: label {label!r} has {len(seen)} values, more than its bound {bound}")
    return out
