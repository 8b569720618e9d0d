"""Structural checks of the deployment files: Kubernetes manifests (against the Kubernetes API
schemas), the compose stack, nginx/Prometheus/Grafana wiring, and the dashboard's and alerts'
PromQL against the metric names a real lmserve Metrics registry exports."""

from __future__ import annotations

import argparse
import ast
import json
import math
import mmap
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from _repo import DEPLOY, REPO_ROOT

from lmserve.server.app import LIVENESS_SERVICE
from lmserve.server.config import ServerSettings, environment_names, settings_from_args
from lmserve.v1 import lmserve_pb2

K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "lmserve.json"
API_SERVICE = lmserve_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
MIN_KUBERNETES = "1.27.0"  # native gRPC probes are GA from 1.27
CRD_KINDS = {"ServiceMonitor", "Kustomization"}
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) for d in load_all(p)]


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in k8s_docs() if d["kind"] == kind]


def deployments() -> dict[str, dict]:
    return {p.name: d for p, d in k8s_docs() if d["kind"] == "Deployment"}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, str]:
    """The container's environment; resourceFieldRef values resolved from its resources (divisor 1)."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            ref = e["valueFrom"]["resourceFieldRef"]
            kind, resource = ref["resource"].split(".")
            env[e["name"]] = str(math.ceil(float(c["resources"][kind][resource])))
    return env


def settings_from_env(env: dict[str, str]) -> ServerSettings:
    """What `lmserve serve` makes of these variables, by its own parser (raises on a bad value)."""
    unknown = {k for k in env if k.startswith("LMSERVE_")} - environment_names()
    assert not unknown, f"variables lmserve does not read: {sorted(unknown)}"
    return settings_from_args(argparse.Namespace(), environ=env)


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


# ---------------------------------------------------------------- Kubernetes


def test_every_yaml_file_parses():
    files = sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        assert load_all(path), f"{path} is empty"


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_resources_match_the_api_schema(path):
    for doc in load_all(path):
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, MIN_KUBERNETES, strict=True)


def test_kustomization_lists_existing_files():
    (kust,) = load_all(K8S / "kustomization.yaml")
    for resource in kust["resources"]:
        assert (K8S / resource).is_file(), resource


@pytest.mark.parametrize("name", ["deployment.yaml", "deployment-gpu.yaml"])
def test_probes_are_grpc_health_checks_on_the_served_port(name):
    c = container(deployments()[name])
    settings = settings_from_env(env_of(c))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": settings.port, "http": settings.http_port, "metrics": settings.metrics_port}
    assert settings.host == "0.0.0.0"  # reachable from the kubelet and other pods
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(c[probe]) & {"grpc", "tcpSocket", "httpGet", "exec"} == {"grpc"}, probe
        assert c[probe]["grpc"]["port"] == settings.port, probe
    # Readiness asks for the API service by its name in the proto; the others for the whole server.
    assert c["readinessProbe"]["grpc"]["service"] == API_SERVICE
    # Liveness asks for the name a drain leaves SERVING: a long drain must not be cut short by a restart.
    assert c["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    assert c["startupProbe"]["grpc"].get("service", "") == ""
    # The startup probe outlasts a slow model load; liveness tolerates a few slow answers.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    assert c["livenessProbe"]["failureThreshold"] >= 3
    assert "command" not in c and "args" not in c, "the image's entrypoint (`lmserve serve`) must run as is"


@pytest.mark.parametrize("name", ["deployment.yaml", "deployment-gpu.yaml"])
def test_termination_grace_covers_prestop_and_drain(name):
    d = deployments()[name]
    c = container(d)
    pre_stop = c["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        sleep = pre_stop["sleep"]["seconds"]
    else:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep", command
        sleep = float(command[1])
    grace = settings_from_env(env_of(c)).grace_period
    assert sleep > 0 and grace > 0
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > sleep + grace


@pytest.mark.parametrize("name", ["deployment.yaml", "deployment-gpu.yaml"])
def test_pods_run_as_the_images_non_root_user(name):
    spec = deployments()[name]["spec"]["template"]["spec"]
    dockerfile_user = [ln.split()[1] for ln in (REPO_ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("USER ")][-1]
    uid, gid = (int(x) for x in dockerfile_user.split(":"))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (uid, gid)
    assert container(deployments()[name])["securityContext"]["allowPrivilegeEscalation"] is False


def test_gpu_variant_replaces_the_cpu_one():
    cpu, gpu = deployments()["deployment.yaml"], deployments()["deployment-gpu.yaml"]
    assert gpu["metadata"]["name"] == cpu["metadata"]["name"]
    assert gpu["spec"]["selector"] == cpu["spec"]["selector"]
    assert gpu["spec"]["template"]["metadata"]["labels"] == cpu["spec"]["template"]["metadata"]["labels"]
    res = container(gpu)["resources"]
    assert str(res["limits"]["nvidia.com/gpu"]) == "1"
    assert settings_from_env(env_of(container(gpu))).device == "cuda"
    assert settings_from_env(env_of(container(cpu))).device == "cpu"
    assert "nvidia.com/gpu" not in container(cpu)["resources"].get("limits", {})


def test_cpu_resources_fit_the_model_and_kv_cache(smollm2_gguf_path):
    import torch

    from lmserve.model.config import ModelConfig
    from lmserve.model.checkpoints.gguf_reader import read_directory
    from lmserve.model.kv_cache import KVCache

    with open(smollm2_gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, tensors = read_directory(buf)
    cfg = ModelConfig.from_gguf(meta)
    params = sum(math.prod(t.ne) for t in tensors)
    c = container(deployments()["deployment.yaml"])
    s = settings_from_env(env_of(c))
    assert s.model == "smollm2"
    max_len = min(s.engine.max_model_len or 4096, cfg.max_position_embeddings)
    weights = params * 4  # float32 on CPU
    kv = s.engine.kv_cache_bytes  # KV memory is held per token, up to this budget, whatever max_batch is
    assert kv is not None, "set LMSERVE_KV_CACHE_GB: the default share of RAM does not know the pod's other needs"
    assert kv >= max_len * KVCache.bytes_per_token(cfg, torch.float32)  # one full-length request fits
    assert s.engine.max_batch >= 64  # no slot-count workaround: concurrency is limited by tokens held
    limit = memory_bytes(c["resources"]["limits"]["memory"])
    assert weights + kv <= 0.75 * limit, f"weights {weights / 2**30:.2f} GiB + KV {kv / 2**30:.2f} GiB vs limit {limit / 2**30:.1f} GiB"
    assert memory_bytes(c["resources"]["requests"]["memory"]) >= weights + kv
    assert s.threads == math.ceil(float(c["resources"]["limits"]["cpu"]))


def test_services_pdb_and_hpa_select_the_deployment():
    d = deployments()["deployment.yaml"]
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in container(d)["ports"]}
    services = by_kind("Service")
    assert {s["metadata"]["name"] for s in services} == {"lmserve", "lmserve-headless"}
    for svc in services:
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]], port
    headless = next(s for s in services if s["metadata"]["name"] == "lmserve-headless")
    assert headless["spec"]["clusterIP"] == "None"
    (pdb,) = by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"].get("maxUnavailable", 0) < d["spec"]["replicas"] or pdb["spec"].get("minAvailable", 0) >= 1
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", d["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] == d["spec"]["replicas"] == 2
    assert container(d)["resources"]["requests"]["cpu"], "CPU utilization needs a CPU request"


def test_scrape_annotations_and_servicemonitor_use_the_metrics_port():
    d = deployments()["deployment.yaml"]
    ann = d["spec"]["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in container(d)["ports"]}
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == ports["metrics"] == settings_from_env(env_of(container(d))).metrics_port
    assert ann["prometheus.io/path"] == "/metrics"
    (sm,) = by_kind("ServiceMonitor")
    (endpoint,) = sm["spec"]["endpoints"]
    scraped = [s for s in by_kind("Service")
               if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
               and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])]
    assert [s["metadata"]["name"] for s in scraped] == ["lmserve"], "each pod must be scraped through exactly one Service"
    assert endpoint["path"] == "/metrics"


# ---------------------------------------------------------------- compose, nginx, Prometheus, Grafana


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def lmserve_services() -> dict[str, ServerSettings]:
    return {name: settings_from_env({k: str(v) for k, v in svc["environment"].items()})
            for name, svc in compose()["services"].items() if name.startswith("lmserve")}


def test_compose_runs_two_replicas_of_the_image_with_drain_time():
    services = compose()["services"]
    replicas = lmserve_services()
    assert len(replicas) == 2
    for name, settings in replicas.items():
        svc = services[name]
        assert svc["build"]["context"] == "../.." and (COMPOSE.parent / svc["build"]["context"] / "Dockerfile").is_file()
        assert settings.host == "0.0.0.0"
        stop = svc["stop_grace_period"]
        assert stop.endswith("s") and float(stop[:-1]) > settings.grace_period
    for name in ("nginx", "prometheus", "grafana"):
        assert name in services
    assert set(services["nginx"]["depends_on"]) == set(replicas)


def test_compose_bind_mounts_exist():
    for name, svc in compose()["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source}"


def test_nginx_upstreams_are_the_compose_replicas():
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    upstream = re.search(r"upstream\s+lmserve_backends\s*\{(.*?)\}", conf, re.S).group(1)
    servers = {m.group(1) for m in re.finditer(r"^\s*server\s+(\S+)", upstream, re.M)}
    assert servers == {f"{name}:{s.port}" for name, s in lmserve_services().items()}
    assert "grpc_pass grpc://lmserve_backends;" in conf
    listen = int(re.search(r"^\s*listen\s+(\d+)\s+http2\s*;", conf, re.M).group(1))
    published = [p for p in compose()["services"]["nginx"]["ports"]]
    assert any(p.split(":")[-1] == str(listen) for p in published), published


def test_nginx_http_upstream_is_the_compose_replicas_http_api():
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    upstream = re.search(r"upstream\s+lmserve_http\s*\{(.*?)\}", conf, re.S).group(1)
    servers = {m.group(1) for m in re.finditer(r"^\s*server\s+(\S+)", upstream, re.M)}
    assert servers == {f"{name}:{s.http_port}" for name, s in lmserve_services().items()}
    assert "hash $conversation_key consistent;" in upstream
    listen = int(re.search(r"^\s*listen\s+(\d+)\s*;", conf, re.M).group(1))
    assert any(p.split(":")[-1] == str(listen) for p in compose()["services"]["nginx"]["ports"])


def test_prometheus_scrapes_every_compose_replica():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "lmserve"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    assert targets == {f"{name}:{s.metrics_port}" for name, s in lmserve_services().items()}
    assert job.get("metrics_path", "/metrics") == "/metrics"
    for rule_file in cfg["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file()
    mount = next(v for v in compose()["services"]["prometheus"]["volumes"] if v.startswith("../prometheus:"))
    assert mount.split(":")[1] == "/etc/prometheus"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard():
    (ds,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    services = compose()["services"]
    assert ds["url"] == "http://prometheus:9090" and "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    (provider,) = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/lmserve.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("../"))
    assert mounts["../grafana/dashboards"] == provider["options"]["path"]
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    dash = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    uids |= {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
    assert uids == {ds["uid"]}


def test_compose_ships_no_default_credentials_and_no_admin_apis():
    services = compose()["services"]
    raw = COMPOSE.read_text()
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    # required from the environment: "${VAR:?message}" makes compose refuse to start without it
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password), password
    assert "admin}" not in password and ":-" not in password
    assert not any(k.startswith("GF_SECURITY_ADMIN_USER") or k == "GF_AUTH_DISABLE_LOGIN_FORM"
                   for k in services["grafana"]["environment"])
    assert services["grafana"]["environment"].get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") == "Viewer"
    prom_flags = services["prometheus"]["command"]
    assert not any(f.startswith(("--web.enable-lifecycle", "--web.enable-admin-api")) for f in prom_flags)
    assert "--web.enable-lifecycle" not in re.sub(r"#.*", "", raw)
    # Prometheus has no login: published on the host's loopback only
    assert all(str(p).startswith("127.0.0.1:") for p in services["prometheus"]["ports"])


# ---------------------------------------------------------------- metric names


@pytest.fixture(scope="module")
def exported_names(trained_model_dir, native_kernels_dir) -> set[str]:
    """Sample names a real Metrics registry exposes (over a real engine of the trained model), plus the
    CUDA gauges it adds on GPU engines (read from its source: this machine may have no GPU)."""
    from lmserve.model.loader import load_model
    from lmserve.server.engine import Engine
    from lmserve.server.metrics import Metrics
    from lmserve.server.engine.settings import EngineSettings

    engine = Engine(load_model(trained_model_dir, dtype="float32", device="cpu", cache_dir=native_kernels_dir),
                    EngineSettings(max_batch=2))
    metrics = Metrics(engine, "trained")
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "gauge": ("",), "info": ("_info",), "summary": ("_count", "_sum", "_created")}
    names = set()
    for family in metrics.registry.collect():
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    tree = ast.parse((REPO_ROOT / "server" / "metrics.py").read_text())
    cuda = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"lmserve_cuda_\w+_bytes", n.value)}
    assert cuda, "server/metrics.py names no CUDA gauges"
    return names | cuda


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers of lmserve's and the process collector's
    series, plus Prometheus' own `up` (label names and values are stripped first)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
    names = set(IDENT.findall(expr))
    return {n for n in names if n.startswith(("lmserve_", "process_")) or n == "up"}


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_name_exported_metrics(exported_names):
    unknown = {(title, n) for title, expr in dashboard_exprs() for n in promql_metric_names(expr)
               if n != "up" and n not in exported_names}
    assert not unknown, f"dashboard metrics the server does not export: {sorted(unknown)}"


def test_alert_rules_only_name_exported_metrics(exported_names):
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    exprs = [r["expr"] for g in groups for r in g["rules"]]
    unknown = {n for e in exprs for n in promql_metric_names(e) if n != "up" and n not in exported_names}
    assert not unknown, sorted(unknown)


def test_dashboard_has_the_required_panels():
    exprs = "\n".join(e for _, e in dashboard_exprs())
    for metric in ("lmserve_time_to_first_token_seconds", "lmserve_inter_token_latency_seconds",
                   "lmserve_request_duration_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert re.search(rf"histogram_quantile\({q}, sum by \(le\) \(rate\({metric}_bucket\{{", exprs), (metric, q)
    assert re.search(r"rate\(lmserve_generated_tokens_total\{", exprs)
    assert re.search(r"sum by \(status\) \(rate\(lmserve_requests_total\{", exprs)
    # the prefix cache's hit rate: reused over looked-up prompt tokens
    assert re.search(r"sum\(rate\(lmserve_prefix_cache_hit_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\) / "
                     r"sum\(rate\(lmserve_prefix_cache_queried_tokens_total\{", exprs)
    # speculation's acceptance rate: accepted over drafted tokens
    assert re.search(r"sum\(rate\(lmserve_speculative_accepted_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\) / "
                     r"sum\(rate\(lmserve_speculative_draft_tokens_total\{", exprs)
    for gauge in ("lmserve_waiting_requests", "lmserve_running_requests", "lmserve_batch_size",
                  "lmserve_kv_slots_used", "lmserve_kv_slots_capacity", "lmserve_kv_cache_bytes",
                  "lmserve_kv_cache_used_bytes", "lmserve_kv_cache_committed_bytes", "lmserve_prefix_cache_bytes",
                  "process_resident_memory_bytes",
                  "lmserve_cuda_memory_allocated_bytes", "lmserve_cuda_memory_reserved_bytes"):
        assert gauge + "{" in exprs, gauge


def test_dashboard_layout_has_unique_ids_and_no_overlapping_panels():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
