"""Quick checks of the benchmark tools (bench/): a 2-hop echo chain under closed- and open-loop load.

No absolute timing thresholds: the machine is shared and noisy.
"""

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` is not an installed package

from bench.echo_chain import echo_request, start_echo_chain
from bench.loadgen import STEP, LoadResult, run_closed_loop, run_load

ECHO = "bench.echo_chain:echo_request"


@pytest.fixture(scope="module")
def target():
    with start_echo_chain(hops=2) as chain:
        assert list(chain.procs) == ["f1", "echo"]
        yield chain.target


def test_closed_loop(target):
    r = run_load(target, ECHO, concurrency=8, duration_s=1.0, processes=2, warmup_s=0.2)
    assert r.calls > 0
    assert r.errors == {}
    assert 0 < r.p50_ms <= r.p90_ms <= r.p99_ms <= r.max_ms
    assert r.throughput_rps > 0 and len(r.client_cpu) == 2
    assert list(r.extra["per_method"]) == ["/bench.Echo/Echo"]


def test_closed_loop_total(target):
    r = run_load(target, ECHO, concurrency=4, duration_s=None, total=50, warmup_s=0)
    assert r.calls == 50 and r.errors == {}


def test_combined_runs_are_their_calls_over_their_summed_time():
    a = LoadResult.from_samples([0.001] * 30, {"UNAVAILABLE": 2}, 1.0, client_cpu=[0.2])
    b = LoadResult.from_samples([0.003] * 10, {}, 3.0, client_cpu=[0.6])
    both = LoadResult.combine([a, b])
    assert both.calls == 42 and both.errors == {"UNAVAILABLE": 2} and both.elapsed_s == 4.0
    assert both.throughput_rps == pytest.approx(40 / 4.0)  # successful calls over the summed time
    assert both.p50_ms == pytest.approx(1.0) and both.max_ms == pytest.approx(3.0)
    assert both.client_cpu == [pytest.approx((0.2 * 1 + 0.6 * 3) / 4)]  # weighted by each run's time


def test_open_loop_rate(target):
    rate = 100.0
    r = run_load(target, ECHO, concurrency=32, duration_s=1.0, warmup_s=0.2, rate_rps=rate, arrival="fixed")
    assert r.errors == {} and r.dropped == 0
    assert r.offered_rps == rate
    assert r.p50_ms <= r.p99_ms
    assert abs(r.throughput_rps - rate) <= 0.2 * rate


def test_sequence_mode(target):
    res = run_closed_loop("bench.echo_chain:echo_twice", (target,), concurrency=4, duration_s=0.5,
                          warmup_s=0.1)
    assert set(res) == {"first", "second", STEP}
    assert all(r.errors == {} and r.p50_ms <= r.p99_ms for r in res.values())
    # one call of each per iteration (iterations straddling the end of warmup count only in part)
    assert res[STEP].calls > 0
    assert all(abs(res[name].calls - res[STEP].calls) <= 4 for name in ("first", "second"))


def test_errors_counted_by_status(target):
    bad = functools.partial(echo_request, method="/bench.Echo/Nope")
    r = run_load(target, bad, concurrency=2, duration_s=None, total=10, warmup_s=0)
    assert r.calls == 10 and r.errors == {"UNIMPLEMENTED": 10} and r.throughput_rps == 0


def test_path_floor_moves_real_tasks_through_every_hop(redis_url, prefix):
    """The Submit-path floor (bench/path_floor.py) must do what it stands for: the stack's own client gets
    PLACED tasks back, every Place and Release reaches a placer's ledger, and every step the task stream."""
    import redis

    from bench.path_floor import Floor, busy_dcs
    from bench.stack_bench import build_requests
    from hsched.stack import placer_groups

    # a process hosting three DCs' placers (hsched up --placer-processes) and one alone, as a Stack lays them out
    groups = placer_groups(["kansas-city", "houston", "indianapolis", "dc-3"], 2)
    assert groups == {"placers-1": ["kansas-city", "houston"], "placers-2": ["indianapolis", "dc-3"]}
    groups = {"placers-1": ["kansas-city", "indianapolis", "dc-3"], "placer-houston": ["houston"]}
    with Floor(groups, busy=busy_dcs(["dc-3", "houston", "indianapolis", "kansas-city"], 2), redis_url=redis_url,
               prefix=prefix, redis_pid=None) as floor:
        assert set(floor.procs) == {"placers-1", "placer-houston", "selector", "gateway"}
        res = run_closed_loop("bench.stack_bench:submit_release", (floor.target, build_requests(None, 20)),
                              concurrency=4, duration_s=None, total=40, warmup_s=0)
    assert res["outcome:placed"].calls == 40
    assert res["Submit"].errors == {} and res["Release"].calls == 40 and res["Release"].errors == {}
    r = redis.Redis.from_url(redis_url)
    ledgers = {dc: [e[b"k"] for _, e in r.xrange(f"{prefix}:ledger:{dc}")] for dc in ("kansas-city", "houston")}
    assert [len(v) for v in ledgers.values()] == [40, 40]  # the selector alternates the two busy placers
    assert all(v.count(b"alloc") == v.count(b"free") == 20 for v in ledgers.values())
    assert r.xlen(f"{prefix}:ledger:indianapolis") == r.xlen(f"{prefix}:ledger:dc-3") == 0
    kinds = [e[b"k"] for _, e in r.xrange(f"{prefix}:tasks")]
    assert {k: kinds.count(k) for k in set(kinds)} == {b"submitted": 40, b"dc_selected": 40, b"placed": 40,
                                                       b"released": 40}


def test_decision_hash_is_the_same_for_two_runs_and_moves_with_the_policy(capsys):
    """bench/decision_hash.py runs placer_scale's speed loop (it once broke when that loop grew an option) and
    its digest is a function of the decisions: two runs of one policy agree, another policy differs."""
    from bench.decision_hash import main

    digests = []
    for policy in ("bestfit", "bestfit", "firstfit"):
        main(["--room", "gpu", "--nodes", "150", "--policy", policy, "--places", "40"])
        line = capsys.readouterr().out.strip().splitlines()[-1]
        digests.append(line.rsplit("sha256 ", 1)[1])
    assert digests[0] == digests[1] != digests[2]
