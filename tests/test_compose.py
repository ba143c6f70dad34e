"""compose.yaml, Dockerfile and .dockerignore, checked without a Docker engine.

- compose.yaml is valid against the official Compose Specification schema (vendored, see
  tests/schemas/README.md), and the validator does reject a broken file;
- the topology is the one `hsched up` runs (src/hsched/stack.py): redis, thermal, selector, one placer per
  data center of the default fleet, gateway; every address a service is given names a service of the
  file and the port that service listens on; dependencies and health checks line up with those addresses;
- every `python -m services.X` exists and its real argument parser accepts the command line (the service's
  `main(argv)` runs with the process bootstrap `run` replaced by a recorder);
- the gRPC health probe used by the health checks answers 0 for SERVING and non-zero otherwise;
- (slow) the compose command lines, with container addresses mapped to loopback ports, start a working
  stack that places a task.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hsched.domain.fleet import load_fleet
from hsched.state.redis import free_port
from hsched.telemetry import EXPORTERS

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
SCHEMA = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"

HSCHED_SERVICES = {"gateway", "selector", "thermal", "placer"}  # the services/ packages
REDIS_URL = "redis://redis:6379/0"


# -- helpers -------------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose variable interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR:+alt}, $$)
    of every string value, as `docker compose` does it with the shell environment `env`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group("plain"):
            return env.get(m.group("plain"), "")
        b = _BRACED.match(m.group("braced"))
        if not b:
            raise ValueError(f"invalid interpolation {m.group(0)!r}")
        name, op, arg = b.group("name"), b.group("op"), b.group("arg") or ""
        val = env.get(name)
        if op == ":-":
            return val if val else arg
        if op == "-":
            return arg if val is None else val
        if op in (":?", "?"):
            if val is None or (op == ":?" and not val):
                raise ValueError(f"required variable {name} is unset: {arg}")
            return val
        if op == ":+":
            return arg if val else ""
        if op == "+":
            return "" if val is None else arg
        return val or ""

    return _VAR.sub(repl, value)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    with COMPOSE.open() as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose(raw) -> dict[str, Any]:
    """compose.yaml as `docker compose` sees it with none of its variables set (the defaults)."""
    return interpolate(raw, {})


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def fleet_dcs() -> list[str]:
    return [dc.name for dc in load_fleet().datacenters]


def module_of(svc: dict[str, Any]) -> str | None:
    """`services.X` for a service run as `python -m services.X ...`, else None."""
    cmd = svc.get("command")
    if isinstance(cmd, list) and cmd[:2] == ["python", "-m"] and len(cmd) > 2:
        return cmd[2]
    return None


def hsched_services(services) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services.items() if name != "redis"}


def flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, f"{name} must appear exactly once in {cmd}"
    return cmd[cmd.index(name) + 1]


def listen_port(svc: dict[str, Any]) -> int:
    host, _, port = flag(svc["command"], "--listen").rpartition(":")
    assert host == "0.0.0.0", "a service in a container must listen on 0.0.0.0 to be reachable"
    assert port.isdigit() and int(port) > 0, "fixed gRPC ports: other services are configured with them"
    return int(port)


def container_env(svc: dict[str, Any]) -> dict[str, str]:
    """The service's `environment:` (map form); a key without a value passes the shell's through, or nothing."""
    env = svc.get("environment") or {}
    assert isinstance(env, dict), "environment: in map form"
    return {k: str(v) for k, v in env.items() if v is not None}


def parse_command(svc_name: str, svc: dict[str, Any], monkeypatch, capsys) -> argparse.Namespace:
    """Run the service's real `main(argv)` with the compose environment; capture the parsed arguments
    instead of starting the server."""
    module = module_of(svc)
    server = importlib.import_module(f"{module}.server")
    for key in os.environ:  # the container sees the compose environment, not this shell's HSCHED_*
        if key.startswith("HSCHED_"):
            monkeypatch.delenv(key)
    for key, value in container_env(svc).items():
        monkeypatch.setenv(key, value)
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(server, "run", lambda name, args, serve: seen.append(args))
    try:
        server.main(svc["command"][3:])
    except SystemExit as exc:
        pytest.fail(f"{svc_name}: {module} rejects its compose command line (exit {exc.code}):\n"
                    f"{capsys.readouterr().err}")
    assert len(seen) == 1, f"{module}.server.main did not reach run()"
    return seen[0]


# -- the schema ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator():
    schema = yaml.safe_load(SCHEMA.read_text())  # JSON is YAML
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def schema_errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def test_compose_file_is_valid_against_the_compose_specification(validator, raw, compose):
    assert schema_errors(validator, raw) == []
    assert schema_errors(validator, compose) == []  # and after interpolation (ports, numbers)
    assert "version" not in raw, "the Compose Specification has no version: key (obsolete)"


@pytest.mark.parametrize("breakage", [
    ("unknown service key", lambda d: d["services"]["gateway"].update(listen="0.0.0.0:50051")),
    ("misspelt depends_on condition", lambda d: d["services"]["gateway"].update(
        depends_on={"redis": {"condition": "service_ready"}})),
    ("command not a string or list", lambda d: d["services"]["selector"].update(command={"python": "-m"})),
    ("healthcheck retries not a number", lambda d: d["services"]["redis"]["healthcheck"].update(retries=[3])),
    ("unknown top-level key", lambda d: d.update(service={})),
], ids=lambda b: b[0])
def test_the_schema_check_rejects_a_broken_file(validator, raw, breakage):
    broken = copy.deepcopy(raw)
    breakage[1](broken)
    assert schema_errors(validator, broken), f"{breakage[0]} was not detected"


def test_no_variable_is_required(raw):
    interpolate(raw, {})  # raises on ${VAR:?...} or a malformed ${...}: `docker compose up` must just work


def test_environment_is_overridable_from_the_shell(raw):
    default = interpolate(raw, {})["services"]
    custom = interpolate(raw, {"HSCHED_TRACES": "otlp", "HSCHED_PLACER_POLICY": "firstfit"})["services"]
    for name, svc in hsched_services(default).items():
        assert svc["environment"]["HSCHED_TRACES"] == "none", name
        assert svc["environment"]["HSCHED_TRACES"] in EXPORTERS
        assert custom[name]["environment"]["HSCHED_TRACES"] == "otlp", name
    assert "firstfit" in custom["placer-denver"]["command"]


# -- topology ------------------------------------------------------------------------------------------------


def test_services_are_redis_thermal_selector_gateway_and_one_placer_per_fleet_dc(services, fleet_dcs):
    assert set(services) == {"redis", "thermal", "selector", "gateway", *(f"placer-{dc}" for dc in fleet_dcs)}
    assert len(fleet_dcs) == 11  # the default fleet the file is written for


def test_redis_is_the_official_image_persisting_to_a_named_volume(raw, compose, services):
    redis = services["redis"]
    assert redis["image"] == "redis:7-alpine"
    cmd = redis["command"]
    assert cmd[0] == "redis-server" and flag(cmd, "--save") == "" and flag(cmd, "--appendonly") == "yes"
    assert flag(cmd, "--appendfsync") == "everysec" and flag(cmd, "--dir") == "/data"
    volume, _, target = redis["volumes"][0].partition(":")
    assert target == "/data" and volume in compose["volumes"], "the AOF must live on a named volume"
    always = interpolate(raw, {"HSCHED_REDIS_APPENDFSYNC": "always"})["services"]["redis"]["command"]
    assert flag(always, "--appendfsync") == "always"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_every_hsched_service_runs_an_existing_module_of_the_one_image(services):
    images = set()
    for name, svc in hsched_services(services).items():
        module = module_of(svc)
        assert module, f"{name}: command must be an exec-form list 'python -m services.X ...'"
        assert module.removeprefix("services.") in HSCHED_SERVICES, f"{name}: unknown module {module}"
        assert importlib.util.find_spec(module) is not None, f"{name}: {module} not found"
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: {module} has no __main__"
        expected = "services.placer" if name.startswith("placer-") else f"services.{name}"
        assert module == expected, name
        images.add(svc["image"])
        assert svc["build"]["context"] == "." and (ROOT / svc["build"].get("dockerfile", "Dockerfile")).is_file()
    assert images == {"hsched:latest"}, "one image for every hsched service"


def test_every_command_line_is_accepted_by_the_service_parser(services, fleet_dcs, monkeypatch, capsys):
    ports = {name: listen_port(svc) for name, svc in hsched_services(services).items()}
    assert len(set(ports.values())) == len(ports), f"gRPC ports must be distinct: {ports}"
    metrics = {}
    for name, svc in hsched_services(services).items():
        args = parse_command(name, svc, monkeypatch, capsys)
        assert args.listen == f"0.0.0.0:{ports[name]}"
        assert args.redis_url == REDIS_URL, name
        assert args.fleet is None, f"{name}: the file is written for the default fleet"
        assert args.traces in EXPORTERS
        assert 9100 <= args.metrics_port <= 9199, f"{name}: fixed metrics port expected"
        metrics[name] = args.metrics_port
        if name.startswith("placer-"):
            assert args.datacenter == name.removeprefix("placer-"), name
            assert args.thermal == f"thermal:{ports['thermal']}", name
        if name == "gateway":
            assert args.selector == f"selector:{ports['selector']}"
            pairs = [p.split("=", 1) for p in args.placers.split(",")]
            assert [dc for dc, _ in pairs] == fleet_dcs, "--placers must name every DC of the fleet, once"
            assert dict(pairs) == {dc: f"placer-{dc}:{ports[f'placer-{dc}']}" for dc in fleet_dcs}
    assert len(set(metrics.values())) == len(metrics), f"metrics ports must be distinct: {metrics}"


def test_a_wrong_flag_is_caught_by_the_parser_check(services, monkeypatch, capsys):
    svc = copy.deepcopy(services["placer-denver"])
    svc["command"] += ["--datacentre", "denver"]
    with pytest.raises(pytest.fail.Exception, match="rejects its compose command line"):
        parse_command("placer-denver", svc, monkeypatch, capsys)


def _references(svc: dict[str, Any], names: set[str]) -> set[str]:
    """Services a command line addresses (redis://redis:6379, thermal:50060, dc=placer-dc:50061, …)."""
    text = " ".join(svc.get("command") or [])
    return {m.group(1) for m in re.finditer(r"(?:^|[\s=,/@])([a-z0-9._-]+):\d+", text)} & names


def test_depends_on_names_existing_services_and_every_service_a_command_addresses(services):
    names = set(services)
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        assert set(deps) <= names, f"{name} depends on unknown services {set(deps) - names}"
        assert _references(svc, names) <= set(deps), f"{name} addresses services it does not depend on"
        for dep, spec in deps.items():
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy: it has no check"
    # no cycles: a topological order exists
    order = _start_order(services)
    assert order[0] == "redis" and order[-1] == "gateway"


def _start_order(services) -> list[str]:
    done: list[str] = []
    pending = dict(services)
    while pending:
        ready = sorted(n for n, s in pending.items() if set(s.get("depends_on") or {}) <= set(done))
        assert ready, f"depends_on cycle among {sorted(pending)}"
        done += ready
        for n in ready:
            del pending[n]
    return done


def test_health_checks_probe_the_port_each_service_listens_on(services):
    for name, svc in hsched_services(services).items():
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], name
        compile(test[3], f"{name} healthcheck", "exec")
        assert test[4] == f"127.0.0.1:{listen_port(svc)}", name
        assert test[5] == ("placer" if name.startswith("placer-") else name), f"{name}: the probe's certificate"


