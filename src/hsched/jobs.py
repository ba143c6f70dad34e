"""DAG jobs (issue 15; papers 001 and 004): validation, the job state as a fold of the task stream,
and the orchestrator that submits each stage's tasks once its parents succeeded.

A job is stages of identical parallel tasks; a stage is runnable when every parent stage has succeeded. Stage 1
(the selector) chooses ONE data center for the whole job (data gravity: its stages exchange data); every task of
the job goes to that DC's placer with allow_defer, so a full DC queues the job's tasks instead of sending them
elsewhere.

Durability: the job's own records (job_submitted / job_running / job_succeeded / job_failed / job_cancelled, a
serialized hsched.v1.Job each) travel on the task stream with the task records, and each task of a job carries
job_id and stage and has the deterministic id `<job_id>.<stage>.<i>`. A job's progress is therefore a pure
function of the task table (`decide`): a restarted gateway folds the stream, calls `JobOrchestrator.recover`,
and continues every job from where the stream says it is; re-submitting a task whose record is already durable
returns that record (the gateway deduplicates by task id), so no stage runs twice.

Several gateways on one Redis (hsched.state.gateways): each job has one owner, the gateway that advances it; its
job records and its tasks' records are fenced by that ownership (and job records are version-checked, so a
CancelJob on another gateway and the owner's own step never overwrite one another). A job whose owner is gone is
adopted by a live gateway (`keep_adopting`, and `recover` at start), which continues it from the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hsched.cancel import cancel_and_wait
from hsched.convert import resources_from_pb, task_to_pb
from hsched.costs.selection import exclusion_summary
from hsched.domain.dag import paths_to_end
from hsched.domain.errors import ValidationError
from hsched.domain.limits import JOB_MAX_TASKS, STAGE_MAX_TASKS, check_count, check_message, string_limit
from hsched.domain.task import MAX_RUNTIME_S, NetworkRequirements, TaskSpec
from hsched.retry import retry_with_backoff
from hsched.rpc import Unavailable
from hsched.state.gateways import GatewayLease
from hsched.state.redis import NotReplicated
from hsched.state.tasks import JOB_TERMINAL, Conflict, TaskStore, job_step, now_ms
from hsched.v1 import common_pb2 as pb
from hsched.v1 import selector_pb2

log = logging.getLogger(__name__)

# No dots: a task id is `<job_id>.<stage>.<i>` and must split back unambiguously.
_STAGE_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,47}[a-z0-9])?\Z")
# Task states after which a task of a job never becomes SUCCEEDED: the job fails.
_LOST = {pb.TASK_STATE_FAILED: "failed", pb.TASK_STATE_EXPIRED: "expired in the queue",
         pb.TASK_STATE_REJECTED: "was rejected", pb.TASK_STATE_RELEASED: "was released by its client"}
_FINISHED_TASK = (pb.TASK_STATE_SUCCEEDED, *_LOST)
_RUNNING_OR_DONE = (pb.TASK_STATE_RUNNING, pb.TASK_STATE_SUCCEEDED, pb.TASK_STATE_FAILED)
_WAITING_TASK = (pb.TASK_STATE_DEFERRED, pb.TASK_STATE_PREEMPTED)  # queued at the DC, holding nothing


def new_job_id() -> str:
    """Time-ordered like task ids (ListJobs pages by it); no dots (task ids embed it)."""
    return f"j{now_ms():012x}{secrets.token_hex(4)}"


def task_id_of(job_id: str, stage: str, index: int) -> str:
    return f"{job_id}.{stage}.{index}"


def job_of(task_id: str) -> str | None:
    """The job a task id names (`<job_id>.<stage>.<i>`), None for a Submit's task (its ids have no dot)."""
    job_id, dot, _ = task_id.partition(".")
    return job_id if dot else None


# -- validation --------------------------------------------------------------------------------------------------


def _stage_spec(job: pb.JobSpec, stage: pb.StageSpec) -> TaskSpec:
    """The domain TaskSpec of one task of `stage`: the job's tenant, placement needs and priority, the stage's
    per-task resources and runtime. The job's GPU models restrict its GPU stages only."""
    n = job.network
    gpu_models = tuple(job.gpu_models) if stage.resources.gpu_count > 0 else ()
    return TaskSpec(resources=resources_from_pb(stage.resources), runtime_s=stage.runtime_s,
                    tenant=job.tenant or "default", name=f"{job.name}-{stage.name}" if job.name else stage.name,
                    request_id=job.request_id, priority=job.priority, replicas=1, data_size_mb=job.data_size_mb,
                    entry_vertex=job.entry_vertex,
                    network=NetworkRequirements(n.max_latency_ms, n.max_jitter_ms, n.max_loss_percent),
                    gpu_models=gpu_models, priority_class=job.priority_class)


