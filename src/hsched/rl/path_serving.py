"""The selector's learned path finder (`--path-finder per-dqn`) and its agreement metrics.

Kept apart from hsched.rl.dqn so that a selector routing on Dijkstra never imports torch. The safety net is
not here but in `hsched.costs.rank_datacenters`: every agent path is checked against Dijkstra's and used only
when it is valid and not longer; `DcSelector` counts those checks (`path_checks`, `path_agreed`).
"""

from __future__ import annotations

import logging
from typing import Any

from hsched.costs.graph import WanGraph
from hsched.costs.paths import PathFinder
from hsched.telemetry import metrics as m

log = logging.getLogger("hsched.selector")

PATH_FINDERS = ("dijkstra", "per-dqn")
DEFAULT_MODEL = "per_dqn_path"  # models/per_dqn_path.pt


def selector_path_finder(kind: str, model: str, graph: WanGraph) -> PathFinder | None:
    """The learned path finder for `kind`, or None (Dijkstra) when asked for Dijkstra or when the model is
    missing or of the old one-hot format (said in the log; the selector then routes on Dijkstra). The
    graph-relative agent runs on any WAN, whatever its vertex count."""
    if kind == "dijkstra":
        return None
    if kind not in PATH_FINDERS:
        raise ValueError(f"path finder: must be one of {', '.join(PATH_FINDERS)}, got {kind!r}")
    from hsched.rl import dqn  # torch: only imported when a learned finder is asked for
    from hsched.rl.checkpoint import serve_on_one_thread

    serve_on_one_thread()
    try:
        finder = dqn.load_path_finder(model, graph, name=kind)
    except (FileNotFoundError, dqn.ModelMismatch) as exc:
        log.warning("path finder %s: %s; routing on dijkstra instead", kind, exc)
        return None
    log.info("path finder %s: serving %s (every path checked against dijkstra)", kind, model)
    return finder


def register_path_metrics(metrics: Any, selector: Any, requested: str) -> None:
    """Prometheus families on the selector's MetricsServer: the path finder served (and the one asked for), and
    with an agent the share of checked agent paths it used (valid, not longer than Dijkstra's) and the check
    counts by outcome since start (replaced: its fallbacks to Dijkstra)."""
    finder = selector.path_finder
    served = finder.name if finder is not None else "dijkstra"
    metrics.register_gauge_family(*m.HSCHED_SELECTOR_PATH_FINDER_INFO, lambda: [((served, requested), 1.0)])
    if finder is None:
        return
    metrics.register_gauge_family(*m.HSCHED_SELECTOR_PATH_AGREEMENT, lambda: [
        ((finder.name,), selector.path_agreed / selector.path_checks)] if selector.path_checks else [])
    metrics.register_counter_family(*m.HSCHED_SELECTOR_PATH_CHECKS, lambda: [
        ((finder.name, "used"), selector.path_agreed),
        ((finder.name, "replaced"), selector.path_checks - selector.path_agreed)])
