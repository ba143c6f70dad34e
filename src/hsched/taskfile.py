"""Declarative task files for `hsched submit -f FILE` (issue 18 item 2): read, check and name every task spec of a
YAML/JSON file before anything is sent.

A file holds either ONE DAG job (a mapping with a `stages` key: hsched.jobs, unchanged), or task specs: one mapping,
a list of mappings, or a multi-document YAML stream (`---`) of either. A task spec's keys are hsched.v1.TaskSpec's
field names (`resources: {cpu_milli, memory_mib, ...}`, `runtime_s`, `gpu_models`, `network: {max_latency_ms,
...}`, ...), as in a grpcurl/JSON Submit; the gateway-set DAG fields (job_id, stage, ...) are refused. Types are
checked here (YAML has no int32 or uint32); the rules are the gateway's own (`TaskSpec.validate` and the request
size limits `check_message`), so a file that passes here is refused by the gateway only for what needs the fleet
(an unknown entry vertex).

Paths name where a bad value is, zero-based like yq: `[2].resources.cpu_milli` is the third task of a list (or the
third document of a stream), `[1][0].runtime_s` the first task of a stream's second document when that document is
a list; a single mapping's fields have no prefix.

Idempotency (`kubectl apply`-style): every spec gets a request_id. One the file gives is used as is; a spec
without one gets `f-<hash>`, a hash of the file's absolute path, the spec's index in the file and its content
(canonical JSON), so running the same file again sends the same ids and the gateway answers each with its first
answer (duplicate) — nothing is submitted twice. Editing a spec (or moving the file) changes its derived id: it is
then a new task, and the old one is left as it is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hsched import yamlfile
from hsched.convert import RESOURCE_FIELDS, task_to_pb
from hsched.domain.errors import ValidationError
from hsched.domain.limits import INT_RANGES, STAGE_MAX_TASKS, check_message, int_field
from hsched.domain.resources import Resources
from hsched.domain.task import JOB_TASK_FIELDS, NetworkRequirements, TaskSpec
from hsched.v1 import common_pb2 as pb

# the TaskSpec fields a file may set, by kind; job_id, stage, stage_path_s and job_work_s are the gateway's
_STRINGS = ("request_id", "tenant", "name", "entry_vertex", "priority_class")
_INTS = ("priority", "replicas")
_FLOATS = ("runtime_s", "data_size_mb", "queue_timeout_s")
_NETWORK = ("max_latency_ms", "max_jitter_ms", "max_loss_percent")
TASK_FIELDS = (*_STRINGS, *_INTS, *_FLOATS, "resources", "network", "gpu_models")


class SpecFileError(ValidationError):
    """A bad task file: `field` is the YAML path inside it, the message starts with the file's name."""

    def __init__(self, file: str, field: str, rule: str, value: object = None) -> None:
        super().__init__(field, rule, value)
        self.file = file
        self.args = (f"{file}: {self.args[0]}",)


@dataclass(frozen=True)
class FileTask:
    where: str          # the YAML path of the spec, e.g. "[2]" ("" for a file's only mapping)
    spec: TaskSpec      # validated, with its request_id (given or derived)
    derived_id: bool    # True when the request_id was derived (the file gave none)


@dataclass(frozen=True)
class SubmitFile:
    job: pb.JobSpec | None        # a DAG job file ...
    tasks: tuple[FileTask, ...]   # ... or its task specs (all valid)


def _join(where: str, field: str) -> str:
    if not field or not where:
        return where or field
    return f"{where}.{field}" if where and not field.startswith("[") else f"{where}{field}"


