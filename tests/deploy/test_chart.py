"""CI checks of the Helm chart and dashboards that need no cluster (platform.md §7).

Lint strictly and render with the Helm v4 SDK (helm-python-sdk), validate every manifest
against the Kubernetes 1.33 schemas (kubernetes-validate, strict), validate values files
against values.schema.json (jsonschema), and assert on the rendered objects.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "lorafleet"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "rel", "ml"


def load_values(name: str) -> dict[str, Any]:
    """A ci/ values file by stem ("gpu"), or {} for "default"."""
    if name == "default":
        return {}
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) or {}


def values_names() -> list[str]:
    return ["default", *(p.name.removesuffix("-values.yaml") for p in CI_VALUES)]


def deep_merge(base: dict, override: dict) -> dict:
    """Helm's coalescing: maps merge key by key, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Rendered:
    """The objects of one render, with lookups by kind and name."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.objects: list[dict[str, Any]] = []
        for path, text in sorted(files.items()):
            if path.endswith("NOTES.txt"):
                continue
            self.objects += [doc for doc in yaml.safe_load_all(text) if doc]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
        return found[0]

    def workload(self, component: str) -> dict[str, Any]:
        found = [
            o
            for o in self.objects
            if o["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet")
            and o["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, component
        return found[0]

    def container(
        self, component: str, name: str | None = None, role: str = "leader"
    ) -> dict[str, Any]:
        """A container of the component's pod (of a LeaderWorkerSet: the leader's or worker's)."""
        workload = self.workload(component)
        if workload["kind"] == "LeaderWorkerSet":
            pod = workload["spec"]["leaderWorkerTemplate"][f"{role}Template"]["spec"]
        else:
            pod = workload["spec"]["template"]["spec"]
        return next(c for c in pod["containers"] if c["name"] == (name or component))

    def pod_specs(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, pod spec) of every workload template (both of a LeaderWorkerSet) and bare Pod."""
        out = []
        for o in self.objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                out.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
            elif o["kind"] == "LeaderWorkerSet":
                for role in ("leader", "worker"):
                    template = o["spec"]["leaderWorkerTemplate"][f"{role}Template"]
                    out.append((f"{o['metadata']['name']}/{role}", template["spec"]))
            elif o["kind"] == "Pod":
                out.append((o["metadata"]["name"], o["spec"]))
        return out


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name → value (or the valueFrom mapping) of a container's env."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.fixture(scope="session")
def chart():
    loaded = helm_python.Chart.load(str(CHART))
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def render(chart) -> Callable[..., Rendered]:
    """render(values) → Rendered, cached per values (renders are pure apart from random keys)."""
    cache: dict[str, Rendered] = {}

    def _render(values: dict[str, Any] | None = None) -> Rendered:
        key = yaml.safe_dump(values or {}, sort_keys=True)
        if key not in cache:
            files = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE)
            cache[key] = Rendered(files)
        return cache[key]

    return _render


KUBE_VERSION = "1.33.0"
FULL = f"{RELEASE}-lorafleet"
GRPC_SERVICES = {
    "controller": "lorafleet.v1.ControllerService",
    "trainer": "lorafleet.v1.TrainerService",
    "rollout": "lorafleet.v1.RolloutService",
}
# CRD kinds kubernetes-validate has no schema for; asserted on structurally below.
CRD_GROUPS = ("monitoring.coreos.com/", "leaderworkerset.x-k8s.io/", "cert-manager.io/")
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
METRIC_NAME = re.compile(r"\b((?:lorafleet|grpc_server)_[a-z0-9_]+)\b")


# --- lint, render, validate -------------------------------------------------------------


@pytest.mark.parametrize("name", values_names(), ids=lambda n: f"{n}-values")
def test_lint_strict(name):
    report = helm_python.lint(
        str(CHART), load_values(name), strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("name", values_names(), ids=lambda n: f"{n}-values")
def test_every_manifest_validates_against_kubernetes_schemas(render, name):
    rendered = render(load_values(name))
    validated = 0
    for obj in rendered.objects:
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        validated += 1
    kinds = sorted({o["kind"] for o in rendered.objects})
    print(f"\n{name}: {len(rendered.objects)} manifests ({validated} schema-validated): {kinds}")
    assert validated >= 10


def test_validation_catches_a_broken_manifest(render):
    """The validator is strict: an unknown field in a rendered Deployment is rejected."""
    deployment = json.loads(json.dumps(render().workload("controller")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_objects_are_namespaced_and_uniquely_named(render):
    rendered = render(load_values("full"))
    seen = set()
    for obj in rendered.objects:
        meta = obj["metadata"]
        if meta["name"] != f"{RELEASE}-extra":  # extraObjects are the user's, as written
            assert meta["namespace"] == NAMESPACE, meta["name"]
        key = (obj["kind"], meta["name"])
        assert key not in seen, key
        seen.add(key)


# --- values schema ------------------------------------------------------------------------


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize("name", values_names(), ids=lambda n: f"{n}-values")
def test_values_files_match_schema(name):
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    merged = deep_merge(defaults, load_values(name))
    jsonschema.Draft202012Validator(_schema()).validate(merged)


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ({"redis": {"appendfsync": "no"}}, "appendfsync"),
        ({"redis": {"maxmemory": "0"}}, "maxmemory"),
        ({"trainer": {"replicaCnt": 2}}, "replicaCnt"),
        ({"rollout": {"engine": "tensorrt"}}, "engine"),
        ({"rollout": {"vllm": {"maxLoraRank": 48}}}, "maxLoraRank"),
        ({"rollout": {"sglang": {"loraTargetModules": ["qproj"]}}}, "loraTargetModules"),
        ({"trainer": {"gpu": {"count": -1}}}, "count"),
        ({"controller": {"logLevel": "verbose"}}, "logLevel"),
        ({"controller": {"settings": {"sessionTimeout": 60}}}, "sessionTimeout"),
        ({"trainer": {"settings": {"snapshotEverySteps": -1}}}, "snapshotEverySteps"),
    ],
)
def test_schema_rejects_bad_values(chart, override, path):
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(deep_merge(defaults, override), _schema())
    with pytest.raises(helm_python.HelmValuesError, match=path):
        chart.render(values=override, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"controller": {"replicaCount": 2}}, "leaderElection"),
        ({"redis": {"enabled": False}}, "redis.external"),
        ({"gateway": {"downloadSecret": {"value": "x", "existingSecret": "y"}}}, "not both"),
        ({"rollout": {"sglang": {"maxLorasPerBatch": 8, "maxLoadedLoras": 4}}}, "maxLoadedLoras"),
        ({"rollout": {"numSlots": 32}}, "numSlots"),
        ({"rollout": {"engine": "vllm", "numSlots": 32}}, "vllm.maxCpuLoras"),
        ({"rollout": {"engine": "vllm", "vllm": {"maxLoras": 32}}}, "maxCpuLoras must be >= "),
        ({"redis": {"external": {"cluster": True}}}, "Redis Cluster"),
    ],
)
def test_template_guards_fail_with_a_message(chart, override, message):
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart.render(values=override, name=RELEASE, namespace=NAMESPACE)


# --- rendered objects ---------------------------------------------------------------------


@pytest.mark.parametrize("name", values_names(), ids=lambda n: f"{n}-values")
def test_every_pod_is_hardened(render, name):
    for pod_name, pod in render(load_values(name)).pod_specs():
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True, pod_name
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, pod_name
        assert pod.get("hostNetwork") is not True and pod.get("hostPID") is not True
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            where = f"{pod_name}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["runAsNonRoot"] is True, where
            assert sc.get("privileged") is not True, where


@pytest.mark.parametrize("name", values_names(), ids=lambda n: f"{n}-values")
def test_grpc_services_use_native_grpc_probes(render, name):
    """On the gRPC port, or with internal TLS on the plaintext health port (the kubelet
    cannot present a client certificate), which the service is told to open."""
    values = load_values(name)
    tls = values.get("tls", {}).get("enabled", True)  # on by default
    rendered = render(values)
    for component, service in GRPC_SERVICES.items():
        c = rendered.container(component)
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        health = env_of(c).get(f"LORAFLEET_{component.upper()}_HEALTH_PORT")
        if tls:
            assert port != int(health)
            port = int(health)
            assert {"name": "health", "containerPort": port, "protocol": "TCP"} in c["ports"]
        else:
            assert health is None and "health" not in {p["name"] for p in c["ports"]}
        assert c["livenessProbe"]["grpc"] == {"port": port, "service": ""}
        assert c["startupProbe"]["grpc"] == {"port": port, "service": ""}
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}


def test_model_loading_gets_a_long_startup_budget(render):
    rendered = render()
    for component, container in [("trainer", "trainer"), ("rollout", "sglang")]:
        probe = rendered.container(component, container)["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800, component


def test_service_env_vars(render):
    rendered = render()
    controller = env_of(rendered.container("controller"))
    assert controller["LORAFLEET_CONTROLLER_PORT"] == "50051"
    assert controller["LORAFLEET_CONTROLLER_METRICS_PORT"] == "9100"
    # The bundled Redis's generated password, from its Secret, expanded by the kubelet.
    assert controller["LORAFLEET_CONTROLLER_REDIS_URL"] == (
        f"redis://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
    )
    assert controller["REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": f"{FULL}-redis", "key": "redis-password"}
    }
    assert controller["LORAFLEET_CONTROLLER_TRAINER_SERVICE"] == f"{FULL}-trainer-headless"
    trainer = env_of(rendered.container("trainer"))
    assert trainer["LORAFLEET_TRAINER_PORT"] == "50052"
    assert trainer["LORAFLEET_TRAINER_MODEL_PATH"] == "/models/base"
    assert trainer["LORAFLEET_TRAINER_NUM_SLOTS"] == "8"
    assert trainer["LORAFLEET_TRAINER_STORAGE_ROOT"] == "/checkpoints"
    assert trainer["LORAFLEET_TRAINER_CONTROLLER_ADDRESS"] == f"{FULL}-controller:50051"
    assert trainer["LORAFLEET_TRAINER_REPLICA_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert trainer["LORAFLEET_TRAINER_ADVERTISE_ADDRESS"] == (
        f"$(LORAFLEET_TRAINER_REPLICA_ID).{FULL}-trainer-headless.{NAMESPACE}.svc:50052"
    )
    rollout = env_of(rendered.container("rollout"))
    assert rollout["LORAFLEET_ROLLOUT_PORT"] == "50053"
    gateway = env_of(rendered.container("gateway"))
    assert gateway["LORAFLEET_GATEWAY_PORT"] == "8000"
    assert gateway["LORAFLEET_GATEWAY_METRICS_PORT"] == "9100"
    assert gateway["LORAFLEET_GATEWAY_CONTROLLER_ADDRESS"] == f"{FULL}-controller:50051"
    for component in ("controller", "trainer", "rollout", "gateway"):
        prefix = f"LORAFLEET_{component.upper()}_"
        env = env_of(rendered.container(component))
        assert env[prefix + "HOST"] == "0.0.0.0"
        assert env[prefix + "LOG_LEVEL"] == "INFO"


# What each service reads: its own prefix over these settings classes (see its --help).
def _settings_classes() -> dict[str, tuple[str, list[type]]]:
    from lorafleet.replica import ReplicaSettings
    from lorafleet.settings import ServerSettings
    from lorafleet_controller.settings import ControllerSettings
    from lorafleet_gateway.settings import GatewaySettings
    from lorafleet_rollout.settings import RolloutSettings
    from lorafleet_trainer.settings import TrainerSettings

    return {
        "controller": ("LORAFLEET_CONTROLLER_", [ControllerSettings, ServerSettings]),
        "trainer": ("LORAFLEET_TRAINER_", [TrainerSettings, ServerSettings, ReplicaSettings]),
        "rollout": ("LORAFLEET_ROLLOUT_", [RolloutSettings, ServerSettings, ReplicaSettings]),
        "gateway": ("LORAFLEET_GATEWAY_", [GatewaySettings]),
    }


# Stands in for what the kubelet fills in (pod name, Secret keys): long enough for any key.
FROM_CLUSTER = "value-from-the-cluster-0123456789abcdef"


@pytest.mark.parametrize("name", ["default", "full", "multinode", "vllm"])
def test_service_env_loads_through_the_services_own_settings(render, name):
    """Every LORAFLEET_<SVC>_* variable the chart sets is a setting that service reads (a
    misspelt or stale name would be silently ignored), and the values pass its validation."""
    import dataclasses

    from lorafleet.settings import TLS_PREFIX, TlsSettings, load_settings

    rendered = render(load_values(name))
    for component, (prefix, classes) in _settings_classes().items():
        lws = rendered.workload(component)["kind"] == "LeaderWorkerSet"
        for role in ("leader", "worker") if lws and component == "trainer" else ("leader",):
            container = rendered.container(component, role=role)
            names = [e["name"] for e in container["env"]]
            assert len(names) == len(set(names)), f"{component}: a variable set twice"
            env = {
                k: v if isinstance(v, str) else FROM_CLUSTER
                for k, v in env_of(container).items()
                if k.startswith("LORAFLEET_")
            }
            read = {prefix + f.name.upper() for cls in classes for f in dataclasses.fields(cls)}
            read |= {TLS_PREFIX + f.name.upper() for f in dataclasses.fields(TlsSettings)}
            assert set(env) - read == set(), f"{component}: not settings it reads"
            for cls in classes:
                load_settings(cls, prefix, env)
            load_settings(TlsSettings, TLS_PREFIX, env)


# Settings the chart leaves to the service's default (extraEnv sets them where needed): a
# setting a service gains must be wired, exposed in `settings`, or listed here, by decision.
LEFT_TO_DEFAULTS = {
    "controller": {
        "COALESCE_WINDOW_MS",
        "HEARTBEAT_INTERVAL_SECONDS",
        "MAX_MESSAGE_BYTES",
        "PIPELINE_SUBMITS",
        "RESIDENT_VERSIONS",
        "ROLLOUT_WAIT_SECONDS",
        "SAMPLE_SPREAD_INFLIGHT",
        "SAMPLE_WORKERS",
        "STORE_ROOM_CHECK_SECONDS",
        "SWEEP_INTERVAL_SECONDS",
        "TRANSPORT_RETRY_SECONDS",
    },
    # GROUP_RESHARD_AFTER_FORWARD: auto resolves by device (cuda reshards, cpu keeps).
    "trainer": {
        "GROUP_KEEPALIVE_SECONDS",
        "GROUP_RESHARD_AFTER_FORWARD",
        "MAX_MESSAGE_BYTES",
        "REGISTER_INTERVAL_SECONDS",
    },
    # ENGINE_LAUNCH: SGLang and vLLM run as their own containers.
    "rollout": {"ENGINE_LAUNCH", "MAX_MESSAGE_BYTES", "REGISTER_INTERVAL_SECONDS"},
    # Wire-protocol switches keep their defaults; the key comes from DOWNLOAD_SECRET (a Secret).
    "gateway": {
        "ACK_RESULTS",
        "COMPRESS_FWDBWD",
        "DOWNLOAD_SECRET_FILE",
        "PROTO_FLAGS",
    },
}


def test_every_service_setting_is_wired_exposed_or_left_by_decision(render):
    import dataclasses

    renders = [load_values(n) for n in values_names()]
    renders.append({"redis": {"enabled": False, "external": {"url": "redis://r", "cluster": True}}})
    for component, (prefix, classes) in _settings_classes().items():
        chart_sets = set()
        for values in renders:
            extra = {e["name"] for e in values.get(component, {}).get("extraEnv", [])}
            container = render(values).container(component)
            chart_sets |= {e["name"] for e in container["env"]} - extra
        settings = {f.name.upper() for cls in classes for f in dataclasses.fields(cls)}
        unwired = {s for s in settings if prefix + s not in chart_sets}
        assert unwired == LEFT_TO_DEFAULTS[component], (
            f"{component}: wire new settings in the chart, or add them to its `settings` "
            "values (and full-values), or to LEFT_TO_DEFAULTS"
        )


def test_settings_values_become_env(render):
    """Each component's `settings` map renders as <PREFIX><UPPER_SNAKE> (whole numbers stay
    integers); null keys render nothing, and full-values sets every key. (Bare render on
    engine torch: with a server engine a null maxLoraRank takes the server's, tested below.)"""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    full = load_values("full")
    rendered = render(full)
    bare = render({"rollout": {"engine": "torch"}})
    for component, (prefix, _) in _settings_classes().items():
        keys = defaults[component]["settings"]
        assert all(v is None for v in keys.values()), component
        assert set(full[component]["settings"]) == set(keys), component
        env = env_of(rendered.container(component))
        for key, value in full[component]["settings"].items():
            var = prefix + re.sub(r"(?<!^)(?=[A-Z])", "_", key).upper()
            want = str(value).lower() if isinstance(value, bool) else str(value)  # YAML's true
            assert env[var] == want, var
            assert var not in env_of(bare.container(component)), var
    env = env_of(rendered.container("rollout"))
    assert env["LORAFLEET_ROLLOUT_PREFIX_CACHE_BYTES"] == "268435456"
    assert env["LORAFLEET_ROLLOUT_MAX_ADAPTER_BYTES"] == "2147483648"


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ({}, "64"),  # SGLang's default --max-lora-rank
        (load_values("gpu"), "32"),
        ({"rollout": {"engine": "vllm", "vllm": {"maxLoraRank": 16}}}, "16"),
        ({"rollout": {"settings": {"maxLoraRank": 8}}}, "8"),  # lower than the server's
        ({"rollout": {"engine": "torch"}}, None),  # the service's own default
    ],
)
def test_rollout_accepts_no_rank_its_server_cannot_load(chart, render, values, want):
    """A null settings.maxLoraRank becomes the server's --max-lora-rank; a larger one fails
    rendering (the rollout would accept adapters the server refuses at publish)."""
    env = env_of(render(values).container("rollout"))
    assert env.get("LORAFLEET_ROLLOUT_MAX_LORA_RANK") == want
    names = [e["name"] for e in render(values).container("rollout")["env"]]
    assert len(names) == len(set(names))
    engine = values.get("rollout", {}).get("engine", "sglang")
    if engine != "torch":
        too_big = deep_merge(values, {"rollout": {"settings": {"maxLoraRank": 128}}})
        with pytest.raises(helm_python.HelmRenderError, match=f"rollout.{engine}.maxLoraRank"):
            chart.render(values=too_big, name=RELEASE, namespace=NAMESPACE)


