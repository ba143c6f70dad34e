"""The fleet views — `hsched dcs`, `hsched nodes DC`, `hsched describe TASK` — and `-o table|json|yaml`, through the
real CLI (subprocesses) against a real stack of the small fleet with tenant authentication: the columns and the
hand-computed free capacity, json and yaml that parse and agree with the table, a placer that is down or fenced
shown as such, a tenant that sees the fleet but describes only its own tasks, one-line errors."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import redis
import yaml

from hsched import views
from hsched.security import tokens as tk
from hsched.stack import Stack, StackConfig
from hsched.state.keys import Keys
from tests.conftest import SMALL_FLEET, delete_prefix
from tests.test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url):
    prefix = f"test-views-{uuid.uuid4().hex[:10]}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0, auth=True)
    try:
        with Stack(config) as s:
            yield s
    finally:
        delete_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def env(stack, tmp_path_factory):
    """The CLI's environment for the admin, alice and bob (tenant tokens added to the running stack's file)."""
    runtime = str(tmp_path_factory.mktemp("runtime"))  # no running-stack file: --gateway names the stack
    alice, _ = tk.create_token(stack.tokens_file, "alice", name="alice")
    bob, _ = tk.create_token(stack.tokens_file, "bob", name="bob")
    base = {"XDG_RUNTIME_DIR": runtime, "HSCHED_TOKEN": "", "HSCHED_TOKEN_FILE": ""}
    return {"admin": {**base, "HSCHED_TOKEN_FILE": str(stack.admin_token_file)},
            "alice": {**base, "HSCHED_TOKEN": alice}, "bob": {**base, "HSCHED_TOKEN": bob}, "nobody": base}


def cli(stack, env, *argv, who="admin", code=0):
    done = run_cli(*argv, "--gateway", stack.gateway, env=env[who])
    assert done.returncode == code, (argv, done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    return done


def rows(text: str) -> list[list[str]]:
    """A table's lines split into cells (columns are two or more spaces apart)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]


@pytest.fixture(scope="module")
def tasks(stack, env):
    """alice's CPU task (min-cost: cheap), bob's GPU task (only gpu has cards) and alice's rejected one."""
    cpu = cli(stack, env, "submit", "--cpu", "4", "--memory-gib", "8", who="alice").stdout.split()[0]
    gpu = cli(stack, env, "submit", "--cpu", "2", "--gpus", "1", "--gpu-core-percent", "50", "--gpu-memory-gib", "4",
              "--entry", "a", "--data-mb", "200", who="bob").stdout.split()[0]
    rejected = cli(stack, env, "submit", "--cpu", "8", "--gpus", "4", "--gpu-memory-gib", "8", who="alice",
                   code=1).stdout.split()[0]
    return {"cpu": cpu, "gpu": gpu, "rejected": rejected}


VOLATILE = ("ttl_ms", "unix_ms", "ledger_id")  # change between two calls on a live stack


