"""deploy/ and docker/compose.yaml: no cluster runs here, so every file is parsed (YAML, `bash -n`,
shellcheck when installed), every `recycle ...` command line in them goes through the project's own
parsers (the `recycle` command's and runtime_adapter.agent_cli's `add_agent_parser`), the Kubernetes
manifests are checked for consistency (selectors, ports, volumes, config references), and the shell
that computes each host's workers is run for every host with a stand-in `recycle` that records its
command line: together the hosts must run every worker of the job exactly once."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import pytest
import yaml

from tests.jobs import service_job_doc

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "deploy" / "slurm"
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "docker" / "compose.yaml"
SHELLCHECK = shutil.which("shellcheck")
JOB_ID, WORKER_TOKEN = "job-0123", "worker-token-xyz"

Worker = tuple[int, int]


# --- the project's parsers ------------------------------------------------------------------------


def subcommand_parser(add: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add(parser.add_subparsers(dest="command", required=True))
    return parser


def parse_recycle(argv: list[str]) -> argparse.Namespace:
    """`recycle SUB ...` through the `recycle` command's parser; an agent line also through
    runtime_adapter.agent_cli's add_agent_parser alone."""
    from recycle_cli import build_parser

    assert argv[0] == "recycle", argv
    try:
        args = build_parser().parse_args(argv[1:])
        if argv[1] == "agent":
            from runtime_adapter.agent_cli import add_agent_parser

            args = subcommand_parser(add_agent_parser).parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"`{shlex.join(argv)}` does not parse (exit {exc.code}; usage above)") from None
    return args


def workers_of(args: argparse.Namespace) -> list[Worker]:
    """The agent's --workers "d,s;d,s" as a list."""
    out = []
    for item in args.workers.split(";"):
        d, s = item.split(",")
        out.append((int(d), int(s)))
    return out


def grid(D: int, P: int) -> set[Worker]:
    return {(d, s) for d in range(D) for s in range(P)}


def assert_every_worker_once(per_host: list[list[Worker]], D: int, P: int) -> None:
    flat = [w for ws in per_host for w in ws]
    assert len(flat) == len(set(flat)), f"a worker runs on two hosts: {per_host}"
    assert set(flat) == grid(D, P), f"hosts {per_host} do not cover the {D} x {P} grid"


