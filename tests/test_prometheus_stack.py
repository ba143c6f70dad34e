"""A real Prometheus (`hsched up --prometheus`: Stack(prometheus=True)) against a real stack of the small fleet that
replayed a slice of the openb trace; everything checked through Prometheus' HTTP API:

- it scrapes every service of the stack and the supervisor (the generated config), all targets up;
- every hsched_* family it stored follows the naming rules (hsched.telemetry.naming, fed per target with the
  families Prometheus holds: /api/v1/label/__name__/values, /api/v1/metadata for the types, /api/v1/query for
  the samples), with the label bounds of tests/test_metrics_naming.py, and none of a service's families is missing;
- every query of every Grafana dashboard (deploy/grafana/dashboards) returns data: at least one finite sample.

The GPU room asks for the learned `ddpg` policy with no model (as in test_metrics_naming), so the fallback counter
exists; the replay keeps its tasks (no release at the end), so allocation, running and deferred series are live.
Skipped when no prometheus binary is installed (`apt-get install prometheus`; .ci/run installs it)."""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.parse
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hsched.replay import load_trace, replay, with_locations
from hsched.telemetry.naming import PREFIX, naming_problems
from hsched.telemetry.prometheus import TARGET_LABEL, PrometheusMissing, prometheus_binary
from tests import dashboards
from tests.conftest import small_fleet_stack
from tests.test_metrics_naming import label_bounds

pytestmark = pytest.mark.slow

TASKS = 40  # of the openb trace: mostly GPU pods, enough to fill the small fleet's GPU room and defer some
# Dashboard queries allowed to return nothing after a short replay: {(dashboard file, panel title): why}. Empty
# today: every family the dashboards read exists from a service's start (counters at 0, e.g. preemptions and
# restarts), so even a quiet series answers. A query that needs an event a short replay may not produce goes
# here, with the reason; the test fails if a listed query does return data (the exception is stale).
EMPTY_OK: dict[tuple[str, str], str] = {}
TARGET_LABELS = {"job", "instance", TARGET_LABEL}  # added by Prometheus / the scrape config, not by the services


def api(base: str, path: str, **params: str) -> object:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=30) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, promql: str) -> list[dict]:
    return api(base, "/api/v1/query", query=promql)["result"]


def wait_for(what: str, check, deadline_s: float = 90.0, every_s: float = 0.5):
    deadline = time.monotonic() + deadline_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus: {what} not seen within {deadline_s:.0f} s")
        time.sleep(every_s)


def _value(text: str) -> str:
    v = float(text)
    return "NaN" if math.isnan(v) else ("+Inf" if v == math.inf else "-Inf" if v == -math.inf else repr(v))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def expositions(base: str) -> dict[str, str]:
    """{hsched_service: the text exposition of that target's hsched_* families, rebuilt from what Prometheus
    stored} — what naming_problems reads from a direct scrape: # TYPE lines from the metadata, the latest sample
    of every series, without the labels Prometheus adds."""
    names = [n for n in api(base, "/api/v1/label/__name__/values") if n.startswith(PREFIX)]
    metadata = {name: entries[0]["type"] for name, entries in api(base, "/api/v1/metadata").items()
                if name.startswith(PREFIX)}
    # stored sample name -> its family. Prometheus scrapes OpenMetrics (what prometheus_client answers it), whose
    # TYPE line names a counter without _total; a counter's samples are stored as scraped (_total or not: the rule
    # checks that), histograms' as _bucket/_sum/_count
    suffixes = {"counter": ("_total", ""), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count")}
    family_of = {name + suffix: name for name, kind in metadata.items() for suffix in suffixes.get(kind, ("",))}
    untyped = sorted(set(names) - set(family_of))
    assert not untyped, f"Prometheus has no type metadata for {untyped}"
    lines: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for series in query(base, f'{{__name__=~"{PREFIX}.+"}}'):
        labels = dict(series["metric"])
        name, target = labels.pop("__name__"), labels[TARGET_LABEL]
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()) if k not in TARGET_LABELS)
        family = family_of[name]
        # the text format's TYPE line names a counter by its sample (x_total), as prometheus_client writes it
        typed = name if metadata[family] == "counter" else family
        lines[target][(typed, metadata[family])].append(f"{name}{{{text}}} {_value(series['value'][1])}")
    return {target: "".join(f"# TYPE {typed} {kind}\n" + "\n".join(samples) + "\n"
                            for (typed, kind), samples in sorted(families.items()))
            for target, families in lines.items()}


def hsched_families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text) if f.name.startswith(PREFIX) and f.samples}


