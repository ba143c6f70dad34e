"""Name or path → a trace the loaders read, and its tasks: what `--trace NAME|PATH` resolves to.

Known names are the traces shipped in `data/` (`TRACES`); anything else must be a file in a format a loader
reads: a Parallel Workloads Archive log (`*.swf`, `*.swf.gz`) or an openb pod list (`*.csv`, `*.csv.gz`
with `name,cpu_milli,memory_mib,num_gpu,gpu_milli` columns). The kind is told by the file's content (an
openb header line, else SWF records), not trusted from the suffix alone.

Scaling knob: SWF logs count processors, not cores. `cores_per_proc` (`--cores-per-proc`) makes each
processor that many cores, which is how a log of small jobs (e.g. KTH's 1-100 single-core processors) is
brought to a fleet of 24-core servers' load; openb pods are already in milli-cores and take no scaling.
`time_compression` (`--time-compression`) divides an SWF log's submit times by that factor, runtimes unchanged:
the offered load rises by the factor while the jobs' widths and lengths stay the log's (Feitelson's load scaling
by interarrival times). The two together match a log to another's load and mean width (docs/results.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hsched.domain.errors import ValidationError
from hsched.domain.task import TaskSpec
from hsched.traces._io import TraceFileError, text_lines
from hsched.traces.openb import POD_COLUMNS as OPENB_COLUMNS

TRACES: dict[str, str] = {
    "openb": "alibaba_openb_gpu_2023/openb_pod_list_default.csv.gz",
    "openb-gpuspec33": "alibaba_openb_gpu_2023/openb_pod_list_gpuspec33.csv.gz",
    "thunder": "pwa_swf/LLNL-Thunder-2007-1.1-cln.swf.gz",
    "kth": "pwa_swf/KTH-SP2-1996-2.1-cln.swf.gz",
}
LABELS = {"openb": "Alibaba openb (default pod list)", "openb-gpuspec33": "Alibaba openb (gpuspec33 pod list)",
          "thunder": "LLNL Thunder", "kth": "KTH SP2"}


@dataclass(frozen=True)
class TraceRef:
    name: str  # the catalogue name, or the file's name
    kind: str  # "swf" | "openb"
    path: Path
    cores_per_proc: int = 1  # SWF only: cores per processor
    time_compression: float = 1.0  # SWF only: submit times divided by this

    @property
    def label(self) -> str:
        """How reports name the data: 'LLNL Thunder (LLNL-Thunder-2007-1.1-cln.swf.gz)' for a catalogue trace, a
        file's path for a file (it was 'kth300.swf (kth300.swf)'), with the scaling when not 1."""
        scale = f", {self.cores_per_proc} cores per processor" if self.cores_per_proc != 1 else ""
        if self.time_compression != 1:
            scale += f", submit times ÷ {self.time_compression:g}"
        if self.name in LABELS:
            return f"{LABELS[self.name]} ({self.path.name}{scale})"
        return f"{self.path} ({scale[2:]})" if scale else str(self.path)


def resolve_trace(spec: str, cores_per_proc: int = 1, field: str = "--trace",
                  time_compression: float = 1.0) -> TraceRef:
    """A catalogue name or a file path → TraceRef; ValidationError naming `field` (or the scaling flag) otherwise."""
    from hsched.traces import data_dir

    if cores_per_proc < 1:
        raise ValidationError("--cores-per-proc", "must be an integer >= 1", cores_per_proc)
    if not (math.isfinite(time_compression) and time_compression > 0):
        raise ValidationError("--time-compression", "must be a finite number > 0", time_compression)
    if spec in TRACES:
        path = data_dir() / TRACES[spec]
        kind = "openb" if spec.startswith("openb") else "swf"
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValidationError(field, f"must be one of {', '.join(TRACES)} or an existing SWF / openb pod-list "
                                         "file", spec)
        kind = _sniff(path)
    if kind == "openb":
        if cores_per_proc != 1:
            raise ValidationError("--cores-per-proc", "applies to SWF logs only (openb pods are in milli-cores)",
                                  cores_per_proc)
        if time_compression != 1:
            raise ValidationError("--time-compression", "applies to SWF logs only (an openb pod list's creation "
                                  "times are not an arrival process to rescale)", time_compression)
    return TraceRef(spec if spec in TRACES else path.name, kind, path, cores_per_proc, time_compression)


def _sniff(path: Path) -> str:
    for line in text_lines(path):  # TraceFileError naming the file if it cannot be read
        text = line.strip()
        if not text or text.startswith(";"):
            continue
        cols = [c.strip() for c in text.split(",")]
        if all(c in cols for c in OPENB_COLUMNS):
            return "openb"
        if len(text.split()) >= 18:
            return "swf"
        break
    raise TraceFileError(path, "is neither an SWF log (18-field records) nor an openb pod list (a header with "
                               f"{','.join(OPENB_COLUMNS)})")


def trace_tasks(ref: TraceRef, limit: int | None = None, skip: int = 0, tenant: str = "") -> list[TaskSpec]:
    """The trace's tasks in file order (`skip` first, then at most `limit`)."""
    return [t for _, t in trace_jobs(ref, limit, skip, tenant)]


def trace_jobs(ref: TraceRef, limit: int | None = None, skip: int = 0,
               tenant: str = "") -> list[tuple[float, TaskSpec]]:
    """(submit time s, task) per job/pod, in file order."""
    if ref.kind == "openb":
        from hsched.traces.openb import load_openb_pods, openb_pod_to_task

        pods = load_openb_pods(ref.path, limit=None if limit is None else skip + limit)[skip:]
        return [(float(p.creation_s), openb_pod_to_task(p)) for p in pods]
    from hsched.traces.swf import load_swf, swf_job_to_task

    return [(j.submit_s / ref.time_compression,
             swf_job_to_task(j, cores_per_proc=ref.cores_per_proc, tenant=tenant or ref.name))
            for j in load_swf(ref.path, limit=limit, skip=skip)]