def fake_bin(tmp: Path) -> tuple[Path, Path]:
    """A directory with a `recycle` that records its argv (one JSON line each) and a `sleep` that returns."""
    bindir, log = tmp / "bin", tmp / "recycle.calls"
    bindir.mkdir()
    (bindir / "recycle").write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    (bindir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    return bindir, log


def calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [["recycle", *json.loads(line)] for line in log.read_text().splitlines()]


def shellcheck(path: Path, shell: str = "bash") -> None:
    if SHELLCHECK is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    r = subprocess.run([SHELLCHECK, "-s", shell, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# --- Slurm ----------------------------------------------------------------------------------------


SCRIPTS = [SLURM / "recycle.sbatch", SLURM / "recycle-node.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_slurm_scripts_parse(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_slurm_scripts_shellcheck(script: Path) -> None:
    shellcheck(script)


def test_sbatch_directives() -> None:
    text = (SLURM / "recycle.sbatch").read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
    assert "--ntasks-per-node=1" in directives and "--no-kill" in directives, directives


class FakeService(BaseHTTPRequestHandler):
    """/readyz and POST /v1/jobs, as the service answers them; records what it was sent."""

    posts: ClassVar[list[tuple[dict[str, str], dict[str, Any]]]] = []

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/readyz" else 404, {"ready": True})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeService.posts.append((dict(self.headers), body))
        self._answer(201, {"id": JOB_ID, "worker_token": WORKER_TOKEN, "version": 1, "state": "running"})

    def _answer(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_service() -> Iterator[int]:
    FakeService.posts = []
    server = ThreadingHTTPServer(("0.0.0.0", 0), FakeService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_store() -> Iterator[int]:
    with socket.create_server(("0.0.0.0", 0)) as sock:
        yield sock.getsockname()[1]


def run_sbatch(
    tmp: Path, nodes: int, env: dict[str, str], job: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """recycle.sbatch as Slurm would run it on the first node, with an `srun` that runs its command
    once per node (SLURM_NODEID 0..nodes-1) and records its options, and the recording `recycle`."""
    bindir, _ = fake_bin(tmp)
    (bindir / "srun").write_text(
        "#!/bin/sh\n"
        f'while [ $# -gt 0 ]; do case $1 in -*) echo "$1" >> {tmp}/srun.opts; shift;; *) break;; esac; done\n'
        'n=0; while [ "$n" -lt "$SLURM_NNODES" ]; do SLURM_NODEID=$n "$@" || exit $?; n=$((n + 1)); done\n'
    )
    (bindir / "srun").chmod(0o755)
    (bindir / "sleep").unlink()  # the real one: the service and store loops may sleep
    spec = tmp / "job.json"
    spec.write_text(json.dumps(job))
    full_env = {
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "HOME": str(tmp),
        "SLURM_JOB_ID": "777",
        "SLURM_NNODES": str(nodes),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SHARED_DIR": str(tmp / "shared"),
        "TMPDIR": str(tmp),
        "PYTHON": sys.executable,
        "RECYCLE_CONTROLLER_TOKEN": "controller-secret",
        **env,
    }
    cmd = ["bash", str(SLURM / "recycle.sbatch"), str(spec)]
    return subprocess.run(cmd, env=full_env, cwd=tmp, capture_output=True, text=True, timeout=90)


def check_agents(agents: list[list[str]], D: int, P: int, per_node: int) -> list[argparse.Namespace]:
    parsed = [parse_recycle(argv) for argv in agents]
    for n, args in enumerate(parsed):
        expect = [divmod(n * per_node + i, P) for i in range(per_node)]
        assert workers_of(args) == expect, f"node {n}: pipeline-major layout expected"
        assert (args.job_id, args.token) == (JOB_ID, WORKER_TOKEN)
        assert args.device == "auto" and args.backend == "auto"
    assert_every_worker_once([workers_of(a) for a in parsed], D, P)
    return parsed


def test_sbatch_starts_service_store_and_one_agent_per_node(
    tmp_path: Path, fake_service: int, fake_store: int
) -> None:
    """Service and store started on the first node, the job registered there, three agents."""
    job = service_job_doc(3, 2, 2)
    env = {"SERVICE_PORT": str(fake_service), "STORE_PORT": str(fake_store), "WORKERS_PER_NODE": "2",
           "ITERATIONS": "30", "CHECKPOINT_EVERY": "5"}  # fmt: skip
    r = run_sbatch(tmp_path, 3, env, job)
    assert r.returncode == 0, r.stdout + r.stderr
    got = calls(tmp_path / "recycle.calls")
    by_command = {argv[1] for argv in got}
    assert by_command == {"serve", "store", "agent"}, got
    # every subcommand the Slurm files name ran here, so every one was parsed below
    named = set(re.findall(r"^\s*(?:exec\s+|keep_running\s+)?recycle (\w+)", "".join(
        p.read_text() for p in SCRIPTS), re.M))  # fmt: skip
    assert named == by_command
    serve = parse_recycle(next(a for a in got if a[1] == "serve"))
    store = parse_recycle(next(a for a in got if a[1] == "store"))
    assert (serve.port, store.port) == (fake_service, fake_store)
    agents = check_agents([a for a in got if a[1] == "agent"], 3, 2, 2)
    head = socket.gethostname()
    for args in agents:
        assert args.service == f"http://{head}:{fake_service}" and args.store == f"{head}:{fake_store}"
        assert args.checkpoint_dir == str(tmp_path / "shared" / "777" / "checkpoints")
        assert (int(args.iterations), int(args.checkpoint_every)) == (30, 5)
    (headers, body), *more = FakeService.posts
    assert not more and body["job"] == job and body["max_failures"] == 2
    assert headers["Authorization"] == "Bearer controller-secret"
    opts = (tmp_path / "srun.opts").read_text().split()
    assert {"--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0"} <= set(opts), opts


def test_sbatch_with_external_service_and_store(tmp_path: Path, fake_service: int, fake_store: int) -> None:
    """SERVICE_URL and STORE given: nothing started but the agents (4 nodes x 1 worker, D=2 x P=2)."""
    env = {"SERVICE_URL": f"http://127.0.0.1:{fake_service}", "STORE": f"127.0.0.1:{fake_store}",
           "WORKERS_PER_NODE": "1", "ENTRY": "examples.hf_gpt2:training", "MODEL": '{"n": 2}'}  # fmt: skip
    r = run_sbatch(tmp_path, 4, env, service_job_doc(2, 2, 2))
    assert r.returncode == 0, r.stdout + r.stderr
    got = calls(tmp_path / "recycle.calls")
    assert [a[1] for a in got] == ["agent"] * 4
    for args in check_agents(got, 2, 2, 1):
        assert args.service == env["SERVICE_URL"] and args.store == env["STORE"]
        assert (args.entry, args.model) == (env["ENTRY"], env["MODEL"])


def test_sbatch_refuses_a_job_that_does_not_fit_the_allocation(tmp_path: Path) -> None:
    r = run_sbatch(tmp_path, 2, {"WORKERS_PER_NODE": "2"}, service_job_doc(3, 2, 2))
    assert r.returncode == 2 and "3 x 2 workers, the allocation 2 nodes x 2" in r.stderr, r.stderr
    assert calls(tmp_path / "recycle.calls") == [] and not (tmp_path / "srun.opts").exists()


# --- Kubernetes -----------------------------------------------------------------------------------


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in objects, f"{path.name}: {key} defined twice"
                objects[key] = doc
    return objects


def workloads(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> pod template of every Deployment, StatefulSet and Job."""
    return {name: doc["spec"]["template"] for (kind, name), doc in objects.items()
            if kind in ("Deployment", "StatefulSet", "Job")}  # fmt: skip


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == present
    images = {i["name"] for i in kust["images"]}
    used = {c["image"] for t in workloads(k8s_objects()).values() for c in t["spec"]["containers"]}
    assert used <= images, used - images


def test_k8s_references_resolve() -> None:
    """Selectors match pod labels; every mounted volume, claim, ConfigMap, Secret and key exists."""
    objects = k8s_objects()
    for (kind, name), doc in objects.items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        template = doc["spec"]["template"]
        labels, pod = template["metadata"]["labels"], template["spec"]
        if kind != "Job":
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in objects, name
            if "configMap" in v:
                cm = objects[("ConfigMap", v["configMap"]["name"])]
                for item in v["configMap"].get("items", []):
                    assert item["key"] in cm["data"], (name, item)
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name}/{c['name']}: mounts undeclared volume {m['name']}"
            for ref in c.get("envFrom", []):
                kind_ref = "ConfigMap" if "configMapRef" in ref else "Secret"
                assert (kind_ref, next(iter(ref.values()))["name"]) in objects, (name, ref)
            for e in c.get("env", []):
                src = e.get("valueFrom", {})
                for key, kind_ref, field in (("configMapKeyRef", "ConfigMap", "data"),
                                             ("secretKeyRef", "Secret", "stringData")):  # fmt: skip
                    if key in src:
                        target = objects[(kind_ref, src[key]["name"])]
                        assert src[key]["key"] in target[field], (name, e)


def container_port(pod: dict[str, Any], target: int | str) -> int:
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            if target in (p.get("name"), p["containerPort"]):
                return int(p["containerPort"])
    raise AssertionError(f"no container port {target!r}")


def service_addresses() -> dict[str, int]:
    """Service name -> port, checked: its selector picks exactly one workload, its targetPort is that
    workload's container port and the `recycle` command there listens on it (--port)."""
    objects = k8s_objects()
    out = {}
    for (kind, name), svc in objects.items():
        if kind != "Service":
            continue
        picked = [w for w, t in workloads(objects).items()
                  if svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()]  # fmt: skip
        assert len(picked) == 1, f"Service {name} selects {picked}"
        template = workloads(objects)[picked[0]]
        if svc["spec"].get("clusterIP") == "None":
            continue  # headless: the StatefulSet's names only
        (port,) = svc["spec"]["ports"]
        listening = container_port(template, port["targetPort"])
        (container,) = template["spec"]["containers"]
        args = parse_recycle(container["command"])
        assert args.port == listening, f"{name}: the container listens on {args.port}, not {listening}"
        out[name] = int(port["port"])
    return out


def test_k8s_services_reach_the_listening_ports() -> None:
    assert set(service_addresses()) == {"recycle-service", "recycle-store"}


def test_k8s_service_config_and_database_url() -> None:
    objects = k8s_objects()
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert secret["metadata"]["name"] == "recycle-secrets"
    assert {"RECYCLE_CONTROLLER_TOKEN", "RECYCLE_DATABASE_URL"} <= set(secret["stringData"])
    (service,) = workloads(objects)["recycle-service"]["spec"]["containers"]
    refs = {next(iter(r.values()))["name"] for r in service["envFrom"]}
    assert refs == {"recycle-service-config", "recycle-secrets"}
    args = parse_recycle(service["command"])
    assert args.data_dir == objects[("ConfigMap", "recycle-service-config")]["data"]["RECYCLE_DATA_DIR"]
    assert objects[("Deployment", "recycle-service")]["spec"]["replicas"] == 1
    register = workloads(objects)["recycle-register"]["spec"]["containers"][0]["command"]
    assert register[:2] == ["python", "docker/register_job.py"] and (ROOT / register[1]).is_file()
    url = urlsplit(register[2])
    assert service_addresses()[str(url.hostname)] == url.port


def test_k8s_agents_one_per_host_with_gpus_and_shared_volume() -> None:
    objects = k8s_objects()
    sts = objects[("StatefulSet", "recycle-agent")]
    assert objects[("Service", sts["spec"]["serviceName"])]["spec"]["clusterIP"] == "None"
    pod = sts["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    run = objects[("ConfigMap", "recycle-run")]["data"]
    job = json.loads(run["job.json"])
    per_host = int(run["WORKERS_PER_HOST"])
    assert sts["spec"]["replicas"] * per_host == job["num_pipelines"] * job["num_stages"]
    assert int(run["NUM_STAGES"]) == job["num_stages"]
    (agent,) = pod["spec"]["containers"]
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == per_host
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    assert objects[("PersistentVolumeClaim", claims["shared"])]["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert mounts["/shared"] == "shared"


def agent_script(tmp: Path) -> Path:
    script = tmp / "agent.sh"
    script.write_text(k8s_objects()[("ConfigMap", "recycle-agent-script")]["data"]["agent.sh"])
    return script


def test_k8s_agent_script_shellcheck(tmp_path: Path) -> None:
    shellcheck(agent_script(tmp_path), shell="sh")


def test_k8s_agent_script_runs_every_worker_once(tmp_path: Path) -> None:
    """The agent container's script, run for every StatefulSet ordinal with the env the manifest gives."""
    objects = k8s_objects()
    sts = objects[("StatefulSet", "recycle-agent")]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["sh", "/etc/recycle/agent.sh"]
    script, (bindir, log) = agent_script(tmp_path), fake_bin(tmp_path)
    job_env = tmp_path / "job.env"
    job_env.write_text(f"RECYCLE_JOB_ID={JOB_ID}\nRECYCLE_WORKER_TOKEN={WORKER_TOKEN}\n")
    run = objects[("ConfigMap", "recycle-run")]["data"]
    job = json.loads(run["job.json"])
    for n in range(sts["spec"]["replicas"]):
        env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
        for e in container["env"]:
            src = e.get("valueFrom", {})
            if "configMapKeyRef" in src:
                env[e["name"]] = run[src["configMapKeyRef"]["key"]]
            elif "fieldRef" in src:
                assert src["fieldRef"]["fieldPath"] == "metadata.name"
                env[e["name"]] = f"{sts['metadata']['name']}-{n}"
            else:
                env[e["name"]] = e["value"]
        env["JOB_ENV"] = str(job_env)
        r = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stdout + r.stderr
    agents = [parse_recycle(argv) for argv in calls(log)]
    assert len(agents) == sts["spec"]["replicas"]
    addresses = service_addresses()
    for n, args in enumerate(agents):
        assert workers_of(args) == [divmod(n * int(run["WORKERS_PER_HOST"]) + i, job["num_stages"])
                                    for i in range(int(run["WORKERS_PER_HOST"]))]  # fmt: skip
        url = urlsplit(args.service)
        assert addresses[str(url.hostname)] == url.port
        host, port = args.store.rsplit(":", 1)
        assert addresses[host] == int(port)
        assert (args.job_id, args.token, args.device) == (JOB_ID, WORKER_TOKEN, "auto")
        assert args.checkpoint_dir.startswith("/shared/")
    assert_every_worker_once([workers_of(a) for a in agents], job["num_pipelines"], job["num_stages"])


# --- Docker Compose -------------------------------------------------------------------------------


def compose_expand(line: str, env: dict[str, str]) -> str:
    """Compose-escaped shell variables ($${X}, $${X:-default}) replaced by `env` values or defaults."""
    return re.sub(r"\$\$\{(\w+)(:-(\w+))?\}", lambda m: env.get(m.group(1), m.group(3) or "x"), line)


def compose_replicas(services: dict[str, Any], host: str) -> dict[str, Any]:
    """The services a container reaches as `host`: the one named so, or those with that network alias."""
    return {
        name: svc
        for name, svc in services.items()
        if name == host or host in (svc.get("networks") or {}).get("default", {}).get("aliases", [])
    }


def test_compose_one_agent_per_host_container() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    hosts = {n: s for n, s in services.items() if n.startswith("host-")}
    assert len(hosts) >= 2
    job = json.loads((ROOT / "docker" / "tiny-d2p2.json").read_text())
    register = services["register"]["command"]
    assert register[3] == "docker/tiny-d2p2.json"
    per_host = []
    for name, svc in hosts.items():
        assert svc["hostname"] == name
        script = svc["command"][-1]
        env = {**svc["environment"], "RECYCLE_JOB_ID": JOB_ID, "RECYCLE_WORKER_TOKEN": WORKER_TOKEN}
        argv = shlex.split(compose_expand(script.split("exec ", 1)[1], env))
        args = parse_recycle(argv)
        per_host.append(workers_of(args))
        assert (args.job_id, args.token) == (JOB_ID, WORKER_TOKEN)
        url = urlsplit(args.service)
        replicas = compose_replicas(services, str(url.hostname))
        assert len(replicas) >= 2, f"{name}: {url.hostname} names no service replicas"
        for replica in replicas.values():  # each replica listens on the port the agents use
            argv = replica["command"]
            assert argv[argv.index("--port") + 1] == str(url.port), argv
        assert args.store.rsplit(":", 1)[0] in services
        # the checkpoint directory is a named volume every host container mounts (a shared file system)
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        assert mounts[args.checkpoint_dir] in doc["volumes"]
    shared = {tuple(sorted(s["volumes"])) for s in hosts.values()}
    assert len(shared) == 1, "every host container mounts the same volumes"
    assert_every_worker_once(per_host, job["num_pipelines"], job["num_stages"])
