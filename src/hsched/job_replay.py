"""Replay Decima's TPC-H DAG jobs through a running gateway (`hsched up --replay tpch`, `hsched replay tpch`) and
summarise: jobs succeeded / failed, average and p95 job completion time (JCT), mean utilisation, preemptions.

Each DAG (hsched.traces.decima) becomes a SubmitJob: stage i is `s<i>`, its tasks one executor slot each (the
loader's assumption: 1 core, 1 GiB), its runtime Decima's mean task duration. Arrivals are a seeded Poisson
process (Decima's continuous arrivals) with mean gap `interval_s` of trace time. Time is compressed by the
stack's time factor F (the placers run a task for runtime_s / F wall seconds), so the replay submits job k at
arrival_k / F wall seconds and reports JCTs back in trace seconds (wall × F).

`max_tasks_per_stage` folds a wide stage into fewer, longer tasks with the same executor-seconds (as
`dag_stage_to_task` does for replicas) so a replay of ~3000 tasks finishes in about a minute on a laptop.

Alibaba 2018 batch DAGs (`hsched replay alibaba2018`, hsched.traces.alibaba2018; paper 001's trace) map the
same way: trace task i (a DAG vertex with `instances` parallel instances) becomes stage `t<i>` with the loader's
dependency edges as parents; one stage task asks one instance's request — plan_cpu / 100 cores as cpu_milli,
plan_mem (percent of a v2018 machine, whose absolute memory the trace normalises away) × `machine_memory_gib`
(default 384 GiB: 4 GiB per core of the 96-core machines, an assumption) as memory — and runs the instance's
duration; more than `max_tasks_per_stage` instances fold into that many longer tasks with the same
instance-seconds (runtime = duration × instances / tasks, as for TPC-H). Jobs: the loader's complete ones with
at least `min_tasks` tasks (default 2: real DAGs) and at most `max_instances` instances, a seeded random
`limit` of them, Poisson arrivals of mean gap `interval_s` (the trace's own start times span 8 days). The
critical-path bound is computed on the job as submitted (folded tasks run longer).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from hsched.cancel import cancel_and_wait
from hsched.domain.dag import critical_path
from hsched.retry import retrying
from hsched.rpc import CHANNEL_OPTIONS
from hsched.security.client import ClientCredentials
from hsched.traces.alibaba2018 import MACHINE_MEMORY, AlibabaJob, load_alibaba_jobs
from hsched.traces.decima import (
    DEFAULT_CPU_PER_TASK_MILLI,
    DEFAULT_MEMORY_MIB_PER_TASK,
    TENANT,
    DagJob,
    load_tpch_dags,
)
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc

FINISHED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


@dataclass(frozen=True)
class TraceJob:
    name: str
    arrival_s: float  # trace seconds after the first arrival
    spec: pb.JobSpec
    critical_path_s: float  # the JCT with unlimited executors and no overheads: a lower bound (trace seconds)


def dag_to_job_spec(dag: DagJob, max_tasks_per_stage: int = 0, request_id: str = "", tenant: str = TENANT
                    ) -> pb.JobSpec:
    """A JobSpec for a TPC-H DAG; `max_tasks_per_stage` > 0 folds wider stages (same executor-seconds)."""
    stages = []
    for s in dag.stages:
        tasks = s.num_tasks if not max_tasks_per_stage else min(s.num_tasks, max_tasks_per_stage)
        stages.append(pb.StageSpec(
            name=f"s{s.index}", tasks=tasks, runtime_s=s.work_s / tasks,
            resources=pb.Resources(cpu_milli=DEFAULT_CPU_PER_TASK_MILLI, memory_mib=DEFAULT_MEMORY_MIB_PER_TASK),
            parents=[f"s{p}" for p in s.parents]))
    return pb.JobSpec(name=dag.name, tenant=tenant, request_id=request_id, priority_class="offline", stages=stages)


def tpch_jobs(sizes: list[str] | None = None, limit: int = 0, interval_s: float = 30.0, seed: int = 0,
              max_tasks_per_stage: int = 16, run_id: str = "") -> list[TraceJob]:
    """The TPC-H DAGs of `sizes` (default 2g: 22 queries), the first `limit` (0 = all) in a seeded random order,
    with Poisson arrivals of mean gap `interval_s`. Request ids are `<run_id>-<name>` (idempotent retries within
    one replay; a new run_id per replay)."""
    rng = random.Random(seed)
    dags = load_tpch_dags(sizes=sizes or ["2g"])
    rng.shuffle(dags)
    if limit:
        dags = dags[:limit]
    # the bound of each job as submitted (folded stages run longer tasks)
    return _with_arrivals([(d.name, dag_to_job_spec(d, max_tasks_per_stage)) for d in dags], interval_s, rng, run_id)


ALIBABA_MACHINE_MEMORY_GIB = 384.0  # a v2018 machine's memory (normalised to 100 in the trace): 4 GiB per core


def alibaba_resources(cpu_cores: float, memory: float, machine_memory_gib: float = ALIBABA_MACHINE_MEMORY_GIB
                      ) -> tuple[int, int]:
    """(cpu_milli, memory_mib) of a trace demand (cores, percent of a machine's memory); monotone, so a slice
    type that covers a demand in trace units covers it in the stack's units too (hsched.engine.slices)."""
    return max(1, round(cpu_cores * 1000)), max(1, round(memory / MACHINE_MEMORY * machine_memory_gib * 1024))


def alibaba_to_job_spec(job: AlibabaJob, max_tasks_per_stage: int = 0, request_id: str = "", tenant: str = TENANT,
                        machine_memory_gib: float = ALIBABA_MACHINE_MEMORY_GIB) -> pb.JobSpec:
    """A JobSpec for an Alibaba 2018 batch job (module docstring); `max_tasks_per_stage` > 0 folds wider
    stages (same instance-seconds)."""
    stages = []
    for i, t in enumerate(job.tasks):
        tasks = t.instances if not max_tasks_per_stage else min(t.instances, max_tasks_per_stage)
        cpu_milli, memory_mib = alibaba_resources(t.cpu_cores, t.memory, machine_memory_gib)
        stages.append(pb.StageSpec(
            name=f"t{i}", tasks=tasks, runtime_s=t.duration_s * t.instances / tasks,
            resources=pb.Resources(cpu_milli=cpu_milli, memory_mib=memory_mib),
            parents=[f"t{p}" for p in job.parents(i)]))
    return pb.JobSpec(name=job.name, tenant=tenant, request_id=request_id, priority_class="offline", stages=stages)


def alibaba_jobs(limit: int = 0, interval_s: float = 30.0, seed: int = 0, max_tasks_per_stage: int = 16,
                 min_tasks: int = 2, max_instances: int | None = 2000, run_id: str = "",
                 machine_memory_gib: float = ALIBABA_MACHINE_MEMORY_GIB) -> list[TraceJob]:
    """Alibaba 2018 batch DAG jobs as TraceJobs (module docstring), like `tpch_jobs`."""
    rng = random.Random(seed)
    jobs = load_alibaba_jobs(max_instances=max_instances, min_tasks=min_tasks)
    rng.shuffle(jobs)
    return _with_arrivals([(j.name, alibaba_to_job_spec(j, max_tasks_per_stage, "", TENANT, machine_memory_gib))
                           for j in (jobs[:limit] if limit else jobs)], interval_s, rng, run_id)


def _with_arrivals(specs: list[tuple[str, pb.JobSpec]], interval_s: float, rng: random.Random, run_id: str
                   ) -> list[TraceJob]:
    """Poisson arrivals of mean gap `interval_s`, request ids `<run_id>-<name>`, critical-path bounds."""
    run_id = run_id or secrets.token_hex(3)
    out, at = [], 0.0
    for i, (name, spec) in enumerate(specs):
        if i:
            at += rng.expovariate(1.0 / interval_s)
        spec.request_id = f"{run_id}-{name}"
        out.append(TraceJob(name, at, spec, _critical_path(spec)))
    return out


def _critical_path(spec: pb.JobSpec) -> float:
    index = {s.name: i for i, s in enumerate(spec.stages)}  # Alibaba's parents may come later in the list
    return critical_path([s.runtime_s for s in spec.stages], [[index[p] for p in s.parents] for s in spec.stages],
                         spec.request_id)


@dataclass
class JobReplayStats:
    submitted: int = 0
    final: dict[str, pb.Job] = field(default_factory=dict)  # job id -> last seen
    bound_s: dict[str, float] = field(default_factory=dict)  # job id -> critical path (trace seconds)
    errors: Counter = field(default_factory=Counter)
    retried: int = 0  # calls sent again after UNAVAILABLE / DEADLINE_EXCEEDED (hsched.retry.retrying)
    utilisation: list[float] = field(default_factory=list)  # CPU utilisation samples of the jobs' DCs
    preemptions: int = 0
    elapsed_s: float = 0.0
    time_factor: float = 1.0

    def states(self) -> Counter:
        return Counter(pb.JobState.Name(j.state).removeprefix("JOB_STATE_").lower() for j in self.final.values())

    def jct_s(self) -> list[float]:
        """Completion times of the succeeded jobs in trace seconds (wall × time factor)."""
        return sorted((j.finished_unix_ms - j.created_unix_ms) / 1000 * self.time_factor
                      for j in self.final.values() if j.state == pb.JOB_STATE_SUCCEEDED)

    def summary(self) -> dict:
        jct = self.jct_s()
        states = self.states()
        bounds = [self.bound_s[j] for j, job in self.final.items() if job.state == pb.JOB_STATE_SUCCEEDED]
        return {"submitted": self.submitted, "succeeded": states["succeeded"],
                "failed": states["failed"] + states["cancelled"] + self.errors.total(),
                "unfinished": states["pending"] + states["running"],
                "avg_jct_s": sum(jct) / len(jct) if jct else None,
                "p95_jct_s": jct[min(len(jct) - 1, int(0.95 * len(jct)))] if jct else None,
                "avg_critical_path_s": sum(bounds) / len(bounds) if bounds else None,
                "mean_cpu_utilisation": sum(self.utilisation) / len(self.utilisation) if self.utilisation else None,
                "preemptions": self.preemptions, "elapsed_s": self.elapsed_s, "time_factor": self.time_factor}


async def _utilisation(redis, prefix: str, dcs: set[str]) -> list[float]:
    """The DCs' latest CPU utilisation, a sample each; none while Redis is away (restarting, failing over): the
    replay goes on through its gateway."""
    from redis.exceptions import RedisError

    from hsched.state.keys import Keys

    keys, out = Keys(prefix), []
    for dc in sorted(dcs):
        try:
            latest = await redis.xrevrange(keys.summary(dc), count=1)
        except RedisError:
            return out
        if latest:
            value = json.loads(latest[0][1][b"s"]).get("cpu_utilisation")
            if value is not None:
                out.append(float(value))
    return out


async def replay_jobs(gateway: str, jobs: list[TraceJob], time_factor: float, redis_url: str | None = None,
                      prefix: str = "hsched", timeout_s: float = 600.0, progress=None, poll_s: float = 0.5,
                      credentials: ClientCredentials | None = None) -> JobReplayStats:
    """Submit each job at arrival / time_factor wall seconds, follow them (ListJobs) until all have finished or
    `timeout_s` passed, sampling the jobs' DCs' CPU utilisation meanwhile; `progress(finished, total)`.
    `credentials`: token and TLS of the gateway (hsched.security.client; default none)."""
    credentials = credentials or ClientCredentials()
    metadata = credentials.metadata
    stats = JobReplayStats(time_factor=time_factor)
    redis = None
    if redis_url:
        from hsched.state.redis import connect
        redis = connect(redis_url)
    ids: dict[str, str] = {}  # job id -> name
    async with credentials.aio_channel(gateway, options=CHANNEL_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        start = time.monotonic()

        async def submit(job: TraceJob) -> None:
            await asyncio.sleep(max(0.0, job.arrival_s / time_factor - (time.monotonic() - start)))
            try:  # the request id makes a retry safe
                reply = await retrying(lambda: stub.SubmitJob(gateway_pb2.SubmitJobRequest(job=job.spec), timeout=30,
                                                              metadata=metadata), stats)
            except grpc.aio.AioRpcError as exc:
                stats.errors[exc.code().name] += 1
                return
            stats.submitted += 1
            ids[reply.job.job_id] = job.name
            stats.final[reply.job.job_id] = reply.job
            stats.bound_s[reply.job.job_id] = job.critical_path_s

        submitting = [asyncio.create_task(submit(j)) for j in jobs]
        try:
            while time.monotonic() - start < timeout_s:
                await asyncio.sleep(poll_s)
                page = ""
                while True:
                    reply = await retrying(lambda page=page: stub.ListJobs(gateway_pb2.ListJobsRequest(
                        tenant=TENANT, limit=1000, page_token=page), timeout=30, metadata=metadata), stats)
                    for j in reply.jobs:
                        if j.job_id in ids:
                            stats.final[j.job_id] = j
                    if not (page := reply.next_page_token):
                        break
                running_dcs = {j.datacenter for j in stats.final.values() if j.state not in FINISHED}
                if redis is not None and running_dcs:
                    stats.utilisation.extend(await _utilisation(redis, prefix, running_dcs))
                done = sum(j.state in FINISHED for j in stats.final.values()) + stats.errors.total()
                if progress:
                    progress(done, len(jobs))
                if done == len(jobs) and all(t.done() for t in submitting):
                    break
            stats.elapsed_s = time.monotonic() - start
            stats.preemptions = await _preemptions(stub, set(ids), metadata, stats)
        finally:
            await cancel_and_wait(submitting)
            if redis is not None:
                await redis.aclose()
    return stats


async def _preemptions(stub, job_ids: set[str], metadata: tuple, stats: JobReplayStats) -> int:
    total, page = 0, ""
    while True:
        reply = await retrying(lambda page=page: stub.List(gateway_pb2.ListRequest(
            tenant=TENANT, limit=1000, page_token=page), timeout=30, metadata=metadata), stats)
        total += sum(t.preemptions for t in reply.tasks if t.spec.job_id in job_ids)
        if not (page := reply.next_page_token):
            return total
