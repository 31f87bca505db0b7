"""The Kubernetes manifests (deploy/k8s/) and compose.yaml agree with the code they run: every
command parses with the CLI, every ``OUTBOX_*`` name is a setting of it and its value
validates, the probes ask paths the daemons serve on the port they listen on, and the KEDA
example never scales consumers past the partitions."""

from __future__ import annotations

import os
import re
import shlex
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from outbox_relay.cli import main as cli
from outbox_relay.cli import options
from outbox_relay.consumer import metrics as consumer_metrics
from outbox_relay.runs.settings import ServeSettings, WorkerSettings
from outbox_relay.shared.metrics_server import MetricsServer
from outbox_relay.shared.settings import CommonSettings, DaemonSettings, RelaySettings
from tests.helpers import ROOT

K8S = ROOT / "deploy" / "k8s"

# The settings model of each command the manifests run (as cli/main.py builds its parser).
MODELS: dict[tuple[str, ...], type[CommonSettings]] = {
    ("db", "upgrade"): CommonSettings,
    ("db", "check"): CommonSettings,
    ("relay",): RelaySettings,
    ("consume",): WorkerSettings,
    ("serve",): ServeSettings,
}


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def configmap() -> dict[str, str]:
    (config,) = of_kind("ConfigMap")
    data: dict[str, str] = config["data"]
    return data


def secret_keys() -> set[str]:
    (secret,) = of_kind("Secret")
    return set(secret["stringData"])


def workloads() -> list[dict[str, Any]]:
    return of_kind("Deployment") + of_kind("Job")


def containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def outbox_argvs(container: dict[str, Any]) -> list[list[str]]:
    """The ``outbox …`` command lines a container runs: its args (the image's entrypoint is
    ``outbox``), or each ``outbox`` invocation in its ``sh -c`` script."""
    if "command" not in container:
        return [list(container["args"])]
    command = container["command"]
    assert command[:2] == ["sh", "-c"], command
    lexer = shlex.shlex(command[2], posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words, argvs = list(lexer), []
    for i, word in enumerate(words):
        if word == "outbox":
            rest = words[i + 1:]
            ends = [n for n, w in enumerate(rest) if w in (";", "&&", "||", "|", "do", "done")]
            argvs.append(rest[:ends[0]] if ends else rest)
    assert argvs, f"{container['name']} runs no outbox command"
    return argvs


def parsed(argv: list[str]) -> tuple[type[CommonSettings], Any]:
    """The command's settings model and parsed namespace (argparse exits on a bad command)."""
    namespace = cli.build_parser().parse_args(argv)
    key = tuple(a for a in argv[:2] if not a.startswith("-"))
    model = MODELS.get(key) or MODELS[key[:1]]
    return model, namespace


def environment(container: dict[str, Any]) -> dict[str, str]:
    """The ``OUTBOX_*`` environment of a container: its ConfigMap, its Secret (the example's
    values) and its own ``env`` entries (a field reference stands for a pod name)."""
    env: dict[str, str] = {}
    (secret,) = of_kind("Secret")
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            assert source["configMapRef"]["name"] == of_kind("ConfigMap")[0]["metadata"]["name"]
            env.update(configmap())
        if "secretRef" in source:
            assert source["secretRef"]["name"] == secret["metadata"]["name"]
            env.update(secret["stringData"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "outbox-pod-0")
    return env


def settings_of(model: type[CommonSettings], env: dict[str, str],
                monkeypatch: pytest.MonkeyPatch) -> CommonSettings:
    with monkeypatch.context() as m:
        for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        return model()


def known_names() -> set[str]:
    cli.build_parser()  # imports every settings model
    fields = {f"OUTBOX_{name.upper()}" for model in options._settings_models()
              for name in model.model_fields}
    return fields | options.NOT_FIELDS


def test_every_manifest_is_a_kubernetes_object_and_the_kustomization_lists_files() -> None:
    for doc in documents():
        assert {"apiVersion", "kind"} <= set(doc), doc
    (kustomization,) = of_kind("Kustomization")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    kinds = sorted(d["kind"] for d in workloads())
    assert kinds == ["Deployment", "Deployment", "Job"]


def test_every_command_is_a_cli_command_and_its_environment_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    known = known_names()
    ran: set[tuple[str, ...]] = set()
    for workload in workloads():
        for container in containers(workload):
            env = environment(container)
            assert set(env) <= known, f"unknown settings in {container['name']}: " \
                f"{sorted(set(env) - known)}"
            for argv in outbox_argvs(container):
                model, namespace = parsed(argv)
                ran.add(tuple(argv[:2]) if argv[0] == "db" else (argv[0],))
                for item in container.get("env", []):  # set for this command: its own field
                    field = item["name"].removeprefix("OUTBOX_").lower()
                    assert hasattr(namespace, field), f"{item['name']} is not `outbox {argv[0]}`'s"
                settings_of(model, env, monkeypatch)  # every value validates
    assert ran == {("relay",), ("consume",), ("db", "upgrade"), ("db", "check")}


def test_urls_come_from_a_secret_and_other_settings_from_the_configmap() -> None:
    assert {"OUTBOX_DATABASE_URL", "OUTBOX_REDIS_URL"} <= secret_keys()
    assert not {"OUTBOX_DATABASE_URL", "OUTBOX_REDIS_URL"} & set(configmap())
    (kustomization,) = of_kind("Kustomization")
    assert "secret.example.yaml" not in kustomization["resources"]  # placeholders: never applied
    for workload in workloads():
        for container in containers(workload):
            assert any("secretRef" in s for s in container.get("envFrom", [])), container["name"]


def served_paths() -> dict[str, int]:
    """What the daemons' metrics server answers on each path (its real code)."""
    server = MetricsServer("127.0.0.1", 0, CollectorRegistry())
    answers = {}
    try:
        for path in ("/healthz", "/readyz", "/metrics", "/nope"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}",
                                            timeout=5) as reply:
                    answers[path] = reply.status
            except urllib.error.HTTPError as err:
                answers[path] = err.code
    finally:
        server.stop()
    assert answers["/nope"] == 404
    return answers


def test_daemons_listen_on_every_interface_on_the_port_the_probes_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served = served_paths()
    for deployment in of_kind("Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        (argv,) = outbox_argvs(container)
        model, _ = parsed(argv)
        assert issubclass(model, DaemonSettings)
        settings = settings_of(model, environment(container), monkeypatch)
        assert isinstance(settings, DaemonSettings)
        assert settings.metrics_host == "0.0.0.0"  # the kubelet and Prometheus are outside
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == settings.metrics_port != 0
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(settings.metrics_port)
        assert served[annotations["prometheus.io/path"]] == 200
        probes = {k: container[k]["httpGet"] for k in
                  ("startupProbe", "livenessProbe", "readinessProbe")}
        assert probes["livenessProbe"]["path"] == "/healthz"
        assert probes["readinessProbe"]["path"] == "/readyz"
        for probe in probes.values():
            assert probe["port"] in ("metrics", settings.metrics_port)
            assert served[probe["path"]] != 404


def test_pods_run_as_non_root_with_resource_requests() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    image_user = re.search(r"^USER (\d+)$", dockerfile, re.M)
    assert image_user, "the image's USER is numeric (runAsNonRoot can check it)"
    for workload in workloads():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == int(image_user.group(1))
        assert pod["automountServiceAccountToken"] is False
        for container in containers(workload):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert "memory" in container["resources"]["limits"]


def test_keda_scales_consumers_on_group_lag_up_to_the_partitions() -> None:
    (scaled,) = of_kind("ScaledObject")
    consumers = [d for d in of_kind("Deployment")
                 if outbox_argvs(d["spec"]["template"]["spec"]["containers"][0])[0][0]
                 == "consume"]
    assert [d["metadata"]["name"] for d in consumers] == [scaled["spec"]["scaleTargetRef"]["name"]]
    # scale-out is by partitions: one consumer of a group owns a partition stream at a time
    assert scaled["spec"]["maxReplicaCount"] == int(configmap()["OUTBOX_PARTITIONS"])
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    lag = f"{consumer_metrics.NAMESPACE}_group_lag"
    assert lag == "outbox_consumer_group_lag" and lag in query
    assert f'group="{configmap()["OUTBOX_GROUP"]}"' in query
    text = (K8S / "keda-scaledobject.yaml").read_text()
    assert "scale-out is by partitions" in text  # the why, where the cap is set


def test_compose_runs_cli_commands_with_known_settings_and_reachable_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    known = known_names()
    built = {name: s for name, s in compose["services"].items() if "build" in s}
    assert {"migrate", "relay", "consumer"} <= set(built)
    for name, service in built.items():
        env = {k: str(v) for k, v in service["environment"].items()}
        assert set(env) <= known, (name, sorted(set(env) - known))
        model, _ = parsed(list(service["command"]))
        settings = settings_of(model, env, monkeypatch)
        if isinstance(settings, DaemonSettings) and settings.metrics_port:
            assert settings.metrics_host == "0.0.0.0", name  # Prometheus is another container
            assert service["expose"] == [str(settings.metrics_port)]
            probe = " ".join(service["healthcheck"]["test"])
            assert f"127.0.0.1:{settings.metrics_port}/healthz" in probe


def test_the_images_environment_names_are_settings() -> None:
    text = (ROOT / "Dockerfile").read_text()
    names = {n for line in text.splitlines() if line.startswith("ENV ")
             for n in re.findall(r"(OUTBOX_[A-Z_]+)=", line)}
    assert names and names <= known_names()