def _find_cycle(names: list[str], parents: Mapping[str, list[str]]) -> list[str] | None:
    """A dependency cycle as [a, b, ..., a] (each a parent of the next), or None (iterative DFS)."""
    colour: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in names:
        if root in colour:
            continue
        path: list[str] = []
        stack: list[tuple[str, Iterable[str]]] = [(root, iter(parents[root]))]
        colour[root] = 1
        path.append(root)
        while stack:
            node, todo = stack[-1]
            nxt = next(todo, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt) == 1:
                cycle = [*path[path.index(nxt):], nxt]
                return list(reversed(cycle))  # parent before child
            elif nxt not in colour:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(parents[nxt])))
    return None


def validate_job(job: pb.JobSpec) -> None:
    """Raise ValidationError naming the first field (`job.…`) that breaks a rule: sizes (hsched.domain.limits),
    then the job's fields, every stage (name, tasks, its task spec), unknown / duplicate / self parents and
    dependency cycles (the cycle is named)."""
    check_message(job, "job.")
    if not job.stages:
        raise ValidationError("job.stages", "must name at least one stage")
    if job.gpu_models and not any(stage.resources.gpu_count > 0 for stage in job.stages):
        raise ValidationError("job.gpu_models", "only allowed when a stage asks for GPUs (resources.gpu_count > 0)",
                              list(job.gpu_models))
    index: dict[str, int] = {}
    total = 0
    for i, stage in enumerate(job.stages):
        where = f"job.stages[{i}]"
        if not _STAGE_NAME_RE.match(stage.name):
            raise ValidationError(f"{where}.name", "must be 1-49 characters of [a-z0-9_-], starting and ending "
                                  "alphanumeric (no dots: task ids are <job_id>.<stage>.<i>)", stage.name)
        if stage.name in index:
            raise ValidationError(f"{where}.name", f"must be unique in the job (stages[{index[stage.name]}] has it)",
                                  stage.name)
        index[stage.name] = i
        if not 1 <= stage.tasks <= STAGE_MAX_TASKS:
            raise ValidationError(f"{where}.tasks", f"must be in 1..{STAGE_MAX_TASKS}", stage.tasks)
        total += stage.tasks
        if job.name and len(job.name) + 1 + len(stage.name) > (limit := string_limit("name")):
            raise ValidationError("job.name", f"must be at most {limit - 1 - len(stage.name)} characters with stage "
                                  f"{stage.name!r}: its tasks are named <job name>-<stage name>, at most {limit} "
                                  f"(got {len(job.name)})")
        try:
            _stage_spec(job, stage).validate()
        except ValidationError as exc:  # per-stage fields under the stage, the rest are the job's
            own = exc.field.split(".")[0].split("[")[0] in ("resources", "runtime_s")
            raise ValidationError(f"{where}.{exc.field}" if own else f"job.{exc.field}", exc.rule, exc.value) from None
        if stage.runtime_s <= 0:  # a task's 0 (runs until released) would never let the stages after it start
            raise ValidationError(f"{where}.runtime_s", "must be > 0: a stage's tasks must finish for the stages "
                                  "that depend on it to run (0, run until released, is for standalone tasks)",
                                  stage.runtime_s)
    if total > JOB_MAX_TASKS:
        raise ValidationError("job.stages", f"must hold at most {JOB_MAX_TASKS} tasks in all (got {total})")
    parents: dict[str, list[str]] = {}
    for i, stage in enumerate(job.stages):
        check_count(f"job.stages[{i}].parents", len(stage.parents), "parents")
        seen: set[str] = set()
        for j, parent in enumerate(stage.parents):
            where = f"job.stages[{i}].parents[{j}]"
            if parent not in index:
                raise ValidationError(where, "must name a stage of the job", parent)
            if parent == stage.name:
                raise ValidationError(where, "a stage cannot depend on itself (a cycle)", parent)
            if parent in seen:
                raise ValidationError(where, "is listed twice", parent)
            seen.add(parent)
        parents[stage.name] = list(stage.parents)
    cycle = _find_cycle([s.name for s in job.stages], parents)
    if cycle:
        raise ValidationError(f"job.stages[{index[cycle[-1]]}].parents",
                              f"the stages form a dependency cycle: {' -> '.join(cycle)}")


def normalized(job: pb.JobSpec) -> pb.JobSpec:
    """The job as stored: wire defaults applied (tenant "" → "default", priority_class "" → "offline")."""
    out = pb.JobSpec()
    out.CopyFrom(job)
    out.tenant = job.tenant or "default"
    out.priority_class = job.priority_class or "offline"
    return out