def _float(where: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValidationError(where, "must be a number", value)
    return float(value)


def _str(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValidationError(where, "must be a string", value)
    return value


def _mapping(where: str, value: Any, fields: tuple[str, ...], what: str) -> dict:
    if not isinstance(value, dict):
        raise ValidationError(where, f"must be a mapping of {what} fields", type(value).__name__)
    for key in value:
        if key not in fields:
            if key in JOB_TASK_FIELDS:
                raise ValidationError(_join(where, str(key)), "is set by the gateway on a DAG job's tasks (write a "
                                      "job file with stages instead)")
            raise ValidationError(_join(where, str(key)), f"is not a {what} field (one of: {', '.join(fields)})")
    return value


def job_from_dict(data: Any, where: str = "job") -> pb.JobSpec:
    """A JobSpec from a YAML/JSON document whose keys are JobSpec's field names (see examples/job.yaml), each value
    checked as a task file's are (an integer field takes integers in its wire type's range only: not "4", 1e1, 4.0
    or true); a bad one raises ValidationError naming its path as the gateway does (`job.stages[0].tasks`)."""
    if not isinstance(data, dict):
        raise ValidationError(where, "must be a mapping of JobSpec fields (name, stages, ...)", type(data).__name__)
    job = pb.JobSpec()
    _fill(job, data, where)
    return job


def _fill(message: Any, data: Any, where: str) -> None:
    fields = message.DESCRIPTOR.fields_by_name
    if not isinstance(data, dict):
        raise ValidationError(where, f"must be a mapping of {message.DESCRIPTOR.name} fields "
                              f"({', '.join(fields)})", type(data).__name__)
    for key, value in data.items():
        f = fields.get(key) if isinstance(key, str) else None
        at = _join(where, str(key))
        if f is None:
            raise ValidationError(at, f"is not a {message.DESCRIPTOR.name} field (one of: {', '.join(fields)})")
        if f.is_repeated and not isinstance(value, list):
            raise ValidationError(at, "must be a list", type(value).__name__)
        for i, item in enumerate(value if f.is_repeated else [value]):
            item_at = f"{at}[{i}]" if f.is_repeated else at
            if f.message_type is not None:
                _fill(getattr(message, key).add() if f.is_repeated else getattr(message, key), item, item_at)
                continue
            if f.type == f.TYPE_STRING:
                item = _str(item_at, item)
            elif f.type in INT_RANGES:
                if (message.DESCRIPTOR.name, key) == ("StageSpec", "tasks") and type(item) is int \
                        and not 1 <= item <= STAGE_MAX_TASKS:  # the job's rule, not the wire type's wider one
                    raise ValidationError(item_at, f"must be in 1..{STAGE_MAX_TASKS}", item)
                item = int_field(item_at, item, message, key)
            elif f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
                item = _float(item_at, item)
            else:  # no such field in JobSpec today: refuse rather than guess
                raise ValidationError(item_at, "cannot be set from a file", item)
            if f.is_repeated:
                getattr(message, key).append(item)
            else:
                setattr(message, key, item)


def task_from_mapping(data: Any) -> TaskSpec:
    """A TaskSpec from one document's mapping (TaskSpec field names), with the gateway's rules checked; a
    ValidationError names the field's path inside the mapping. Defaults are the wire's (tenant "default",
    replicas 1, ...); `request_id` is left as given ("" if none)."""
    d = _mapping("", data, TASK_FIELDS, "TaskSpec")
    if "resources" not in d:
        raise ValidationError("resources", "is required (cpu_milli, memory_mib, ...: per replica)")
    r = _mapping("resources", d["resources"], RESOURCE_FIELDS, "Resources")
    # the wire type's range: what the gateway would get; the domain rules (>= 0, 1..100) come after
    resources = Resources(**{f: int_field(f"resources.{f}", r[f], pb.Resources, f) for f in r})
    n = _mapping("network", d.get("network", {}), _NETWORK, "NetworkRequirements")
    network = NetworkRequirements(**{f: _float(f"network.{f}", n[f]) for f in n})
    models = d.get("gpu_models", [])
    if not isinstance(models, list):
        raise ValidationError("gpu_models", "must be a list of GPU model names", models)
    if "runtime_s" not in d:
        raise ValidationError("runtime_s", "is required (task seconds; 0 = runs until released)")
    spec = TaskSpec(
        resources=resources, runtime_s=_float("runtime_s", d["runtime_s"]),
        network=network, gpu_models=tuple(_str(f"gpu_models[{i}]", m) for i, m in enumerate(models)),
        **{f: _str(f, d[f]) for f in _STRINGS if f in d},
        **{f: int_field(f, d[f], pb.TaskSpec, f) for f in _INTS if f in d},
        **{f: _float(f, d[f]) for f in _FLOATS if f in d and f != "runtime_s"})
    if spec.tenant == "":  # the wire's "" = default, as the gateway reads it (convert.task_from_pb)
        spec = _replace(spec, tenant="default")
    spec.validate()          # the gateway's rules
    check_message(task_to_pb(spec))  # and its request size limits
    return spec


def _replace(spec: TaskSpec, **changes) -> TaskSpec:
    return replace(spec, **changes)


def task_to_mapping(spec: TaskSpec) -> dict:
    """The file form of a spec (the inverse of task_from_mapping for a standalone task): every field written."""
    return {"request_id": spec.request_id, "tenant": spec.tenant, "name": spec.name, "priority": spec.priority,
            "priority_class": spec.priority_class,
            "resources": {f: getattr(spec.resources, f) for f in RESOURCE_FIELDS},
            "replicas": spec.replicas, "runtime_s": spec.runtime_s, "data_size_mb": spec.data_size_mb,
            "entry_vertex": spec.entry_vertex, "queue_timeout_s": spec.queue_timeout_s,
            "network": {f: getattr(spec.network, f) for f in _NETWORK}, "gpu_models": list(spec.gpu_models)}


def derive_request_id(path: str | Path, index: int, data: Any) -> str:
    """`f-` + 32 hex digits of sha256(absolute path, index, canonical JSON of the spec as written): stable across
    runs of an unchanged file, different for every spec of it."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    digest = hashlib.sha256(f"{Path(path).resolve()}\0{index}\0{canonical}".encode()).hexdigest()
    return f"f-{digest[:32]}"


def read_documents(path: str | Path) -> list[Any]:
    p = Path(path)
    try:
        text = yamlfile.read_text(p)
    except OSError as exc:
        raise ValidationError("-f", f"cannot read the file ({exc.strerror or exc})", str(p)) from None
    docs = [d for d in yamlfile.documents(text, str(p)) if d is not None]  # a trailing `---` is an empty document
    if not docs:
        raise ValidationError(str(p), "holds no task spec or job")
    return docs


def _entries(docs: list[Any]) -> list[tuple[str, Any]]:
    """Every task spec of the file with its YAML path, in file order."""
    if len(docs) == 1:
        doc = docs[0]
        return [(f"[{i}]", x) for i, x in enumerate(doc)] if isinstance(doc, list) else [("", doc)]
    out: list[tuple[str, Any]] = []
    for d, doc in enumerate(docs):
        out.extend([(f"[{d}][{i}]", x) for i, x in enumerate(doc)] if isinstance(doc, list) else [(f"[{d}]", doc)])
    return out


def load_submit_file(path: str | Path) -> SubmitFile:
    """The file's DAG job or ALL its task specs, checked by the gateway's rules (hsched.jobs.validate_job, TaskSpec's);
    the first bad one raises SpecFileError naming its path, so nothing is sent."""
    from hsched.jobs import validate_job

    file = str(path)
    docs = read_documents(path)
    if len(docs) == 1 and isinstance(docs[0], dict) and "stages" in docs[0]:
        try:
            job = job_from_dict(docs[0])
            validate_job(job)
            if not job.request_id:  # as a task spec's: running the file again submits nothing twice
                job.request_id = derive_request_id(path, 0, docs[0])
            return SubmitFile(job=job, tasks=())
        except ValidationError as exc:
            raise SpecFileError(file, exc.field, exc.rule, exc.value) from None
    tasks: list[FileTask] = []
    seen: dict[tuple[str, str], str] = {}
    for index, (where, data) in enumerate(_entries(docs)):
        if isinstance(data, dict) and "stages" in data:
            raise SpecFileError(file, _join(where, "stages"), "a DAG job must be the whole file: its one top-level "
                                "mapping, not an item of a list nor one of several --- documents")
        try:
            spec = task_from_mapping(data)
        except ValidationError as exc:
            raise SpecFileError(file, _join(where, exc.field), exc.rule, exc.value) from None
        derived = not spec.request_id
        if derived:
            spec = _replace(spec, request_id=derive_request_id(path, index, data))
        key = (spec.tenant, spec.request_id)
        if key in seen:  # the gateway would answer the second with the first's task: a mistake in the file
            raise SpecFileError(file, _join(where, "request_id"), f"must be unique per tenant in the file "
                                f"({seen[key] or 'the first spec'} has it)", spec.request_id)
        seen[key] = where
        tasks.append(FileTask(where, spec, derived))
    if not tasks:
        raise ValidationError(file, "holds no task spec (an empty list)")
    return SubmitFile(job=None, tasks=tuple(tasks))
