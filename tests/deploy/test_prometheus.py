"""A real Prometheus scraping a real lmserve server, configured from deploy/prometheus/prometheus.yml;
promtool checks of the shipped config and alert rules; every Grafana panel query run against it."""

from __future__ import annotations

import json
import math
import subprocess
import time

import pytest
from _procs import Prometheus, render_prometheus_config
from _repo import DEPLOY, server_harness, trained_model

from lmserve.client import Client, SamplingParams

PROM_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "lmserve.json"
REQUESTS = 12
TTFT_P90 = "histogram_quantile(0.9, sum(rate(lmserve_time_to_first_token_seconds_bucket[1m])) by (le))"


# ---------------------------------------------------------------- promtool on the shipped files


def promtool(promtool_bin, *args) -> subprocess.CompletedProcess:
    return subprocess.run([promtool_bin, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)


def test_shipped_config_is_valid(promtool_bin):
    proc = promtool(promtool_bin, "check", "config", "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alert_rules_are_valid_and_pass_their_unit_tests(promtool_bin):
    checked = promtool(promtool_bin, "check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool(promtool_bin, "test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


# ---------------------------------------------------------------- a live scrape


@pytest.fixture(scope="module")
def server(trained_model_dir, tmp_path_factory):
    with server_harness.ServerProcess(trained_model_dir, log_dir=tmp_path_factory.mktemp("server")) as srv:
        srv.start(threads=1, max_batch=4, grace_period=5)
        yield srv


@pytest.fixture(scope="module")
def prometheus(prometheus_bin, server, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    target = f"{server_harness.HOST}:{server.metrics_port}"
    config = render_prometheus_config((PROM_DIR / "prometheus.yml").read_text(), [target], "1s")
    prom = Prometheus(prometheus_bin, config, workdir, server_harness.free_port()).start()
    try:
        yield prom
    finally:
        prom.stop()


def scalar(result: dict) -> float | None:
    """The single value of an instant-vector query result, None when it is empty."""
    assert result["status"] == "success", result
    series = result["data"]["result"]
    if not series:
        return None
    assert len(series) == 1, series
    return float(series[0]["value"][1])


@pytest.fixture(scope="module")
def served(server, prometheus):
    """Prometheus scraped the idle server, then REQUESTS generations (half read to the end, half left
    after the first token), then their final counts, at least twice. Returns the client-side TTFTs."""
    server_harness.wait_until(
        lambda: scalar(prometheus.query("lmserve_running_requests")) == 0,
        timeout=30, interval=0.2, what="a first scrape of the idle server")
    client_ttfts = []
    prompts = trained_model.prompt_continuations((2, 5))
    with Client(server.target) as client:
        for i in range(REQUESTS):
            start = time.perf_counter()
            for chunk in client.stream(prompts[i % len(prompts)][0], SamplingParams(max_new_tokens=12, ignore_eos=True)):
                if chunk.token_ids and len(client_ttfts) == i:
                    client_ttfts.append(time.perf_counter() - start)
                    if i % 2:
                        break  # leaves the stream (cancelled, unless the last token was already out)
    server_harness.wait_until(
        lambda: scalar(prometheus.query("sum(lmserve_requests_total)")) == REQUESTS
        and scalar(prometheus.query("min(count_over_time(lmserve_requests_total[1m]))")) >= 2,
        timeout=30, interval=0.2, what=f"Prometheus to see {REQUESTS} finished requests twice")
    return client_ttfts


def test_ttft_p90_from_prometheus_is_bounded_by_what_clients_saw(served, prometheus, server):
    p90 = scalar(prometheus.query(TTFT_P90))
    assert p90 is not None and math.isfinite(p90) and p90 > 0
    # histogram_quantile interpolates inside a bucket, so it cannot pass the upper bound of the bucket
    # holding the slowest first token; the server's TTFT is at most what the client measured.
    bounds = sorted(float(b["le"]) for b in server.metrics().labels("lmserve_time_to_first_token_seconds_bucket"))
    assert p90 <= next(b for b in bounds if b >= max(served))


def test_prometheus_totals_match_the_servers_own_metrics(served, prometheus, server):
    own = server.wait_idle()
    for name in ("lmserve_generated_tokens_total", "lmserve_prompt_tokens_total", "lmserve_time_to_first_token_seconds_count"):
        server_harness.wait_until(lambda: scalar(prometheus.query(f"sum({name})")) == own.total(name),
                                  timeout=10, interval=0.2, what=f"{name} == {own.total(name)} in Prometheus")
    statuses = prometheus.query('sum by (status) (lmserve_requests_total{job="lmserve"})')["data"]["result"]
    assert {s["metric"]["status"]: float(s["value"][1]) for s in statuses} == {
        labels["status"]: own.total("lmserve_requests_total", status=labels["status"])  # summed over finish reasons
        for labels in own.labels("lmserve_requests_total")}


def test_every_counter_series_starts_at_zero(served, prometheus):
    # rate() and increase() only see what happens between two scrapes of a series. A series that
    # first appears with requests already counted (a label pair exported on its first increment)
    # hides those requests from the dashboard's request rates; every series must be exported at 0
    # before its first event (the idle scrape the `served` fixture waited for).
    result = prometheus.query('{__name__=~"lmserve_.+(_total|_count)", job="lmserve"}[5m]')
    assert result["status"] == "success", result
    first = {json.dumps(s["metric"], sort_keys=True): float(s["values"][0][1]) for s in result["data"]["result"]}
    assert any('"lmserve_requests_total"' in k for k in first), first
    late = {k: v for k, v in first.items() if v != 0}
    assert not late, "series whose first scrape already counted events:\n" + "\n".join(f"{k} = {v}" for k, v in late.items())


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query in the dashboard, Grafana variables replaced for one server."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
            out.append((panel["title"], expr))
    return out


# Panels that read device-specific series: empty on a CPU server, which exports no CUDA gauges.
CUDA_ONLY = {"CUDA memory"}


def test_every_dashboard_query_runs_and_has_data(served, prometheus):
    empty = []
    for title, expr in dashboard_queries():
        result = prometheus.query(expr)
        assert result["status"] == "success", f"{title}: {expr}\n{result.get('error')}"
        values = [float(s["value"][1]) for s in result["data"]["result"]]
        if not values and title not in CUDA_ONLY:
            empty.append(f"{title}: {expr}")
        assert not any(math.isnan(v) for v in values if title.startswith(("Time to first", "TTFT"))), expr
    assert not empty, "queries with no data:\n" + "\n".join(empty)


def test_dashboard_replica_variable_lists_the_server(served, prometheus, server):
    dash = json.loads(DASHBOARD.read_text())
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "instance"]
    # Grafana's label_values(SELECTOR, LABEL) is the label-values API restricted to SELECTOR.
    selector, label = var["definition"].removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
    values = prometheus.api(f"label/{label}/values", **{"match[]": selector})
    assert values["data"] == [f"{server_harness.HOST}:{server.metrics_port}"]