def test_rollout_adapters_live_where_sglang_reads_them(render):
    """Pushed adapters go to the checkpoint volume (the root filesystem is read-only), which
    the SGLang container mounts at the same path."""
    rendered = render()
    env = env_of(rendered.container("rollout"))
    assert env["LORAFLEET_ROLLOUT_ADAPTER_DIR"] == "/checkpoints/rollout-adapters"
    assert env["LORAFLEET_ROLLOUT_MAX_LOADED_ADAPTERS"] == "8"
    sglang = rendered.container("rollout", "sglang")
    assert "/checkpoints" in {m["mountPath"] for m in sglang["volumeMounts"]}


# Each rollout engine's containers (a parametrized id "sglang" would skip without SGLANG_URL).
SERVING_CONTAINERS = {
    "sglang": ["rollout", "sglang"],
    "vllm": ["rollout", "vllm"],
    "torch": ["rollout"],
}


@pytest.mark.parametrize("engine", sorted(SERVING_CONTAINERS), ids=lambda e: f"{e}-engine")
def test_serving_containers_mount_the_checkpoints_read_only(render, engine):
    """Rollouts and their servers read every tenant's checkpoints; the one folder a rollout
    writes there is its pushed adapters', mounted writable on its own (a subPath of the same
    volume, at the path the server reads it from)."""
    rendered = render({"rollout": {"engine": engine}})
    for name in SERVING_CONTAINERS[engine]:
        mounts = rendered.container("rollout", name)["volumeMounts"]
        volume = [m for m in mounts if m["name"] == "checkpoints" and "subPath" not in m]
        assert volume == [{"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True}]
        writable = [m for m in mounts if m["name"] == "checkpoints" and "subPath" in m]
        assert writable == (
            [
                {
                    "name": "checkpoints",
                    "mountPath": "/checkpoints/rollout-adapters",
                    "subPath": "rollout-adapters",
                }
            ]
            if name == "rollout"
            else []
        )
    env = env_of(rendered.container("rollout"))
    assert env["LORAFLEET_ROLLOUT_ADAPTER_DIR"] == "/checkpoints/rollout-adapters"
    trainer = {m["name"]: m for m in rendered.container("trainer")["volumeMounts"]}
    assert "readOnly" not in trainer["checkpoints"]  # the trainer writes the saved states


def test_redis_cluster(render):
    url = "redis://redis-cluster.data.svc:6379/0"
    rendered = render({"redis": {"enabled": False, "external": {"url": url, "cluster": True}}})
    env = env_of(rendered.container("controller"))
    assert env["LORAFLEET_CONTROLLER_REDIS_CLUSTER"] == "true"
    assert "LORAFLEET_CONTROLLER_REDIS_CLUSTER" not in env_of(render().container("controller"))


def test_sglang_is_the_default_rollout_engine(render):
    rendered = render()
    rollout = env_of(rendered.container("rollout"))
    assert rollout["LORAFLEET_ROLLOUT_ENGINE"] == "sglang"
    assert rollout["LORAFLEET_ROLLOUT_ENGINE_URL"] == "http://127.0.0.1:30000"
    sglang = rendered.container("rollout", "sglang")
    cmd = sglang["command"]
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    for flag in (
        "--enable-lora",
        "--host=127.0.0.1",
        "--port=30000",
        "--model-path=/models/base",
        "--max-lora-rank=64",
        "--max-loras-per-batch=8",
        "--max-loaded-loras=16",
    ):
        assert flag in cmd, flag
    assert cmd[cmd.index("--lora-target-modules") + 1] == "all"
    assert "127.0.0.1:30000/health" in " ".join(sglang["livenessProbe"]["exec"]["command"])
    # SGLang reads published adapters by path: same model and checkpoint mounts.
    mounts = {m["name"]: m for m in sglang["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True and "checkpoints" in mounts


# SGLang 0.5.23 compares an adapter's targets with --lora-target-modules after folding fused
# sub-projections (srt/lora/utils.py get_normalized_target_modules): the reference the chart's
# render-time guard (templates/rollout/_pod.tpl) must agree with.
SGLANG_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def _sglang_name(module: str) -> str:
    return SGLANG_FUSED.get(module, module)


def _sdk_default_targets(preset: str) -> list[str]:
    """The modules of the adapter our trainer exports for the SDK's create_lora_training_client
    defaults (train_attn, train_mlp, train_unembed), under SGLang's module names (expert banks
    as experts.{e}.gate_up_proj / down_proj: their last part)."""
    from transformers import AutoModelForCausalLM

    from lorafleet_models.build import model_config
    from lorafleet_models.presets import PRESETS
    from lorafleet_trainer.domain import LoraSpec
    from lorafleet_trainer.lora import Router
    from lorafleet_trainer.sites import wrap_model
    from lorafleet_trainer.targets import peft_targets, resolve_targets

    model = AutoModelForCausalLM.from_config(model_config(PRESETS[preset], 0, 0))
    _, sites = wrap_model(model, Router())
    spec = LoraSpec(rank=32, train_attn=True, train_mlp=True, train_unembed=True)
    modules, parameters = peft_targets(resolve_targets(spec, sites), sites)
    return sorted({name.rsplit(".", 1)[-1] for name in modules + parameters})


@pytest.mark.parametrize("preset", ["tiny", "tiny-phi3", "tiny-moe"])
def test_sglang_target_guard_agrees_with_the_trainers_default_adapter(chart, preset):
    """Dense, fused (Phi-3) and MoE: --lora-target-modules naming exactly what the trainer's
    default adapter targets renders; leaving out any module that SGLang would then refuse
    (no other listed module folds to the same name) fails rendering, naming it."""
    targets = _sdk_default_targets(preset)
    assert "lm_head" in targets

    def render(modules: list[str]) -> None:
        values = {"rollout": {"sglang": {"loraTargetModules": modules}}}
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)

    render(targets)
    for module in targets:
        rest = [m for m in targets if m != module]
        if _sglang_name(module) in {_sglang_name(m) for m in rest}:
            render(rest)  # SGLang folds a sibling into the same fused module: still loads
            continue
        with pytest.raises(helm_python.HelmRenderError, match=f"missing {_sglang_name(module)}"):
            render(rest)


def _merged(name: str) -> dict[str, Any]:
    """A values file over the chart's defaults, as Helm coalesces them."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    return deep_merge(defaults, load_values(name))


SGLANG_PROFILES = [n for n in values_names() if _merged(n)["rollout"]["engine"] == "sglang"]


@pytest.mark.parametrize("name", SGLANG_PROFILES, ids=lambda n: f"{n}-values")
def test_every_sglang_profile_loads_the_sdk_default_adapter(chart, render, name):
    """Every profile on SGLang names lm_head (or all) and renders it into the server's flags;
    the same profile without lm_head fails rendering with a message naming it."""
    values = _merged(name)
    modules = values["rollout"]["sglang"]["loraTargetModules"]
    command = render(load_values(name)).container("rollout", "sglang")["command"]
    start = command.index("--lora-target-modules") + 1
    assert command[start : start + len(modules)] == modules
    if modules == ["all"]:
        return
    assert "lm_head" in modules
    without = [m for m in modules if m != "lm_head"]
    broken = deep_merge(load_values(name), {"rollout": {"sglang": {"loraTargetModules": without}}})
    with pytest.raises(helm_python.HelmRenderError, match="missing lm_head"):
        chart.render(values=broken, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("name", ["default", "multinode"])
def test_sglang_honours_seeds_and_returns_unscaled_logprobs(render, name):
    """--enable-deterministic-inference (SGLang ignores sampling_seed without it) by default,
    off by value; SGLANG_RETURN_ORIGINAL_LOGPROB=1 on every SGLang container (leader and
    workers of a group): logprobs before temperature scaling, as the trainer computes them."""
    values = load_values(name)
    rendered = render(values)
    group = _merged(name)["rollout"]["leaderWorkerSet"]["enabled"]
    roles = ("leader", "worker") if group else ("leader",)
    for role in roles:
        sglang = rendered.container("rollout", "sglang", role=role)
        assert "--enable-deterministic-inference" in sglang["command"], role
        assert env_of(sglang)["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1", role
    off = render(deep_merge(values, {"rollout": {"sglang": {"deterministicInference": False}}}))
    for role in roles:
        sglang = off.container("rollout", "sglang", role=role)
        assert "--enable-deterministic-inference" not in sglang["command"], role
        assert env_of(sglang)["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1", role


def test_chart_launches_sglang_as_the_fleets_launcher_does(chart, render):
    """lorafleet_rollout.sglang_server owns how `lorafleet up` and the real-server tier start
    SGLang; the chart's container carries every variable its GPU profile sets, with the same
    value, and the launcher's own target list passes the chart's guard."""
    from lorafleet_rollout.sglang_server import LORA_TARGETS, SGLangServer

    launcher = SGLangServer(Path("/models/base"), 30000, device="cuda").env({})
    for name in ("default", "multinode"):
        values = load_values(name)
        group = _merged(name)["rollout"]["leaderWorkerSet"]["enabled"]
        for role in ("leader", "worker") if group else ("leader",):
            env = env_of(render(values).container("rollout", "sglang", role=role))
            assert {k: env.get(k) for k in launcher} == launcher, (name, role)
    values = {"rollout": {"sglang": {"loraTargetModules": list(LORA_TARGETS)}}}
    chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


def test_vllm_engine_runs_a_vllm_server_beside_the_rollout(render):
    """engine vllm: the rollout container drives a loopback vLLM server the way VLLMEngine
    expects (runtime LoRA loading on, the base model under the served name the rollout is
    told), the GPUs go to the vLLM container, and both read adapters from the same volume."""
    values = load_values("vllm")
    rendered = render(values)
    pod = rendered.workload("rollout")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["rollout", "vllm"]
    rollout = rendered.container("rollout")
    env = env_of(rollout)
    assert env["LORAFLEET_ROLLOUT_ENGINE"] == "vllm"
    assert env["LORAFLEET_ROLLOUT_ENGINE_URL"] == "http://127.0.0.1:8000"
    assert env["LORAFLEET_ROLLOUT_SERVED_MODEL_NAME"] == "base"
    assert env["LORAFLEET_ROLLOUT_MAX_LOADED_ADAPTERS"] == "16"
    assert "nvidia.com/gpu" not in rollout["resources"].get("limits", {})

    vllm = rendered.container("rollout", "vllm")
    cmd = vllm["command"]
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in (
        f"--model={env['LORAFLEET_ROLLOUT_MODEL_PATH']}",
        "--served-model-name=base",
        "--host=127.0.0.1",
        "--port=8000",
        "--enable-lora",
        "--max-lora-rank=32",
        "--max-loras=8",
        "--max-cpu-loras=16",
        "--tensor-parallel-size=1",
        "--gpu-memory-utilization=0.85",
    ):
        assert flag in cmd, flag
    vllm_env = env_of(vllm)
    assert vllm_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert vllm_env["HF_HUB_OFFLINE"] == "1"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "127.0.0.1:8000/health" in " ".join(vllm["livenessProbe"]["exec"]["command"])
    assert "127.0.0.1:8000/health" in " ".join(vllm["startupProbe"]["exec"]["command"])
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True
    assert mounts["checkpoints"]["mountPath"] == "/checkpoints"
    assert env["LORAFLEET_ROLLOUT_ADAPTER_DIR"].startswith("/checkpoints/")
    # The rollout accepts no rank its server cannot load.
    assert int(env["LORAFLEET_ROLLOUT_MAX_LORA_RANK"]) <= values["rollout"]["vllm"]["maxLoraRank"]
    assert "sglang" not in json.dumps(pod)
    # No --max-model-len: the rollout takes the context length from the model's config.
    assert not any(a.startswith("--max-model-len") for a in cmd)
    assert "engine vllm (vLLM v0.32.0)" in rendered.files["lorafleet/templates/NOTES.txt"]


# Reads each rendered server command with the server's own argument parser (SGLang 0.5.23's
# ServerArgs, vLLM 0.32's serve parser and LoRAConfig validation), in that server's venv from
# `make tiers`; prints what it parsed, by key.
_PARSE_SERVER_FLAGS = {
    "sglang": """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
out = {}
for key, argv in json.loads(sys.argv[1]).items():
    a = parser.parse_args(argv)
    out[key] = {"enable_lora": a.enable_lora, "max_lora_rank": a.max_lora_rank,
                "targets": a.lora_target_modules, "deterministic": a.enable_deterministic_inference}
print(json.dumps(out))
""",
    "vllm": """
import json, sys
from vllm.config.lora import LoRAConfig
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
out = {}
for key, argv in json.loads(sys.argv[1]).items():
    a = parser.parse_args(argv)
    validate_parsed_serve_args(a)
    LoRAConfig(max_lora_rank=a.max_lora_rank, max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras)
    out[key] = {"enable_lora": a.enable_lora, "max_lora_rank": a.max_lora_rank,
                "served": a.served_model_name, "model": a.model}
print(json.dumps(out))
""",
}
# What the kubelet substitutes in a LeaderWorkerSet pod's command.
_KUBELET_VARS = {"$(LWS_WORKER_INDEX)": "1", "$(LWS_LEADER_ADDRESS)": "10.0.0.1"}


@pytest.mark.slow
# (ids not the bare engine name: the root conftest skips anything with the keyword "sglang")
@pytest.mark.parametrize("engine", ["sglang", "vllm"], ids=lambda e: f"{e}-parser")
def test_rendered_server_flags_parse_with_the_servers_own_parser(render, engine):
    """Every SGLang / vLLM server command any profile renders (StatefulSet pods and both roles
    of a LeaderWorkerSet group) is accepted by that server's real argument parser, which reads
    back LoRA on, the rank, and (SGLang) the targets and determinism switch the values set."""
    python = REPO / ".venvs" / engine / "bin" / "python"
    if not python.exists():
        pytest.skip(f".venvs/{engine} is absent: run `make tiers`")
    commands: dict[str, list[str]] = {}
    profiles: dict[str, dict[str, Any]] = {}
    for name in [*values_names(), "engine-vllm"]:
        values = {"rollout": {"engine": "vllm"}} if name == "engine-vllm" else load_values(name)
        for pod_name, pod in render(values).pod_specs():
            for c in pod["containers"]:
                if c["name"] == engine:
                    argv = c["command"][3:]
                    for var, value in _KUBELET_VARS.items():
                        argv = [a.replace(var, value) for a in argv]
                    commands[f"{name}:{pod_name}"] = argv
                    profiles[f"{name}:{pod_name}"] = deep_merge(
                        yaml.safe_load((CHART / "values.yaml").read_text()), values
                    )["rollout"][engine]
    assert len(commands) >= (6 if engine == "sglang" else 2), sorted(commands)
    result = subprocess.run(
        [str(python), "-c", _PARSE_SERVER_FLAGS[engine], json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(parsed) == set(commands)
    for key, got in parsed.items():
        want = profiles[key]
        assert got["enable_lora"] is True, key
        assert got["max_lora_rank"] == want["maxLoraRank"], key
        if engine == "sglang":
            assert got["targets"] == want["loraTargetModules"], key
            assert got["deterministic"] is want["deterministicInference"], key
        else:
            assert got["served"] == [want["servedModelName"]], key
            assert got["model"].startswith("/models"), key


def test_gpu_values(render):
    values = load_values("gpu")
    rendered = render(values)
    trainer = rendered.container("trainer")
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert trainer["resources"]["requests"]["memory"] == "32Gi"
    sglang = rendered.container("rollout", "sglang")
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in rendered.container("rollout")["resources"].get("limits", {})
    modules = values["rollout"]["sglang"]["loraTargetModules"]
    start = sglang["command"].index("--lora-target-modules") + 1
    assert sglang["command"][start : start + len(modules)] == modules
    assert "--mem-fraction-static=0.85" in sglang["command"]
    for component in ("trainer", "rollout"):
        pod = rendered.workload(component)["spec"]["template"]["spec"]
        assert pod["runtimeClassName"] == "nvidia"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]


def test_gpu_resource_name_and_count_are_values(render):
    rendered = render(load_values("full"))
    assert rendered.container("trainer")["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == 2
    assert (
        rendered.container("rollout", "sglang")["resources"]["limits"]["nvidia.com/mig-3g.40gb"]
        == 2
    )
    assert "--tp-size=2" in rendered.container("rollout", "sglang")["command"]


def test_minimal_cpu_runs_the_torch_engine_without_gpus(render):
    rendered = render(load_values("minimal-cpu"))
    pod = rendered.workload("rollout")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["rollout"]
    env = env_of(pod["containers"][0])
    assert env["LORAFLEET_ROLLOUT_ENGINE"] == "torch"
    assert "LORAFLEET_ROLLOUT_ENGINE_URL" not in env
    text = json.dumps(rendered.objects)
    assert "nvidia.com" not in text
    controller = env_of(rendered.container("controller"))
    assert controller["LORAFLEET_CONTROLLER_TRAINERS"] == (
        f"{FULL}-trainer-0={FULL}-trainer-0.{FULL}-trainer-headless.{NAMESPACE}.svc:50052"
    )
    assert not rendered.of_kind("Role")


def test_torch_engine_on_gpu_puts_the_gpu_on_the_rollout_container(render):
    rendered = render({"rollout": {"engine": "torch"}})
    rollout = rendered.container("rollout")
    assert rollout["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("name", values_names(), ids=lambda n: f"{n}-values")
def test_statefulsets_have_headless_services(render, name):
    rendered = render(load_values(name))
    statefulsets = rendered.of_kind("StatefulSet")
    groups = rendered.of_kind("LeaderWorkerSet")  # LWS makes its own headless Service
    assert {
        s["metadata"]["labels"]["app.kubernetes.io/component"] for s in statefulsets + groups
    } >= {"trainer", "rollout"}
    for sts in statefulsets:
        svc = rendered.get("Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    rollout_ip = rendered.get("Service", f"{FULL}-rollout")
    assert rollout_ip["spec"]["type"] == "ClusterIP" and "clusterIP" not in rollout_ip["spec"]


@pytest.mark.parametrize("name", values_names(), ids=lambda n: f"{n}-values")
def test_labels_and_selectors(render, name):
    rendered = render(load_values(name))
    for obj in rendered.objects:
        if obj["metadata"]["name"] == f"{RELEASE}-extra":  # the user's object, as written
            continue
        labels = obj["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance"):
            assert labels[key] in ("lorafleet", RELEASE), (obj["kind"], key)
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/part-of"] == "lorafleet"
        if obj["kind"] in ("Deployment", "StatefulSet"):
            selector = obj["spec"]["selector"]["matchLabels"]
            template = obj["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= template.items()
            assert "app.kubernetes.io/version" not in selector
    if name == "full":
        assert all(
            o["metadata"]["labels"]["team"] == "ml-platform"
            for o in rendered.objects
            if o["metadata"]["name"] != f"{RELEASE}-extra"
        )


def test_worker_volumes(render):
    rendered = render()
    for component in ("trainer", "rollout"):
        pod = rendered.workload(component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": "lorafleet-models",
            "readOnly": True,
        }
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == (
            f"{FULL}-checkpoints"
        )
        mounts = {m["mountPath"]: m for m in rendered.container(component)["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True
        assert mounts["/dev/shm"]["name"] == "dshm"
    pvc = rendered.get("PersistentVolumeClaim", f"{FULL}-checkpoints")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_per_pod_checkpoints_and_host_path_model(render):
    rendered = render(
        {"checkpoints": {"mode": "perPod", "accessModes": ["ReadWriteOnce"]}, **_host_model()}
    )
    assert not rendered.of_kind("PersistentVolumeClaim")
    for component in ("trainer", "rollout"):
        sts = rendered.workload(component)
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "checkpoints"
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert "checkpoints" not in volumes
        assert volumes["model"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}


def _host_model() -> dict:
    return {"model": {"source": "hostPath"}}


def test_controller_is_a_single_writer_by_default(render):
    deployment = render().workload("controller")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_controller_leader_election(render):
    rendered = render(load_values("full"))
    deployment = rendered.workload("controller")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    env = env_of(rendered.container("controller"))
    assert env["LORAFLEET_CONTROLLER_LEADER_ELECTION"] == "true"
    assert env["LORAFLEET_CONTROLLER_LEASE_NAME"] == "lorafleet-leader"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{FULL}-controller"
    assert pod["automountServiceAccountToken"] is True
    role = rendered.get("Role", f"{FULL}-controller")
    rules = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"]) for r in role["rules"]}
    assert rules[("discovery.k8s.io", "endpointslices")] >= {"list", "watch"}
    assert rules[("", "pods")] >= {"list", "watch"}
    assert rules[("coordination.k8s.io", "leases")] >= {"get", "create", "update"}
    binding = rendered.get("RoleBinding", f"{FULL}-controller")
    assert binding["subjects"][0]["name"] == f"{FULL}-controller"


def test_only_the_controller_mounts_an_api_token(render):
    for name, pod in render(load_values("full")).pod_specs():
        if not name.endswith("-controller"):
            assert pod["automountServiceAccountToken"] is False, name


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_bundled_redis(render, fsync):
    rendered = render({"redis": {"appendfsync": fsync}})
    redis = rendered.workload("redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == fsync
    assert cmd[cmd.index("--maxmemory") + 1] == "2gb"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    # A generated password (kept across upgrades), from a Secret; Redis's protected mode is
    # left on, which the password satisfies.
    assert cmd[cmd.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "--protected-mode" not in cmd
    ref = {"secretKeyRef": {"name": f"{FULL}-redis", "key": "redis-password"}}
    assert env_of(container)["REDIS_PASSWORD"] == ref
    assert env_of(container)["REDISCLI_AUTH"] == ref  # the probes' redis-cli
    password = rendered.get("Secret", f"{FULL}-redis")["data"]["redis-password"]
    assert len(password) >= 40  # 32 random characters, base64
    existing = render({"redis": {"auth": {"existingSecret": "corp-redis", "secretKey": "pw"}}})
    assert f"{FULL}-redis" not in {s["metadata"]["name"] for s in existing.of_kind("Secret")}
    assert env_of(existing.container("controller"))["REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": "corp-redis", "key": "pw"}
    }
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert rendered.get("Service", redis["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_external_redis(render):
    url = "rediss://redis.example.com:6380/2"
    rendered = render({"redis": {"enabled": False, "external": {"url": url}}})
    assert not rendered.of_kind("StatefulSet") or all(
        s["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"
        for s in rendered.of_kind("StatefulSet")
    )
    assert env_of(rendered.container("controller"))["LORAFLEET_CONTROLLER_REDIS_URL"] == url
    by_secret = render({"redis": {"enabled": False, "external": {"existingSecret": "r"}}})
    assert env_of(by_secret.container("controller"))["LORAFLEET_CONTROLLER_REDIS_URL"] == {
        "secretKeyRef": {"name": "r", "key": "redis-url"}
    }


def test_gateway_service_ingress_and_secret(render):
    rendered = render(load_values("full"))
    ingress = rendered.get("Ingress", f"{FULL}-gateway")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    service = rendered.get("Service", backend["name"])
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    env = env_of(rendered.container("gateway"))
    assert env["LORAFLEET_GATEWAY_DOWNLOAD_SECRET"]["secretKeyRef"]["name"] == (
        "lorafleet-download"
    )
    assert f"{FULL}-gateway" not in {s["metadata"]["name"] for s in rendered.of_kind("Secret")}
    default = render()
    secret = default.get("Secret", f"{FULL}-gateway")
    assert len(secret["data"]["download-secret"]) > 40
    assert not default.of_kind("Ingress")


def _policies(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in rendered.of_kind("NetworkPolicy")}


def _peer_name(peer: dict[str, Any]) -> str:
    labels = peer.get("podSelector", {}).get("matchLabels", {})
    return labels.get("app.kubernetes.io/component", labels.get("app.kubernetes.io/name", "?"))


def _sources(policy: dict[str, Any], port: int) -> list[str]:
    """Who may reach `port` ("anyone" for a rule without `from`, "*" for a rule of every port)."""
    out = []
    for rule in policy["spec"]["ingress"]:
        if "ports" not in rule or any(p["port"] == port for p in rule["ports"]):
            for peer in rule.get("from", [{"anyone": True}]):
                out.append("anyone" if "anyone" in peer else _peer_name(peer))
    return sorted(out)


def _destinations(policy: dict[str, Any]) -> set[tuple[str, int | None]]:
    """(peer, port) of each egress rule: "dns", a component, or "any address"; None = every port."""
    out = set()
    for rule in policy["spec"]["egress"]:
        peers = rule.get("to") or [{"any address": True}]
        for peer in peers:
            name = "any address" if "any address" in peer else _peer_name(peer)
            if peer.get("podSelector", {}).get("matchLabels", {}).get("k8s-app") == "kube-dns":
                name = "dns"
            for port in rule.get("ports") or [{"port": None}]:
                out.add((name, port["port"]))
    return out


@pytest.mark.parametrize("name", ["default", "full"])
def test_network_policies(render, name):
    """On by default, ingress and egress, for every pod of the release: each component reaches
    only what it calls, and a pod without the release's labels only the gateway's HTTP port."""
    rendered = render(load_values(name))
    policies = _policies(rendered)
    components = ("controller", "trainer", "rollout", "gateway", "redis", "test")
    assert set(policies) == {f"{FULL}-{c}" for c in components}
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    # Every pod of the release is selected by its component's policy.
    for pod_name, _ in rendered.pod_specs():
        selected = [
            p
            for p in policies.values()
            if pod_name.removeprefix(f"{FULL}-").split("-")[0]
            == p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        ]
        assert len(selected) == 1, pod_name
    pol = {c: policies[f"{FULL}-{c}"] for c in components}
    assert _sources(pol["trainer"], 50052) == ["controller"]
    assert _sources(pol["rollout"], 50053) == ["controller"]
    assert _sources(pol["redis"], 6379) == ["controller"]
    assert _sources(pol["trainer"], 9100) == ["prometheus"]
    assert _sources(pol["controller"], 9100) == ["prometheus"]
    assert _sources(pol["gateway"], 9100) == ["prometheus"]
    assert "prometheus" not in _sources(pol["gateway"], 8000)  # it serves no /metrics
    # Trainers and rollouts register themselves with the controller; the test pod checks it.
    assert _sources(pol["controller"], 50051) == ["gateway", "rollout", "test", "trainer"]
    assert _sources(pol["test"], 8000) == []
    # Strangers reach the gateway's HTTP port (API keys guard it; full-values names who) only.
    for component, policy in pol.items():
        for rule in policy["spec"]["ingress"]:
            anyone = "from" not in rule
            assert not anyone or (component == "gateway" and rule["ports"][0]["port"] == 8000)
    if name == "full":
        assert "anyone" not in _sources(pol["gateway"], 8000)
    dns = {("dns", 53)}
    assert _destinations(pol["gateway"]) == dns | {("controller", 50051)}
    assert _destinations(pol["trainer"]) == dns | {("controller", 50051)}
    assert _destinations(pol["rollout"]) == dns | {("controller", 50051)}
    assert _destinations(pol["redis"]) == set()
    assert _destinations(pol["test"]) == dns | {("controller", 50051), ("gateway", 8000)}
    assert _destinations(pol["controller"]) == dns | {
        ("trainer", 50052),
        ("rollout", 50053),
        ("redis", 6379),
        ("any address", 443),  # the Kubernetes API (discovery, the Lease)
        ("any address", 6443),
    }
    assert not render({"networkPolicy": {"enabled": False}}).of_kind("NetworkPolicy")


def test_network_policies_open_multi_node_groups_and_external_redis(render):
    """The pods of trainer and rollout groups reach each other on every port (rendezvous,
    NCCL); an external Redis is reached on its URL's port, anywhere."""
    pol = _policies(render(load_values("multinode")))
    for component in ("trainer", "rollout"):
        policy = pol[f"{FULL}-{component}"]
        assert (component, None) in _destinations(policy)
        assert component in _sources(policy, 12345)  # any port
        assert _sources(policy, 50052 if component == "trainer" else 50053) == sorted(
            ["controller", component]
        )
    external = {"redis": {"enabled": False, "external": {"url": "rediss://r.example.com:6380/1"}}}
    pol = _policies(render(external))
    assert f"{FULL}-redis" not in pol
    assert ("any address", 6380) in _destinations(pol[f"{FULL}-controller"])
    extra = {"networkPolicy": {"controllerEgress": [{"ports": [{"port": 9000}]}]}}
    assert ("any address", 9000) in _destinations(_policies(render(extra))[f"{FULL}-controller"])


def test_pod_disruption_budgets(render):
    rendered = render(load_values("full"))
    pdbs = {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p
        for p in rendered.of_kind("PodDisruptionBudget")
    }
    assert set(pdbs) == {"controller", "trainer", "rollout", "gateway"}
    for component, pdb in pdbs.items():
        workload = rendered.workload(component)
        assert pdb["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]


def test_service_monitors_select_metrics_ports(render):
    rendered = render(load_values("full"))
    monitors = rendered.of_kind("ServiceMonitor")
    assert len(monitors) == 4
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        selector = monitor["spec"]["selector"]["matchLabels"]
        matched = [
            s
            for s in rendered.of_kind("Service")
            if selector.items() <= s["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, monitor["metadata"]["name"]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "metrics"
        assert endpoint["port"] in {p["name"] for p in matched[0]["spec"]["ports"]}
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
        assert endpoint["metricRelabelings"][0]["action"] == "drop"
    assert not render().of_kind("ServiceMonitor")


def test_gateway_metrics_stay_off_the_public_service(render):
    """The gateway's metrics port is its own container port, on a headless Service for
    Prometheus; the public Service (a LoadBalancer, say) carries HTTP only."""
    rendered = render(
        deep_merge(load_values("full"), {"gateway": {"service": {"type": "LoadBalancer"}}})
    )
    ports = {p["name"]: p["containerPort"] for p in rendered.container("gateway")["ports"]}
    assert ports == {"http": 8000, "metrics": 9100}
    public = rendered.get("Service", f"{FULL}-gateway")
    assert [p["name"] for p in public["spec"]["ports"]] == ["http"]
    assert "lorafleet.io/scrape" not in public["metadata"]["labels"]
    scraped = rendered.get("Service", f"{FULL}-gateway-metrics")
    assert scraped["spec"]["clusterIP"] == "None"
    assert (
        scraped["spec"]["selector"]
        == rendered.workload("gateway")["spec"]["selector"]["matchLabels"]
    )
    (port,) = scraped["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("metrics", 9100, "metrics")


def test_dashboard_config_maps(render):
    rendered = render(load_values("full"))
    maps = [
        c
        for c in rendered.of_kind("ConfigMap")
        if "grafana_dashboard" in c["metadata"].get("labels", {})
    ]
    assert len(maps) == len(DASHBOARDS) == 4
    uids = set()
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "lorafleet"}
        ((file_name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / file_name).read_text())
        uids.add(json.loads(text)["uid"])
    assert len(uids) == 4
    assert not [
        c
        for c in render().of_kind("ConfigMap")
        if "grafana_dashboard" in c["metadata"].get("labels", {})
    ]


def test_escape_hatches(render):
    rendered = render(load_values("full"))
    controller = rendered.container("controller")
    assert controller["args"] == ["--verbose"]
    assert env_of(controller)["LORAFLEET_CONTROLLER_COALESCE_WINDOW_MS"] == "5"
    assert {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in controller[
        "volumeMounts"
    ]
    extra = rendered.get("ConfigMap", f"{RELEASE}-extra")
    assert extra["data"] == {"note": "rendered through tpl"}
    assert "--enable-lora-overlap-loading" in rendered.container("rollout", "sglang")["command"]
    assert (
        rendered.container("trainer")["image"] == "registry.example.com/lorafleet/trainer:0.1.0-rc1"
    )


def test_helm_test_hook(render):
    (pod,) = render().of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["command"][-1]
    assert f"{FULL}-controller:50051" in script and "/api/v1/healthz" in script
    compile(script, "helm-test", "exec")


def test_notes_render(render):
    notes = render(load_values("full")).files["lorafleet/templates/NOTES.txt"]
    assert "https://tinker.example.com/api/v1/" in notes
    assert "Lease lorafleet-leader" in notes


# --- dashboards ---------------------------------------------------------------------------


def test_dashboards_are_generated_from_build_py():
    build = REPO / "deploy" / "dashboards" / "build.py"
    result = subprocess.run(
        [sys.executable, str(build), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _dashboards() -> list[dict]:
    return [json.loads(p.read_text()) for p in DASHBOARDS]


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_dashboards_structure():
    dashboards = _dashboards()
    assert {d["uid"] for d in dashboards} == {
        "lorafleet-fleet-overview",
        "lorafleet-training",
        "lorafleet-sampling",
        "lorafleet-ledger",
    }
    for d in dashboards:
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), d["uid"]
        for panel in d["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert target["expr"].count("(") == target["expr"].count(")")
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24


def _metrics_txt() -> set[str]:
    lines = (REPO / "deploy" / "dashboards" / "metrics.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def test_dashboards_use_only_listed_metrics():
    listed = _metrics_txt()
    used = {m for d in _dashboards() for e in _exprs(d) for m in METRIC_NAME.findall(e)}
    assert used - listed == set(), "add these to deploy/dashboards/metrics.txt"
    assert listed - used == set(), "metrics.txt lists names no dashboard uses"


def test_metric_names_follow_conventions():
    for name in _metrics_txt():
        assert re.fullmatch(r"(lorafleet|grpc_server)_[a-z0-9_]+", name), name
        assert not name.endswith(("_count", "_sum")), name


# --- trainer groups and multi-node (LeaderWorkerSet) -----------------------------------------


def test_gpus_per_replica_runs_torchrun_in_one_pod(render):
    rendered = render(load_values("llama-70b"))
    assert rendered.workload("trainer")["kind"] == "StatefulSet"
    trainer = rendered.container("trainer")
    assert trainer["command"] == [
        "torchrun",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=8",
        "-m",
        "lorafleet_trainer",
    ]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = env_of(trainer)
    assert env["LORAFLEET_TRAINER_DEVICE"] == "cuda"
    assert env["LORAFLEET_TRAINER_GROUP_TIMEOUT_SECONDS"] == "120"
    # One GPU per replica stays a plain process.
    single = render(load_values("gpu")).container("trainer")
    assert single["command"] == ["python", "-m", "lorafleet_trainer"]
    assert "LORAFLEET_TRAINER_GROUP_TIMEOUT_SECONDS" not in env_of(single)


def test_leader_worker_sets_validate_and_wire_the_group(render):
    """The LWS objects (a CRD: no upstream schema here) are checked structurally, and every
    pod template they hold is validated as a Pod against the Kubernetes schemas."""
    rendered = render(load_values("multinode"))
    kinds = {
        (o["kind"], o["metadata"]["labels"]["app.kubernetes.io/component"])
        for o in rendered.objects
        if "app.kubernetes.io/component" in o["metadata"]["labels"]
    }
    assert ("StatefulSet", "trainer") not in kinds and ("StatefulSet", "rollout") not in kinds
    for component in ("trainer", "rollout"):
        lws = rendered.get("LeaderWorkerSet", f"{FULL}-{component}-group")
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = lws["spec"]
        assert spec["replicas"] == 1
        assert spec["leaderWorkerTemplate"]["size"] == 2
        assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        for role in ("leader", "worker"):
            template = spec["leaderWorkerTemplate"][f"{role}Template"]
            assert template["metadata"]["labels"]["lorafleet.io/group-role"] == role
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{component}-{role}", "namespace": NAMESPACE},
                "spec": template["spec"],
            }
            kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)

    leader = rendered.container("trainer", role="leader")
    worker = rendered.container("trainer", role="worker")
    for c in (leader, worker):
        assert c["command"] == [
            "torchrun",
            "--nnodes=2",
            "--nproc-per-node=8",
            "--node-rank=$(LWS_WORKER_INDEX)",
            "--master-addr=$(LWS_LEADER_ADDRESS)",
            "--master-port=29500",
            "-m",
            "lorafleet_trainer",
        ]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    # Rank 0 (the leader) serves gRPC and is what the controller dials; workers only follow.
    assert "grpc" in {p["name"] for p in leader["ports"]} and "readinessProbe" in leader
    assert "grpc" not in {p["name"] for p in worker["ports"]} and "readinessProbe" not in worker
    assert env_of(leader)["LORAFLEET_TRAINER_ADVERTISE_ADDRESS"] == (
        f"$(LORAFLEET_TRAINER_REPLICA_ID).{FULL}-trainer-group.{NAMESPACE}.svc:50052"
    )

    # Multi-node SGLang: one server over the group; the rollout container only on the leader.
    lws = rendered.get("LeaderWorkerSet", f"{FULL}-rollout-group")["spec"]["leaderWorkerTemplate"]
    assert [c["name"] for c in lws["leaderTemplate"]["spec"]["containers"]] == ["rollout", "sglang"]
    assert [c["name"] for c in lws["workerTemplate"]["spec"]["containers"]] == ["sglang"]
    for role in ("leader", "worker"):
        args = rendered.container("rollout", "sglang", role=role)["command"]
        assert {
            "--tp-size=8",
            "--pp-size=2",
            "--nnodes=2",
            "--node-rank=$(LWS_WORKER_INDEX)",
        } <= set(args)
        assert "--dist-init-addr=$(LWS_LEADER_ADDRESS):20000" in args
    assert "livenessProbe" not in rendered.container("rollout", "sglang", role="worker")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"trainer": {"leaderWorkerSet": {"enabled": True}}, "checkpoints": {"mode": "perPod"}},
            "checkpoints.mode shared",
        ),
        ({"rollout": {"engine": "torch", "leaderWorkerSet": {"enabled": True}}}, "engine sglang"),
    ],
)
def test_group_guards(chart, override, message):
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart.render(values=override, name=RELEASE, namespace=NAMESPACE)


# --- internal mutual TLS ---------------------------------------------------------------------

TLS_KINDS = ("controller", "trainer", "rollout", "gateway")
EXISTING = {kind: f"corp-{kind}-tls" for kind in TLS_KINDS}
# Each render with TLS on: Helm's certificates, cert-manager with the chart's CA, existing
# Secrets, multi-node.
TLS_RENDERS = {
    "helm-generated (the default)": {},
    "cert-manager": load_values("tls"),
    "existing-secrets": {"tls": {"enabled": True, "existingSecret": EXISTING}},
    "multinode": deep_merge(load_values("multinode"), {"tls": {"enabled": True}}),
}


def _secret_volumes(pod: dict[str, Any]) -> dict[str, str]:
    """volume name -> Secret name of a pod spec's secret volumes."""
    return {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}


@pytest.mark.parametrize("case", TLS_RENDERS)
def test_every_lorafleet_container_gets_the_tls_identity(render, case):
    """Every lorafleet container (and the helm test pod) has LORAFLEET_TLS_* naming files of
    its kind's Secret, mounted read-only with a key only the pod's group reads; SGLang none."""
    rendered = render(TLS_RENDERS[case])
    seen = set()
    for pod_name, pod in rendered.pod_specs():
        volumes = _secret_volumes(pod)
        for c in pod["containers"]:
            env = env_of(c)
            if c["name"] not in (*TLS_KINDS, "health"):
                assert not any(k.startswith("LORAFLEET_TLS_") for k in env), c["name"]
                assert "tls" not in {m["name"] for m in c.get("volumeMounts", [])}
                continue
            kind = "gateway" if c["name"] == "health" else c["name"]  # helm test dials as it
            seen.add(kind)
            assert env["LORAFLEET_TLS_CA_FILE"] == "/etc/lorafleet/tls/ca.crt"
            assert env["LORAFLEET_TLS_CERT_FILE"] == "/etc/lorafleet/tls/tls.crt"
            assert env["LORAFLEET_TLS_KEY_FILE"] == "/etc/lorafleet/tls/tls.key"
            assert env["LORAFLEET_TLS_SERVER_NAME"] == f"{FULL}-internal"
            assert env["LORAFLEET_TLS_ADMIN_NAMES"] == "lorafleet-admin"
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
            assert mount == {"name": "tls", "mountPath": "/etc/lorafleet/tls", "readOnly": True}
            expected = EXISTING[kind] if case == "existing-secrets" else f"{FULL}-{kind}-tls"
            assert volumes["tls"] == expected, pod_name
            (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
            assert volume["secret"]["defaultMode"] == 0o440
    assert seen == set(TLS_KINDS)


@pytest.mark.parametrize("case", TLS_RENDERS)
def test_the_admin_certificate_is_mounted_by_no_pod(render, case):
    rendered = render(TLS_RENDERS[case])
    admin = f"{FULL}-admin-tls"
    for pod_name, pod in rendered.pod_specs():
        assert admin not in json.dumps(pod), pod_name
        for c in pod["containers"]:
            assert "lorafleet-admin" not in {
                e.get("value") for e in c.get("env", []) if e["name"] != "LORAFLEET_TLS_ADMIN_NAMES"
            }


def test_tls_via_cert_manager_with_the_charts_own_ca(render):
    rendered = render(load_values("tls"))
    certs = {c["metadata"]["name"]: c for c in rendered.of_kind("Certificate")}
    assert set(certs) == {f"{FULL}-{k}-tls" for k in (*TLS_KINDS, "admin")} | {f"{FULL}-ca"}
    for cert in certs.values():
        assert cert["apiVersion"] == "cert-manager.io/v1"
    ca = certs[f"{FULL}-ca"]["spec"]
    assert ca["isCA"] is True and ca["privateKey"]["rotationPolicy"] == "Never"
    issuers = {i["metadata"]["name"]: i["spec"] for i in rendered.of_kind("Issuer")}
    assert issuers == {
        f"{FULL}-selfsigned": {"selfSigned": {}},
        f"{FULL}-ca": {"ca": {"secretName": ca["secretName"]}},
    }
    assert ca["issuerRef"]["name"] == f"{FULL}-selfsigned"
    services = {s["metadata"]["name"] for s in rendered.of_kind("Service")}
    for kind in TLS_KINDS:
        spec = certs[f"{FULL}-{kind}-tls"]["spec"]
        assert spec["secretName"] == f"{FULL}-{kind}-tls"
        assert spec["commonName"] == kind
        assert spec["usages"] == ["digital signature", "server auth", "client auth"]
        assert spec["issuerRef"] == {
            "name": f"{FULL}-ca",
            "kind": "Issuer",
            "group": "cert-manager.io",
        }
        names = spec["dnsNames"]
        # The name peers check (pods are dialled by IP), and the kind's Services (not the
        # gateway's metrics Service: Prometheus scrapes plaintext HTTP).
        assert names[0] == f"{FULL}-internal"
        assert {n for n in names if n in services} == {
            s
            for s in services
            if s.startswith(f"{FULL}-{kind}") and "redis" not in s and not s.endswith("-metrics")
        }, kind
    assert (
        f"*.{FULL}-trainer-headless.{NAMESPACE}.svc"
        in certs[f"{FULL}-trainer-tls"]["spec"]["dnsNames"]
    )
    admin = certs[f"{FULL}-admin-tls"]["spec"]
    assert admin["commonName"] == "lorafleet-admin"
    assert admin["usages"] == ["digital signature", "client auth"]
    assert "dnsNames" not in admin
    # Reloader rolls the Deployments/StatefulSets when their certificate is renewed.
    for kind in TLS_KINDS:
        workload = rendered.workload(kind)
        annotations = workload["metadata"]["annotations"]
        assert annotations["secret.reloader.stakater.com/reload"] == f"{FULL}-{kind}-tls"
    assert not render().of_kind("Certificate")


def test_tls_with_an_issuer_and_existing_secrets(render):
    issuer = {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    rendered = render(
        {
            "tls": {
                "enabled": True,
                "existingSecret": {"trainer": "gpu-trainer-tls"},
                "certManager": {"issuerRef": issuer},
            }
        }
    )
    certs = {c["metadata"]["name"]: c["spec"] for c in rendered.of_kind("Certificate")}
    assert set(certs) == {f"{FULL}-{k}-tls" for k in ("controller", "rollout", "gateway", "admin")}
    assert all(spec["issuerRef"] == issuer for spec in certs.values())
    assert not rendered.of_kind("Issuer")
    trainer = rendered.workload("trainer")["spec"]["template"]["spec"]
    assert _secret_volumes(trainer)["tls"] == "gpu-trainer-tls"
    # Every kind from existing Secrets: nothing for cert-manager to do.
    every = render({"tls": {"enabled": True, "existingSecret": EXISTING}})
    assert not every.of_kind("Certificate") and not every.of_kind("Issuer")
    notes = every.files["lorafleet/templates/NOTES.txt"]
    assert "mutual TLS" in notes and f"{FULL}-admin-tls" not in notes


def test_tls_by_default_with_certificates_helm_generates(render):
    """Without cert-manager the chart makes the CA and every certificate itself: one CA signs
    them all, each kind's common name is its role and its DNS names are those cert-manager
    would put in, the admin certificate is client-only; no Certificate objects."""
    import base64

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    rendered = render()
    assert not rendered.of_kind("Certificate") and not rendered.of_kind("Issuer")
    cert_manager = render(load_values("tls"))

    def pem(secret: str, key: str) -> x509.Certificate:
        data = rendered.get("Secret", secret)["data"][key]
        return x509.load_pem_x509_certificate(base64.b64decode(data))

    ca = pem(f"{FULL}-ca", "tls.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for kind in (*TLS_KINDS, "admin"):
        secret = f"{FULL}-{kind}-tls"
        assert rendered.get("Secret", secret)["type"] == "kubernetes.io/tls"
        assert pem(secret, "ca.crt") == ca
        leaf = pem(secret, "tls.crt")
        leaf.verify_directly_issued_by(ca)
        (cn,) = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        usages = set(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
        if kind == "admin":
            assert cn.value == "lorafleet-admin"
            continue
        assert cn.value == kind
        spec = cert_manager.get("Certificate", secret)["spec"]
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == spec["dnsNames"]
    # The CA's key is in its own Secret, which no pod mounts.
    for pod_name, pod in rendered.pod_specs():
        assert f"{FULL}-ca" not in _secret_volumes(pod).values(), pod_name


def test_tls_guards(chart):
    partial = {"tls": {"provider": "certManager", "existingSecret": {"trainer": "t"}}}
    with pytest.raises(helm_python.HelmRenderError, match="issuerRef"):
        chart.render(values=partial, name=RELEASE, namespace=NAMESPACE)
    generated = {"tls": {"existingSecret": {"trainer": "t"}}}
    with pytest.raises(helm_python.HelmRenderError, match="did not sign the existing Secrets"):
        chart.render(values=generated, name=RELEASE, namespace=NAMESPACE)
    with pytest.raises(helm_python.HelmValuesError, match="adminNames"):
        chart.render(values={"tls": {"adminNames": []}}, name=RELEASE, namespace=NAMESPACE)


def test_gateway_pods_roll_when_the_charts_download_key_changes(render):
    def checksum(values: dict) -> str | None:
        meta = render(values).workload("gateway")["spec"]["template"]["metadata"]
        return meta.get("annotations", {}).get("checksum/download-secret")

    key = "k" * 32
    assert checksum({"gateway": {"downloadSecret": {"value": key}}}) == checksum(
        {"gateway": {"downloadSecret": {"value": key}, "replicaCount": 3}}
    )
    assert checksum({"gateway": {"downloadSecret": {"value": key}}}) != checksum(
        {"gateway": {"downloadSecret": {"value": "j" * 32}}}
    )
    assert checksum(load_values("full")) is None  # an existing Secret is the operator's


async def test_rendered_tls_wiring_authenticates_real_grpc_peers(render, tmp_path):
    """Certificates made as the rendered Certificates specify (common name, DNS names), in
    files where the rendered LORAFLEET_TLS_* env says, loaded by the services' own code: the
    controller reaches a trainer dialled by IP (as discovery does) because every certificate
    carries the shared server name; without that name, or without a certificate, the call is
    refused; the kubelet's probe gets an answer in plaintext on the health port."""
    import dataclasses

    import grpc
    import trustme
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from lorafleet.rpc.channel import make_channel
    from lorafleet.rpc.server import ServiceSpec, start_server
    from lorafleet.settings import TLS_PREFIX, ServerSettings, TlsSettings, load_settings
    from lorafleet.testing import free_port
    from lorafleet.tls import identity_from_settings

    rendered = render(load_values("tls"))
    ca = trustme.CA()
    identities = {}
    for kind in ("controller", "trainer"):
        spec = rendered.get("Certificate", f"{FULL}-{kind}-tls")["spec"]
        leaf = ca.issue_cert(*spec["dnsNames"], common_name=spec["commonName"])
        folder = tmp_path / kind
        folder.mkdir()
        ca.cert_pem.write_to_path(str(folder / "ca.crt"))
        leaf.cert_chain_pems[0].write_to_path(str(folder / "tls.crt"))
        leaf.private_key_pem.write_to_path(str(folder / "tls.key"))
        env = {
            k: v.replace("/etc/lorafleet/tls", str(folder))
            for k, v in env_of(rendered.container(kind)).items()
            if k.startswith(TLS_PREFIX)
        }
        identities[kind] = identity_from_settings(load_settings(TlsSettings, TLS_PREFIX, env))

    service = GRPC_SERVICES["trainer"]
    trainer = await start_server(
        ServerSettings(port=0, health_port=free_port()),
        [ServiceSpec(None, lambda servicer, server: None, service)],
        tls=identities["trainer"],
    )

    async def check(channel: grpc.aio.Channel) -> int:
        async with channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)).status

    serving = health_pb2.HealthCheckResponse.SERVING
    address = f"127.0.0.1:{trainer.port}"
    try:
        assert await check(make_channel(address, tls=identities["controller"])) == serving
        unnamed = dataclasses.replace(identities["controller"], server_name="")
        for refused in (make_channel(address, tls=unnamed), grpc.aio.insecure_channel(address)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await check(refused)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        probe = grpc.aio.insecure_channel(f"127.0.0.1:{trainer.health_port}")
        assert await check(probe) == serving
    finally:
        await trainer.stop()


def _pod_env(rendered: Rendered, component: str, pod: str) -> dict[str, str]:
    """A container's env as the kubelet gives it on one host: fieldRefs of pod `pod`,
    secretKeyRefs read from the rendered Secrets, $(VAR) expanded, Service names -> loopback."""
    import base64

    secrets = {o["metadata"]["name"]: o.get("data", {}) for o in rendered.of_kind("Secret")}
    fields = {"metadata.name": pod, "metadata.namespace": NAMESPACE}
    out: dict[str, str] = {}
    for name, value in env_of(rendered.container(component)).items():
        if isinstance(value, dict) and "fieldRef" in value:
            value = fields[value["fieldRef"]["fieldPath"]]
        elif isinstance(value, dict):
            ref = value["secretKeyRef"]
            value = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
        value = re.sub(r"\$\((\w+)\)", lambda m: out[m.group(1)], value)
        out[name] = re.sub(rf"{FULL}-[a-z-]+(\.{NAMESPACE}\.svc)?", "127.0.0.1", value)
    return out


def _secret_identity(rendered: Rendered, secret: str, folder: Path) -> Any:
    """The TLS identity in a rendered certificate Secret, through files as a pod mounts them."""
    import base64

    from lorafleet.settings import TlsSettings
    from lorafleet.tls import identity_from_settings

    folder.mkdir()
    data = rendered.get("Secret", secret)["data"]
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (folder / key).write_bytes(base64.b64decode(data[key]))
    settings = TlsSettings(
        folder / "ca.crt", folder / "tls.crt", folder / "tls.key", server_name=f"{FULL}-internal"
    )
    return identity_from_settings(settings)


def test_chart_defaults_admit_no_caller_without_a_certificate(render, tmp_path):
    """The default install, started as rendered: the controller with the env, the Helm-made
    certificate and the generated Redis password the chart gives it, Redis requiring that
    password. A caller without a certificate reaches nothing (the handshake refuses it); the
    gateway's certificate cannot mint a key; the trainer's cannot register a rollout or act
    for a tenant; the admin certificate (which no pod mounts) can, and the refused calls
    changed nothing."""
    import grpc

    from lorafleet.rpc.channel import make_blocking_channel
    from lorafleet.testing import (
        child_env,
        free_port,
        redis_server,
        service_process,
        wait_until,
    )
    from lorafleet.v1 import controller_pb2, controller_pb2_grpc

    rendered = render()
    env = _pod_env(rendered, "controller", f"{FULL}-controller-0")
    tls = tmp_path / "tls"
    identity = {
        kind: _secret_identity(rendered, f"{FULL}-{kind}-tls", tmp_path / kind)
        for kind in ("controller", "gateway", "trainer", "admin")
    }
    (tmp_path / "controller").rename(tls)
    port, health = free_port(), free_port()
    env = {k: v.replace("/etc/lorafleet/tls", str(tls)) for k, v in env.items()}
    with redis_server(tmp_path / "redis", password=env["REDIS_PASSWORD"]) as redis:
        assert env["LORAFLEET_CONTROLLER_REDIS_URL"].startswith("redis://:")
        url = env["LORAFLEET_CONTROLLER_REDIS_URL"].replace(":6379/", f":{redis.port}/")
        env.update(
            LORAFLEET_CONTROLLER_REDIS_URL=url,
            LORAFLEET_CONTROLLER_PORT=str(port),
            LORAFLEET_CONTROLLER_HEALTH_PORT=str(health),
            LORAFLEET_CONTROLLER_METRICS_PORT="0",
            LORAFLEET_CONTROLLER_HOST="127.0.0.1",
            LORAFLEET_CONTROLLER_STORAGE_ROOT=str(tmp_path / "checkpoints"),
            LORAFLEET_CONTROLLER_SHARED_ADAPTER_ROOT=str(tmp_path / "checkpoints" / "shared"),
            # No cluster to discover pods in: replicas announce themselves.
            LORAFLEET_CONTROLLER_DISCOVERY="self",
        )
        address = f"127.0.0.1:{port}"
        log = tmp_path / "controller.log"
        with service_process("lorafleet_controller", port, child_env(**env), log):

            def admin() -> controller_pb2_grpc.ControllerServiceStub:
                channel = make_blocking_channel(address, tls=identity["admin"])
                return controller_pb2_grpc.ControllerServiceStub(channel)

            def serving() -> bool:
                try:
                    admin().GetCapabilities(controller_pb2.GetCapabilitiesRequest(), timeout=5)
                except grpc.RpcError:
                    return False
                return True

            wait_until(serving, "the controller serves on the rendered certificates")
            create = controller_pb2.CreateApiKeyRequest(tenant="victim", label="stolen")
            no_certificate = [
                grpc.insecure_channel(address),
                grpc.secure_channel(
                    address,
                    grpc.ssl_channel_credentials(root_certificates=identity["admin"].ca),
                    options=[("grpc.ssl_target_name_override", f"{FULL}-internal")],
                ),
            ]
            for channel in no_certificate:
                with channel, pytest.raises(grpc.RpcError) as info:
                    controller_pb2_grpc.ControllerServiceStub(channel).CreateApiKey(
                        create, timeout=10
                    )
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            register = controller_pb2.RegisterReplicaRequest(
                kind=controller_pb2.REPLICA_KIND_ROLLOUT,
                replica_id="rollout-9",
                address="127.0.0.1:1",
                base_model="fake",
            )
            refused = [
                ("gateway", lambda s: s.CreateApiKey(create, timeout=10), "operator"),
                ("trainer", lambda s: s.RegisterReplica(register, timeout=10), "kind"),
                (
                    "trainer",
                    lambda s: s.CreateSession(
                        controller_pb2.CreateSessionRequest(tenant="victim"), timeout=10
                    ),
                    "gateway or operator",
                ),
            ]
            for kind, call, why in refused:
                with (
                    make_blocking_channel(address, tls=identity[kind]) as channel,
                    pytest.raises(grpc.RpcError) as info,
                ):
                    call(controller_pb2_grpc.ControllerServiceStub(channel))
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, kind
                assert why in str(info.value.details()), kind
            stub = admin()
            keys = stub.ListApiKeys(controller_pb2.ListApiKeysRequest(tenant="victim"), timeout=10)
            assert list(keys.keys) == []
            status = stub.GetFleetStatus(controller_pb2.GetFleetStatusRequest(), timeout=10)
            assert list(status.replicas) == []
            assert stub.CreateApiKey(create, timeout=10).api_key
        assert env["REDIS_PASSWORD"] not in log.read_text()


def test_model_quantization_reaches_trainer_rollout_and_model_server(chart, render):
    """model.quantization is one value for the whole model: both services get it (the
    controller refuses a replica that differs), fp8 becomes the server's own
    --quantization, and int8, which neither SGLang nor vLLM has, fails rendering with them."""
    rendered = render()
    for component, prefix in (("trainer", "LORAFLEET_TRAINER_"), ("rollout", "LORAFLEET_ROLLOUT_")):
        assert env_of(rendered.container(component))[prefix + "QUANTIZATION"] == "none"
    assert not any(
        a.startswith("--quantization") for a in rendered.container("rollout", "sglang")["command"]
    )
    fp8 = {"model": {"quantization": "fp8"}}
    assert "--quantization=fp8" in render(fp8).container("rollout", "sglang")["command"]
    vllm = deep_merge(load_values("vllm"), fp8)
    assert "--quantization=fp8" in render(vllm).container("rollout", "vllm")["command"]
    int8 = {"model": {"quantization": "int8"}, "rollout": {"engine": "torch"}}
    rendered = render(int8)
    for component, prefix in (("trainer", "LORAFLEET_TRAINER_"), ("rollout", "LORAFLEET_ROLLOUT_")):
        assert env_of(rendered.container(component))[prefix + "QUANTIZATION"] == "int8"
    for engine in ("sglang", "vllm"):
        with pytest.raises(helm_python.HelmRenderError, match="torch engine only"):
            chart.render(
                values={"model": {"quantization": "int8"}, "rollout": {"engine": engine}},
                name=RELEASE,
                namespace=NAMESPACE,
            )
    with pytest.raises(helm_python.HelmValuesError, match="quantization"):
        chart.render(values={"model": {"quantization": "int4"}}, name=RELEASE, namespace=NAMESPACE)
