"""The fleet from its images: the four images `make images` builds, started with the Helm
chart's own commands, environment and mTLS layout, teaching the tiny model a fact through
the real tinker SDK (issue 25).

What it proves that the process-level tests cannot: the images' commands, users (uid 10001,
as the chart's securityContext), settings from the chart's env, file permissions on the
mounted model, checkpoints and certificates, and that the rollout image carries its native
decode kernels (its metrics say which path it runs).

How it runs here: buildah (chroot isolation, host network, deploy/images storage). `podman run` was
tried on these machines and fails: crun cannot set RLIMIT_NOFILE/RLIMIT_NPROC inside the
sandbox ("Operation not permitted"), whatever --ulimit says. So each service is a buildah
working container of its image, run on the host network (the chart's ports, made free
ones here); Redis is the host's redis-server (the chart's Redis is a third-party image no
registry here can serve). Every container is stopped and removed afterwards, by PID and by
name. Images are reused while their sources are unchanged (content tag, deploy/images).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet.testing import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "lorafleet"
RELEASE, NAMESPACE = "rel", "ml"
UID = 10001  # the images' USER and the chart's runAsUser/fsGroup
SERVICES = ("controller", "trainer", "rollout", "gateway")

_spec = importlib.util.spec_from_file_location("lorafleet_images", REPO / "deploy/images/build.py")
assert _spec is not None and _spec.loader is not None
images_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images_build)


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    """The four images, built or reused (`make tiers` installs buildah and mmdebstrap)."""
    if not shutil.which("buildah"):
        pytest.skip("no buildah: `make tiers` installs it (apt-get install buildah mmdebstrap)")
    base = images_build.ensure_base("buildah")
    images_build.fill_wheels()
    report = images_build.build(images_build.SERVICES, "buildah", base)
    print(json.dumps(report, indent=2))
    return {entry["service"]: entry for entry in report}


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    helm_python = pytest.importorskip("helm_python")
    chart = helm_python.Chart.load(str(CHART))
    try:
        files = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    finally:
        chart.close()
    return [
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(out.get(key), dict) else value
    return out


_HOST = re.compile(rf"[^\s=,:/@]*{RELEASE}-lorafleet-[^\s=,:/@]*(?=:\d)")


def _container_env(
    objects: list[dict[str, Any]], workload: dict[str, Any], container: dict[str, Any]
) -> dict[str, str]:
    """The container's env as the kubelet would give it, with cluster names resolved for one
    host: Service and pod DNS names -> 127.0.0.1, fieldRefs -> the pod's name and namespace,
    secretKeyRefs -> the rendered Secret, $(VAR) -> earlier variables."""
    pod = workload["metadata"]["name"] + "-0"
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = str(item["value"])
        else:
            source = item["valueFrom"]
            if "fieldRef" in source:
                value = {"metadata.name": pod, "metadata.namespace": NAMESPACE}[
                    source["fieldRef"]["fieldPath"]
                ]
            else:
                ref = source["secretKeyRef"]
                secret = secrets[ref["name"]]
                if ref["key"] in secret.get("stringData", {}):
                    value = secret["stringData"][ref["key"]]
                else:
                    value = base64.b64decode(secret["data"][ref["key"]]).decode()
        value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
        env[item["name"]] = _HOST.sub("127.0.0.1", value)
    return env


class Container:
    """One service run from its image: a buildah working container on the host network."""

    def __init__(self, name: str, image: str, folder: Path) -> None:
        self.name = f"lorafleet-test-{name}-{uuid.uuid4().hex[:8]}"
        self.log = folder / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        subprocess.run(
            [*images_build.BUILDAH, "from", "-q", "--name", self.name, image],
            check=True,
            capture_output=True,
        )

    def start(self, command: list[str], env: dict[str, str], mounts: list[str]) -> None:
        settings = [arg for k, v in env.items() for arg in ("--env", f"{k}={v}")]
        subprocess.run([*images_build.BUILDAH, "config", *settings, self.name], check=True)
        volumes = [arg for m in mounts for arg in ("-v", m)]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    *images_build.BUILDAH,
                    "run",
                    "--isolation",
                    "chroot",
                    "--network",
                    "host",
                    *volumes,
                    self.name,
                    "--",
                    *command,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def config(self) -> dict[str, Any]:
        out = subprocess.run(
            [*images_build.BUILDAH, "inspect", "--type", "container", self.name],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)["OCIv1"]["config"]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM buildah (it kills what runs inside), then remove the working container."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        subprocess.run([*images_build.BUILDAH, "rm", self.name], capture_output=True, check=False)


def _owned(path: Path) -> Path:
    """A folder (or file) the images' user owns, as fsGroup makes a pod's volumes."""
    os.chown(path, UID, UID)
    return path


@pytest.fixture
def fleet_from_images(
    built: dict[str, Any], redis_server, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    from lorafleet_cli.ca import ADMIN_NAME, make_run_ca

    ports = {s: free_port() for s in SERVICES}
    metrics = {s: free_port() for s in SERVICES}
    health = {s: free_port() for s in SERVICES if s != "gateway"}  # it probes over HTTP
    ci = yaml.safe_load((CHART / "ci" / "minimal-cpu-values.yaml").read_text())
    values = _merge(
        ci,
        {
            "tls": {"enabled": True},
            "redis": {"port": redis_server.port},
            "gateway": {"port": ports["gateway"], "metricsPort": metrics["gateway"]},
            **{
                s: {"port": ports[s], "metricsPort": metrics[s], "healthPort": health[s]}
                for s in health
            },
        },
    )
    objects = _render(values)
    # The chart's generated Redis password, which the controller's URL now carries.
    import redis

    (secret,) = [
        o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-redis")
    ]
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    redis.Redis(port=redis_server.port).config_set("requirepass", password)
    server_name = f"{RELEASE}-lorafleet-internal"
    certs = make_run_ca(tmp_path / "ca", list(SERVICES), server_names=(server_name,))
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    _owned(checkpoints)
    # The model as a pre-staged volume holds it: readable by the pods' user (the cached
    # tiny model's files are private to the user who built it).
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    for path in (model, *model.rglob("*")):
        _owned(path)
    running: dict[str, Container] = {}
    probes: dict[str, tuple[str, Any]] = {}
    try:
        for service in ("controller", "trainer", "rollout", "gateway"):
            workload = next(
                o
                for o in objects
                if o["kind"] in ("Deployment", "StatefulSet")
                and o["metadata"]["labels"].get("app.kubernetes.io/component") == service
            )
            container = next(
                c
                for c in workload["spec"]["template"]["spec"]["containers"]
                if c["name"] == service
            )
            assert container["image"] == built[service]["image"]  # the chart deploys what we built
            probes[service] = _probe(container)
            env = _container_env(objects, workload, container)
            # Volumes as the pod mounts them: the Secret's three files, the model, the
            # checkpoint claim, an emptyDir on /tmp.
            tls = tmp_path / f"tls-{service}"
            tls.mkdir()
            files = certs[service]
            for source, name in (
                (files.ca_file, "ca.crt"),
                (files.cert_file, "tls.crt"),
                (files.key_file, "tls.key"),
            ):
                shutil.copy(source, tls / name)
                _owned(tls / name).chmod(0o440)
            scratch = tmp_path / f"tmp-{service}"
            scratch.mkdir()
            _owned(scratch).chmod(0o1777)
            paths = {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}
            mounts = [f"{tls}:/etc/lorafleet/tls:ro", f"{scratch}:/tmp"]
            if "/checkpoints" in paths:
                mounts.append(f"{checkpoints}:/checkpoints")
            if "/models" in paths:
                mounts.append(f"{model}:{env[f'LORAFLEET_{service.upper()}_MODEL_PATH']}:ro")
            running[service] = Container(service, container["image"], tmp_path)
            config = running[service].config()
            assert config["User"] == f"{UID}:{UID}"
            command = [*container.get("command", config["Entrypoint"]), *container.get("args", [])]
            running[service].start(command, env, mounts)
        admin = certs[ADMIN_NAME]
        yield {
            "running": running,
            "ports": ports,
            "metrics": metrics,
            "probes": probes,
            "admin": admin,
            "server_name": server_name,
            "tmp": tmp_path,
        }
    finally:
        for service in reversed(list(running)):
            running[service].stop()


def _probe(container: dict[str, Any]) -> tuple[str, Any]:
    """The chart's readiness probe, as this host asks it: ("grpc", (port, service name)) on
    the plaintext health port, or ("http", url) with a named port resolved."""
    probe = container["readinessProbe"]
    if "grpc" in probe:
        return "grpc", (probe["grpc"]["port"], probe["grpc"].get("service", ""))
    port = probe["httpGet"]["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    return "http", f"http://127.0.0.1:{port}{probe['httpGet']['path']}"


def _ready(kind: str, target: Any) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if kind == "http":
        try:
            with urllib.request.urlopen(target, timeout=5) as r:
                return bool(r.status == 200)
        except OSError:
            return False
    port, name = target
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=name), timeout=5
            )
        except grpc.RpcError:
            return False
    return bool(status.status == health_pb2.HealthCheckResponse.SERVING)


def _logs(running: dict[str, Container]) -> str:
    return "\n".join(
        f"--- {s}\n{c.log.read_text(errors='replace')[-3000:]}" for s, c in running.items()
    )


def test_the_sdk_quickstart_learns_its_fact_through_the_images(
    fleet_from_images: dict[str, Any], sdk_python, tmp_path: Path
) -> None:
    from lorafleet.rpc.channel import make_blocking_channel
    from lorafleet.settings import TlsSettings
    from lorafleet.tls import identity_from_settings
    from lorafleet.v1 import controller_pb2, controller_pb2_grpc

    fleet = fleet_from_images
    running: dict[str, Container] = fleet["running"]
    base_url = f"http://127.0.0.1:{fleet['ports']['gateway']}"

    def healthy() -> bool:
        """Every service answers the chart's readiness probe (and none has exited)."""
        dead = [s for s, c in running.items() if not c.alive()]
        assert not dead, f"{dead} exited:\n{_logs(running)}"
        return all(_ready(*probe) for probe in fleet["probes"].values())

    try:
        wait_until(healthy, "every service from its image answers its readiness probe", 900)
    except AssertionError as error:
        waiting = [s for s, probe in fleet["probes"].items() if not _ready(*probe)]
        raise AssertionError(f"{error}: {waiting} not ready\n{_logs(running)}") from None

    admin = fleet["admin"]
    settings = TlsSettings(
        admin.ca_file, admin.cert_file, admin.key_file, server_name=fleet["server_name"]
    )
    identity = identity_from_settings(settings)
    with make_blocking_channel(f"127.0.0.1:{fleet['ports']['controller']}", tls=identity) as ch:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        api_key = stub.CreateApiKey(
            controller_pb2.CreateApiKeyRequest(tenant="images", label="quickstart"), timeout=30
        ).api_key

    python = sdk_python("0.38.0")
    env = dict(
        os.environ,
        TINKER_BASE_URL=base_url,
        TINKER_API_KEY=api_key,
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(fleet["tmp"] / "tmp-trainer" / ".cache" / "huggingface"),
        QUICKSTART_STEPS="40",
        QUICKSTART_LR="3e-3",
        QUICKSTART_PLOT=str(tmp_path / "loss.png"),
    )
    out = subprocess.run(
        [str(python), str(REPO / "examples" / "quickstart.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-4000:]}\n{_logs(running)}"
    assert "OK: the model learned the fact" in out.stdout

    with urllib.request.urlopen(
        f"http://127.0.0.1:{fleet['metrics']['rollout']}/metrics", timeout=10
    ) as r:
        exposition = r.read().decode()
    paths = re.findall(r'lorafleet_rollout_decode_kernels\{path="([^"]+)"\} 1\.0', exposition)
    assert paths and paths[0].startswith("x86-64-v"), paths  # native kernels, not "torch"
