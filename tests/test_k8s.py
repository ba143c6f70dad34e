"""`hsched k8s render` (hsched.deploy.k8s), checked without a cluster (none runs here):

- every object is valid against the Kubernetes OpenAPI schemas in strict mode (kubernetes-validate), for the
  default fleet, tests/fleets/small.yaml and the external-Redis variant; the validator does reject a broken one;
- the topology: one placer Deployment per data center with two replicas, its --datacenter, the lease flags,
  readiness on the server's health and liveness on `liveness`; the gateway's --placers names every DC's placer
  Service; every address a command line holds names a Service whose selector and port reach the pods meant;
- every command line is accepted by the service's real parser;
- NetworkPolicies, evaluated as Kubernetes does (default deny, then the union of the rules selecting a pod, on
  both ends), admit exactly the intended pairs;
- no secret value in any manifest; the external Redis' URL comes from the Secret, mounted as a file;
- bad input is one line naming the flag, exit 2, nothing written; output is deterministic; deploy/k8s/ is what
  the generator renders for the default fleet (so it cannot drift);
- a real gRPC server answers `liveness` SERVING while its overall health is NOT_SERVING (a standby placer), and
  a placer Deployment's own command line, run twice as real processes on a real Redis, gives one ready lease
  holder and one live standby that becomes ready when the holder is killed.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from hsched import cli, rpc
from hsched.deploy import k8s
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import default_fleet_path, load_fleet
from hsched.policies.fairshare import TenantWeights

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "tests" / "fleets" / "small.yaml"
COMMITTED = ROOT / "deploy" / "k8s"
K8S_VERSIONS = ["1.37.0", "1.30.0"]  # the newest schema the validator ships, and the oldest we document
PLACER_PORT, THERMAL_PORT, SELECTOR_PORT, GATEWAY_PORT = 50061, 50060, 50052, 50051
HSCHED = ("gateway", "selector", "thermal", "placer")


def rendered(fleet_path: Path | None = None, **options) -> list[dict[str, Any]]:
    path = fleet_path or default_fleet_path()
    return k8s.render(load_fleet(path), path.read_text(), k8s.Options(**options))


@pytest.fixture(scope="module")
def default_objects() -> list[dict[str, Any]]:
    return rendered()


def by_kind(objects, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} must appear exactly once in {args}"
    return args[args.index(name) + 1]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


# -- schema --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", ["default", "small", "external-redis", "tuned"])
def test_every_object_is_valid_against_the_kubernetes_schema_in_strict_mode(variant, version):
    objects = {"default": lambda: rendered(),
               "small": lambda: rendered(SMALL),
               "tuned": lambda: rendered(SMALL, **TUNED),
               "external-redis": lambda: rendered(SMALL, redis_url_secret="hsched-redis", namespace="sched")}[variant]()
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_a_broken_manifest(default_objects):
    deployment = copy.deepcopy(by_kind(default_objects, "Deployment")["gateway"])
    container(deployment)["livenessProbe"]["grpc"]["sevrice"] = "liveness"  # a typo strict mode must catch
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    deployment = copy.deepcopy(by_kind(default_objects, "Deployment")["gateway"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


# -- topology ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fleet_path", [None, SMALL], ids=["default", "small"])
def test_one_placer_deployment_per_dc_with_an_active_and_a_standby_replica(fleet_path):
    fleet = load_fleet(fleet_path)
    objects = rendered(fleet_path)
    placers = {n: d for n, d in by_kind(objects, "Deployment").items() if d["metadata"]["labels"][
        "app.kubernetes.io/component"] == "placer"}
    assert sorted(placers) == sorted(f"placer-{dc.name}" for dc in fleet.datacenters)
    for dc in fleet.datacenters:
        d = placers[f"placer-{dc.name}"]
        assert d["spec"]["replicas"] == 2
        assert d["spec"]["strategy"] == {"type": "Recreate"}  # a rolling update would wait on a never-ready standby
        c = container(d)
        assert flag(c["args"], "--datacenter") == dc.name
        assert "--standby" in c["args"] and "--no-standby" not in c["args"]
        assert float(flag(c["args"], "--fenced-exit-s")) > 3  # longer than the default 3 s lease
        assert pod_labels(d)["hsched/datacenter"] == dc.name
        # ready = holds the lease (the whole server's health); alive = answers at all (`liveness`)
        assert c["readinessProbe"]["grpc"] == {"port": PLACER_PORT}
        assert c["livenessProbe"]["grpc"] == {"port": PLACER_PORT, "service": rpc.LIVENESS}
        assert c["startupProbe"]["grpc"] == {"port": PLACER_PORT, "service": rpc.LIVENESS}


def test_gateway_and_selector_run_two_rolling_replicas_and_thermal_one_recreated(default_objects):
    deployments = by_kind(default_objects, "Deployment")
    assert deployments["gateway"]["spec"]["replicas"] >= 2
    assert deployments["selector"]["spec"]["replicas"] >= 2
    assert deployments["thermal"]["spec"]["replicas"] == 1
    # thermal is the single telemetry writer: a rollout must stop the old pod before it starts the new one
    assert deployments["thermal"]["spec"]["strategy"] == {"type": "Recreate"}
    for name in ("gateway", "selector"):  # interchangeable replicas roll one at a time, never below 2
        assert deployments[name]["spec"]["strategy"] == {
            "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pdbs = by_kind(default_objects, "PodDisruptionBudget")
    assert set(pdbs) == {"gateway", "selector"}  # a placer's PDB would block drains: its standby is never ready
    for name, pdb in pdbs.items():
        assert pdb["spec"]["selector"]["matchLabels"] == deployments[name]["spec"]["selector"]["matchLabels"]


def service_reaching(objects, host: str, port: int) -> list[dict[str, Any]]:
    """The workloads a `host:port` address reaches: the Service `host`, its port to a named container port
    the selected pods declare with that number."""
    services = by_kind(objects, "Service")
    assert host in services, f"{host}:{port} names no Service"
    svc = services[host]
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    workloads = [w for w in objects if w["kind"] in ("Deployment", "StatefulSet")
                 and svc["spec"]["selector"].items() <= pod_labels(w).items()]
    assert workloads, f"Service {host} selects no pods"
    for w in workloads:
        named = {p["name"]: p["containerPort"] for p in container(w)["ports"]}
        assert named.get(sp["targetPort"]) == port, f"{host}:{port} does not reach {w['metadata']['name']}"
    return workloads


@pytest.mark.parametrize("fleet_path", [None, SMALL], ids=["default", "small"])
def test_gateway_placers_map_names_every_dcs_placer_service(fleet_path):
    fleet = load_fleet(fleet_path)
    objects = rendered(fleet_path)
    args = container(by_kind(objects, "Deployment")["gateway"])["args"]
    pairs = [p.split("=", 1) for p in flag(args, "--placers").split(",")]
    assert [dc for dc, _ in pairs] == [dc.name for dc in fleet.datacenters]
    for dc, address in pairs:
        host, port = address.rsplit(":", 1)
        (w,) = service_reaching(objects, host, int(port))
        assert w["kind"] == "Deployment" and flag(container(w)["args"], "--datacenter") == dc
    (selector,) = service_reaching(objects, *_host_port(flag(args, "--selector")))
    assert selector["metadata"]["name"] == "selector"


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def test_every_address_on_a_command_line_reaches_the_service_meant(default_objects):
    for w in by_kind(default_objects, "Deployment").values():
        args = container(w)["args"]
        redis = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/0", flag(args, "--redis-url"))
        (r,) = service_reaching(default_objects, redis.group(1), int(redis.group(2)))
        assert r["kind"] == "StatefulSet"
        if "--thermal" in args:
            (t,) = service_reaching(default_objects, *_host_port(flag(args, "--thermal")))
            assert t["metadata"]["name"] == "thermal"
        listen = flag(args, "--listen")
        assert listen.startswith("0.0.0.0:"), "reachable from other pods"
        assert int(listen.rsplit(":", 1)[1]) == container(w)["ports"][0]["containerPort"]
        assert flag(args, "--fleet") == f"{k8s.FLEET_DIR}/{k8s.FLEET_KEY}"


def test_the_fleet_configmap_holds_the_fleet_file_every_pod_mounts(default_objects):
    (cm,) = by_kind(default_objects, "ConfigMap").values()
    text = cm["data"][k8s.FLEET_KEY]
    assert text == default_fleet_path().read_text()
    for w in by_kind(default_objects, "Deployment").values():
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in container(w)["volumeMounts"]}
        assert volumes[mounts[k8s.FLEET_DIR]["name"]]["configMap"]["name"] == cm["metadata"]["name"]
        # a changed fleet file changes the pod template, so every service restarts on it
        assert len(w["spec"]["template"]["metadata"]["annotations"][k8s.FLEET_HASH]) == 64


def test_redis_runs_composes_command_line_with_its_aof_on_a_volume(default_objects):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]["command"]
    sts = by_kind(default_objects, "StatefulSet")["redis"]
    c = container(sts)
    expected = [a.replace("${HSCHED_REDIS_APPENDFSYNC:-everysec}", "everysec") for a in compose]
    assert c["args"] == [*expected, "--maxmemory", "1536mb", "--maxmemory-policy", "noeviction"]  # 3/4 of 2Gi
    assert c["resources"]["limits"]["memory"] == "2Gi"
    assert c["image"] == yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]["image"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]} == {claim["metadata"]["name"]: "/data"}
    assert by_kind(default_objects, "Service")["redis"]["spec"]["clusterIP"] == "None"  # headless
    always = container(by_kind(rendered(redis_appendfsync="always"), "StatefulSet")["redis"])["args"]
    assert flag(always, "--appendfsync") == "always"


def test_redis_refuses_writes_below_its_memory_limit_instead_of_being_oom_killed(monkeypatch):
    monkeypatch.setitem(k8s.RESOURCES, "redis", (k8s.RESOURCES["redis"][0], {"cpu": "1", "memory": "1G"}))
    c = container(by_kind(rendered(), "StatefulSet")["redis"])
    assert c["resources"]["limits"]["memory"] == "1G"
    assert flag(c["args"], "--maxmemory") == "715mb"  # 0.75 * 10**9 bytes = 715.3 MiB (Redis' mb is 2**20)
    assert flag(c["args"], "--maxmemory-policy") == "noeviction"  # hsched's state must never be evicted


def test_every_command_line_is_accepted_by_the_service_parser(monkeypatch, tmp_path):
    secret = tmp_path / "redis-url"
    secret.write_text("redis://hsched:pw@redis.example:6379/0\n")
    for options, redis_url in (({}, "redis://redis:6379/0"),
                               ({"redis_url_secret": "hsched-redis"}, "redis://hsched:pw@redis.example:6379/0")):
        for w in by_kind(rendered(**options), "Deployment").values():
            c = container(w)
            argv = [str(secret) if a == f"{k8s.SECRET_DIR}/{k8s.SECRET_KEY}" else a for a in c["args"]]
            args = parse_command(c["command"], argv, {e["name"]: e["value"] for e in c["env"]}, monkeypatch)
            assert args.redis_url == redis_url
            assert args.metrics_host == "0.0.0.0"
            assert args.metrics_port == next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")


TUNED = {"nodes_to_score": "10%", "dag_policy": "tetris",
         "tenant_weights": TenantWeights({"a": 2.0, "b": 1.0}, 0.5).to_json(), "epoch": "c78899cb56e8eaf1"}


def test_with_an_epoch_every_service_expects_it_and_refuses_a_redis_without_it(monkeypatch):
    """A Redis that lost its volume looks empty, and the first service claimed a new epoch on it (cards in use
    handed out again); with --epoch every service gets HSCHED_EPOCH and claims nothing."""
    for options, expected in (({"epoch": "c78899cb56e8eaf1"}, "c78899cb56e8eaf1"), ({}, None)):
        deployments = by_kind(rendered(SMALL, **options), "Deployment").values()
        assert len(deployments) == 6  # thermal, selector, gateway, three placers
        for w in deployments:
            c = container(w)
            env = {e["name"]: e["value"] for e in c["env"]}
            assert parse_command(c["command"], c["args"], env, monkeypatch).expect_epoch == expected


def test_the_placers_get_the_scoring_bound_dag_policy_and_tenant_weights_from_the_configmap(monkeypatch, tmp_path):
    objects = rendered(SMALL, **TUNED)
    data = by_kind(objects, "ConfigMap")[k8s.FLEET_CONFIGMAP]["data"]
    weights = tmp_path / k8s.WEIGHTS_KEY
    weights.write_text(data[k8s.WEIGHTS_KEY])
    placers = [w for w in by_kind(objects, "Deployment").values() if w["metadata"]["name"].startswith("placer-")]
    assert len(placers) == 3
    for w in placers:
        c = container(w)
        assert flag(c["args"], "--tenant-weights") == f"{k8s.FLEET_DIR}/{k8s.WEIGHTS_KEY}"  # the mounted ConfigMap
        argv = [str(weights) if a == f"{k8s.FLEET_DIR}/{k8s.WEIGHTS_KEY}" else a for a in c["args"]]
        argv[argv.index("--fleet") + 1] = str(SMALL)
        args = parse_command(c["command"], argv, {e["name"]: e["value"] for e in c["env"]}, monkeypatch)
        assert args.tenant_weights == TenantWeights({"a": 2.0, "b": 1.0}, 0.5)
        assert (args.nodes_to_score, args.dag_policy) == ("10%", "tetris")
    plain = {w["metadata"]["name"]: w for w in by_kind(rendered(SMALL), "Deployment").values()}
    for w in placers:  # new weights roll the placers, as a new fleet file does
        annotations = [x["spec"]["template"]["metadata"]["annotations"] for x in (w, plain[w["metadata"]["name"]])]
        assert annotations[0] != annotations[1]
        assert "--tenant-weights" not in container(plain[w["metadata"]["name"]])["args"]


def parse_command(command: list[str], argv: list[str], env: dict[str, str], monkeypatch) -> argparse.Namespace:
    """The service's real `main(argv)` with the pod's environment, `run` replaced by a recorder."""
    assert command[:2] == ["python", "-m"]
    server = importlib.import_module(f"{command[2]}.server")
    for key in os.environ:
        if key.startswith("HSCHED_") or key == "REDIS_URL":
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(server, "run", lambda name, args, serve: seen.append(args))
    server.main(argv)  # a rejected command line exits here (SystemExit fails the test)
    assert len(seen) == 1
    return seen[0]


def test_pods_run_unprivileged_with_requests_and_limits(default_objects):
    units = {"": 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}

    def quantity(q: str) -> float:
        m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", q)
        return float(m.group(1)) * units[m.group(2)]

    workloads = [o for o in default_objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == 3 + 11 + 1
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        c = container(w)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        for resource in ("cpu", "memory"):
            assert 0 < quantity(c["resources"]["requests"][resource]) <= quantity(c["resources"]["limits"][resource])
        assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(c)


# -- NetworkPolicies -----------------------------------------------------------------------------------------


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", "the evaluator knows In only"
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _peer_matches(peer: dict[str, Any], labels: dict[str, str] | None) -> bool:
    """A from/to peer against a pod of the namespace (its labels) or an address outside it (None)."""
    assert set(peer) == {"podSelector"}, f"the evaluator knows same-namespace pod peers only: {peer}"
    return labels is not None and _matches(peer["podSelector"], labels)


def _admits(policies, direction: str, pod: dict[str, str], other: dict[str, str] | None, port: int,
            protocol: str = "TCP") -> bool:
    """Kubernetes semantics: a pod no policy of `direction` selects is open; else some rule must admit."""
    kind = "Ingress" if direction == "ingress" else "Egress"
    selecting = [p["spec"] for p in policies if kind in p["spec"]["policyTypes"] and _matches_pod(p, pod)]
    if not selecting:
        return True
    peers_key = "from" if direction == "ingress" else "to"
    for spec in selecting:
        for rule in spec.get(direction, []):
            if "ports" in rule and not any(p["port"] == port and p["protocol"] == protocol for p in rule["ports"]):
                continue
            if peers_key not in rule or any(_peer_matches(peer, other) for peer in rule[peers_key]):
                return True
    return False


def _matches_pod(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = policy["spec"]["podSelector"]
    return not selector or _matches(selector, labels)


def allowed_pairs(objects) -> set[tuple[str, str, int]]:
    """(source, destination, port) for every pod pair and port of the deployment, plus 'outside' (a client or
    an external address), that the NetworkPolicies admit at both ends."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = {o["metadata"]["name"]: pod_labels(o) for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    ports = {6379} | {p["containerPort"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
                      for p in container(o)["ports"]}  # 6379 also for an external Redis
    pairs = set()
    for src, src_labels in [*pods.items(), ("outside", None)]:
        for dst, dst_labels in [*pods.items(), ("outside", None)]:
            if src == dst:
                continue
            for port in ports:
                out = src_labels is None or _admits(policies, "egress", src_labels, dst_labels, port)
                inn = dst_labels is None or _admits(policies, "ingress", dst_labels, src_labels, port)
                if out and inn:
                    pairs.add((src, dst, port))
    return pairs