# -- choosing the job's data center -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeRequest:
    """One question stage 1 answers for a job: the stages whose tasks have one shape, as one task spec."""

    stages: tuple[str, ...]
    roots: bool  # some of these stages have no parents: they run first
    task: pb.TaskSpec
    scale: float = 1.0  # the job's cost is `scale` × the answer's (task-seconds over a task's runtime limit)


def selection_requests(job: pb.JobSpec) -> list[ShapeRequest]:
    """The questions stage 1 answers for a job: one task spec per distinct task shape of its stages.

    Feasibility: a DC must hold one task of EVERY shape, one at a time — the tasks run in waves and queue at the
    DC, so the job's total never has to fit at once, and no made-up task of every stage's largest resources
    (a GPU stage's cards with a CPU stage's cores) has to either.
    Cost (eq.1 is linear in resources × time): each shape's request is held for its stages' task-seconds
    Σ tasks·runtime, so summed over the shapes the resource cost is the job's total for any prices; the job's
    data moves once, so only the first request carries its data_size_mb (eq.2). Task-seconds beyond a task's
    runtime limit divide every request's time and data by one factor (`scale`): the ranking is unchanged.
    """
    shapes: dict[bytes, list[pb.StageSpec]] = {}
    for stage in job.stages:
        shapes.setdefault(stage.resources.SerializeToString(deterministic=True), []).append(stage)
    task_seconds = [sum(s.tasks * s.runtime_s for s in stages) for stages in shapes.values()]
    scale = max(1.0, max(task_seconds) / MAX_RUNTIME_S)
    out = []
    for i, (stages, seconds) in enumerate(zip(shapes.values(), task_seconds, strict=True)):
        spec = _stage_spec(job, stages[0])
        task = task_to_pb(replace(spec, runtime_s=seconds / scale, request_id="",
                                  data_size_mb=spec.data_size_mb / scale if i == 0 else 0.0))
        out.append(ShapeRequest(tuple(s.name for s in stages), any(not s.parents for s in stages), task, scale))
    return out


@dataclass
class _Option:
    datacenter: str
    total_cost: float = 0.0
    room_now: bool = True
    queued_tasks: int = 0
    shapes: int = 0


def choose_datacenter(requests: list[ShapeRequest], answers: list[selector_pb2.SelectResponse]
                      ) -> tuple[str, str]:
    """(DC, why) from the selector's answers to `selection_requests`: among the DCs that can hold a task of every
    shape, the cheapest by the summed total that has room now for its first stages' tasks (the answers'
    `room_now` for the shapes of stages without parents: free room, nothing queued), else the cheapest (its
    stages queue there); ("", why not) if none can. Raises Unavailable if none can now but one whose placer is
    not serving could: that is no verdict on the job. (A job commits to one DC, so a full one would hold it
    while another sits idle; a task tries DCs in turn.)"""
    options: dict[str, _Option] = {}
    reasons: dict[str, list[str]] = {}
    unserved: set[str] = set()
    for request, answer in zip(requests, answers, strict=True):
        for c in answer.candidates:
            o = options.setdefault(c.datacenter, _Option(c.datacenter))
            o.total_cost += c.total_cost * request.scale
            o.shapes += 1
            o.queued_tasks = max(o.queued_tasks, c.queued_tasks)
            o.room_now = o.room_now and (c.room_now or not request.roots)
        for e in answer.excluded:
            if e.unavailable:
                unserved.add(e.datacenter)
            else:
                shown = ", ".join(request.stages[:3]) + (", …" if len(request.stages) > 3 else "")
                reasons.setdefault(e.datacenter, []).append(f"{e.reason} (stage {shown})")
    ordered = sorted((o for o in options.values() if o.shapes == len(requests) and o.datacenter not in unserved),
                     key=lambda o: o.total_cost)
    if ordered:
        roomy = next((o for o in ordered if o.room_now), None)
        pick = roomy or ordered[0]
        why = (f"{pick.datacenter}: cheapest of {len(ordered)} data centers able to hold every stage's tasks"
               f"{' with room for them now' if roomy is not None and len(ordered) > 1 else ''}, at a total job "
               f"cost of {pick.total_cost:.4f}")
        if passed := ordered[:ordered.index(pick)]:
            why += "; cheaper but full now: " + ", ".join(_room_note(o) for o in passed)
        elif roomy is None:
            why += "; no data center has room for them now: its stages queue there"
        return pick.datacenter, why
    why = "no data center can hold this job: " + (
        exclusion_summary((dc, "; ".join(r)) for dc, r in reasons.items()) or "no data center answered")
    if could := sorted(unserved - reasons.keys()):
        raise Unavailable(f"{why}; {', '.join(could)} could hold it once its placer serves again: nothing was "
                          "kept, retry (with the same request_id)")
    return "", why


