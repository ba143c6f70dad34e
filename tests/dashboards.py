"""The Grafana dashboards of deploy/grafana/dashboards, read as tests need them (tests/test_compose.py checks their
structure, tests/test_prometheus_stack.py runs every query against a real Prometheus)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards"
# Grafana's built-in interval variables, as a query sent straight to Prometheus must spell them
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
_FUNCTIONS_AND_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                        "unless", "offset"}


@dataclass(frozen=True)
class Query:
    dashboard: str  # file name
    panel: str  # panel title
    ref: str  # refId
    expr: str  # as written in the dashboard

    @property
    def promql(self) -> str:
        """The expression with Grafana's interval variables replaced, as Prometheus' HTTP API takes it."""
        out = self.expr
        for var, value in GRAFANA_VARIABLES.items():
            out = out.replace(var, value)
        return out

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}: {self.expr}"


def load() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows too; rows themselves are not panels."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries() -> list[Query]:
    return [Query(name, panel["title"], target["refId"], target["expr"])
            for name, dash in load().items() for panel in panels(dash) for target in panel.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (identifiers not followed by `(`, outside label matchers,
    strings and range brackets, that are not keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # grouping labels
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group(0) in _FUNCTIONS_AND_WORDS:
            continue
        if text[max(0, m.start() - 1)].isdigit():  # the "e" of 1e3
            continue
        names.add(m.group(0))
    return names
