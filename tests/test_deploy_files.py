"""The deployment files under docker/ are valid offline: hadolint on every Dockerfile, the Compose file against the
Compose JSON schema, HAProxy's own config check, the Kubernetes manifests against the Kubernetes schemas, and the
Grafana dashboard and Prometheus config naming metrics and targets that exist."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .system_tools import needs

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
K8S_VERSION = "1.30"  # an old enough cluster: the manifests use only stable APIs


def tool(name: str) -> str:
    """The venv's copy (installed by the test extra) or one on PATH."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} not installed (pip install -e '.[test]')"
    return found


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("Dockerfile*")), ids=lambda p: p.name)
def test_hadolint(dockerfile):
    result = subprocess.run([tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def interpolate(text: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR:?error}` with nothing set: the default (or a placeholder)."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*)|:?\?[^}]*)?\}", lambda m: m.group(2) or "set", text)


def test_the_unmute_compose_file_points_unmute_at_one_duplexd():
    """docker/compose.unmute.yaml: valid Compose; Unmute's backend finds its STT and its TTS at the one duplexd, which
    serves both with the key Unmute's clients send."""
    schema = json.loads((ROOT / "tests" / "data" / "compose_spec.json").read_text())
    compose = yaml.safe_load(interpolate((DOCKER / "compose.unmute.yaml").read_text()))
    jsonschema.validate(compose, schema, cls=jsonschema.Draft7Validator)
    services = compose["services"]
    env = dict(item.split("=", 1) for item in services["backend"]["environment"])
    assert env["KYUTAI_STT_URL"] == env["KYUTAI_TTS_URL"] == "ws://duplexd:8998"
    command = services["duplexd"]["command"]
    assert "--api-key=public_token" in command and any(arg.startswith("--tts=") for arg in command)
    assert services["duplexd"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_the_agents_compose_file_serves_agents_with_vllm_beside():
    """docker/compose.agents.yaml: valid Compose; duplexd's flags are what `duplexd serve` accepts for voice agents
    (an STT main model, --tts, --llm at the vLLM service's OpenAI API, its model), vLLM parses tool calls, and the
    two share GPU 0 with the LLM's share that docs/DEPLOY.md sizes."""
    import argparse

    from duplexd.server import cli

    schema = json.loads((ROOT / "tests" / "data" / "compose_spec.json").read_text())
    compose = yaml.safe_load(interpolate((DOCKER / "compose.agents.yaml").read_text()))
    jsonschema.validate(compose, schema, cls=jsonschema.Draft7Validator)
    duplexd, llm = compose["services"]["duplexd"], compose["services"]["llm"]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    settings = cli.settings_from_args(parser.parse_args(duplexd["command"]))
    assert settings.hf_repo.startswith("kyutai/stt-") and settings.tts is not None
    assert settings.llm == "http://llm:8000/v1" and settings.max_sessions == settings.tts_streams
    flags = dict(arg.removeprefix("--").split("=", 1) if "=" in arg else (arg[2:], "") for arg in llm["command"])
    assert settings.llm_model == flags["model"] and "enable-auto-tool-choice" in flags and "tool-call-parser" in flags
    assert f"--llm-share {flags['gpu-memory-utilization']}" in (ROOT / "docs" / "DEPLOY.md").read_text()
    for service in (duplexd, llm):
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0"]


def test_compose_file_matches_the_compose_schema():
    schema = json.loads((ROOT / "tests" / "data" / "compose_spec.json").read_text())
    compose = yaml.safe_load(interpolate((DOCKER / "compose.yaml").read_text()))
    jsonschema.validate(compose, schema, cls=jsonschema.Draft7Validator)
    services = compose["services"]
    gpus = [s for s in services if s.startswith("duplexd-gpu")]
    assert len(gpus) >= 2 and {"haproxy", "prometheus", "grafana"} <= set(services)
    for name in gpus:
        service = services[name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["device_ids"] == [name.removeprefix("duplexd-gpu")]
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
    for mount in [v for s in services.values() for v in s.get("volumes", [])]:
        source = mount.split(":")[0]
        if source.startswith("./"):
            assert (DOCKER / source).exists(), mount
    # Prometheus scrapes every replica, HAProxy balances over every replica.
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    replicas = {v for k, v in services["haproxy"]["environment"].items() if k.startswith("DUPLEXD_REPLICA_")}
    assert {f"{name}:8998" for name in gpus} == replicas <= targets


@needs("haproxy")
def test_haproxy_config_check():
    env = {**os.environ, "HAPROXY_ERRORS_DIR": str(DOCKER / "errors")}
    result = subprocess.run(
        ["haproxy", "-c", "-f", str(DOCKER / "haproxy.cfg")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DOCKER / "haproxy.cfg").read_text()
    for line in ("balance leastconn", "option httpchk GET /ready", "http-check expect status 200", "timeout tunnel"):
        assert line in text


def k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] != "Kustomization":  # a kustomize file, not an API object
                docs.append((f"{path.name}:{doc['kind']}", doc))
    return docs


@pytest.mark.parametrize(("name", "doc"), k8s_documents(), ids=[name for name, _ in k8s_documents()])
def test_kubernetes_manifest_matches_the_schema(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_deployment_probes_gpu_and_grace_period():
    docs = {doc["kind"]: doc for _, doc in k8s_documents()}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert pod["terminationGracePeriodSeconds"] > float(env["DUPLEXD_DRAIN_TIMEOUT"])
    assert {"PodDisruptionBudget", "Service", "Ingress", "HorizontalPodAutoscaler"} <= set(docs)
    (metric,) = docs["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "duplexd_sessions_active"
    assert "duplexd_sessions_active" in docs["ConfigMap"]["data"]["config.yaml"]
    annotations = docs["Ingress"]["metadata"]["annotations"]
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 360  # longer than a session


def served_metrics() -> set[str]:
    """Every series name server/core/metrics.py exports (counters with _total, histograms with their suffixes)."""
    source = (ROOT / "duplexd" / "server" / "core" / "metrics.py").read_text()
    names = set(re.findall(r'"(duplexd_\w+)"', source))
    counters = set(re.findall(r'Counter\(\s*"(duplexd_\w+)"', source)) | set(
        re.findall(r'"(duplexd_(?:engine_steps|frames_in|frames_out))"', source)
    )
    histograms = set(re.findall(r'Histogram\(\s*"(duplexd_\w+)"', source))
    return (
        names | {f"{n}_total" for n in counters} | {f"{n}_{s}" for n in histograms for s in ("bucket", "sum", "count")}
    )


def test_grafana_dashboard_queries_served_metrics():
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "duplexd.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bduplexd_\w+", expr)}
    assert used and used <= served_metrics(), used - served_metrics()
    for needed in (
        "duplexd_sessions_active",
        "duplexd_sessions_capacity",
        "duplexd_step_duration_seconds_bucket",
        "duplexd_frames_late_total",
        "duplexd_sessions_refused_total",
    ):
        assert needed in used
    provider = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "dashboards" / "duplexd.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dockerfiles_import_names_that_exist():
    """Python run at build time (`python -c "from duplexd... import X"`) names modules and names that exist."""
    found = 0
    for dockerfile in DOCKER.glob("Dockerfile*"):
        for module, names in re.findall(r"from (duplexd[\w.]*) import ([\w, ]+)", dockerfile.read_text()):
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(importlib.import_module(module), name), f"{dockerfile.name}: {module}.{name}"
                found += 1
    assert found, "no build-time import found: the check checks nothing"