def stable(doc):
    if isinstance(doc, dict):
        return {k: stable(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def test_dcs_shows_free_and_total_capacity_per_dc_in_every_format(stack, env, tasks):
    table = rows(cli(stack, env, "dcs").stdout)
    assert tuple(table[0]) == views.DCS_HEADERS
    by_dc = {r[0]: dict(zip(table[0], r, strict=True)) for r in table[1:]}
    assert list(by_dc) == ["cheap", "near", "gpu"]  # the fleet's order
    # small.yaml: cheap and near 4 × (24 cores, 96 GiB); gpu 4 × (32 cores, 256 GiB, 2 T4 of 16 GiB)
    cheap, near, gpu = by_dc["cheap"], by_dc["near"], by_dc["gpu"]
    assert (cheap["KIND"], cheap["STATUS"], cheap["NODES"]) == ("cpu", "serving", "4")
    assert (cheap["CPU(FREE/TOTAL)"], cheap["MEM_GIB(FREE/TOTAL)"]) == ("92/96", "376/384")  # alice's 4 cores, 8 GiB
    assert (near["CPU(FREE/TOTAL)"], near["MEM_GIB(FREE/TOTAL)"], near["GPUS(IDLE/TOTAL)"]) == ("96/96", "384/384", "-")
    assert (gpu["KIND"], gpu["CPU(FREE/TOTAL)"], gpu["MEM_GIB(FREE/TOTAL)"]) == ("gpu", "126/128", "1023/1024")
    assert gpu["GPUS(IDLE/TOTAL)"] == "T4 7/8" and gpu["GPU%"] == "6.2%"  # half of one card of 8 busy
    assert cheap["CPU%"] == "4.2%" and cheap["POLICY"] == "bestfit"  # 4 of 96 cores
    for row in by_dc.values():
        assert float(row["PUE"]) > 1.0 and 15.0 < float(row["INLET_C"]) < 40.0
        assert re.fullmatch(r"\S+ token [1-9]\d* ttl \d+\.\ds", row["LEASE"]), row["LEASE"]

    doc = json.loads(cli(stack, env, "dcs", "-o", "json").stdout)
    assert stable(doc) == stable(json.loads(cli(stack, env, "dcs", "--json").stdout))
    assert stable(yaml.safe_load(cli(stack, env, "dcs", "-o", "yaml").stdout)) == stable(doc)
    views_by_dc = {v["datacenter"]: v for v in doc["datacenters"]}
    g = views_by_dc["gpu"]
    # 64-bit integers as numbers (protobuf's JSON mapping writes them as strings)
    assert g["gpus"] == [{"model": "T4", "cards": 8, "cards_idle": 7, "core_percent_free": 750,
                          "memory_mib_free": 8 * 16384 - 4096, "memory_mib_capacity": 8 * 16384}]
    assert views_by_dc["cheap"]["summary"]["free"]["cpu_milli"] == 92000
    for name, v in views_by_dc.items():  # the table's lease column is the json's lease
        assert by_dc[name]["LEASE"].startswith(f"{v['lease']['holder']} token {v['lease']['fencing_token']} ")
        assert by_dc[name]["PUE"] == f"{v['thermal']['pue_after']:.3f}"
        assert v["thermal"]["redline_c"] == 27.0


def test_nodes_shows_each_node_and_card(stack, env, tasks):
    placed = json.loads(cli(stack, env, "describe", tasks["gpu"], "-o", "json").stdout)["task"]["assignments"][0]
    slice_ = placed["gpus"][0]
    out = cli(stack, env, "nodes", "gpu").stdout
    assert "T4: 7/8 cards idle, 7.5 card-equivalents of cores and 124/128 GiB free" in out
    table = rows(out.split("\n", 2)[2])
    assert tuple(table[0]) == views.NODES_HEADERS and len(table) == 5
    by_node = {r[0]: r for r in table[1:]}
    other = 1 - slice_.get("card", 0)
    cards = {f"{slice_.get('card', 0)}:50%/12", f"{other}:100%/16"}
    assert by_node[placed["node"]][2:7] == ["ok", "1", "30/32", "255/256", "T4"]
    assert set(by_node[placed["node"]][7].split()) == cards
    assert all(r[2:] == ["ok", "0", "32/32", "256/256", "T4", "0:100%/16 1:100%/16"] for n, r in by_node.items()
               if n != placed["node"])
    doc = json.loads(cli(stack, env, "nodes", "gpu", "--gpu-model", "T4", "-o", "json").stdout)
    assert len(doc["nodes"]) == 4 and yaml.safe_load(cli(stack, env, "nodes", "gpu", "-o", "yaml").stdout)[
        "nodes"] == doc["nodes"]
    cheap = rows(cli(stack, env, "nodes", "cheap").stdout.split("\n", 1)[1])
    assert sorted(r[4] for r in cheap[1:]) == ["20/24", "24/24", "24/24", "24/24"]  # alice's 4 cores on one node

    assert_one_line_error(cli(stack, env, "nodes", "nowhere", code=1), 1, "datacenter", "cheap, near, gpu", "nowhere")
    assert_one_line_error(cli(stack, env, "nodes", "cheap", "--gpu-model", "T4", code=1), 1, "gpu_model", "none")
    assert_one_line_error(cli(stack, env, "nodes", "gpu", "--gpu-model", "A100", code=1), 1, "gpu_model", "T4")


def test_tenants_shows_each_tenants_fair_share_and_a_tenant_only_its_own(stack, env, tasks):
    """bob's one GPU task in gpu (2 cores, half a card): the only tenant there, so it deserves what it asks for
    and its share is 1. alice sees her own rows only; a DC that is not in the fleet is a one-line usage error."""
    table = rows(cli(stack, env, "tenants", "--datacenter", "gpu").stdout)
    assert tuple(table[0]) == views.TENANTS_HEADERS
    bob = next(r for r in table[1:] if r[1] == "bob")
    assert bob[:5] == ["gpu", "bob", "1", "1", "0"] and bob[5] == "2/2/2" and bob[7:] == ["0.5/0.5/0.5", "1.00"]
    for line in rows(cli(stack, env, "tenants", who="alice").stdout)[1:]:
        assert line[1] == "alice", line
    doc = json.loads(cli(stack, env, "tenants", "-o", "json").stdout)
    assert {t["tenant"] for v in doc["datacenters"] for t in v.get("tenants", [])} >= {"alice", "bob"}
    assert_one_line_error(run_cli("tenants", "--datacenter", "atlantis", "--gateway", stack.gateway,
                                  env=env["admin"]), 2, "--datacenter", "atlantis")


def test_describe_explains_the_choice_and_shows_the_history(stack, env, tasks):
    text = cli(stack, env, "describe", tasks["gpu"]).stdout
    for line in ("Data center:  gpu", "Why:          ranked 1 of 1 by the selector (min-cost)",
                 "Path:         a -> b -> c", "Placement:    policy bestfit", "Thermal:      hottest inlet",
                 "  cheap: the task needs 1 GPUs in all, the DC has 0 GPUs"):
        assert line in text, text
    # eq.1 for 1 h: 2 cores × 0.04 + 1 GiB × 0.005 + 0.5 GPU × 1.0; eq.2: 0.2 GB × 1 ms (a-b-c) × 0.01
    assert "Cost:         resource 0.5850 (cpu 0.0800 + memory 0.0050 + gpu 0.5000) + network 0.0020 = 0.5870" in text
    events = text.split("Events:", 1)[1]
    assert [r[1] for r in rows(events)[1:4]] == ["submitted", "dc_selected", "placed"]
    doc = json.loads(cli(stack, env, "describe", tasks["gpu"], "-o", "json").stdout)
    assert [e["kind"] for e in doc["events"]][:3] == ["submitted", "dc_selected", "placed"]
    assert all(e["task_id"] == tasks["gpu"] for e in doc["events"])
    # yaml renders the same task; its lifecycle fields may move between the two calls (it can start running)
    moving = {"state", "updated_unix_ms", "started_unix_ms", "finished_unix_ms"}
    as_yaml = yaml.safe_load(cli(stack, env, "describe", tasks["gpu"], "-o", "yaml").stdout)["task"]
    assert {k: v for k, v in as_yaml.items() if k not in moving} == {k: v for k, v in doc["task"].items()
                                                                      if k not in moving}
    rejected = cli(stack, env, "describe", tasks["rejected"]).stdout
    assert "State:        REJECTED" in rejected and "Data center:  -" in rejected
    for reason in ("  cheap: the task needs 4 GPUs in all, the DC has 0 GPUs",
                   "  near: the task needs 4 GPUs in all, the DC has 0 GPUs", "  gpu: no node of gpu has 4 GPUs (max 2)"):
        assert reason in rejected  # the full reasons, one line per DC
    assert_one_line_error(cli(stack, env, "describe", "tnosuchtask", code=1), 1, "NOT_FOUND", "tnosuchtask")


def test_a_tenant_sees_the_fleet_but_describes_only_its_own_tasks(stack, env, tasks):
    assert rows(cli(stack, env, "dcs", who="alice").stdout)[1][0] == "cheap"
    assert "Data center:  cheap" in cli(stack, env, "describe", tasks["cpu"], who="alice").stdout
    assert_one_line_error(cli(stack, env, "describe", tasks["gpu"], who="alice", code=1), 1, "NOT_FOUND",
                          tasks["gpu"])  # bob's: answered exactly as a task that does not exist
    assert_one_line_error(cli(stack, env, "dcs", who="nobody", code=1), 1, "UNAUTHENTICATED")


def test_get_list_watch_and_job_take_every_output_format(stack, env, tasks):
    task = json.loads(cli(stack, env, "get", tasks["cpu"], "-o", "json").stdout)
    assert yaml.safe_load(cli(stack, env, "get", tasks["cpu"], "-o", "yaml").stdout)["task_id"] == tasks["cpu"]
    assert task["task_id"] == tasks["cpu"] and len(cli(stack, env, "get", tasks["cpu"]).stdout.splitlines()) == 1
    listed = yaml.safe_load(cli(stack, env, "list", "-o", "yaml").stdout)
    assert {t["task_id"] for t in listed["tasks"]} >= set(tasks.values())
    assert json.loads(cli(stack, env, "list", "--json").stdout)["tasks"][0]["task_id"] == listed["tasks"][0]["task_id"]
    # a finished task: watch prints it once and exits (1: it did not end well); as json, one object per line
    watched = cli(stack, env, "watch", tasks["rejected"], "-o", "json", code=1).stdout.splitlines()
    assert len(watched) == 1 and json.loads(watched[0])["state"] == "TASK_STATE_REJECTED"
    assert yaml.safe_load(cli(stack, env, "job", "list", "-o", "yaml").stdout) == {"jobs": []}  # none: an empty list
    assert_one_line_error(cli(stack, env, "get", tasks["cpu"], "--json", "-o", "yaml", code=2), 2, "--json", "-o yaml")
    assert_one_line_error(cli(stack, env, "dcs", "-o", "xml", code=2), 2, "-o", "invalid choice")


def until(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_a_placer_down_or_fenced_is_shown_as_such(stack, env, tasks, redis_url):
    def near():
        doc = json.loads(cli(stack, env, "dcs", "-o", "json").stdout)
        return next(v for v in doc["datacenters"] if v["datacenter"] == "near")

    stack.kill("placer-near")
    try:
        table = {r[0]: r for r in rows(cli(stack, env, "dcs").stdout)}
        assert table["near"][2:6] == ["unreachable", "4", "?/96", "?/384"] and table["cheap"][2] == "serving"
        assert_one_line_error(cli(stack, env, "nodes", "near", code=1), 1, "near", "unreachable")
        view = until(lambda: (v := near())["lease"].get("holder") is None and v, "the dead placer's lease lapses")
        assert view["status"] == "unreachable" and view["summary"]["capacity"]["cpu_milli"] == 96000
    finally:
        stack.restart("placer-near")
    serving = until(lambda: (v := near())["status"] == "serving" and v, "the restarted placer serves")
    token = int(serving["lease"]["fencing_token"])
    # another owner takes the lease (as a second placer would when this one stalls): the placer is fenced out and
    # says so (standby, naming the holder), then takes it back with a newer token once it lapses
    keys, r = Keys(stack.config.prefix), redis.Redis.from_url(redis_url)
    r.set(keys.lease("near"), "intruder", px=4000)
    r.incr(keys.fence("near"))
    fenced = until(lambda: (v := near())["status"] == "standby" and v, "the placer sees it lost its lease")
    assert fenced["lease"]["holder"] == "intruder" and "holder is intruder" in fenced["reason"]
    back = until(lambda: (v := near())["status"] == "serving" and v, "the placer takes its lease back")
    assert int(back["lease"]["fencing_token"]) >= token + 2
    assert back["summary"]["free"]["cpu_milli"] == 96000  # its ledger folded afresh: nothing lost, nothing added


def test_amounts_keep_the_precision_they_were_asked_in():
    """(250m CPU showed as 0.2, three 25 % GPU slices as 0.8.)"""
    from hsched import views

    assert [views.cores(m) for m in (250, 1500, 96000, 1)] == ["0.25", "1.5", "96", "0.001"]
