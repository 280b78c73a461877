"""Infra and deployment files are valid for their tools (structure checked offline)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_compose_services_and_dependencies():
    c = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = c["services"]
    assert {"postgres", "prefect-server", "prefect-worker", "minio", "minio-init", "prometheus", "grafana"} <= set(
        services
    )
    for name, svc in services.items():
        assert "image" in svc, name
        tag = svc["image"].rsplit(":", 1)[-1]
        assert ":" in svc["image"] and tag != "latest", f"{name}: image not pinned"
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on without conditions"
        for d, cond in deps.items():
            assert d in services, f"{name} depends on unknown {d}"
            want = "service_completed_successfully" if d == "minio-init" else "service_healthy"
            assert cond == {"condition": want}, f"{name} -> {d}"
            if want == "service_healthy":
                assert "healthcheck" in services[d], f"{d} has no healthcheck to wait on"
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (INFRA / src).exists(), f"{name} mounts missing {src}"
            elif not src.startswith("/"):
                assert src in c.get("volumes", {}), f"{name} uses undeclared volume {src}"
    server_env = services["prefect-server"]["environment"]
    assert "postgresql+asyncpg://" in server_env["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert server_env["PREFECT_SERVER_METRICS_ENABLED"] == "true"  # else /api/metrics is a 404
    assert "mc mb --ignore-existing" in " ".join(services["minio-init"]["command"])
    worker = services["prefect-worker"]
    assert (
        worker["build"]["dockerfile"] == "infra/Dockerfile" and (INFRA.parent / worker["build"]["context"][1:]).is_dir()
    )
    assert "GF_SECURITY_ADMIN_PASSWORD" in services["grafana"]["environment"]
    # every credential comes from infra/.env: the example names each one, with no value
    example = dict(
        line.split("=", 1)
        for line in (INFRA / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    used = set(re.findall(r"\$\{([A-Z_]+)", (INFRA / "docker-compose.yml").read_text()))
    assert used - {"CAPTIONFLOW_IMAGE", "CAPTIONFLOW_FLAVOUR"} <= set(example)
    assert all(not example[k] for k in example if "PASSWORD" in k)
    # Prometheus scrapes the worker's runs (deployed with --metrics-port 8080) and the Prefect server
    p = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in p["scrape_configs"]}
    assert targets["ray"] == ["prefect-worker:8080"] and "8080" in worker["expose"]


def test_dockerfile_lints_clean_and_the_linter_is_real(tmp_path):
    hadolint = Path(sys.executable).with_name("hadolint")
    r = subprocess.run([str(hadolint), str(INFRA / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install x\n")
    r = subprocess.run([str(hadolint), str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "DL3007" in r.stdout  # :latest is flagged
    text = (INFRA / "Dockerfile").read_text()
    assert "USER 1000" in text and text.count("FROM ") == 2  # non-root, multi-stage
    assert "make install FLAVOUR=${FLAVOUR}" in text  # exactly the project's lock
    # bytecode ships compiled in both stages (the image's user cannot write it: each process would compile its
    # imports from source at every start), and no step deletes it
    runs = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert sum("compileall" in line for line in runs) == 2 and not any("__pycache__" in line for line in runs)
    ignore = [line for line in (INFRA.parent / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert ignore[0] == "*" and "!captionflow/" in ignore  # the context is only what the image installs


def test_kuberay_cluster_has_cpu_head_and_autoscaling_gpu_workers():
    (rc,) = _docs(INFRA / "kuberay" / "raycluster.yaml")
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    (gpu,) = rc["spec"]["workerGroupSpecs"]
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for spec in (head["template"]["spec"], gpu["template"]["spec"]):  # Ray's object store needs a real /dev/shm
        (vol,) = spec["volumes"]
        assert vol["emptyDir"]["medium"] == "Memory"
        assert {"name": vol["name"], "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]


def test_k8s_worker_manifests():
    docs = _docs(INFRA / "k8s" / "prefect-worker.yaml")
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ConfigMap", "Deployment", "ServiceAccount", "Role", "RoleBinding"}
    dep = by_kind["Deployment"]
    assert dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == by_kind["ServiceAccount"]["metadata"]["name"]
    # every ConfigMap key the worker reads is defined
    for env in pod["containers"][0]["env"]:
        ref = env.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            assert (
                ref["name"] == by_kind["ConfigMap"]["metadata"]["name"] and ref["key"] in by_kind["ConfigMap"]["data"]
            )
    # what the Kubernetes worker does: Jobs (create .. delete), pods and their logs, events
    allowed = {
        (g, r, v)
        for rule in by_kind["Role"]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    for need in [("batch", "jobs", v) for v in ("create", "get", "list", "watch", "delete")] + [
        ("", "pods", "list"),
        ("", "pods/log", "get"),
        ("", "events", "watch"),
    ]:
        assert need in allowed, need
    names = {e["name"] for e in pod["containers"][0]["env"]}
    assert "PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES" in names  # a namespaced Role: no cluster-wide watch
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]


def test_prometheus_and_grafana():
    assert shutil.which("promtool"), "no promtool: `make system-deps` installs Debian's prometheus package"
    r = subprocess.run(
        ["promtool", "check", "config", str(INFRA / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    p = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in p["scrape_configs"]} >= {"ray", "prefect"}
    d = json.loads((INFRA / "grafana" / "dashboards" / "captionflow.json").read_text())
    assert d["panels"] and all(panel["targets"][0]["expr"] for panel in d["panels"])
    exprs = " ".join(panel["targets"][0]["expr"] for panel in d["panels"])
    assert "ray_data_" in exprs and "vllm" in exprs
    ids = [panel["id"] for panel in d["panels"]]
    assert len(ids) == len(set(ids))


def test_prefect_yaml_matches_the_flow():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    from captionflow.config import GROUPS, RunConfig

    for dep in spec["deployments"]:
        module, func = dep["entrypoint"].rsplit(".", 1)  # the image's installed package: no host path
        path = ROOT / (module.replace(".", "/") + ".py")
        assert f"def {func}(" in path.read_text() and dep["pull"] == []
        # the parameters validate against the typed form: a group per GROUPS entry, every field once
        assert list(dep["parameters"]) == [g.lower() for g in GROUPS]
        RunConfig(**{k: v for group in dep["parameters"].values() for k, v in group.items()})
        assert dep["enforce_parameter_schema"] and dep["concurrency_limit"] == {
            "limit": 1,
            "collision_strategy": "ENQUEUE",
        }
        assert dep["work_pool"]["job_variables"]["image"]  # no environment variable that could be unset
        assert "{{ $" not in yaml.safe_dump(dep)
    names = {d["name"]: d for d in spec["deployments"]}
    assert names["golden-nightly"]["schedules"][0]["cron"]
    trig = names["on-checkpoint"]["triggers"][0]
    assert trig["expect"] == ["captionflow.checkpoint.created"]
    assert trig["parameters"] == {"model": {"model": "{{ event.payload.uri }}"}}  # the rest: the deployment's


def test_wheelhouse_scripts_parse():
    for script in [*(INFRA / "wheelhouse").glob("*.sh"), *(INFRA.parent / "bench").glob("*.sh")]:
        subprocess.run(["bash", "-n", str(script)], check=True)
    lock = (INFRA.parent / "requirements" / "gpu-host.lock").read_text()
    pins = dict(line.split("==", 1) for line in lock.splitlines() if "==" in line and not line.startswith(" "))
    # vLLM 0.26.0 is the newest built for the host's torch 2.11; the lock must agree with the host
    assert pins["vllm"] == "0.26.0" and pins["ray"] == "2.60.0" and pins["torch"] == "2.11.0"
    assert pins["numpy"] == "2.5.2" and pins["prefect"] == "3.9.1"
    words = lambda f: {
        w
        for line in (INFRA / "wheelhouse" / f).read_text().splitlines()
        if not line.startswith("#")
        for w in line.split()
    }
    present, excluded = words("gpu-host-present.txt"), words("gpu-host-exclude.txt")
    assert {"torch", "transformers", "numpy"} <= present  # the host's own stay
    assert not ({"vllm", "ray", "prefect", "pydantic"} & (present | excluded))  # the wheelhouse carries these
