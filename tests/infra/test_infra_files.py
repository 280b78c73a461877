"""Infra and deployment files are valid for their tools (structure checked offline)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_compose_services_and_dependencies():
    c = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = c["services"]
    assert {"postgres", "prefect-server", "prefect-worker", "minio", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert "image" in svc, name
        deps = svc.get("depends_on", [])
        for d in deps if isinstance(deps, list) else deps.keys():
            assert d in services, f"{name} depends on unknown {d}"
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (INFRA / src).exists(), f"{name} mounts missing {src}"
            elif not src.startswith("/"):
                assert src in c.get("volumes", {}), f"{name} uses undeclared volume {src}"
    assert "postgresql+asyncpg://" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]


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


def test_k8s_worker_manifests():
    kinds = {d["kind"] for d in _docs(INFRA / "k8s" / "prefect-worker.yaml")}
    assert kinds == {"Deployment", "ServiceAccount", "Role", "RoleBinding"}
    dep = next(d for d in _docs(INFRA / "k8s" / "prefect-worker.yaml") if d["kind"] == "Deployment")
    assert dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]


def test_prometheus_and_grafana():
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
    from captionflow.config import RunConfig

    for dep in spec["deployments"]:
        path, func = dep["entrypoint"].split(":")
        assert (ROOT / path).exists() and f"def {func}(" in (ROOT / path).read_text()
        RunConfig(**dep["parameters"])  # the parameters validate against the typed form
        assert dep["enforce_parameter_schema"] and dep["concurrency_limit"] == 1
    names = {d["name"]: d for d in spec["deployments"]}
    assert names["golden-nightly"]["schedules"][0]["cron"]
    trig = names["on-checkpoint"]["triggers"][0]
    assert trig["expect"] == ["captionflow.checkpoint.created"]
    assert trig["parameters"] == {"model": "{{ event.payload.uri }}"}  # the rest: the deployment's


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