def test_every_service_is_restarted_when_it_exits(services):
    # Docker restarts on exit only (never on unhealthy): a placer fenced for good exits to be restarted
    for name, svc in services.items():
        assert svc.get("restart") in ("always", "unless-stopped"), name


def _published(svc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host ip, host port, container port) of each short-syntax `ports:` entry; host ip "" = every interface
    (Docker's default when the entry names no address)."""
    out = []
    for mapping in svc.get("ports") or []:
        assert isinstance(mapping, str), "ports in short syntax (HOST_IP:HOST_PORT:CONTAINER_PORT)"
        parts = str(mapping).split(":")
        out.append((("", *parts) if len(parts) == 2 else tuple(parts))[-3:])
    return out


def exposure_problems(compose: dict[str, Any]) -> list[str]:
    """What breaks the exposure rule (docs/security.md): the gateway's gRPC port is the only published port, on
    127.0.0.1 unless HSCHED_GATEWAY_BIND is set; every other service (Redis included) and every /metrics and
    health endpoint is on the `internal: true` network only."""
    problems = []
    services = compose["services"]
    networks = compose.get("networks") or {}
    if (networks.get("internal") or {}).get("internal") is not True:
        problems.append("the network `internal` must exist with `internal: true`")
    routed = {n for n, spec in networks.items() if not (spec or {}).get("internal")} | {"default"}
    for name, svc in services.items():
        if "network_mode" in svc:
            problems.append(f"{name}: network_mode bypasses the compose networks")
        joined = set(svc.get("networks") or ["default"])  # no networks: key = the project's default network
        if "internal" not in joined:
            problems.append(f"{name}: not on the internal network")
        if name != "gateway" and joined != {"internal"}:
            problems.append(f"{name}: on {sorted(joined - {'internal'})} besides the internal network")
        if name != "gateway" and (svc.get("ports") or svc.get("expose")):
            problems.append(f"{name}: publishes ports")
    gateway = services["gateway"]
    if not set(gateway.get("networks") or ["default"]) & routed:
        problems.append("gateway: its published port needs a network with a route out")
    published = _published(gateway)
    if [(ip, c) for ip, _, c in published] != [("127.0.0.1", str(listen_port(gateway)))]:
        problems.append(f"gateway: publish the gRPC port once, on 127.0.0.1 by default, not {published}")
    return problems


def test_only_the_gateway_is_published_and_only_on_loopback_by_default(raw, compose):
    assert exposure_problems(compose) == []
    services = compose["services"]
    metrics = {flag(svc["command"], "--metrics-port") for svc in hsched_services(services).values()}
    assert not metrics & {c for _, _, c in _published(services["gateway"])}, "/metrics is never published"
    everywhere = interpolate(raw, {"HSCHED_GATEWAY_BIND": "0.0.0.0", "HSCHED_GATEWAY_PORT": "8443"})["services"]
    assert _published(everywhere["gateway"]) == [("0.0.0.0", "8443", "50051")]


@pytest.mark.parametrize("breakage", [
    ("redis published", lambda d: d["services"]["redis"].update(ports=["127.0.0.1:6379:6379"])),
    ("gateway on every interface", lambda d: d["services"]["gateway"].update(ports=["0.0.0.0:50051:50051"])),
    ("gateway without an address", lambda d: d["services"]["gateway"].update(ports=["50051:50051"])),
    ("gateway metrics published", lambda d: d["services"]["gateway"]["ports"].append("127.0.0.1:9100:9100")),
    ("placer on the routed network", lambda d: d["services"]["placer-denver"].update(networks=["internal", "edge"])),
    ("selector on the default network", lambda d: d["services"]["selector"].pop("networks")),
    ("thermal on the host network", lambda d: d["services"]["thermal"].update(network_mode="host")),
    ("internal network routed", lambda d: d["networks"]["internal"].pop("internal")),
], ids=lambda b: b[0])
def test_the_exposure_check_catches(compose, breakage):
    broken = copy.deepcopy(compose)
    breakage[1](broken)
    assert exposure_problems(broken), f"{breakage[0]} was not detected"


@pytest.fixture(scope="module")
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def test_health_probe_exits_0_only_when_serving(services, health_server):
    servicer, port = health_server
    test = services["gateway"]["healthcheck"]["test"]

    assert test[5] == "gateway"

    def probe(target: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "HSCHED_TLS_DIR"}
        return subprocess.run([sys.executable, "-c", test[3], target, "gateway"], capture_output=True, timeout=30,
                              env=env).returncode

    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe(f"127.0.0.1:{port}") == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert probe(f"127.0.0.1:{port}") != 0
    assert probe(f"127.0.0.1:{free_port()}") != 0  # nothing listening


# -- Dockerfile / .dockerignore ------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_builds_one_slim_non_root_image_with_the_data():
    ins = _instructions()
    froms = [rest for op, rest in ins if op == "FROM"]
    assert froms and all(f.split()[0] == "python:3.11-slim" for f in froms)
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    users = [rest for op, rest in final if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the runtime stage must run as a non-root user"
    env = " ".join(rest for op, rest in final if op == "ENV")
    data = re.search(r"HSCHED_DATA=(\S+)", env)
    assert data, "HSCHED_DATA must point at the copied data/ (hsched.traces.data_dir)"
    assert any(op == "COPY" and rest.split()[0] == "data/" and rest.split()[-1].rstrip("/") == data.group(1)
               for op, rest in final)
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    assert re.search(r"pip (install|wheel)\b.*\s\.(\s|$)", runs), "the project is installed with pip from ."
    assert "hsched" in " ".join(rest for op, rest in final if op == "RUN")
    models = re.search(r"HSCHED_MODELS_DIR=(\S+)", env)
    assert models, "HSCHED_MODELS_DIR must point at the copied models/ (hsched.rl.checkpoint.models_dir)"
    assert any(op == "COPY" and rest.split()[0] == "models/" and rest.split()[-1].rstrip("/") == models.group(1)
               for op, rest in final)
    # torch comes from PyTorch's CPU index: PyPI's Linux wheel is a multi-GB CUDA build
    assert "download.pytorch.org/whl/cpu" in " ".join(rest for op, rest in ins if op == "ENV")


def _glob(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over a slash-separated path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics: the last pattern matching the path or one of its parent folders wins; a
    pattern starting with `!` re-includes."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        rx = _glob(os.path.normpath(pat.removeprefix("!").strip()).lstrip("/"))
        if any(rx.match(c) for c in candidates):
            ignored = not neg
    return ignored


def test_dockerignore_keeps_what_the_build_copies_and_drops_the_rest():
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    for op, rest in _instructions():
        if op == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert not _dockerignored(src.rstrip("/"), patterns), f"{src} is copied but .dockerignore'd"
    for kept in ["src/hsched/__init__.py", "services/gateway/server.py", "data/README.md", "pyproject.toml"]:
        assert not _dockerignored(kept, patterns), kept
    for dropped in [".git/HEAD", "tests/test_compose.py", "src/hsched/__pycache__/x.pyc", ".venv/bin/python"]:
        assert _dockerignored(dropped, patterns), dropped


# -- the real thing, without Docker --------------------------------------------------------------------------


@pytest.mark.slow
def test_compose_command_lines_start_a_stack_that_places_a_task(services, fleet_dcs, redis_url, tmp_path):
    """Every service started with its compose command line, container addresses mapped to loopback
    ports, in depends_on order, each waited for with its own compose health check."""
    from hsched.v1 import common_pb2 as pb
    from hsched.v1 import gateway_pb2, gateway_pb2_grpc

    apps = hsched_services(services)
    local = {name: free_port() for name in apps}
    names = "|".join(sorted(map(re.escape, apps), key=len, reverse=True))
    prefix = f"test-compose-{uuid.uuid4().hex[:8]}"

    def localize(name: str, svc: dict[str, Any]) -> list[str]:
        argv = list(svc["command"])
        argv[argv.index("--listen") + 1] = f"127.0.0.1:{local[name]}"
        argv[argv.index("--metrics-port") + 1] = str(free_port())
        argv[argv.index("--redis-url") + 1] = redis_url
        argv = [re.sub(rf"(^|[=,])({names}):\d+", lambda m: f"{m.group(1)}127.0.0.1:{local[m.group(2)]}", a)
                for a in argv]
        return [sys.executable, *argv[1:], "--prefix", prefix]

    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in [n for n in _start_order(services) if n in apps]:
            env = {**os.environ, **container_env(apps[name])}
            log = (tmp_path / f"{name}.log").open("wb")
            procs[name] = subprocess.Popen(localize(name, apps[name]), stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)
        probe = services["gateway"]["healthcheck"]["test"][3]
        for name in [n for n in _start_order(services) if n in apps]:
            deadline = time.monotonic() + 120
            while subprocess.run([sys.executable, "-c", probe, f"127.0.0.1:{local[name]}"],
                                 capture_output=True).returncode != 0:
                if procs[name].poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{name} did not become healthy:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")
                time.sleep(0.5)
        with grpc.insecure_channel(f"127.0.0.1:{local['gateway']}") as ch:
            gw = gateway_pb2_grpc.GatewayStub(ch)
            spec = pb.TaskSpec(resources=pb.Resources(cpu_milli=2000, memory_mib=4096), runtime_s=600)
            task = gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30).task
            assert task.state == pb.TASK_STATE_PLACED, task.reason
            assert task.datacenter in fleet_dcs
            assert gw.Release(gateway_pb2.ReleaseRequest(task_id=task.task_id), timeout=30).task.state == \
                pb.TASK_STATE_RELEASED
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        from tests.conftest import delete_prefix

        delete_prefix(redis_url, prefix)
