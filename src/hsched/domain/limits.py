"""Size limits on every string and repeated field a service accepts: the one table of them.

Why: whatever a request carries is stored (the task stream, the ledger), echoed (rejection reasons, error
details) and held in memory, so an unbounded field is an unbounded cost — a 1 MB `gpu_models` list once
became a 6.8 MB task record. The limits are checked on the raw protobuf message before anything converts
or looks at it (`check_message`, run by the servers' request deserializer), so an over-limit request costs
one length check, and the INVALID_ARGUMENT it gets names the field and the limit, never the value.

Limits are by field name (the same name means the same thing in every message); fields not named here get
the defaults. `TaskSpec.validate` uses the same table for specs built in Python (CLI, simulator).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from hsched.domain.errors import ValidationError

# characters (strings) per field name; a repeated string's entries each obey its limit
STRING_LIMITS: dict[str, int] = {
    "request_id": 128,
    "tenant": 63,            # a DNS-1123 label
    "name": 253,             # a DNS-1123 subdomain (task names, node names)
    "entry_vertex": 128,
    "gpu_models": 64,
    "task_id": 128,
    "datacenter": 128,
    "selector_method": 64,
    "method": 64,
    "page_token": 128,       # a task id
    "after_event_id": 64,    # a Redis stream id: "<ms>-<seq>"
    "min_ledger_id": 64,
    "trace_context": 512,    # W3C traceparent/tracestate/baggage keys and values
    "job_id": 128,
    "stage": 64,             # a DAG job's stage name (hsched.jobs allows 49 characters)
    "parents": 64,           # stage names
    "priority_class": 16,
}
# entries per repeated (or map) field name
REPEATED_LIMITS: dict[str, int] = {
    "gpu_models": 16,
    "trace_context": 8,
    "calls": 1024,           # the batch streams: the gateway sends at most --max-batch (128) per message
    "deltas": 100_000,       # thermal Predict: at most one per node of a data center
    "stages": 256,           # a DAG job's stages (TPC-H's largest has 18)
    "parents": 256,          # a stage's parent stages
}
# DAG jobs (hsched.jobs): every task of a job is a task of the gateway's table, so a job's size is bounded like a
# request's. TPC-H's largest stage has 593 tasks and its largest job 3717.
STAGE_MAX_TASKS = 1000
JOB_MAX_TASKS = 10_000
# tasks or jobs per List/ListJobs page: a request's 0 asks for the default, more than the most is refused (the
# gateway checks; the CLI's --limit takes this range)
LIST_DEFAULT, LIST_MAX = 100, 1000
# What a protobuf integer field carries, by its wire type (Python ints, YAML and CSV have no such bounds)
INT32_MIN, INT32_MAX, INT64_MAX = -2**31, 2**31 - 1, 2**63 - 1
INT_RANGES = {FieldDescriptor.TYPE_INT32: (INT32_MIN, INT32_MAX),
              FieldDescriptor.TYPE_INT64: (-INT64_MAX - 1, INT64_MAX),
              FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1)}
DEFAULT_STRING_LIMIT = 256
DEFAULT_REPEATED_LIMIT = 1024
# a batch's calls are checked one by one (hsched.batching.serve_batch), so one bad call fails only itself
_NOT_DESCENDED = frozenset({"calls"})


def int_field(where: str, value: Any, message: Any, name: str) -> int:
    """`value` for the integer field `name` of the protobuf `message`, as files give one (a task, job or readings
    file): an int in its wire type's range (INT_RANGES), never 4.0, 1e3, "4" or true; ValidationError naming
    `where` and the rule otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(where, "must be an integer", value)
    lo, hi = INT_RANGES[message.DESCRIPTOR.fields_by_name[name].type]
    if not lo <= value <= hi:
        raise ValidationError(where, f"must be in {lo}..{hi}", value)
    return value


def string_limit(name: str) -> int:
    return STRING_LIMITS.get(name, DEFAULT_STRING_LIMIT)


def repeated_limit(name: str) -> int:
    return REPEATED_LIMITS.get(name, DEFAULT_REPEATED_LIMIT)


def check_string(field: str, value: str, name: str | None = None) -> None:
    """Raise ValidationError if `value` is longer than the limit of `name` (default: the last part of `field`)."""
    limit = string_limit(name or field.rpartition(".")[2].partition("[")[0])
    if len(value) > limit:
        raise ValidationError(field, f"must be at most {limit} characters (got {len(value)})")


def check_count(field: str, count: int, name: str | None = None) -> None:
    limit = repeated_limit(name or field.rpartition(".")[2])
    if count > limit:
        raise ValidationError(field, f"must have at most {limit} entries (got {count})")


_S = FieldDescriptor.TYPE_STRING
_M = FieldDescriptor.TYPE_MESSAGE
# per message type: (name, kind, repeated, is map, nested descriptor) of the fields worth checking
_plans: dict[str, list[tuple[str, int, bool, bool, Descriptor | None]]] = {}


def _plan(desc: Descriptor) -> list[tuple[str, int, bool, bool, Descriptor | None]]:
    plan = _plans.get(desc.full_name)
    if plan is None:
        plan = _plans[desc.full_name] = []  # placed first: recursive message types terminate
        for f in desc.fields:
            repeated = f.is_repeated
            is_map = f.type == _M and f.message_type.GetOptions().map_entry
            if f.type == _S or repeated:
                plan.append((f.name, f.type, repeated, is_map, None))
            elif f.type == _M and _plan(f.message_type):
                plan.append((f.name, f.type, False, False, f.message_type))
        _plans[desc.full_name] = plan
    return plan


def check_message(msg: Any, prefix: str = "") -> None:
    """Raise ValidationError for the first string or repeated field of `msg` (a protobuf message, nested ones
    included) over its limit; costs a length check per field."""
    for name, kind, repeated, is_map, nested in _plan(msg.DESCRIPTOR):
        value = getattr(msg, name)
        path = prefix + name
        if repeated:
            check_count(path, len(value), name)
            if is_map:
                for k, v in value.items():
                    check_string(f"{path}[key]", k, name)
                    if isinstance(v, str):
                        check_string(f"{path}[value]", v, name)
            elif kind == _S:
                limit = string_limit(name)
                for i, s in enumerate(value):
                    if len(s) > limit:
                        check_string(f"{path}[{i}]", s, name)
            elif kind == _M and name not in _NOT_DESCENDED:
                for i, m in enumerate(value):
                    check_message(m, f"{path}[{i}].")
        elif kind == _S:
            if len(value) > string_limit(name):
                check_string(path, value, name)
        elif nested is not None and msg.HasField(name):
            check_message(value, path + ".")
