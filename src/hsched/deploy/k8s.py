"""Kubernetes manifests for one hsched deployment, generated from its fleet file (`hsched k8s render`).

The topology is compose.yaml's (and `hsched up`'s): Redis, thermal, selector, one placer per data center of
the fleet, the gateway; the same command lines, with the Services' DNS names as addresses. What Kubernetes
adds (docs/operations.md, "Kubernetes"):

- Redis is a StatefulSet with an append-only file on a PersistentVolumeClaim behind a headless Service, run
  with compose's command line; or, with `redis_url_secret`, no Redis at all: every service reads the URL of
  an external one from that Secret's key `redis-url`, mounted as a file (--redis-url-file), so no manifest
  holds a password.
- Each data center's placer is one Deployment of two replicas: both fold the ledger, the DC's Redis lease
  decides which one writes (--standby: the other is a NOT_SERVING standby that takes over when the lease
  lapses). Readiness is the gRPC health of the whole server, so the placer Service's only endpoint is the
  lease holder; liveness asks for the health service `liveness` (hsched.rpc.LIVENESS), which every server
  answers SERVING while it runs, so a standby is alive without being ready.
- NetworkPolicies: deny everything, then admit DNS, clients to the gateway, the gateway to the selector and
  the placers, the placers to thermal, and every hsched service to Redis.

The output is deterministic (objects in apply order, keys sorted, no timestamps) so that a rendered copy can
be committed and diffed: deploy/k8s/ is the default fleet's."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from hsched import yamlfile
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Fleet
from hsched.policies.base import NodesToScore
from hsched.policies.dagqueue import DAG_POLICIES
from hsched.policies.heuristics import POLICY_NAMES
from hsched.rpc import LIVENESS

# Fixed gRPC and /metrics ports per role (compose.yaml's; every pod has its own address, so all placers share one)
PORTS = {"gateway": (50051, 9100), "selector": (50052, 9101), "thermal": (50060, 9102), "placer": (50061, 9111)}
REDIS_PORT = 6379
REDIS_IMAGE = "redis:7-alpine"  # compose.yaml's
REDIS_UID, REDIS_GID = 999, 1000  # the redis user of the alpine image
HSCHED_UID = 10001  # the Dockerfile's user hsched
FLEET_CONFIGMAP = "hsched-fleet"
FLEET_DIR, FLEET_KEY = "/etc/hsched/fleet", "fleet.yaml"
WEIGHTS_KEY = "tenant-weights.json"  # the placers' --tenant-weights, beside the fleet file in its ConfigMap
SECRET_DIR, SECRET_KEY = "/var/run/secrets/hsched", "redis-url"  # compose.tls.yaml's secret file name
PLACER_REPLICAS = 2  # one holds the DC's lease, the other is its standby
REPLICAS = {"gateway": 2, "selector": 2, "thermal": 1}
# A placer that lost its lease and cannot take it back exits after this long (--fenced-exit-s): the gateway's
# connection to the placer Service stays with that pod until it closes, so the default 120 s would keep the DC
# unreachable that long while the standby already serves; 30 s still rides out a Redis pod's restart.
PLACER_FENCED_EXIT_S = 30

LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_DATACENTER = "hsched/datacenter"
FLEET_HASH = "hsched/fleet-sha256"  # pod template annotation: a new fleet file rolls every pod
COMMON_LABELS = {LABEL_PART_OF: "hsched", "app.kubernetes.io/managed-by": "hsched-k8s-render"}

RESOURCES = {  # requests: what the default fleet needs; limits: room for learned policies and larger rooms
    "gateway": ({"cpu": "250m", "memory": "256Mi"}, {"cpu": "2", "memory": "1Gi"}),
    "selector": ({"cpu": "100m", "memory": "256Mi"}, {"cpu": "1", "memory": "512Mi"}),
    "thermal": ({"cpu": "250m", "memory": "512Mi"}, {"cpu": "1", "memory": "2Gi"}),
    "placer": ({"cpu": "250m", "memory": "512Mi"}, {"cpu": "1", "memory": "2Gi"}),
    "redis": ({"cpu": "250m", "memory": "512Mi"}, {"cpu": "1", "memory": "2Gi"}),
}

# Redis refuses writes at this share of its memory limit instead of being OOM-killed at the limit (maxmemory-policy
# noeviction: hsched's state must never be evicted); the rest is for the AOF rewrite's copy-on-write, the client
# buffers and fragmentation, which maxmemory does not count
REDIS_MAXMEMORY_SHARE = Decimal("0.75")

# apply order: the namespace, then the policies (no pod ever runs unprotected), config, Services, workloads
KIND_ORDER = ["Namespace", "NetworkPolicy", "ConfigMap", "Service", "StatefulSet", "Deployment",
              "PodDisruptionBudget"]

RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
RFC1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
RFC1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?\Z")
UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
         "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
QUANTITY = re.compile(rf"^([0-9]+(?:\.[0-9]+)?)({'|'.join(UNITS)})\Z")
EPOCH = re.compile(r"[A-Za-z0-9_-]{1,64}")
HEADER = ("# Generated by `hsched k8s render` (hsched.deploy.k8s) from the fleet file: do not edit, render again.\n")


@dataclass(frozen=True)
class Options:
    namespace: str = "hsched"
    image: str = "hsched:latest"
    redis_url_secret: str | None = None  # a Secret with key `redis-url`: an external Redis, no StatefulSet
    redis_port: int = REDIS_PORT  # with redis_url_secret: its port, which the egress policy opens to any address
    redis_storage: str = "1Gi"  # the in-cluster Redis' volume
    redis_appendfsync: str = "everysec"  # or "always", as compose's HSCHED_REDIS_APPENDFSYNC
    policy: str = "bestfit"
    gpu_policy: str | None = None  # the policy of DCs with GPU cards (None: `policy`), as `hsched up --gpu-policy`
    nodes_to_score: str = "all"  # the placers' --nodes-to-score, as `hsched up --nodes-to-score`
    dag_policy: str = "fifo"  # the placers' --dag-policy
    tenant_weights: str = ""  # the placers' fair-share weights as TenantWeights.to_json (""= every tenant 1)
    epoch: str = ""  # every service's HSCHED_EPOCH: the one Redis must hold (""= the first service claims one)

    def check(self) -> None:
        """ValidationError naming the flag of the first bad option."""
        if len(self.namespace) > 63 or not RFC1123_LABEL.match(self.namespace):
            raise ValidationError("--namespace", "must be an RFC 1123 label: at most 63 lowercase letters, digits "
                                  "and '-', starting and ending with a letter or digit", self.namespace)
        if self.namespace == "default" or self.namespace.startswith("kube-"):
            raise ValidationError("--namespace", "must be a namespace of hsched's own, not default or kube-*: it "
                                  "gets Pod Security 'restricted' and a NetworkPolicy denying every pod in it all "
                                  "traffic", self.namespace)
        if not self.image or any(c.isspace() for c in self.image):
            raise ValidationError("--image", "must be a non-empty image reference without spaces", self.image)
        if self.redis_url_secret is not None and (len(self.redis_url_secret) > 253
                                                  or not RFC1123_SUBDOMAIN.match(self.redis_url_secret)):
            raise ValidationError("--redis-url-secret", "must be a Secret name (RFC 1123 subdomain: lowercase "
                                  "letters, digits, '-' and '.')", self.redis_url_secret)
        if not 0 < self.redis_port < 65536:
            raise ValidationError("--redis-port", "must be a TCP port in 1..65535", self.redis_port)
        if self.redis_port != REDIS_PORT and not self.redis_url_secret:  # a forgotten secret? refused, not ignored
            raise ValidationError("--redis-port", "is the external Redis' port and needs --redis-url-secret (the "
                                  f"in-cluster Redis listens on {REDIS_PORT})", self.redis_port)
        if not quantity(self.redis_storage):  # the API server refuses a claim of 0
            raise ValidationError("--redis-storage", "must be a positive Kubernetes quantity such as 1Gi or 500Mi",
                                  self.redis_storage)
        if self.redis_appendfsync not in ("everysec", "always"):
            raise ValidationError("--redis-appendfsync", "must be everysec or always", self.redis_appendfsync)
        for flag, policy in (("--policy", self.policy), ("--gpu-policy", self.gpu_policy or self.policy)):
            if policy not in POLICY_NAMES:
                raise ValidationError(flag, f"must be one of {', '.join(POLICY_NAMES)}", policy)
        try:
            NodesToScore.parse(self.nodes_to_score)
        except ValueError as exc:
            raise ValidationError("--nodes-to-score", str(exc).removeprefix("nodes_to_score: ")) from None
        if self.epoch and not EPOCH.fullmatch(self.epoch):
            raise ValidationError("--epoch", "must be the epoch Redis holds (`redis-cli GET hsched:epoch`): 1-64 "
                                  "letters, digits, '_' or '-'", self.epoch)
        if self.dag_policy not in DAG_POLICIES:
            raise ValidationError("--dag-policy", f"must be one of {', '.join(DAG_POLICIES)}", self.dag_policy)


def render(fleet: Fleet, fleet_text: str, options: Options, fleet_label: str = "--fleet") -> list[dict[str, Any]]:
    """Every object of the deployment, in apply order. `fleet_text` is the fleet file as given (the ConfigMap
    holds it verbatim); `fleet_label` names it in errors. Raises ValidationError naming the flag or field."""
    options.check()
    _check_fleet(fleet, fleet_text, fleet_label)
    b = _Builder(fleet, fleet_text, options)
    objects = [b.namespace(), b.fleet_configmap(), *b.network_policies(), *b.redis(),
               *b.service_objects("thermal", b.listen_args("thermal")),
               *b.service_objects("selector", b.listen_args("selector")),
               *(obj for dc in fleet.datacenters for obj in b.placer(dc)),
               *b.service_objects("gateway", b.gateway_args())]
    return sorted(objects, key=lambda o: (KIND_ORDER.index(o["kind"]), o["metadata"]["name"]))


def quantity(text: str) -> Decimal | None:
    """A Kubernetes quantity (the plain and binary/decimal-suffixed forms QUANTITY admits) as a number; None if
    `text` is none."""
    m = QUANTITY.match(text)
    return Decimal(m.group(1)) * UNITS[m.group(2)] if m else None


def _check_fleet(fleet: Fleet, fleet_text: str, label: str) -> None:
    for i, dc in enumerate(fleet.datacenters):
        name = placer_name(dc.name)
        if len(name) > 63 or not RFC1035_LABEL.match(name):
            raise ValidationError(f"{label}: datacenters[{i}].name", "must make placer-<name> a Kubernetes Service "
                                  "name: lowercase letters, digits and '-', ending with a letter or digit, at "
                                  "most 56 characters", dc.name)
    graphml = ((yamlfile.document(fleet_text, label) or {}).get("wan") or {}).get("graphml")  # as load_fleet reads it
    if graphml:  # inside a pod the fleet file stands alone: its graph must be one the image ships
        from hsched.traces import data_dir

        if not (data_dir() / graphml).is_file():
            raise ValidationError(f"{label}: wan.graphml", "must name a graph of the data dir the image ships "
                                  "(data/): in a pod the fleet file is alone in a ConfigMap", graphml)


def placer_name(dc: str) -> str:
    return f"placer-{dc}"


def to_stream(objects: list[dict[str, Any]]) -> str:
    """One multi-document YAML stream (`kubectl apply -f -`)."""
    return HEADER + "".join("---\n" + _dump(o) for o in objects)


def file_of(obj: dict[str, Any]) -> str:
    """The file of `-o DIR` an object goes to: one per component, the cross-cutting kinds apart."""
    kind = obj["kind"]
    if kind == "Namespace":
        return "namespace.yaml"
    if kind == "NetworkPolicy":
        return "network-policies.yaml"
    if kind == "ConfigMap":
        return "fleet-configmap.yaml"
    return f"{obj['metadata']['labels'][LABEL_NAME]}.yaml"


def to_files(objects: list[dict[str, Any]]) -> dict[str, str]:
    """`-o DIR`'s files by name: one per component and a kustomization.yaml listing them in apply order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:  # objects come in apply order, so do files by their first object
        grouped.setdefault(file_of(obj), []).append(obj)
    files = {name: HEADER + "---\n".join(_dump(o) for o in objs) for name, objs in grouped.items()}
    files["kustomization.yaml"] = HEADER + _dump({"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                                  "kind": "Kustomization", "resources": list(grouped)})
    return files


def write_dir(files: dict[str, str], directory: Path) -> list[Path]:
    """Write `files` into `directory` (created), each by a temporary file and a rename, and remove the files
    an earlier render left there that this one no longer makes (ours: they start with HEADER)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in sorted(files.items()):
        path = directory / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        written.append(path)
    for stale in sorted(directory.glob("*.yaml")):
        if stale.name not in files and stale.read_text(errors="replace").startswith(HEADER):
            stale.unlink()
    return written


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the fleet file in its ConfigMap) as literal blocks, readable in a diff."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def _dump(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=True, default_flow_style=False, allow_unicode=True, width=120)


class _Builder:
    def __init__(self, fleet: Fleet, fleet_text: str, options: Options) -> None:
        self.fleet, self.fleet_text, self.o = fleet, fleet_text, options
        # what the pods read from the ConfigMap: a change rolls them (the fleet alone keeps its old hash)
        config = fleet_text + (f"\0{options.tenant_weights}" if options.tenant_weights else "")
        self.fleet_hash = hashlib.sha256(config.encode()).hexdigest()

    # -- shared pieces -----------------------------------------------------------------------------------------

    def meta(self, name: str, component: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": name, "namespace": self.o.namespace,
                "labels": {**COMMON_LABELS, LABEL_NAME: name, LABEL_COMPONENT: component, **(extra or {})}}

    @staticmethod
    def select(name: str, component: str) -> dict[str, str]:
        """The labels a workload's pods are selected by (its Deployment, Service and PDB)."""
        return {LABEL_NAME: name, LABEL_COMPONENT: component}

    @staticmethod
    def pods_of(*components: str) -> dict[str, Any]:
        """A NetworkPolicy pod selector: the hsched pods of these components."""
        if len(components) == 1:
            return {"matchLabels": {LABEL_PART_OF: "hsched", LABEL_COMPONENT: components[0]}}
        return {"matchLabels": {LABEL_PART_OF: "hsched"},
                "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": sorted(components)}]}

    def redis_url_args(self) -> list[str]:
        if self.o.redis_url_secret:
            return ["--redis-url-file", f"{SECRET_DIR}/{SECRET_KEY}"]
        return ["--redis-url", f"redis://redis:{REDIS_PORT}/0"]  # compose's: no password, NetworkPolicy-fenced

    def listen_args(self, component: str) -> list[str]:
        """What every service is given: its fixed ports on every interface of its pod, Redis, the fleet file."""
        grpc_port, metrics_port = PORTS[component]
        return ["--listen", f"0.0.0.0:{grpc_port}", "--metrics-port", str(metrics_port),
                "--metrics-host", "0.0.0.0", *self.redis_url_args(), "--fleet", f"{FLEET_DIR}/{FLEET_KEY}"]

    def placer_args(self, dc) -> list[str]:
        gpu = dc.capacity_total().gpu_count > 0
        policy = self.o.gpu_policy if gpu and self.o.gpu_policy else self.o.policy
        args = ["--datacenter", dc.name, *self.listen_args("placer"), "--thermal", f"thermal:{PORTS['thermal'][0]}",
                "--policy", policy, "--standby", "--fenced-exit-s", str(PLACER_FENCED_EXIT_S)]
        if self.o.nodes_to_score != "all":
            args += ["--nodes-to-score", self.o.nodes_to_score]
        if self.o.dag_policy != "fifo":
            args += ["--dag-policy", self.o.dag_policy]
        if self.o.tenant_weights:
            args += ["--tenant-weights", f"{FLEET_DIR}/{WEIGHTS_KEY}"]
        return args

    def gateway_args(self) -> list[str]:
        placers = ",".join(f"{dc.name}={placer_name(dc.name)}:{PORTS['placer'][0]}" for dc in self.fleet.datacenters)
        return [*self.listen_args("gateway"), "--selector", f"selector:{PORTS['selector'][0]}", "--placers", placers]

    @staticmethod
    def grpc_probe(port: int, service: str, period_s: int, failures: int) -> dict[str, Any]:
        grpc = {"port": port, **({"service": service} if service else {})}  # no service: the whole server ("")
        return {"grpc": grpc, "periodSeconds": period_s, "timeoutSeconds": min(5, period_s), "failureThreshold": failures}

    @staticmethod
    def container_security() -> dict[str, Any]:
        return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                "capabilities": {"drop": ["ALL"]}}

    @staticmethod
    def pod_security(uid: int, gid: int) -> dict[str, Any]:
        return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid, "fsGroup": gid,
                "seccompProfile": {"type": "RuntimeDefault"}}

    @staticmethod
    def resources(component: str) -> dict[str, Any]:
        requests, limits = RESOURCES[component]
        return {"requests": dict(requests), "limits": dict(limits)}

    @staticmethod
    def spread(select: dict[str, str]) -> dict[str, Any]:
        """Replicas on different nodes when the cluster has them (a placer's standby must not share its
        holder's node), but schedulable on one."""
        return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": dict(select)}}}]}}

    # -- objects -----------------------------------------------------------------------------------------------

    def namespace(self) -> dict[str, Any]:
        # Pod Security Admission enforces what the pods claim: non-root, no privilege escalation, no capabilities
        labels = {**COMMON_LABELS, "pod-security.kubernetes.io/enforce": "restricted",
                  "pod-security.kubernetes.io/enforce-version": "latest"}
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.o.namespace, "labels": labels}}

    def fleet_configmap(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": self.meta(FLEET_CONFIGMAP, "config"),
                "data": {FLEET_KEY: self.fleet_text,
                         **({WEIGHTS_KEY: self.o.tenant_weights} if self.o.tenant_weights else {})}}

    def service_objects(self, component: str, args: list[str], name: str | None = None,
                        extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """An hsched service: its Deployment, its Service and (with several interchangeable replicas) a PDB."""
        name = name or component
        grpc_port, metrics_port = PORTS[component]
        select = self.select(name, component)
        placer = component == "placer"
        volumes = [{"name": "fleet", "configMap": {"name": FLEET_CONFIGMAP}},
                   {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]  # the root fs is read-only
        mounts = [{"name": "fleet", "mountPath": FLEET_DIR, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"}]
        if self.o.redis_url_secret:
            volumes.append({"name": "redis-url", "secret": {
                "secretName": self.o.redis_url_secret, "defaultMode": 0o440,
                "items": [{"key": SECRET_KEY, "path": SECRET_KEY}]}})
            mounts.append({"name": "redis-url", "mountPath": SECRET_DIR, "readOnly": True})
        container = {
            "name": component, "image": self.o.image, "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-m", f"services.{component}"], "args": args,
            "env": [{"name": "HSCHED_LOG_LEVEL", "value": "INFO"}, {"name": "HSCHED_TRACES", "value": "none"},
                    *([{"name": "HSCHED_EPOCH", "value": self.o.epoch}] if self.o.epoch else [])],
            "ports": [{"name": "grpc", "containerPort": grpc_port, "protocol": "TCP"},
                      {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"}],
            # a fold of a long ledger or a model load may take a while: liveness waits for the first answer
            "startupProbe": self.grpc_probe(grpc_port, LIVENESS, 2, 90),
            "livenessProbe": self.grpc_probe(grpc_port, LIVENESS, 10, 6),
            # a placer is ready while it holds its DC's lease: the Service then routes to the holder only
            "readinessProbe": self.grpc_probe(grpc_port, "", 2 if placer else 5, 2),
            "resources": self.resources(component), "securityContext": self.container_security(),
            "volumeMounts": mounts,
        }
        pod = {"automountServiceAccountToken": False, "enableServiceLinks": False,
               "securityContext": self.pod_security(HSCHED_UID, HSCHED_UID), "terminationGracePeriodSeconds": 30,
               "affinity": self.spread(select), "containers": [container], "volumes": volumes}
        # Recreate for placers: a new replica is a standby (never ready) while an old one holds the lease, so a
        # rolling update could never finish; the old holder's clean stop releases the lease at once instead.
        # Recreate for thermal: it must run as a single instance (the one telemetry writer), a surge would add a second
        strategy = {"type": "Recreate"} if component in ("placer", "thermal") else \
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        replicas = PLACER_REPLICAS if placer else REPLICAS[component]
        deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(name, component, extra),
                      "spec": {"replicas": replicas, "revisionHistoryLimit": 3, "selector": {"matchLabels": select},
                               "strategy": strategy,
                               "template": {"metadata": {"labels": {**COMMON_LABELS, **select, **(extra or {})},
                                                         "annotations": {FLEET_HASH: self.fleet_hash}},
                                            "spec": pod}}}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(name, component, extra),
                   "spec": {"type": "ClusterIP", "selector": select,
                            "ports": [{"name": "grpc", "port": grpc_port, "targetPort": "grpc", "protocol": "TCP"},
                                      {"name": "metrics", "port": metrics_port, "targetPort": "metrics",
                                       "protocol": "TCP"}]}}
        objects = [deployment, service]
        if replicas > 1 and not placer:  # a placer's standby is never ready: a PDB would block every drain
            objects.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                            "metadata": self.meta(name, component, extra),
                            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": select}}})
        return objects

    def placer(self, dc) -> list[dict[str, Any]]:
        return self.service_objects("placer", self.placer_args(dc), placer_name(dc.name), {LABEL_DATACENTER: dc.name})

    def redis(self) -> list[dict[str, Any]]:
        """The in-cluster Redis (none with an external one): compose's command line with a maxmemory below its
        memory limit, its AOF on a volume."""
        if self.o.redis_url_secret:
            return []
        select = self.select("redis", "redis")
        maxmemory_mb = int(quantity(RESOURCES["redis"][1]["memory"]) * REDIS_MAXMEMORY_SHARE) // 2**20
        ping = {"exec": {"command": ["redis-cli", "ping"]}, "timeoutSeconds": 3}
        container = {
            "name": "redis", "image": REDIS_IMAGE, "imagePullPolicy": "IfNotPresent",
            "args": ["redis-server", "--save", "", "--appendonly", "yes", "--appendfsync", self.o.redis_appendfsync,
                     "--dir", "/data", "--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "noeviction"],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
            "startupProbe": {**ping, "periodSeconds": 2, "failureThreshold": 150},  # loading a long AOF
            "livenessProbe": {**ping, "periodSeconds": 10, "failureThreshold": 6},
            "readinessProbe": {**ping, "periodSeconds": 5, "failureThreshold": 2},
            "resources": self.resources("redis"), "securityContext": self.container_security(),
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }
        pod = {"automountServiceAccountToken": False, "enableServiceLinks": False,
               "securityContext": self.pod_security(REDIS_UID, REDIS_GID), "terminationGracePeriodSeconds": 30,
               "containers": [container]}
        statefulset = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": self.meta("redis", "redis"),
                       "spec": {"serviceName": "redis", "replicas": 1, "selector": {"matchLabels": select},
                                "template": {"metadata": {"labels": {**COMMON_LABELS, **select}}, "spec": pod},
                                "volumeClaimTemplates": [{
                                    "metadata": {"name": "data"},
                                    "spec": {"accessModes": ["ReadWriteOnce"],
                                             "resources": {"requests": {"storage": self.o.redis_storage}}}}]}}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": self.meta("redis", "redis"),
                   "spec": {"clusterIP": "None", "selector": select,  # headless: the name resolves to the pod
                            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]}}
        return [statefulset, service]

    def network_policies(self) -> list[dict[str, Any]]:
        """Default deny (both ways), then exactly: DNS out of every pod; anyone -> gateway; gateway -> selector,
        placers; placers -> thermal; every hsched service -> Redis. /metrics is admitted to no one (see docs)."""
        def port(p: int, protocol: str = "TCP") -> dict[str, Any]:
            return {"protocol": protocol, "port": p}

        def policy(name: str, component: str, ingress: list, egress: list) -> dict[str, Any]:
            return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": self.meta(name, component),
                    "spec": {"podSelector": self.pods_of(component), "policyTypes": ["Ingress", "Egress"],
                             "ingress": ingress, "egress": egress}}

        def grpc_of(component: str) -> list[dict[str, Any]]:
            return [port(PORTS[component][0])]

        if self.o.redis_url_secret:  # an external Redis: its address is in the Secret, so any address, its port
            to_redis = {"ports": [port(self.o.redis_port)]}
        else:
            to_redis = {"to": [{"podSelector": self.pods_of("redis")}], "ports": [port(REDIS_PORT)]}
        everyone = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy"}
        policies = [
            {**everyone, "metadata": self.meta("default-deny", "network"),
             "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}},
            {**everyone, "metadata": self.meta("allow-dns", "network"),
             "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                      "egress": [{"ports": [port(53, "UDP"), port(53, "TCP")]}]}},
            policy("gateway", "gateway", [{"ports": grpc_of("gateway")}],  # clients: from anywhere
                   [{"to": [{"podSelector": self.pods_of("selector")}], "ports": grpc_of("selector")},
                    {"to": [{"podSelector": self.pods_of("placer")}], "ports": grpc_of("placer")}, to_redis]),
            policy("selector", "selector", [{"from": [{"podSelector": self.pods_of("gateway")}],
                                             "ports": grpc_of("selector")}], [to_redis]),
            policy("placer", "placer", [{"from": [{"podSelector": self.pods_of("gateway")}],
                                         "ports": grpc_of("placer")}],
                   [{"to": [{"podSelector": self.pods_of("thermal")}], "ports": grpc_of("thermal")}, to_redis]),
            policy("thermal", "thermal", [{"from": [{"podSelector": self.pods_of("placer")}],
                                           "ports": grpc_of("thermal")}], [to_redis]),
        ]
        if not self.o.redis_url_secret:
            policies.append(policy("redis", "redis", [{
                "from": [{"podSelector": self.pods_of("gateway", "selector", "placer", "thermal")}],
                "ports": [port(REDIS_PORT)]}], []))
        return policies