@pytest.fixture(scope="module")
def replayed(redis_url, tmp_path_factory):
    try:
        prometheus_binary()
    except PrometheusMissing as exc:
        pytest.skip(str(exc))
    no_models = tmp_path_factory.mktemp("no-models")
    with small_fleet_stack(redis_url, "prometheus", prometheus=True, prometheus_port=0,
                           prometheus_scrape_interval_s=1.0, supervise=True, gpu_policy="ddpg",
                           extra_env={"HSCHED_MODELS_DIR": str(no_models)}) as stack:
        base = stack.prometheus_url
        targets = len(stack.prometheus_targets())  # scraped before the replay: its rates are seen rising
        wait_for(f"{targets} targets up", lambda: len(query(base, "up == 1")) == targets)
        tasks = with_locations(load_trace("openb", TASKS), stack.fleet, seed=1)
        stats = asyncio.run(replay(stack.gateway, tasks, duration_s=2.0, concurrency=8, release=False))
        assert stats.submitted == TASKS and not stats.errors
        submit = 'sum(hsched_rpc_server_requests_total{job="gateway", method="hsched.v1.Gateway/Submit"})'
        wait_for(f"all {TASKS} Submits", lambda: [r for r in query(base, submit) if float(r["value"][1]) >= TASKS])
        time.sleep(3)  # a few more scrapes: every rate() window holds the replay and the quiet after it
        yield stack, base, stats


def test_prometheus_scrapes_every_service_of_the_stack(replayed):
    stack, base, _ = replayed
    expected = stack.prometheus_targets()
    assert set(expected) == {*(n for n in stack.services if n != "prometheus"), "supervisor"}
    targets = api(base, "/api/v1/targets")["activeTargets"]
    seen = {t["labels"][TARGET_LABEL]: t for t in targets}
    assert set(seen) == set(expected)
    for name, target in seen.items():
        assert target["health"] == "up", f"{name}: {target['lastError']}"
        assert target["scrapeUrl"] == f"http://{expected[name]}/metrics"
        assert target["labels"]["job"] == ("placer" if name.startswith("placer-") else name)
    assert stack.services["prometheus"].alive and str(stack.state_dir or stack.run_dir) in \
        " ".join(stack.services["prometheus"].args), "its TSDB lives in the stack's private dir"


def test_every_hsched_family_in_prometheus_follows_the_naming_rules(replayed):
    stack, base, _ = replayed
    texts = expositions(base)
    assert set(texts) == set(stack.prometheus_targets())
    bounds = label_bounds(stack.fleet, services=len(stack.services))
    problems = {target: naming_problems(text, bounds) for target, text in texts.items()}
    assert {t: p for t, p in problems.items() if p} == {}
    # Prometheus holds every family each service exports (the rebuild is not missing any)
    for target, address in stack.prometheus_targets().items():
        direct = hsched_families(urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode())
        assert direct - hsched_families(texts[target]) == set(), target
    families = set().union(*(hsched_families(t) for t in texts.values()))
    assert {"hsched_tasks", "hsched_deferred_tasks", "hsched_placer_policy_fallbacks",
            "hsched_rpc_server_duration_seconds", "hsched_supervisor_service_up"} <= families


def test_the_naming_check_through_prometheus_catches_a_broken_family(replayed):
    """The rebuilt exposition is read as a scrape is: a gauge renamed to look like a counter, a ratio out of
    range or a target label that leaked in are reported."""
    stack, base, _ = replayed
    text = expositions(base)["placer-gpu"]
    bounds = label_bounds(stack.fleet, services=len(stack.services))
    assert naming_problems(text, bounds) == []
    assert naming_problems(text.replace("hsched_deferred_tasks", "hsched_deferred_tasks_total"), bounds)
    assert naming_problems(text + "# TYPE hsched_x_ratio gauge\nhsched_x_ratio 2.0\n", bounds)
    assert naming_problems(text.replace('datacenter="gpu"', 'datacenter="gpu",instance="x"'), bounds)


def test_every_dashboard_query_returns_data(replayed):
    _, base, stats = replayed
    assert stats.outcomes["placed"] > 0 and stats.outcomes["deferred"] > 0, stats.outcomes  # the panels have a story
    all_queries = dashboards.queries()
    assert len(all_queries) >= 30
    empty, unexpected = [], []
    for q in all_queries:
        result = query(base, q.promql)
        finite = [r for r in result if math.isfinite(float(r["value"][1]))]
        if (q.dashboard, q.panel) in EMPTY_OK:
            if finite:
                unexpected.append(f"{q}: listed in EMPTY_OK but returns {len(finite)} series")
        elif not finite:
            empty.append(f"{q} -> {result[:3]}")
    assert empty == [], "queries with no data:\n" + "\n".join(empty)
    assert unexpected == []
    # the check can fail: a misspelt family answers nothing; and the replay was scraped while it ran (rates rose)
    assert query(base, "hsched_dc_pue_typo") == []
    rate = 'sum(rate(hsched_rpc_server_requests_total{job="gateway", method="hsched.v1.Gateway/Submit"}[1m]))'
    assert float(query(base, rate)[0]["value"][1]) > 0