def intended(objects, external_redis: bool) -> set[tuple[str, str, int]]:
    names = [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"]
    placers = [n for n in names if n.startswith("placer-")]
    pairs = {("outside", "gateway", GATEWAY_PORT)}
    pairs |= {("gateway", "selector", SELECTOR_PORT)} | {("gateway", p, PLACER_PORT) for p in placers}
    pairs |= {(p, "thermal", THERMAL_PORT) for p in placers}
    redis = "outside" if external_redis else "redis"
    pairs |= {(n, redis, 6379) for n in names}
    return pairs


@pytest.mark.parametrize("external_redis", [False, True], ids=["in-cluster-redis", "external-redis"])
def test_network_policies_admit_exactly_the_intended_pairs(external_redis):
    objects = rendered(SMALL, **({"redis_url_secret": "hsched-redis"} if external_redis else {}))
    assert allowed_pairs(objects) == intended(objects, external_redis)


def test_network_policies_deny_by_default_and_let_every_pod_resolve_names(default_objects):
    policies = by_kind(default_objects, "NetworkPolicy")
    assert policies["default-deny"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    dns = [p for p in policies.values() if any(
        {"protocol": "UDP", "port": 53} in r.get("ports", []) for r in p["spec"].get("egress", []))]
    assert [p["spec"]["podSelector"] for p in dns] == [{}]
    pods = [pod_labels(o) for o in default_objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert all(_admits(list(policies.values()), "egress", labels, None, 53, "UDP") for labels in pods)


def test_the_evaluator_needs_both_ends_to_admit_a_pair():
    objects = rendered(SMALL)
    policies = by_kind(objects, "NetworkPolicy")
    policies["thermal"]["spec"]["ingress"][0]["from"][0]["podSelector"] = {
        "matchLabels": {"app.kubernetes.io/part-of": "hsched"}}  # thermal now admits every hsched pod ...
    assert allowed_pairs(objects) == intended(objects, False)  # ... but the selector's egress still denies
    policies["selector"]["spec"]["egress"].append({"to": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/component": "thermal"}}}], "ports": [{"protocol": "TCP", "port": THERMAL_PORT}]})
    assert allowed_pairs(objects) - intended(objects, False) == {("selector", "thermal", THERMAL_PORT)}


# -- secrets -------------------------------------------------------------------------------------------------

CREDENTIALS_IN_URL = re.compile(r"[a-z]+://[^/\s@]*@")


@pytest.mark.parametrize("options", [{}, {"redis_url_secret": "hsched-redis"}], ids=["in-cluster", "external"])
def test_no_secret_value_appears_in_any_manifest(options):
    objects = rendered(**options)
    text = k8s.to_stream(objects)
    assert not CREDENTIALS_IN_URL.search(text)
    assert not re.search(r"(?i)password|passwd", text)
    assert not [o for o in objects if o["kind"] == "Secret"]
    for w in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        assert all("valueFrom" not in e and "://" not in e.get("value", "") for e in container(w).get("env", []))


def test_an_external_redis_url_comes_from_the_secret_as_a_file():
    objects = rendered(redis_url_secret="hsched-redis", redis_port=6380)
    assert "StatefulSet" not in {o["kind"] for o in objects} and "redis" not in by_kind(objects, "Service")
    for w in by_kind(objects, "Deployment").values():
        c = container(w)
        assert "--redis-url" not in c["args"]
        path = flag(c["args"], "--redis-url-file")
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "hsched-redis"
        assert volume["secret"]["items"] == [{"key": "redis-url", "path": path.rsplit("/", 1)[1]}]
        assert mount["readOnly"] is True
    egress = by_kind(objects, "NetworkPolicy")["placer"]["spec"]["egress"]
    assert {"ports": [{"protocol": "TCP", "port": 6380}]} in egress


# -- bad input -----------------------------------------------------------------------------------------------


# the cluster's own namespaces: a default-deny policy there would cut CoreDNS or other workloads off
SHARED_NAMESPACES = ["default", "kube-system", "kube-public", "kube-node-lease", "kube-flannel"]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(["k8s", "render", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "flag_named"), [
    (["--namespace", "Sched_Prod"], "--namespace"),
    (["--namespace=-hsched"], "--namespace"),
    (["--namespace", "a" * 64], "--namespace"),
    *((["--namespace", shared], "--namespace") for shared in SHARED_NAMESPACES),
    (["--fleet", "/nonexistent/fleet.yaml"], "--fleet"),
    (["--redis-url-secret", "Redis URL"], "--redis-url-secret"),
    (["--redis-storage", "lots"], "--redis-storage"),
    *((["--redis-storage", zero], "--redis-storage") for zero in ("0", "0Gi", "0.0Mi")),  # the API refuses 0
    (["--redis-port", "70000", "--redis-url-secret", "r"], "--redis-port"),
    (["--redis-port", "6380"], "--redis-port"),  # the external Redis' port, without an external Redis
    (["--image", ""], "--image"),
    (["--nodes-to-score", "0"], "--nodes-to-score"),
    (["--dag-policy", "lifo"], "--dag-policy"),
    (["--tenant-weights", "a=-1"], "--tenant-weights"),
    (["--tenant-weights", "a"], "--tenant-weights"),
    (["--epoch", "a b"], "--epoch"),
])
def test_bad_input_is_one_line_naming_the_flag_exit_2_nothing_written(argv, flag_named, capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, out, err = run_cli([*argv, "-o", str(out_dir)], capsys)
    assert code == 2
    assert out == "" and len(err.strip().splitlines()) == 1 and flag_named in err, err
    assert "Traceback" not in err and not out_dir.exists()


def test_a_redis_port_needs_an_external_redis():
    with pytest.raises(ValidationError, match=r"^--redis-port: is the external Redis' port and needs "
                                              r"--redis-url-secret \(the in-cluster Redis listens on 6379\)"):
        k8s.Options(redis_port=6380).check()
    k8s.Options(redis_port=6379).check()  # what the in-cluster Redis listens on anyway
    k8s.Options(redis_port=6380, redis_url_secret="hsched-redis").check()


def test_redis_storage_is_a_positive_quantity():
    assert [k8s.quantity(q) for q in ("1Gi", "500Mi", "1.5G", "10", "0", "1e3", "1 Gi", "Gi")] == [
        1073741824, 524288000, 1500000000, 10, 0, None, None, None]
    with pytest.raises(ValidationError, match=r"^--redis-storage: must be a positive Kubernetes quantity"):
        k8s.Options(redis_storage="0").check()
    sts = by_kind(rendered(redis_storage="0.5Gi"), "StatefulSet")["redis"]
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"] == {"storage": "0.5Gi"}


def test_a_dc_name_kubernetes_cannot_use_is_one_line_naming_the_fleet(capsys, tmp_path):
    fleet = yaml.safe_load(SMALL.read_text())
    fleet["datacenters"][1]["name"] = "Near_DC"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    code, out, err = run_cli(["--fleet", str(path)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"--fleet {path}: datacenters[1].name" in err and "Near_DC" in err


def test_a_graph_the_image_does_not_ship_is_refused(tmp_path):
    fleet_text = default_fleet_path().read_text().replace("topology_zoo/graphml/Abilene.graphml", "mine.graphml")
    (tmp_path / "mine.graphml").write_text((k8s_data_dir() / "topology_zoo/graphml/Abilene.graphml").read_text())
    (tmp_path / "fleet.yaml").write_text(fleet_text)
    fleet = load_fleet(tmp_path / "fleet.yaml")  # loads here: the graph is next to the file
    with pytest.raises(ValidationError, match=r"--fleet: wan\.graphml: must name a graph of the data dir"):
        k8s.render(fleet, fleet_text, k8s.Options())


def k8s_data_dir() -> Path:
    from hsched.traces import data_dir

    return data_dir()


def test_a_policy_no_placer_knows_is_refused_by_the_library_too():
    with pytest.raises(ValidationError, match="^--gpu-policy: must be one of bestfit"):
        k8s.Options(gpu_policy="best-fit").check()
    k8s.Options(policy="fgd", gpu_policy="eade-ddpg").check()
    args = {flag(container(d)["args"], "--datacenter"): flag(container(d)["args"], "--policy")
            for n, d in by_kind(rendered(SMALL, policy="fgd", gpu_policy="eade-ddpg"), "Deployment").items()
            if n.startswith("placer-")}
    assert args == {"cheap": "fgd", "near": "fgd", "gpu": "eade-ddpg"}  # as `hsched up --gpu-policy` does


def test_a_shared_or_system_namespace_is_refused():
    for name in SHARED_NAMESPACES:
        with pytest.raises(ValidationError, match=r"^--namespace: must be a namespace of hsched's own, not "
                                                  r"default or kube-\*"):
            k8s.Options(namespace=name).check()
    for name in ("defaults", "my-default", "kube", "kubernetes", "hsched-kube-system"):  # only default, kube-*
        k8s.Options(namespace=name).check()


@given(st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z").filter(
    lambda s: s != "default" and not s.startswith("kube-")))
def test_every_other_rfc1123_label_is_accepted_as_a_namespace(name):
    k8s.Options(namespace=name).check()


@given(st.text(min_size=1, max_size=70).filter(
    lambda s: len(s) > 63 or s[0] == "-" or s[-1] == "-" or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789-"
                                                                for c in s)))
def test_anything_else_is_refused_as_a_namespace(name):
    with pytest.raises(ValidationError, match="^--namespace: must be an RFC 1123 label"):
        k8s.Options(namespace=name).check()


# -- output --------------------------------------------------------------------------------------------------


def test_the_stream_is_the_objects_in_apply_order_and_deterministic(default_objects, capsys):
    code, out, _ = run_cli([], capsys)
    assert code == 0
    assert [d for d in yaml.safe_load_all(out) if d] == default_objects
    assert run_cli([], capsys)[1] == out
    kinds = [o["kind"] for o in default_objects]
    assert kinds[0] == "Namespace" and kinds.index("NetworkPolicy") < kinds.index("Deployment")
    assert all(o["metadata"].get("namespace", "hsched") == "hsched" for o in default_objects)
    other = rendered(namespace="sched-prod")
    assert {o["metadata"].get("namespace") for o in other if o["kind"] != "Namespace"} == {"sched-prod"}


def test_a_directory_holds_one_file_per_component_and_a_kustomization(capsys, tmp_path):
    out_dir = tmp_path / "k8s"
    (tmp_path / "k8s").mkdir()
    (out_dir / "placer-gone.yaml").write_text(k8s.HEADER + "{}\n")  # an earlier render's DC, since removed
    (out_dir / "mine.yaml").write_text("# my own overlay\n")  # not ours: left alone
    code, _, _ = run_cli(["--fleet", str(SMALL), "-o", str(out_dir)], capsys)
    assert code == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == sorted(["kustomization.yaml", "mine.yaml", "namespace.yaml", "network-policies.yaml",
                            "fleet-configmap.yaml", "redis.yaml", "thermal.yaml", "selector.yaml", "gateway.yaml",
                            "placer-cheap.yaml", "placer-near.yaml", "placer-gpu.yaml"])
    kustomization = yaml.safe_load((out_dir / "kustomization.yaml").read_text())
    assert kustomization["resources"][0] == "namespace.yaml"
    assert sorted(kustomization["resources"]) == sorted(set(names) - {"kustomization.yaml", "mine.yaml"})
    objects = [d for f in kustomization["resources"] for d in yaml.safe_load_all((out_dir / f).read_text()) if d]
    def key(o):
        return o["kind"], o["metadata"]["name"]

    assert sorted(objects, key=key) == sorted(rendered(SMALL), key=key)


def test_deploy_k8s_is_what_the_generator_renders_for_the_default_fleet():
    expected = k8s.to_files(rendered())
    committed = {p.name: p.read_text() for p in COMMITTED.iterdir()}
    assert set(committed) == set(expected), "run: hsched k8s render -o deploy/k8s"
    for name, text in expected.items():
        assert committed[name] == text, f"deploy/k8s/{name} is stale: run hsched k8s render -o deploy/k8s"


# -- liveness vs readiness on a real server ------------------------------------------------------------------


async def test_a_not_serving_server_still_answers_liveness():
    server, port, health = await rpc.start_server(lambda s: None, ["hsched.v1.Placer"], "127.0.0.1:0", serving=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

            assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING  # a standby: not ready
            assert await status(rpc.LIVENESS) == health_pb2.HealthCheckResponse.SERVING  # but alive
            await rpc.set_health(health, ["hsched.v1.Placer"], True)  # it took the lease
            assert await status("") == health_pb2.HealthCheckResponse.SERVING
            await rpc.set_health(health, ["hsched.v1.Placer"], False)  # fenced
            assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await status(rpc.LIVENESS) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


def _health(target: str, service: str) -> int | None:
    try:
        with grpc.insecure_channel(target) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=2).status
    except grpc.RpcError:
        return None


def _wait_for(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.1)
    return value


def test_a_dcs_two_replicas_run_as_a_ready_holder_and_a_live_standby_that_takes_over(redis_url, prefix, tmp_path):
    """The placer Deployment's own command line, twice (its addresses mapped to this machine), probed as the
    manifest's probes ask: one replica ready, both alive; the holder killed, the standby becomes ready."""
    c = container(by_kind(rendered(SMALL), "Deployment")["placer-cheap"])
    ready_service = c["readinessProbe"]["grpc"].get("service", "")
    live_service = c["livenessProbe"]["grpc"]["service"]
    local = {"--listen": "127.0.0.1:0", "--redis-url": redis_url, "--fleet": str(SMALL), "--metrics-port": "-1"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in ("a", "b"):
            args = [local.get(prev, arg) for prev, arg in zip(["", *c["args"]], c["args"], strict=False)]
            args += ["--prefix", prefix, "--port-file", str(tmp_path / f"{name}.port")]
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen([sys.executable, "-m", "services.placer", *args], stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
        ports = {n: tmp_path / f"{n}.port" for n in procs}
        _wait_for(lambda: all(p.exists() for p in ports.values()), "both replicas listening")
        targets = {n: f"127.0.0.1:{p.read_text().strip()}" for n, p in ports.items()}
        serving = health_pb2.HealthCheckResponse.SERVING

        def ready() -> list[str]:
            return [n for n, t in targets.items() if _health(t, ready_service) == serving]

        (holder,) = _wait_for(ready, "one replica ready")
        time.sleep(1)  # the standby stays a standby while the holder renews
        assert ready() == [holder]
        assert all(_health(t, live_service) == serving for t in targets.values())  # both alive
        os.killpg(procs[holder].pid, signal.SIGKILL)
        procs[holder].wait(10)
        (standby,) = set(targets) - {holder}
        _wait_for(lambda: ready() == [standby], "the standby ready in the holder's place")
        assert _health(targets[standby], live_service) == serving
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