def _room_note(c: _Option) -> str:
    return f"{c.datacenter} ({c.queued_tasks} tasks queued)" if c.queued_tasks else f"{c.datacenter} (no free room)"


# -- the job's state, a fold of the task table ---------------------------------------------------------------------


def stage_queue_hints(spec: pb.JobSpec, stage: str) -> tuple[float, float]:
    """What the placer's --dag-policy needs of the job's DAG, for a task of `stage` (task seconds): the stage's
    critical path to the job's end (its runtime + the longest chain of descendants: the env's per-stage
    critical_path_s) and the job's work left when the stage becomes runnable, Σ tasks × runtime over the stages
    that are not its ancestors (its ancestors have all succeeded then; exact for a chain, an upper bound when a
    sibling branch has progressed). Static, so a re-submitted task carries the same values."""
    by_name = {s.name: s for s in spec.stages}
    index = {s.name: i for i, s in enumerate(spec.stages)}
    below = paths_to_end([s.runtime_s for s in spec.stages], [[index[p] for p in s.parents] for s in spec.stages])
    ancestors, frontier = set(), list(by_name[stage].parents)
    while frontier:
        p = frontier.pop()
        if p not in ancestors:
            ancestors.add(p)
            frontier.extend(by_name[p].parents)
    work = sum(s.tasks * s.runtime_s for s in spec.stages if s.name not in ancestors)
    return below[index[stage]], work


def stage_task_spec(job: pb.Job, stage: pb.StageSpec) -> pb.TaskSpec:
    spec = task_to_pb(_stage_spec(job.spec, stage))
    spec.job_id = job.job_id
    spec.stage = stage.name
    spec.stage_path_s, spec.job_work_s = stage_queue_hints(job.spec, stage.name)
    spec.request_id = ""  # the task id is the idempotency key of a job's task
    return spec


def stage_tasks(job: pb.Job, tasks: Mapping[str, pb.Task], stage: pb.StageSpec) -> list[pb.Task | None]:
    return [tasks.get(task_id_of(job.job_id, stage.name, i)) for i in range(stage.tasks)]


def stage_statuses(job: pb.Job, tasks: Mapping[str, pb.Task]) -> list[pb.StageStatus]:
    """Each stage's tasks by where they are; once the job is final, none pending: what never ran is cancelled."""
    out = []
    ended = job.state in JOB_TERMINAL
    for stage in job.spec.stages:
        st = pb.StageStatus(name=stage.name, tasks=stage.tasks)
        for t in stage_tasks(job, tasks, stage):
            if t is None or t.state in (pb.TASK_STATE_SUBMITTED, pb.TASK_STATE_DEFERRED, pb.TASK_STATE_PREEMPTED):
                if ended:
                    st.cancelled += 1
                else:
                    st.pending += 1
            elif t.state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_RUNNING):
                st.running += 1
            elif t.state == pb.TASK_STATE_SUCCEEDED:
                st.succeeded += 1
            elif t.state == pb.TASK_STATE_RELEASED:
                st.cancelled += 1
            else:
                st.failed += 1
            if t is not None:
                st.task_ids.append(t.task_id)
        out.append(st)
    return out


def view(job: pb.Job, tasks: Mapping[str, pb.Task]) -> pb.Job:
    """The job as Get/List show it: its record plus every stage's progress from the task table."""
    out = pb.Job()
    out.CopyFrom(job)
    del out.stages[:]
    out.stages.extend(stage_statuses(job, tasks))
    return out


@dataclass
class Decision:
    """What a job needs next, given the task table: exactly one of fail / succeed, or tasks to submit."""

    fail: str = ""                       # the reason the job failed
    succeed: bool = False
    running: bool = False                # some task has started: PENDING → RUNNING
    submit: list[tuple[str, pb.StageSpec]] = field(default_factory=list)  # (task id, stage) not yet submitted
    live: list[str] = field(default_factory=list)  # task ids holding or waiting for resources


def decide(job: pb.Job, tasks: Mapping[str, pb.Task]) -> Decision:
    """The job state machine: a pure function of the job record and the task table (so a restarted gateway
    decides exactly what the last one would have)."""
    d = Decision()
    succeeded: set[str] = set()
    for stage in job.spec.stages:
        done = 0
        for t in stage_tasks(job, tasks, stage):
            if t is None:
                continue
            if t.state in _LOST and not d.fail:
                d.fail = f"task {t.task_id} of stage {stage.name} {_LOST[t.state]}" + (f": {t.reason}" if t.reason
                                                                                     else "")
            if t.state == pb.TASK_STATE_SUCCEEDED:
                done += 1
            elif t.state not in _FINISHED_TASK:
                d.live.append(t.task_id)
            if t.state in _RUNNING_OR_DONE or t.started_unix_ms:
                d.running = True
        if done == stage.tasks:
            succeeded.add(stage.name)
    if d.fail:
        return d
    if len(succeeded) == len(job.spec.stages):
        d.succeed = True
        return d
    for stage in job.spec.stages:
        if stage.name not in succeeded and all(p in succeeded for p in stage.parents):
            d.submit += [(task_id_of(job.job_id, stage.name, i), stage) for i, t in
                         enumerate(stage_tasks(job, tasks, stage)) if t is None]
    return d


def live_tasks(job: pb.Job, tasks: Mapping[str, pb.Task]) -> list[str]:
    """Task ids of the job still holding or waiting for resources (to release when the job fails / is cancelled)."""
    return [t.task_id for stage in job.spec.stages for t in stage_tasks(job, tasks, stage)
            if t is not None and t.state not in _FINISHED_TASK]


# -- the orchestrator ---------------------------------------------------------------------------------------------


@dataclass
class JobPorts:
    """What the orchestrator needs from its gateway: ask stage 1, submit one task of a job to a DC (deduplicated
    by task id: a task already recorded is returned as it is), release one task."""

    select: Callable[[pb.TaskSpec, str], Awaitable[selector_pb2.SelectResponse]]
    submit_task: Callable[[str, pb.TaskSpec, str], Awaitable[pb.Task]]
    release_task: Callable[[str], Awaitable[Any]]


class JobOrchestrator:
    """Runs every job of a gateway: one `advance` at a time per job, re-run whenever one of its tasks changes
    (`on_transition`) until `decide` has nothing more to do.

    `decide` reads every task of the job, so deciding at each of a job's ~4 transitions per task costs O(tasks²):
    a job's worker waits PACE × the time its last `decide` took before the next one, and the transitions that
    come meanwhile are decided together (at most 1 / (1 + PACE) of the event loop for a large job; a small job's
    decide takes µs and is not delayed). A stage's tasks go out at most SUBMITS_IN_FLIGHT at a time, so a wide
    stage does not send a thousand Places at once past their deadlines."""

    PACE = 4.0
    # how long a CancelJob waits for the job's releases before answering: the cancel is recorded first, and the
    # worker keeps retrying the releases of a placer that is away (it answered DEADLINE_EXCEEDED after 30 s)
    CANCEL_WAIT_S = 5.0
    SUBMITS_IN_FLIGHT = 64

    def __init__(self, store: TaskStore, ports: JobPorts, retry_s: float = 1.0,
                 owners: GatewayLease | None = None) -> None:
        self.store = store
        self.ports = ports
        self.retry_s = retry_s
        self.owners = owners  # None: the prefix's only gateway (every job is its own, no fences)
        self.claim_wait_s = 30.0  # how long a SubmitJob waits for another gateway's attempt of its request_id
        self._owned: set[str] = set()  # jobs this gateway advances (its writes for them are fenced by that)
        self._others: dict[str, float] = {}  # job id -> when a live gateway was last found owning it (loop time)
        self._dirty: set[str] = set()
        self._workers: dict[str, asyncio.Task] = {}
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        # job id -> (its request, the settling of its record that reached the Redis master but not its replicas:
        # `_settle`); a retry of the request waits for it
        self._settling: dict[str, tuple[tuple[str, str], asyncio.Task]] = {}
        store.job_observed = self.poke  # another gateway's record of a job (a CancelJob there): decide again

    def fences(self, job_id: str) -> tuple[tuple[str, str], ...]:
        """What a write advancing `job_id` must still hold: this gateway's lease and its ownership of the job."""
        return self.owners.job_fences(job_id) if self.owners is not None else ()

    async def _mine(self, job_id: str) -> bool:
        """Whether this gateway advances `job_id`, adopting it when its owner is gone. A job a live gateway owns
        is asked about again at most once per lease period (its tasks' transitions reach every gateway)."""
        if self.owners is None or job_id in self._owned:
            return True
        loop = asyncio.get_running_loop()
        if loop.time() - self._others.get(job_id, -1e9) < self.owners.ttl_ms / 1000:
            return False
        adopted = await self.owners.adopt(job_id)
        if not adopted:
            self._others[job_id] = loop.time()
            return False
        self._others.pop(job_id, None)
        self._owned.add(job_id)
        if adopted == 2:
            log.info("job %s: adopted (its gateway is gone); continuing it from the task stream", job_id)
        return True

    async def adopt_orphans(self) -> int:
        """Adopt every unfinished job whose owner is gone (and start it); returns how many."""
        if self.owners is None:
            return 0
        adopted = 0
        for job_id, job in list(self.store.jobs.items()):
            if job.state in JOB_TERMINAL or job_id in self._owned:
                continue
            self._others.pop(job_id, None)
            if await self._mine(job_id):
                adopted += 1
                self.poke(job_id)
        return adopted

    async def keep_adopting(self, every_s: float) -> None:
        """`adopt_orphans` every `every_s` until cancelled: a job whose gateway died continues elsewhere even if
        none of its tasks changes any more (the stage that would start next waits for the dead owner)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.adopt_orphans()
            except Exception as exc:  # noqa: BLE001 - Redis away: next round
                log.warning("cannot look for jobs of gateways that are gone (%s: %s)", type(exc).__name__, exc)

    # -- submit / cancel / read

    async def submit(self, spec: pb.JobSpec, method: str = "") -> tuple[pb.Job, bool]:
        """Validate, choose the DC, record the job durably and start it; (job, duplicate). With a request_id a retry
        (per tenant) gets the first answer; a failed attempt (nothing durable) binds nothing."""
        validate_job(spec)
        spec = normalized(spec)
        key = (spec.tenant, spec.request_id)
        if spec.request_id:
            if key in self._inflight:
                return await asyncio.shield(self._inflight[key]), True
            await self._settled(key)
            if (known := await self._durable_job(key)) is not None:
                return known, True
            work = self._inflight[key] = asyncio.ensure_future(self._submit_claimed(spec, method))
            work.add_done_callback(lambda _: self._inflight.pop(key, None))
            return await asyncio.shield(work)
        return await asyncio.shield(asyncio.ensure_future(self._submit(spec, method))), False

    async def _submit_claimed(self, spec: pb.JobSpec, method: str) -> tuple[pb.Job, bool]:
        """A SubmitJob with a request_id when other gateways may share the prefix: claim the request in Redis
        (`{prefix}:job-request:...` = "<job id> <gateway id>", SET NX) before choosing the DC, so a retry on
        another gateway waits for this attempt's job record instead of making a second job; a claim whose gateway
        is gone is taken over. The claim goes with the job's record (which answers retries from then on), or
        when the attempt failed (nothing durable: a retry starts afresh)."""
        owners = self.owners
        if owners is None:
            return await self._submit(spec, method), False
        key = (spec.tenant, spec.request_id)
        rkey = owners.keys.job_request(*key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.claim_wait_s
        while True:
            job_id = new_job_id()
            mine = f"{job_id} {owners.id}"
            holder = await owners.claim(rkey, mine)
            if holder:
                # this gateway's own left-behind claim (its attempts of a request run one at a time), or a gone
                # gateway's: that attempt ended before recording the job, nothing of it is durable
                gateway = holder.partition(" ")[2]
                if (gateway == owners.id or gateway not in await owners.alive({gateway})) \
                        and await owners.take_over(rkey, holder, mine):
                    holder = None
            if holder is None:
                try:
                    await self.store.refresh()  # recorded by an attempt before this claim: the answer
                    if (known := await self._durable_job(key)) is not None:
                        await self._unclaim(rkey, mine)
                        return known, True
                    return await self._submit(spec, method, job_id, claim=(rkey, mine)), False
                except BaseException:
                    await self._unclaim(rkey, mine)
                    raise
            await self.store.refresh()
            if (known := await self._durable_job(key)) is not None:
                return known, True
            if loop.time() > deadline:
                raise Unavailable(f"request_id {spec.request_id!r} is being submitted as a job by another gateway "
                                  "and has no answer yet; retry later (with the same request_id)")
            await asyncio.sleep(0.05)

    async def _settled(self, key: tuple[str, str]) -> None:
        """Wait (a bounded time) until no attempt of request `key` on this gateway is settling."""
        settling = [task for request, task in self._settling.values() if request == key]
        if settling:
            done, _ = await asyncio.wait(settling, timeout=self.claim_wait_s)
            if not done:
                raise Unavailable(f"the first attempt of request_id {key[1]!r} is recorded on the Redis master and its "
                                  "replicas have not confirmed it yet; retry later (with the same request_id)")

    async def _durable_job(self, key: tuple[str, str]) -> pb.Job | None:
        """The job that answers request `key`, once its record is known to be durable: one read back from the master
        whose write failed as NotReplicated answers no retry until the replicas hold it, and none at all once a
        failover lost it (the request then starts afresh). UNAVAILABLE when that cannot be told now."""
        job_id = self.store.jobs_by_request.get(key)
        if job_id is None:
            return None
        await self.store.confirm(job_id)  # (NotReplicated, Redis away: UNAVAILABLE, rpc.status_of)
        return self.get(job_id) if job_id in self.store.jobs else None

    async def _unclaim(self, rkey: str, value: str) -> None:
        assert self.owners is not None
        try:
            await self.owners.unclaim(rkey, value)
        except Exception as exc:  # noqa: BLE001 - left behind, it only makes a retry find the record first
            log.warning("cannot drop the claim of %s (%s: %s)", rkey, type(exc).__name__, exc)

    async def _submit(self, spec: pb.JobSpec, method: str, job_id: str = "",
                      claim: tuple[str, str] | None = None) -> pb.Job:
        requests = selection_requests(spec)
        answers = await asyncio.gather(*(self.ports.select(r.task, method) for r in requests))
        datacenter, why = choose_datacenter(requests, list(answers))
        now = now_ms()
        job = pb.Job(job_id=job_id or new_job_id(), spec=spec, datacenter=datacenter, created_unix_ms=now)
        claimed = (claim,) if claim else ()  # recorded only while this attempt holds the claim, which goes with it
        if not datacenter:
            job.reason = why
            job.finished_unix_ms = now
            records, fences = (job_step("job_submitted", job, why), job_step("job_failed", job, why)), \
                self.fences(job.job_id)[:1]
        else:
            if self.owners is not None:  # before its first record: no other gateway adopts it meanwhile
                await self.owners.own(job.job_id)
                self._owned.add(job.job_id)
            records, fences = (job_step("job_submitted", job, why),), self.fences(job.job_id)
        try:
            await self.store.write(*records, fences=fences, drop=claimed)
        except NotReplicated as exc:  # on the master, not confirmed on its replicas: kept or lost, not failed
            self._settle(job, claim)
            raise Unavailable(f"the job was recorded on the Redis master but its replicas did not confirm it in time "
                              f"({exc}); retry with the same request_id: you get the job once they hold it, or a "
                              "fresh attempt if a failover lost it") from exc
        if datacenter:
            self.poke(job.job_id)
        return self.get(job.job_id)

    def _settle(self, job: pb.Job, claim: tuple[str, str] | None) -> None:
        """A job whose record reached the Redis master but not (yet) its replicas: started once they hold it,
        forgotten (its request id free again) if a failover lost it. Until then no step of it is taken (its
        tasks would outlive a lost job) and a retry of its request on this gateway waits for the outcome."""
        job_id = job.job_id

        async def settle() -> None:
            try:
                stands = await retry_with_backoff(lambda: self.store.kept(job_id), Exception, lambda exc, delay: (
                    f"cannot yet tell whether the unreplicated record of job {job_id} was kept ({type(exc).__name__}: "
                    f"{exc}); retrying in {delay:g} s"), max_delay_s=5.0)
            finally:  # before the poke below: its worker must not find the job still settling
                self._settling.pop(job_id, None)
            if stands:
                log.warning("SubmitJob of %s: its record reached the Redis replicas after all; kept", job_id)
                self.poke(job_id)
                return
            log.warning("SubmitJob of %s: its record was lost with a failed-over Redis master before its replicas "
                        "had it; nothing of it is kept", job_id)
            self.store.forget(job_id)
            self._owned.discard(job_id)
            if self.owners is not None:
                with contextlib.suppress(Exception):  # an ownership left behind names a job nobody will see
                    await self.owners.disown(job_id)
            if claim:  # the failover may have brought back the claim its record dropped
                await self._unclaim(*claim)

        self._settling[job_id] = ((job.spec.tenant, job.spec.request_id),
                                  asyncio.create_task(settle(), name=f"settle job {job_id}"))

    def get(self, job_id: str) -> pb.Job:
        job = self.store.jobs.get(job_id)
        if job is None:
            raise LookupError(f"job {job_id} not found")
        return view(job, self.store.tasks)

    async def cancel(self, job_id: str) -> pb.Job:
        """Record the job cancelled (a finished job is left as it is), then release its tasks."""
        job = self.store.jobs.get(job_id)
        if job is None:
            raise LookupError(f"job {job_id} not found")
        for _ in range(10):  # any gateway cancels; the owner's step written first (Conflict): catch up, again
            job = self.store.jobs[job_id]
            if job.state in JOB_TERMINAL:
                break
            mine = pb.Job()
            mine.CopyFrom(job)
            mine.reason = "cancelled by its client"
            mine.finished_unix_ms = now_ms()
            try:
                await self.store.write(job_step("job_cancelled", mine, mine.reason))
                break
            except Conflict:
                await self.store.refresh()
        else:
            raise Conflict(f"job {job_id}: other gateways kept recording steps of it first; retry the cancel")
        self.poke(job_id)
        worker = self._workers.get(job_id)
        if worker is not None:  # its releases, if they come soon; a placer that is away gets them when back
            await asyncio.wait([worker], timeout=self.CANCEL_WAIT_S)
        return self.get(job_id)

    # -- driving

    def on_transition(self, task: pb.Task, kind: str = "") -> None:
        """A task changed: its job (if any) decides again. Safe to call from any transition hook."""
        if task.spec.job_id:
            self.poke(task.spec.job_id)

    async def transition_callback(self, task: pb.Task, kind: str) -> None:
        """The async form the gateway's transition hub calls."""
        self.on_transition(task, kind)

    def recover(self) -> int:
        """After a gateway start (the table rebuilt, placements reconciled): continue every job that is not
        finished, and finish releasing the tasks of failed/cancelled ones. Returns the jobs resumed."""
        resumed = 0
        for job in list(self.store.jobs.values()):
            if job.state not in JOB_TERMINAL or live_tasks(job, self.store.tasks):
                self.poke(job.job_id)
                resumed += 1
        return resumed

    def poke(self, job_id: str) -> None:
        self._dirty.add(job_id)
        if job_id not in self._workers:
            worker = self._workers[job_id] = asyncio.create_task(self._work(job_id), name=f"job {job_id}")
            worker.add_done_callback(lambda _: self._workers.pop(job_id, None))

    async def _work(self, job_id: str) -> None:
        while job_id in self._dirty:
            self._dirty.discard(job_id)
            try:
                decided_s = await self.advance(job_id)
                if decided_s > 1e-3:
                    await asyncio.sleep(min(self.PACE * decided_s, 1.0))
            except asyncio.CancelledError:
                raise
            except Conflict:  # another gateway wrote first, or this one lost the job: catch up, decide again
                self._owned.discard(job_id)
                self._dirty.add(job_id)
                await asyncio.sleep(0.05)
                try:
                    await self.store.refresh()
                except Exception:  # noqa: BLE001 - Redis away: the next round says so
                    pass
            except Exception as exc:  # noqa: BLE001 - Redis or a peer away: try again, the job is durable
                log.warning("job %s: cannot advance yet (%s: %s); retrying in %g s", job_id, type(exc).__name__,
                            exc, self.retry_s)
                self._dirty.add(job_id)
                await asyncio.sleep(self.retry_s)

    async def advance(self, job_id: str) -> float:
        """One step of the job's state machine (never two at once for a job: `poke` runs one worker per job).
        Returns the seconds `decide` took (0 when it did not run)."""
        job = self.store.jobs.get(job_id)
        if job is None or job_id in self._settling:  # a settled job is poked again
            return 0.0
        tasks = self.store.tasks
        if job.state in JOB_TERMINAL:  # any gateway (a CancelJob on it): releases are idempotent
            await self._release(live_tasks(job, tasks))
            return 0.0
        if not await self._mine(job_id):
            return 0.0  # a live gateway advances it
        job = self.store.jobs[job_id]  # as the table holds it after the ownership check
        started = time.perf_counter()
        d = decide(job, tasks)
        decided_s = time.perf_counter() - started
        mine = pb.Job()
        mine.CopyFrom(job)
        fences = self.fences(job_id)
        if d.fail or d.succeed:
            mine.finished_unix_ms = now_ms()
            mine.reason = d.fail
            await self.store.write(job_step("job_failed" if d.fail else "job_succeeded", mine,
                                            d.fail or "every stage succeeded"), fences=fences)
            if d.fail:
                await self._release(live_tasks(job, tasks))
            if self.owners is not None:
                self._owned.discard(job_id)
                await self.owners.disown(job_id)
            return decided_s
        if d.running and job.state == pb.JOB_STATE_PENDING:
            await self.store.write(job_step("job_running", mine, "a task of the job started"), fences=fences)
        if d.submit:
            slots = asyncio.Semaphore(self.SUBMITS_IN_FLIGHT)

            async def submit(task_id: str, stage: pb.StageSpec) -> None:
                async with slots:
                    await self.ports.submit_task(task_id, stage_task_spec(job, stage), job.datacenter)

            await asyncio.gather(*(submit(task_id, stage) for task_id, stage in d.submit))
            self._dirty.add(job_id)  # what they came back as (placed, rejected ...) may decide more
        return decided_s

    async def _release(self, task_ids: list[str]) -> None:
        """Release `task_ids`: the waiting ones (queued, holding nothing) first, then those holding resources, so
        the room the latter free is not handed to a task of the same job that is about to go."""
        waiting = {t for t in task_ids if (task := self.store.tasks.get(t)) is not None and task.state in _WAITING_TASK}
        failed = []
        for group in ([t for t in task_ids if t in waiting], [t for t in task_ids if t not in waiting]):
            results = await asyncio.gather(*(self.ports.release_task(t) for t in group), return_exceptions=True)
            failed += [(t, r) for t, r in zip(group, results, strict=True) if isinstance(r, Exception)]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(task_ids)} releases failed, first {failed[0][0]}: "
                               f"{failed[0][1]}")

    async def close(self) -> None:
        await cancel_and_wait([*self._workers.values(), *(task for _, task in self._settling.values())])
