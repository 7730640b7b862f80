"""Checks on the deployment files: Dockerfile, ops/ (compose, Prometheus, Grafana, Kubernetes).

The main guard: every `kame_*` metric named in the alert rules or the dashboard must be one the service
really exports (engine/metrics.py, knowledge/metrics.py, telephony/metrics.py), so a renamed metric breaks
this test and not a silent panel or an alert that can never fire.

promtool checks run when `promtool` is on PATH (Debian: `apt-get install prometheus`) and are skipped
otherwise; YAML checks need PyYAML and are skipped without it; rendering the Kubernetes overlay needs
`kubectl` (its built-in kustomize) and is skipped without it (the files are checked anyway).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

try:
    import yaml
except ImportError:  # not a dependency of the project; the YAML checks skip without it
    yaml = None

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "ops"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROM_CONFIG = OPS / "prometheus" / "prometheus.yml"
ALERTS = OPS / "prometheus" / "alerts.yml"
DASHBOARD = OPS / "grafana" / "dashboards" / "kame-phone.json"
GRAFANA_PROVISIONING = OPS / "grafana" / "provisioning"
COMPOSE = OPS / "docker-compose.yml"
COMPOSE_SPLIT = OPS / "docker-compose.split.yml"
ENV_EXAMPLE = OPS / ".env.example"
K8S = OPS / "k8s"
K8S_SPLIT = OPS / "k8s-split"

# The environment the service reads (engine + telephony); deployments must provide all of them.
SERVICE_ENV = {
    "TWILIO_AUTH_TOKEN",
    "PUBLIC_URL",
    "REDIS_URL",
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "ADMIN_TOKEN",
    "KAME_LOG_JSON",
}
SECRET_ENV = {"TWILIO_AUTH_TOKEN", "OPENAI_API_KEY", "ADMIN_TOKEN"}

# A metric name in PromQL or prose: `kame_` not glued to a longer identifier or a recording-rule name.
METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])kame_[a-z0-9_]+")

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Debian/Ubuntu: apt-get install prometheus)"
)
needs_yaml = pytest.mark.skipif(yaml is None, reason="PyYAML is not installed in this environment")
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (for `kubectl kustomize`) not on PATH")

# The engine link's metrics (engine/metrics.py, exported by `kame-phone engine-serve` and the edges).
LINK_METRICS = ("kame_engine_link_edges", "kame_engine_link_errors_total", "kame_engine_link_dropped_total")


# --- helpers ----------------------------------------------------------------------------------------------


def _metric_families() -> list[Any]:
    from prometheus_client import REGISTRY

    import engine.metrics  # noqa: F401  (importing registers the metrics)
    import knowledge.metrics  # noqa: F401
    import telephony.metrics  # noqa: F401

    return [f for f in REGISTRY.collect() if f.name.startswith("kame_")]


def exported_metric_names() -> set[str]:
    """Every series name the service can export: sample names plus the names each type implies.

    A labelled metric with no child yet (e.g. kame_llm_errors_total{kind} before the first error)
    yields no samples, so the names are also derived from the family type.
    """
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in _metric_families():
        names.update(sample.name for sample in family.samples)
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def documented_metric_names() -> set[str]:
    """Names prose may use: the series names plus histogram names without a suffix."""
    return exported_metric_names() | {f.name for f in _metric_families() if f.type == "histogram"}


def metric_names_in(text: str) -> set[str]:
    return set(METRIC_RE.findall(text))


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Panels including those nested in collapsed rows."""
    out = []
    for p in panels:
        out.append(p)
        out.extend(all_panels(p.get("panels", [])))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target."""
    return [
        (p["title"], t["expr"])
        for p in all_panels(load_dashboard()["panels"])
        for t in p.get("targets", [])
        if t.get("expr")
    ]


def dashboard_queries() -> list[str]:
    """Panel PromQL plus the template variable queries (label_values(...))."""
    variables = load_dashboard().get("templating", {}).get("list", [])
    var_queries = [
        (v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
        for v in variables
        if v.get("type") == "query"
    ]
    return [expr for _, expr in dashboard_exprs()] + var_queries


def alert_exprs() -> list[str]:
    if yaml is None:  # without a YAML parser, scan the whole file: stricter, never looser
        return [ALERTS.read_text()]
    (doc,) = load_yaml_docs(ALERTS)
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120, check=False)


def load_yaml_docs(path: Path) -> list[Any]:
    assert yaml is not None
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def parse_duration_s(value: str | int) -> float:
    """Compose/Go style durations: 90, '90s', '10m', '1h30m'."""
    if isinstance(value, int):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


# --- metric names -----------------------------------------------------------------------------------------


def test_exported_metrics_cover_the_known_families() -> None:
    names = exported_metric_names()
    # Spot checks that the derivation works for each type (labelled counter, histogram, gauge).
    assert {"kame_llm_errors_total", "kame_turn_latency_seconds_bucket", "kame_engine_slots_busy"} <= names
    # The SRE-requested families (request counter, drop counters, buffer gauge, call-length histogram).
    assert {
        "kame_llm_requests_total",
        "kame_stt_dropped_frames_total",
        "kame_call_store_dropped_ops_total",
        "kame_call_store_pending_ops",
        "kame_call_duration_seconds_bucket",
    } <= names
    # The engine link (split layout): labelled counters with no child until the first event.
    assert set(LINK_METRICS) <= names


@pytest.mark.parametrize(
    ("path", "queries"), [(ALERTS, alert_exprs), (DASHBOARD, dashboard_queries)], ids=["alerts.yml", "dashboard"]
)
def test_every_metric_queried_is_exported(path: Path, queries: Any) -> None:
    used = set().union(*(metric_names_in(q) for q in queries()))
    assert len(used) >= 5, f"found almost no kame_* metrics in {path.name}: is the regex still right?"
    unknown = sorted(used - exported_metric_names())
    assert not unknown, (
        f"{path.relative_to(ROOT)} queries metrics the service does not export: {unknown}. "
        "Metric names are defined in engine/metrics.py, knowledge/metrics.py and telephony/metrics.py."
    )


@pytest.mark.parametrize("path", [ALERTS, DASHBOARD], ids=["alerts.yml", "dashboard"])
def test_metric_names_in_descriptions_are_real(path: Path) -> None:
    """Panel descriptions and alert text may name a histogram without its suffix; nothing else."""
    unknown = sorted(metric_names_in(path.read_text()) - documented_metric_names())
    assert not unknown, f"{path.relative_to(ROOT)} mentions unknown metrics: {unknown}"


# --- Grafana ----------------------------------------------------------------------------------------------


def test_dashboard_is_valid_json_with_unique_panel_ids() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    panels = all_panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, f"panel {p['title']!r} is wider than the grid"


def test_every_dashboard_panel_has_a_target() -> None:
    for p in all_panels(load_dashboard()["panels"]):
        if p["type"] == "row":  # rows only group panels; they have no queries
            continue
        targets = p.get("targets", [])
        assert targets, f"panel {p['title']!r} has no target"
        assert all(t.get("expr") for t in targets), f"panel {p['title']!r} has an empty query"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"panel {p['title']!r} repeats a refId"
        # The ${datasource} variable makes the dashboard importable next to any Prometheus.
        assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_dashboard_covers_the_core_signals() -> None:
    used = metric_names_in(DASHBOARD.read_text())
    for name in (
        "kame_calls_active",
        "kame_calls_total",
        "kame_engine_slots_busy",
        "kame_engine_slots",
        "kame_first_audio_seconds_bucket",
        "kame_turn_latency_seconds_bucket",
        "kame_turn_overlaps_total",
        "kame_oracle_lag_seconds_bucket",
        "kame_llm_ttft_seconds_bucket",
        "kame_engine_tick_seconds_bucket",
        "kame_engine_deadline_misses_total",
        "kame_engine_underruns_total",
        "kame_engine_input_overruns_total",
        "kame_engine_input_catchups_total",
        "kame_engine_input_backlog_frames",
        "kame_twilio_protocol_errors_total",
        "kame_llm_errors_total",
        "kame_stt_errors_total",
        "kame_stt_dropped_frames_total",
        "kame_redis_errors_total",
        "kame_media_inbound_seconds_bucket",
        "kame_media_outbound_seconds_bucket",
        "kame_twilio_stream_events_total",
        "kame_llm_requests_total",
        "kame_call_duration_seconds_bucket",
        "kame_call_store_pending_ops",
        "kame_call_store_dropped_ops_total",
        "kame_stt_dropped_frames_total",
        "kame_media_outbound_dropped_frames_total",
        "kame_media_playout_delay_seconds_bucket",
        "kame_media_playout_drained_frames_total",
        "kame_media_playout_clears_total",
        *LINK_METRICS,
    ):
        assert name in used, f"the dashboard shows nothing from {name}"


@needs_yaml
def test_grafana_provisioning_parses() -> None:
    (ds_doc,) = load_yaml_docs(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")
    assert any(d["type"] == "prometheus" for d in ds_doc["datasources"])
    (dash_doc,) = load_yaml_docs(GRAFANA_PROVISIONING / "dashboards" / "kame.yml")
    assert dash_doc["providers"][0]["type"] == "file"


@needs_promtool
@needs_yaml
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    """promtool evaluates every panel query (variables substituted) against an empty TSDB: a syntax
    error fails; an empty result is expected."""
    tests = []
    for title, expr in dashboard_exprs():
        concrete = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$instance", ".*")
        assert "$" not in concrete, f"{title!r}: unknown dashboard variable in {expr!r}"
        tests.append({"expr": concrete, "eval_time": "5m", "exp_samples": []})
    unit = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": 'unrelated_series{job="x"}', "values": "0x10"}],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "dashboard_queries_test.yml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    result = promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Prometheus -------------------------------------------------------------------------------------------


@needs_promtool
def test_promtool_check_config() -> None:
    # rule_files are resolved relative to the config file, so this also checks alerts.yml.
    result = promtool("check", "config", PROM_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_yaml
def test_the_k8s_scrape_jobs_are_the_ones_the_alerts_name() -> None:
    """An annotation-discovery job ("kubernetes-pods") gave every series another job label: KameAllInstancesGone
    fired for good and KameInstanceDown / KameEngineDown never could. The shipped jobs keep each kind of pod on
    its /metrics port, under the alerts' job names."""
    (scrape,) = load_yaml_docs(OPS / "prometheus" / "k8s-scrape.yml")
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == {"kame", "kame-engine"}
    exprs = "\n".join(r["expr"] for g in load_yaml_docs(ALERTS)[0]["groups"] for r in g["rules"])
    for name in jobs:
        assert f'job="{name}"' in exprs
    # Each job keeps the pods of its app, on the container port that serves /metrics in the manifests.
    manifests = [*load_yaml_docs(K8S / "deployment.yaml"), *load_yaml_docs(K8S_SPLIT / "engine.yaml")]
    for job, app in (("kame", "kame-phone"), ("kame-engine", "kame-engine")):
        relabel = jobs[job]["relabel_configs"]
        keep = {tuple(r["source_labels"]): r["regex"] for r in relabel if r.get("action") == "keep"}
        assert keep[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == app
        (deployment,) = [d for d in manifests if d.get("kind") == "Deployment"
                         and d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == app]
        ports = {p["name"]: p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", ())}
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert ports[keep[("__meta_kubernetes_pod_container_port_name",)]] == int(annotations["prometheus.io/port"])
    # (Not `promtool check config`: Debian's promtool is built without Kubernetes discovery.)


@needs_promtool
def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", ALERTS)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_yaml
def test_prometheus_scrapes_kame_and_loads_the_rules() -> None:
    (config,) = load_yaml_docs(PROM_CONFIG)
    for rule_file in config["rule_files"]:
        assert (PROM_CONFIG.parent / rule_file).is_file(), rule_file
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kame"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert parse_duration_s(job["scrape_interval"]) == 5


@needs_yaml
@pytest.mark.parametrize("layout", [(COMPOSE,), (COMPOSE, COMPOSE_SPLIT)], ids=["all-in-one", "split"])
def test_compose_serves_metrics_to_prometheus_only(layout: tuple[Path, ...]) -> None:
    """/metrics is on its own port (never the public one, where a flood of scrapes slowed live calls):
    on the compose network for Prometheus' "kame" job, not published on the host."""
    from telephony.config import DEFAULT_METRICS_PORT

    kame = load_compose(*layout)["services"]["kame"]
    assert _flag(kame["command"], "--metrics-host") == "0.0.0.0", "loopback inside the container: unreachable"
    port = _flag(kame["command"], "--metrics-port")
    assert int(port) == DEFAULT_METRICS_PORT != int(_flag(kame["command"], "--port"))
    assert not any(p.split(":")[-1] == port for p in kame["ports"]), "the metrics port must not be published"
    (config,) = load_yaml_docs(PROM_CONFIG)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kame"]
    assert [t for sc in job["static_configs"] for t in sc["targets"]] == [f"kame:{port}"]


@needs_yaml
def test_deployments_transcribe_on_the_gpu() -> None:
    """pocketsphinx is the development STT (CPU, one decoder per call): every GPU deployment uses kyutai."""
    commands = {
        "compose": load_compose(COMPOSE)["services"]["kame"]["command"],
        "compose split engine": load_compose(COMPOSE, COMPOSE_SPLIT)["services"]["engine"]["command"],
        "k8s": _container(k8s_docs()[("Deployment", "kame-phone")], "kame-phone")["args"],
        "k8s split engine": _container(split_docs()[("Deployment", "kame-engine")], "kame-engine")["args"],
    }
    for where, args in commands.items():
        assert _flag(args, "--stt") == "kyutai", where
    assert re.search(r'CMD \[.*"--stt", "kyutai"', "\n".join(dockerfile_instructions()))


@needs_yaml
def test_prometheus_scrapes_the_engine_server_by_dns() -> None:
    """The split layout's engine server has a job of its own ("kame-engine", which the engine alerts
    select) at the compose service's name and engine-serve's --http-port. DNS discovery, so the
    all-in-one stack, where the name does not resolve, has no target (and no down alert) in it."""
    (config,) = load_yaml_docs(PROM_CONFIG)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kame-engine"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert parse_duration_s(job["scrape_interval"]) == 5
    assert "static_configs" not in job, "a static target would be down (KameEngineDown) without the split"
    (sd,) = job["dns_sd_configs"]
    engine = load_compose(COMPOSE, COMPOSE_SPLIT)["services"]["engine"]  # the compose service named "engine"
    assert sd["names"] == ["engine"]
    assert sd["type"] == "A" and sd["port"] == int(_flag(engine["command"], "--http-port"))


@needs_yaml
def test_alert_rules_are_well_formed() -> None:
    (doc,) = load_yaml_docs(ALERTS)
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"].get("summary") and r["annotations"].get("description"), r["alert"]
    exprs = "\n".join(r["expr"] for r in rules)
    # The signals the runbook expects an alert for.
    for name in (
        "kame_turn_latency_seconds_bucket",
        "kame_first_audio_seconds_bucket",
        "kame_engine_deadline_misses_total",
        "kame_engine_tick_seconds_bucket",
        "kame_twilio_protocol_errors_total",
        "kame_llm_errors_total",
        "kame_llm_requests_total",
        "kame_stt_errors_total",
        "kame_stt_process_restarts_total",
        "kame_redis_errors_total",
        "kame_engine_slots_busy",
        "kame_engine_slots",
        "kame_media_outbound_dropped_frames_total",
        "kame_media_playout_delay_seconds_bucket",
        *LINK_METRICS,
    ):
        assert name in exprs, f"no alert uses {name}"
    assert re.search(r"\bup\{[^}]*job=\"kame\"", exprs), "no instance-down alert on the kame job"
    assert re.search(r"\bup\{[^}]*job=\"kame-engine\"", exprs), "no instance-down alert on the kame-engine job"


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ", ".join(f'{k}="{v}"' for k, v in {"job": "kame", **labels}.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def _histogram(name: str, instance: str, per_min: dict[str, int], n: int = 30) -> list[dict[str, str]]:
    """Cumulative buckets growing by `per_min[le]` each minute, plus the matching _count."""
    out = [_series(f"{name}_bucket", {"instance": instance, "le": le}, f"0+{v}x{n}") for le, v in per_min.items()]
    out.append(_series(f"{name}_count", {"instance": instance}, f"0+{per_min['+Inf']}x{n}"))
    return out


def _alerts(name: str, *exp: dict[str, str]) -> dict[str, Any]:
    return {"eval_time": "15m", "alertname": name, "exp_alerts": [{"exp_labels": e} for e in exp]}


# (input series, expected alerts at 15 m) per scenario; one sample per minute.
ALERT_SCENARIOS = [
    pytest.param(
        [
            # a: p95 ~1.475 s at 1 turn/s -> warning only. b: p95 ~4.8 s but 1 turn/min -> below the guard.
            *_histogram("kame_turn_latency_seconds", "a", {"1": 0, "1.5": 60, "+Inf": 60}),
            *_histogram("kame_turn_latency_seconds", "b", {"1": 0, "5": 1, "+Inf": 1}),
        ],
        [
            _alerts("KameTurnLatencyP95High", {"instance": "a", "severity": "warning"}),
            _alerts("KameTurnLatencyP95Critical"),
        ],
        id="turn-latency",
    ),
    pytest.param(
        [
            # a: 60 answered turns a minute and 10 unanswered, 8 of them after over 3 s of dead air (11 %):
            # fires. b: as many unanswered, all under 3 s (a caller's pause that the bot rightly waited out).
            *_histogram("kame_turn_latency_seconds", "a", {"1": 60, "+Inf": 60}),
            *_histogram("kame_turn_unanswered_seconds", "a", {"3.0": 2, "+Inf": 10}),
            *_histogram("kame_turn_latency_seconds", "b", {"1": 60, "+Inf": 60}),
            *_histogram("kame_turn_unanswered_seconds", "b", {"3.0": 10, "+Inf": 10}),
        ],
        [_alerts("KameDeadAir", {"instance": "a", "severity": "warning"})],
        id="dead-air",
    ),
    pytest.param(
        [
            # a: its engine has been falling behind for 15 m (refusing calls). b: keeping time. c: behind for
            # a moment at 14 m, back in time since: not for a minute, no alert.
            _series("kame_engine_falling_behind", {"instance": "a"}, "1x30"),
            _series("kame_engine_falling_behind", {"instance": "b"}, "0x30"),
            _series("kame_engine_falling_behind", {"instance": "c"}, "0x14 1 0x15"),
        ],
        [_alerts("KameNodeSheddingCalls", {"instance": "a", "severity": "warning"})],
        id="node-shedding-calls",
    ),
    pytest.param(
        [
            # a: 1 late tick/s and p99 ~79.9 ms. b: healthy. c: the odd late tick of a loaded node (one every
            # two minutes: under 1 in 1000), no alert.
            _series("kame_engine_deadline_misses_total", {"instance": "a"}, "0+60x30"),
            _series("kame_engine_deadline_misses_total", {"instance": "b"}, "0+0x30"),
            _series("kame_engine_deadline_misses_total", {"instance": "c"}, "0+0.5x30"),
            *_histogram("kame_engine_tick_seconds", "a", {"0.06": 0, "0.07": 0, "0.08": 750, "+Inf": 750}),
            *_histogram("kame_engine_tick_seconds", "b", {"0.02": 750, "0.08": 750, "+Inf": 750}),
        ],
        [
            _alerts("KameEngineDeadlineMisses", {"instance": "a", "severity": "warning"}),
            _alerts("KameEngineFallingBehind", {"instance": "a", "severity": "critical"}),
            _alerts("KameEngineTickP99NearBudget", {"instance": "a", "severity": "warning"}),
        ],
        id="engine",
    ),
    pytest.param(
        [
            # a: 6 errors per 60 requests (10 %, over two kinds). b: every request fails.
            # c: requests and no errors. d: no requests at all (0/0 is no ratio, not an alert). e: an outage
            # while callers talk: 50 of 60 requests superseded before their error came, the other 10 fail
            # (10 of 60 started, but every request that ended failed: critical).
            *(_series("kame_llm_requests_cancelled_total", {"instance": i}, "0+0x30") for i in "abcd"),
            _series("kame_llm_requests_total", {"instance": "e"}, "0+60x30"),
            _series("kame_llm_requests_cancelled_total", {"instance": "e"}, "0+50x30"),
            _series("kame_llm_errors_total", {"instance": "e", "kind": "server_error"}, "0+10x30"),
            _series("kame_llm_requests_total", {"instance": "a"}, "0+60x30"),
            _series("kame_llm_errors_total", {"instance": "a", "kind": "timeout"}, "0+4x30"),
            _series("kame_llm_errors_total", {"instance": "a", "kind": "malformed"}, "0+2x30"),
            _series("kame_llm_requests_total", {"instance": "b"}, "0+60x30"),
            _series("kame_llm_errors_total", {"instance": "b", "kind": "server_error"}, "0+60x30"),
            _series("kame_llm_requests_total", {"instance": "c"}, "0+60x30"),
            _series("kame_llm_errors_total", {"instance": "c", "kind": "timeout"}, "0+0x30"),
            _series("kame_llm_requests_total", {"instance": "d"}, "0+0x30"),
            _series("kame_llm_errors_total", {"instance": "d", "kind": "timeout"}, "0+0x30"),
        ],
        [
            _alerts(
                "KameLLMErrorRatioHigh",
                {"instance": "a", "severity": "warning"},
                {"instance": "b", "severity": "warning"},
                {"instance": "e", "severity": "warning"},
            ),
            _alerts(
                "KameLLMErrorRatioCritical",
                {"instance": "b", "severity": "critical"},
                {"instance": "e", "severity": "critical"},
            ),
        ],
        id="llm-errors",
    ),
    pytest.param(
        [
            # a: peers keep stalling (25 bot frames dropped per minute). b: one stalled peer at 2 m
            # (500 frames in its silent_socket_s), then nothing: pending for 5 m, never firing. c: none.
            _series("kame_media_outbound_dropped_frames_total", {"instance": "a"}, "0+25x30"),
            _series("kame_media_outbound_dropped_frames_total", {"instance": "b"}, "0 0 500x28"),
            _series("kame_media_outbound_dropped_frames_total", {"instance": "c"}, "0x30"),
        ],
        [_alerts("KameMediaOutboundFramesDropped", {"instance": "a", "severity": "warning"})],
        id="media-outbound-drops",
    ),
    pytest.param(
        [
            # a: the STT drops a frame a second, for good (a node over its STT's capacity): fires. b: two
            # stalls, at 8 and 12 m, each dropping a frame of 99 rows at once: not a node over its
            # capacity, no alert (any drop at all would have been "firing" for 7 m by 15 m). c: none.
            _series("kame_stt_dropped_frames_total", {"instance": "a"}, "0+60x30"),
            _series("kame_stt_dropped_frames_total", {"instance": "b"}, "0x7 99x3 198x17"),
            _series("kame_stt_dropped_frames_total", {"instance": "c"}, "0x30"),
        ],
        [_alerts("KameSTTFallingBehind", {"instance": "a", "severity": "warning"})],
        id="stt-falling-behind",
    ),
    pytest.param(
        [
            # a: the STT's process dies every 4 minutes (a lost GPU): fires. b: one death at 5 m: no alert.
            _series("kame_stt_process_restarts_total", {"instance": "a"}, "0 0+0.25x29"),
            _series("kame_stt_process_restarts_total", {"instance": "b"}, "0x4 1x25"),
        ],
        [_alerts("KameSTTProcessCrashLooping", {"instance": "a", "severity": "critical"})],
        id="stt-process-crash-looping",
    ),
    pytest.param(
        [
            _series("kame_stt_errors_total", {"instance": "a"}, "0+1x30"),
            _series("kame_redis_errors_total", {"instance": "a"}, "0+0x30"),
            _series("kame_twilio_protocol_errors_total", {"instance": "a", "kind": "bad_json"}, "0+6x30"),
            _series("kame_twilio_protocol_errors_total", {"instance": "a", "kind": "wrong_sid"}, "0+0x30"),
        ],
        [
            _alerts("KameSTTErrors", {"instance": "a", "severity": "warning"}),
            _alerts("KameRedisErrors"),
            _alerts("KameTwilioProtocolErrors", {"instance": "a", "kind": "bad_json", "severity": "warning"}),
        ],
        id="error-counters",
    ),
    pytest.param(
        [
            _series("kame_engine_slots", {"instance": "a"}, "8x30"),
            _series("kame_engine_slots", {"instance": "b"}, "8x30"),
            _series("kame_engine_slots_busy", {"instance": "a"}, "8x30"),
            _series("kame_engine_slots_busy", {"instance": "b"}, "7x30"),
        ],
        [_alerts("KameCapacityLow", {"severity": "warning"}), _alerts("KameCapacityExhausted")],
        id="capacity-low",
    ),
    pytest.param(
        # A node loading its model (seats 0) pages nobody for minutes; still none after 20 m does.
        [
            _series("kame_engine_slots", {"instance": "a"}, "0x30"),
            _series("kame_engine_slots_busy", {"instance": "a"}, "0x30"),
        ],
        [
            _alerts("KameCapacityExhausted"),
            _alerts("KameNoSeats"),
            {"eval_time": "25m", "alertname": "KameNoSeats", "exp_alerts": [{"exp_labels": {"severity": "critical"}}]},
        ],
        id="no-seats",
    ),
    pytest.param(
        # One busy answer among 50 calls a minute (a node draining) kept the 10 m rate above 0 and fired.
        [
            _series("kame_calls_total", {"instance": "a", "outcome": "completed"}, "0+50x30"),
            _series("kame_calls_total", {"instance": "a", "outcome": "busy"}, "0x8 1x22"),
        ],
        [_alerts("KameCallersGetBusy")],
        id="one-busy-call",
    ),
    pytest.param(
        [
            _series("kame_engine_slots", {"instance": "a"}, "8x30"),
            _series("kame_engine_slots_busy", {"instance": "a"}, "8x30"),
        ],
        [
            _alerts("KameCapacityLow", {"severity": "warning"}),
            _alerts("KameCapacityExhausted", {"severity": "critical"}),
        ],
        id="capacity-exhausted",
    ),
    pytest.param(
        [
            # 60 calls/min: 50 completed, 6 rejected (10 %: fires), 2 silent_socket (3 %: no), 2 busy; and
            # agents' tools at work, 10 transferred and 10 ended by the agent a minute (normal: no alert).
            _series("kame_calls_total", {"instance": "a", "outcome": "completed"}, "0+50x30"),
            _series("kame_calls_total", {"instance": "a", "outcome": "transferred"}, "0+10x30"),
            _series("kame_calls_total", {"instance": "a", "outcome": "ended_by_agent"}, "0+10x30"),
            _series("kame_calls_total", {"instance": "a", "outcome": "rejected"}, "0+6x30"),
            _series("kame_calls_total", {"instance": "a", "outcome": "silent_socket"}, "0+2x30"),
            _series("kame_calls_total", {"instance": "b", "outcome": "busy"}, "0+2x30"),
            _series("kame_twilio_stream_events_total", {"instance": "b", "event": "stream-error"}, "0+1x30"),
            _series("kame_twilio_stream_events_total", {"instance": "b", "event": "stream-started"}, "0+60x30"),
        ],
        [
            _alerts("KameCallsEndingBadly", {"outcome": "rejected", "severity": "warning"}),
            _alerts("KameCallersGetBusy", {"severity": "warning"}),
            _alerts("KameTwilioStreamErrors", {"severity": "warning"}),
        ],
        id="call-outcomes",
    ),
    pytest.param(
        [_series("up", {"instance": "a"}, "0x30"), _series("up", {"instance": "b"}, "1x30")],
        [
            _alerts("KameInstanceDown", {"instance": "a", "job": "kame", "severity": "critical"}),
            _alerts("KameAllInstancesGone"),
        ],
        id="instance-down",
    ),
    pytest.param(
        [
            # e: the engine server is gone. a: an edge (job kame) answering.
            _series("up", {"job": "kame-engine", "instance": "e"}, "0x30"),
            _series("up", {"instance": "a"}, "1x30"),
        ],
        [
            _alerts("KameEngineDown", {"instance": "e", "job": "kame-engine", "severity": "critical"}),
            _alerts("KameInstanceDown"),
        ],
        id="engine-down",
    ),
    pytest.param(
        # e: the engine's container died at 5 m and left DNS discovery: its `up` ends, never reads 0.
        [_series("up", {"job": "kame-engine", "instance": "e"}, "1x5"), _series("up", {"instance": "a"}, "1x30")],
        [
            _alerts("KameEngineGone", {"severity": "critical"}),
            _alerts("KameEngineDown"),
            {"eval_time": "5m", "alertname": "KameEngineGone", "exp_alerts": []},
        ],
        id="engine-gone",
    ),
    pytest.param(
        [
            # a: lost its engine at 12 m and was not restarted yet (the series appears already at 1:
            # increase() would see nothing). b: lost it at 1 m, restarted at 3 m. c: never.
            _series("kame_engine_link_errors_total", {"instance": "a", "kind": "lost"}, "_x12 1x18"),
            _series("kame_engine_link_errors_total", {"instance": "b", "kind": "lost"}, "_ 1 1 _x27"),
            _series("kame_engine_link_edges", {"instance": "c"}, "0x30"),
            # Engine-side kinds are another alert's.
            _series("kame_engine_link_errors_total", {"instance": "e", "kind": "bad_token"}, "1x30"),
        ],
        [_alerts("KameEngineLinkLost", {"instance": "a", "severity": "warning"})],
        id="engine-link-lost",
    ),
    pytest.param(
        [
            # e: loaded, no edge for 15 m. f: loaded with 2 edges. g: still loading (slots 0). h: its edge
            # connected at 5 m. n: an all-in-one node (job kame) exports the same names at 0: not an engine.
            *[
                _series(name, {"job": "kame-engine", "instance": i}, values)
                for i, edges, slots in [("e", "0x30", "8x30"), ("f", "2x30", "8x30"), ("g", "0x30", "0x30"),
                                        ("h", "0x5 1x25", "8x30")]
                for name, values in [("kame_engine_link_edges", edges), ("kame_engine_slots", slots)]
            ],
            _series("kame_engine_link_edges", {"instance": "n"}, "0x30"),
            _series("kame_engine_slots", {"instance": "n"}, "8x30"),
        ],
        [
            _alerts(
                "KameEngineWithoutEdges", {"instance": "e", "job": "kame-engine", "severity": "warning"}
            )
        ],
        id="engine-without-edges",
    ),
    pytest.param(
        [
            # e: one wrong token at 13 m (a new series: only the `unless ... offset` half sees it), a steady
            # stream of bad messages, and one old bad hello (nothing new for 10 m: no alert).
            *[
                _series("kame_engine_link_errors_total", {"job": "kame-engine", "instance": "e", "kind": k}, v)
                for k, v in [("bad_token", "_x13 1x17"), ("bad_message", "0+1x30"), ("bad_hello", "1x30")]
            ],
            # An edge's lost link is KameEngineLinkLost's.
            _series("kame_engine_link_errors_total", {"instance": "a", "kind": "lost"}, "0+1x30"),
            # n: a process started at 8 m exports every kind at 0: nothing to page about.
            *[
                _series("kame_engine_link_errors_total", {"job": "kame-engine", "instance": "n", "kind": k}, "_x8 0x22")
                for k in ("bad_token", "bad_message", "bad_hello", "bad_audio")
            ],
        ],
        [
            _alerts(
                "KameEngineLinkErrors",
                {"instance": "e", "kind": "bad_token", "severity": "warning"},
                {"instance": "e", "kind": "bad_message", "severity": "warning"},
            )
        ],
        id="engine-link-errors",
    ),
    pytest.param(
        [
            # e: an edge keeps falling behind (10 ticks dropped a minute). a: one stall at 2 m, then none.
            # b: the first drops appear as a new series and stop there. c: one stall at 11 m, still in the
            # 5 m rate at 15 m but for under 5 m: pending, not firing.
            _series("kame_engine_link_dropped_total", {"instance": "e", "what": "bot_frames"}, "0+10x30"),
            _series("kame_engine_link_dropped_total", {"instance": "a", "what": "caller_audio"}, "0 0 500x28"),
            _series("kame_engine_link_dropped_total", {"instance": "b", "what": "caller_audio"}, "_x3 40x27"),
            _series("kame_engine_link_dropped_total", {"instance": "c", "what": "caller_audio"}, "0x10 300x19"),
        ],
        [_alerts("KameEngineLinkShedding", {"instance": "e", "what": "bot_frames", "severity": "warning"})],
        id="engine-link-shedding",
    ),
]


@needs_promtool
@needs_yaml
@pytest.mark.parametrize(("input_series", "alert_tests"), ALERT_SCENARIOS)
def test_alerts_fire_as_intended(
    tmp_path: Path, input_series: list[dict[str, str]], alert_tests: list[dict[str, Any]]
) -> None:
    """promtool unit tests of the rule expressions on synthetic series.

    Annotations are stripped from a copy of the rules (promtool compares them verbatim, and their
    templates are already checked by `promtool check rules`); labels, `for` and expressions are kept.
    """
    (doc,) = load_yaml_docs(ALERTS)
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "alerts_no_annotations.yml"
    rules.write_text(yaml.safe_dump(doc, sort_keys=False))
    unit = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": alert_tests}],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    result = promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- docker compose ---------------------------------------------------------------------------------------

_RESET = object()  # docker compose's `!reset` tag: drop the attribute the earlier files set


def load_compose(*paths: Path) -> dict[str, Any]:
    """The model `docker compose -f A -f B ...` builds, as far as these files need: mappings merge,
    `command`/`entrypoint`/`healthcheck.test` are replaced, other sequences append (without repeats),
    and `!reset` removes an attribute."""
    assert yaml is not None

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: _RESET)
    merged: dict[str, Any] = {}
    for path in paths:
        merged = _compose_merge(merged, yaml.load(path.read_text(), Loader))  # noqa: S506 (a SafeLoader)
    return merged


def _compose_merge(base: Any, override: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            if v is _RESET:
                out.pop(k, None)
            else:
                out[k] = _compose_merge(out[k], v, k) if k in out else v
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in {"command", "entrypoint", "test"}:
        return base + [v for v in override if v not in base]
    return override


def _flag(args: list[str], name: str) -> str:
    """The value of `--name=value` in a command line (the form the ops files use)."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(values) == 1, f"{name}=... given {len(values)} times in {args}"
    return values[0]


def _volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> volume name or host path, from short-form `volumes:` entries."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


@needs_yaml
def test_compose_file() -> None:
    (compose,) = load_yaml_docs(COMPOSE)
    services = compose["services"]
    assert {"kame", "redis", "prometheus", "grafana"} <= set(services)

    kame = services["kame"]
    assert kame["build"]["context"] == ".."  # the repo root, where the Dockerfile is
    devices = kame["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert parse_duration_s(kame["stop_grace_period"]) >= 300, "calls need minutes to finish on SIGTERM"
    assert "/healthz" in " ".join(kame["healthcheck"]["test"])
    assert kame["env_file"] in (".env", [".env"])

    assert "--appendonly" in services["redis"]["command"]
    mounts = " ".join(services["prometheus"]["volumes"])
    assert "./prometheus:" in mounts
    mounts = " ".join(services["grafana"]["volumes"])
    assert "./grafana/provisioning:" in mounts and "./grafana/dashboards:" in mounts


@needs_yaml
def test_grafana_refuses_the_example_password(tmp_path: Path) -> None:
    """Compose's `:?` refuses only an empty GRAFANA_ADMIN_PASSWORD; ops/.env.example's placeholder, copied and
    left, was the dashboard's admin password. The entrypoint, run as the image would (with /run.sh standing in
    for Grafana), refuses it and starts Grafana with anything else."""
    (compose,) = load_yaml_docs(COMPOSE)
    entrypoint = compose["services"]["grafana"]["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"]
    run = tmp_path / "run.sh"
    run.write_text('#!/bin/sh\necho "grafana started with $#"\n')
    run.chmod(0o755)
    script = entrypoint[2].replace("$$", "$").replace("/run.sh", str(run))  # compose's escape, then the stand-in
    example = dict(line.split("=", 1) for line in (OPS / ".env.example").read_text().splitlines()
                   if line.startswith("GRAFANA_ADMIN_PASSWORD="))  # fmt: skip
    for password, code, says in [(example["GRAFANA_ADMIN_PASSWORD"], 1, "still holds the placeholder"),
                                 ("a-real-one-Xk9", 0, "grafana started with 0")]:  # fmt: skip
        done = subprocess.run(["/bin/sh", "-c", script, *entrypoint[3:]], capture_output=True, text=True,
                              env={"PATH": os.environ["PATH"], "GF_SECURITY_ADMIN_PASSWORD": password}, timeout=10)
        assert done.returncode == code and says in done.stdout + done.stderr, (password, done)


@needs_yaml
def test_compose_default_is_the_all_in_one_service() -> None:
    """`docker compose -f ops/docker-compose.yml up` must stay what it was: the split is only in the
    override file, not in profiles or services of this one."""
    (compose,) = load_yaml_docs(COMPOSE)
    assert set(compose["services"]) == {"kame", "redis", "prometheus", "grafana"}
    assert not any("profiles" in svc for svc in compose["services"].values())
    command = compose["services"]["kame"]["command"]
    assert command[0] == "serve" and not any(a.startswith("--engine") for a in command)
    assert any(a.startswith("--checkpoint=") for a in command)
    assert "${KAME_HOST_PORT:-8080}:8080" in compose["services"]["kame"]["ports"]


@needs_yaml
def test_compose_split_engine_and_edge() -> None:
    base = load_compose(COMPOSE)
    split = load_compose(COMPOSE, COMPOSE_SPLIT)
    services = split["services"]
    assert set(services) == set(base["services"]) | {"engine"}, "the split adds the engine and nothing else"
    for name in ("redis", "prometheus", "grafana"):
        assert services[name] == base["services"][name], f"the split must not touch {name}"
    engine, edge = services["engine"], services["kame"]

    # The engine: the same image, the GPU, engine-serve with its HTTP side reachable for Prometheus.
    assert engine["build"] == base["services"]["kame"]["build"] and engine["image"] == edge["image"]
    assert any("gpu" in d["capabilities"] for d in engine["deploy"]["resources"]["reservations"]["devices"])
    command = engine["command"]
    assert command[0] == "engine-serve"
    assert _flag(command, "--http-host") == "0.0.0.0"
    port = _flag(command, "--http-port")
    assert f"127.0.0.1:{port}/healthz" in " ".join(engine["healthcheck"]["test"])
    assert _flag(command, "--checkpoint") == "${KAME_CHECKPOINT:-SakanaAI/kame}"
    assert engine["restart"] == "unless-stopped", "a dead engine exits 1 and must come back"
    assert engine["env_file"] in (".env", [".env"]) and engine.get("init") is True
    assert "ports" not in engine, "the engine's link and metrics stay on the compose network"
    assert parse_duration_s(engine["stop_grace_period"]) > 600, "SIGTERM drains the engine's calls (600 s)"

    # The edge: the kame service (same port, same Prometheus target) without the GPU, on the engine.
    assert "deploy" not in edge, "the edge must not reserve the GPU"
    assert edge["command"][0] == "serve" and not any(a.startswith("--checkpoint") for a in edge["command"])
    assert edge["ports"] == base["services"]["kame"]["ports"]
    assert edge["depends_on"]["engine"]["condition"] == "service_started"
    assert edge["depends_on"]["redis"] == base["services"]["kame"]["depends_on"]["redis"]
    assert parse_duration_s(edge["stop_grace_period"]) >= 300, "edges still drain their calls"
    assert "/healthz" in " ".join(edge["healthcheck"]["test"])
    # The seats the edge asks for are the engine's: the only edge takes them all.
    assert _flag(edge["command"], "--max-calls") == _flag(command, "--max-calls")

    # One link address, a Unix socket in a volume both containers mount (no token needed there).
    listen = _flag(command, "--listen")
    assert _flag(edge["command"], "--engine") == listen and listen.startswith("unix:/")
    socket_dir = str(Path(listen.removeprefix("unix:")).parent)
    assert _volume_mounts(engine).get(socket_dir) == _volume_mounts(edge).get(socket_dir) == "kame-data"
    assert "kame-data" in split["volumes"]


@needs_yaml
def test_compose_split_edge_healthcheck_restarts_only_on_503() -> None:
    """Docker does not restart an unhealthy container; the edge's check stops it (SIGTERM to PID 1) on
    /healthz 503 (the engine link is gone for good) and on nothing else."""
    import http.server
    import os
    import sys
    import threading

    script = load_compose(COMPOSE, COMPOSE_SPLIT)["services"]["kame"]["healthcheck"]["test"]
    assert script[:3] == ["CMD", "python", "-c"]
    for status, killed in ((200, False), (500, False), (503, True)):

        class Handler(http.server.BaseHTTPRequestHandler):
            answer = status

            def do_GET(self) -> None:
                self.send_response(self.answer)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            code = script[3].replace("127.0.0.1:8080", f"127.0.0.1:{server.server_address[1]}")
            stub = "import os\nos.kill = lambda pid, sig: print('kill', pid, int(sig))\n"
            result = subprocess.run(
                [sys.executable, "-c", stub + code], capture_output=True, text=True, timeout=30,
                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, check=False,
            )  # fmt: skip
        finally:
            server.shutdown()
            server.server_close()
        assert (result.returncode == 0) == (status == 200), (status, result.stderr)
        assert (result.stdout.strip() == "kill 1 15") == killed, (status, result.stdout)


def test_env_example_lists_the_service_env_with_placeholders() -> None:
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    assert SERVICE_ENV <= set(env), f"missing: {sorted(SERVICE_ENV - set(env))}"
    for key in SECRET_ENV:
        assert env[key].startswith("replace-"), f"{key} in .env.example must be a placeholder"


# --- Kubernetes -------------------------------------------------------------------------------------------


def k8s_docs() -> dict[tuple[str, str], dict[str, Any]]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for d in load_yaml_docs(path):
            assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), path.name
            docs[(d["kind"], d["metadata"]["name"])] = d
    return docs


@needs_yaml
def test_k8s_manifests_parse_and_kustomization_lists_real_files() -> None:
    docs = k8s_docs()
    for kind in ("Namespace", "ConfigMap", "Deployment", "Service", "StatefulSet", "Secret", "Ingress"):
        assert any(k == kind for k, _ in docs), f"no {kind} in ops/k8s"
    (kustomization,) = load_yaml_docs(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    assert "secret.example.yaml" not in kustomization["resources"], "the example Secret must not be applied"


@needs_yaml
def test_k8s_deployment() -> None:
    docs = k8s_docs()
    spec = docs[("Deployment", "kame-phone")]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= 300, "calls need minutes to finish on SIGTERM"
    (container,) = spec["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load takes minutes"
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    # A node drain evicts one pod at a time (each drains its calls while the others take new ones).
    budget = docs[("PodDisruptionBudget", "kame-phone")]["spec"]
    assert budget["maxUnavailable"] == 1
    pods = docs[("Deployment", "kame-phone")]["spec"]["template"]["metadata"]["labels"]
    assert _selects(budget["selector"]["matchLabels"], pods)

    # Every variable the service reads comes from the ConfigMap or the Secret the pod uses.
    config = docs[("ConfigMap", "kame-phone-config")]["data"]
    secret = docs[("Secret", "kame-phone-secrets")]["stringData"]
    refs = {e.get("configMapRef", e.get("secretRef"))["name"] for e in container["envFrom"]}
    assert refs == {"kame-phone-config", "kame-phone-secrets"}
    assert SERVICE_ENV <= set(config) | set(secret), sorted(SERVICE_ENV - set(config) - set(secret))
    assert SECRET_ENV <= set(secret) and not SECRET_ENV & set(config), "secrets belong in the Secret"
    assert all(v.startswith("replace-") for v in secret.values()), "secret.example.yaml must hold placeholders"
    # $(VAR) in args must be defined, or Kubernetes passes the literal text.
    defined = set(config) | set(secret) | {e["name"] for e in container.get("env", [])}
    for arg in container["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in defined, f"args use $({var}), which no env source defines"


@needs_yaml
def test_k8s_metrics_are_on_their_own_port() -> None:
    """The pod serves /metrics on a `metrics` port, on all its interfaces (Prometheus scrapes the pod IP);
    the probes and the Ingress stay on `http`, and the split's edges keep the same flags."""
    docs = k8s_docs()
    deployment = docs[("Deployment", "kame-phone")]
    container = _container(deployment, "kame-phone")
    args = container["args"]
    assert _flag(args, "--metrics-host") == "0.0.0.0"
    port = int(_flag(args, "--metrics-port"))
    assert _port_number(container, "metrics") == port != _port_number(container, "http")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "http", probe
    service_ports = {p["name"]: p for p in docs[("Service", "kame-phone")]["spec"]["ports"]}
    assert service_ports["metrics"]["targetPort"] == "metrics"
    (ingress,) = load_yaml_docs(K8S / "ingress.example.yaml")
    backends = [path["backend"]["service"]["port"] for rule in ingress["spec"]["rules"]
                for path in rule["http"]["paths"]]  # fmt: skip
    assert backends and all(b == {"name": "http"} for b in backends), "the Ingress must not route to metrics"
    edge_args = _container(split_docs()[("Deployment", "kame-phone")], "kame-phone")["args"]
    for flag in ("--metrics-host", "--metrics-port"):  # the patch replaces the whole args list
        assert _flag(edge_args, flag) == _flag(args, flag), flag


# --- Kubernetes: the split overlay (ops/k8s-split) ----------------------------------------------------------


def split_kustomization() -> dict[str, Any]:
    (kustomization,) = load_yaml_docs(K8S_SPLIT / "kustomization.yaml")
    return kustomization


def split_docs() -> dict[tuple[str, str], dict[str, Any]]:
    """The overlay's own resources and patches, by (kind, name)."""
    kustomization = split_kustomization()
    paths = [r for r in kustomization["resources"] if (K8S_SPLIT / r).is_file()]
    paths += [p["path"] for p in kustomization.get("patches", [])]
    docs = {}
    for path in paths:
        for d in load_yaml_docs(K8S_SPLIT / path):
            docs[(d["kind"], d["metadata"]["name"])] = d
    return docs


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@needs_yaml
def test_k8s_split_kustomization_reuses_the_base() -> None:
    kustomization = split_kustomization()
    (base_kustomization,) = load_yaml_docs(K8S / "kustomization.yaml")
    dirs = [r for r in kustomization["resources"] if (K8S_SPLIT / r).is_dir()]
    assert [(K8S_SPLIT / d).resolve() for d in dirs] == [K8S.resolve()], "the overlay builds on ops/k8s"
    for resource in kustomization["resources"]:
        assert (K8S_SPLIT / resource).is_file() or (K8S_SPLIT / resource / "kustomization.yaml").is_file(), resource
    for patch in kustomization["patches"]:
        assert (K8S_SPLIT / patch["path"]).is_file(), patch
    # kustomize refuses an overlay inside its base ("cycle detected").
    assert not K8S_SPLIT.resolve().is_relative_to(K8S.resolve())
    assert kustomization["namespace"] == base_kustomization["namespace"]
    # The base's images: do not reach the overlay's own resources: the same entry must be here.
    assert kustomization["images"] == base_kustomization["images"]
    # Every patch targets something the base defines (a patch without a target fails the build).
    base = k8s_docs()
    for patch in kustomization["patches"]:
        for d in load_yaml_docs(K8S_SPLIT / patch["path"]):
            assert (d["kind"], d["metadata"]["name"]) in base, f"{patch['path']} patches nothing in ops/k8s"


@needs_yaml
def test_k8s_split_engine_deployment() -> None:
    docs = split_docs()
    base = k8s_docs()
    deployment = docs[("Deployment", "kame-engine")]
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    # It holds the only GPU: no surge pod that would wait for a second one.
    strategy = spec["strategy"]
    assert strategy["type"] == "Recreate" or strategy["rollingUpdate"]["maxSurge"] == 0
    pod = spec["template"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 600, "SIGTERM drains the engine's calls (600 s)"
    container = _container(deployment, "kame-engine")
    args = container["args"]
    assert args[0] == "engine-serve"
    assert _flag(args, "--listen") == "tcp://0.0.0.0:7070"
    assert _flag(args, "--http-host") == "0.0.0.0"
    http_port = int(_flag(args, "--http-port"))
    assert http_port == 9091
    base_args = _container(base[("Deployment", "kame-phone")], "kame-phone")["args"]
    for flag in ("--checkpoint", "--max-calls"):
        assert _flag(args, flag) == _flag(base_args, flag), f"{flag} as the base passes it"
    assert {p["containerPort"] for p in container["ports"]} == {7070, http_port}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _port_number(container, container[probe]["httpGet"]["port"]) == http_port, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load takes minutes"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(http_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert "cpu" not in container["resources"]["limits"], "CFS throttling stalls the frame loop"

    # The link token (required off loopback) comes from the Secret, which documents it.
    env = {e["name"]: e for e in container["env"]}
    ref = env["KAME_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = base[("Secret", "kame-phone-secrets")]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert not ref.get("optional")
    assert secret["stringData"]["KAME_ENGINE_TOKEN"].startswith("replace-")
    # The LLM back-end runs here: its settings and key reach the pod.
    config = base[("ConfigMap", "kame-phone-config")]["data"]
    refs = {e["configMapRef"]["name"] for e in container["envFrom"] if "configMapRef" in e}
    assert refs == {"kame-phone-config"} and "OPENAI_BASE_URL" in config
    assert "OPENAI_API_KEY" in env
    defined = set(config) | set(env)
    for arg in args:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in defined, f"args use $({var}), which no env source defines"

    # Its own Service, and never behind the Twilio-facing one.
    labels = pod["metadata"]["labels"]
    service = docs[("Service", "kame-engine")]["spec"]
    assert service["type"] == "ClusterIP" and _selects(service["selector"], labels)
    assert _selects(spec["selector"]["matchLabels"], labels)
    assert not _selects(base[("Service", "kame-phone")]["spec"]["selector"], labels), (
        "the kame-phone Service (Twilio's) would send webhooks to the engine"
    )
    ports = {p["port"]: _port_number(container, p["targetPort"]) for p in service["ports"]}
    assert ports[7070] == 7070 and ports.get(http_port) == http_port


@needs_yaml
def test_k8s_split_edge_patch() -> None:
    docs = split_docs()
    base = k8s_docs()
    patch = docs[("Deployment", "kame-phone")]
    container = _container(patch, "kame-phone")
    base_container = _container(base[("Deployment", "kame-phone")], "kame-phone")
    args = container["args"]
    assert args[0] == "serve"
    engine_service = docs[("Service", "kame-engine")]
    link_port = next(p["port"] for p in engine_service["spec"]["ports"] if p["name"] == "link")
    assert _flag(args, "--engine") == f"tcp://{engine_service['metadata']['name']}:{link_port}"
    assert not any(a.startswith("--checkpoint") for a in args), "the edge loads no model"
    for flag in ("--host", "--port"):  # the base's probes and Service keep pointing at it
        assert _flag(args, flag) == _flag(base_container["args"], flag)
    # No GPU: the strategic-merge patch deletes the base's requests and limits (null) and the toleration.
    resources = container["resources"]
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" in resources[section] and resources[section]["nvidia.com/gpu"] is None, section
    assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]
    pod = patch["spec"]["template"]["spec"]
    assert "tolerations" in pod and pod["tolerations"] is None, "the GPU toleration must be deleted (null)"
    # A surge edge would find no seats left until the old one exits: never ready, a stalled rollout.
    assert patch["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    env = {e["name"]: e for e in container["env"]}
    assert env["KAME_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "KAME_ENGINE_TOKEN"

    # Seats: $(KAME_EDGE_SEATS) is defined, and the edges together ask no more than the engine has.
    config = {**base[("ConfigMap", "kame-phone-config")]["data"], **docs[("ConfigMap", "kame-phone-config")]["data"]}
    (seats_var,) = re.findall(r"\$\((\w+)\)", _flag(args, "--max-calls"))
    replicas = patch["spec"].get("replicas", base[("Deployment", "kame-phone")]["spec"]["replicas"])
    assert replicas * int(config[seats_var]) <= int(config["KAME_MAX_CALLS"])


def kustomize_build(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    assert KUBECTL is not None
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert yaml is not None
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout) if d}


@needs_kubectl
@needs_yaml
def test_k8s_split_renders_with_kustomize() -> None:
    base = kustomize_build(K8S)
    split = kustomize_build(K8S_SPLIT)
    assert set(split) == set(base) | {("Deployment", "kame-engine"), ("Service", "kame-engine"),
                                      ("PodDisruptionBudget", "kame-engine")}  # fmt: skip
    for (kind, name), doc in split.items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == "kame-phone", f"{kind}/{name}"
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kame-phone", f"{kind}/{name}"

    engine = _container(split[("Deployment", "kame-engine")], "kame-engine")
    edge = _container(split[("Deployment", "kame-phone")], "kame-phone")
    all_in_one = _container(base[("Deployment", "kame-phone")], "kame-phone")
    assert engine["image"] == edge["image"] == all_in_one["image"], "one image, one tag for all three"
    assert int(engine["resources"]["limits"]["nvidia.com/gpu"]) == 1
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in edge["resources"][section], section
    assert "tolerations" not in split[("Deployment", "kame-phone")]["spec"]["template"]["spec"]
    assert _flag(edge["args"], "--engine") == "tcp://kame-engine:7070"
    # What the patch does not touch stays the base's: drain time, probes, env sources.
    edge_pod = split[("Deployment", "kame-phone")]["spec"]["template"]["spec"]
    base_pod = base[("Deployment", "kame-phone")]["spec"]["template"]["spec"]
    assert edge_pod["terminationGracePeriodSeconds"] == base_pod["terminationGracePeriodSeconds"]
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "envFrom", "securityContext"):
        assert edge[key] == all_in_one[key], key
    assert {"HF_HOME", "KAME_NODE_ID", "KAME_ENGINE_TOKEN"} <= {e["name"] for e in edge["env"]}
    assert split[("ConfigMap", "kame-phone-config")]["data"]["KAME_EDGE_SEATS"]
    # The Twilio-facing Service selects the edges only.
    selector = split[("Service", "kame-phone")]["spec"]["selector"]
    assert _selects(selector, split[("Deployment", "kame-phone")]["spec"]["template"]["metadata"]["labels"])
    assert not _selects(selector, split[("Deployment", "kame-engine")]["spec"]["template"]["metadata"]["labels"])
    # A node drain evicts one edge and one engine at a time, each budget over its own pods only.
    for name, other in (("kame-phone", "kame-engine"), ("kame-engine", "kame-phone")):
        budget = split[("PodDisruptionBudget", name)]["spec"]
        pods = {n: split[("Deployment", n)]["spec"]["template"]["metadata"]["labels"] for n in (name, other)}
        assert budget["maxUnavailable"] == 1
        assert _selects(budget["selector"]["matchLabels"], pods[name])
        assert not _selects(budget["selector"]["matchLabels"], pods[other])


@needs_kubectl
@needs_yaml
def test_k8s_base_renders_unchanged_by_the_overlay() -> None:
    """The all-in-one layout keeps its GPU pod and no engine resources."""
    base = kustomize_build(K8S)
    assert ("Deployment", "kame-engine") not in base
    container = _container(base[("Deployment", "kame-phone")], "kame-phone")
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert not any(a.startswith("--engine") for a in container["args"])
    assert "KAME_EDGE_SEATS" not in base[("ConfigMap", "kame-phone-config")]["data"]


# --- Dockerfile ---------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[str]:
    """Instructions with line continuations joined and comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    return [i.strip() for i in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if i.strip()]


def test_dockerfile_installs_moshi_without_deps() -> None:
    moshi_installs = [i for i in dockerfile_instructions() if re.search(r"pip install[^&]*moshi", i)]
    assert moshi_installs, "the Dockerfile does not install moshi"
    for instruction in moshi_installs:
        for cmd in re.findall(r"pip install[^&]*moshi[^&]*", instruction):
            assert "--no-deps" in cmd, f"moshi must be installed with --no-deps (it pins torch): {cmd}"
    assert "moshi" not in " ".join(_pyproject_dependencies()), "moshi must stay out of pyproject dependencies"


def _pyproject_dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_dockerfile_runtime_contract() -> None:
    instructions = dockerfile_instructions()
    text = "\n".join(instructions)
    assert any(i.startswith("HEALTHCHECK") and "/healthz" in i for i in instructions), "no /healthz HEALTHCHECK"
    # one image, two servers: the check's port comes from KAME_HEALTH_PORT (engine-serve listens on 9091)
    assert any(i.startswith("HEALTHCHECK") and "KAME_HEALTH_PORT" in i and "8080" in i for i in instructions)
    assert 'ENTRYPOINT ["kame-phone"]' in text
    assert "EXPOSE 8080 9092" in text  # the public port, and /metrics (`serve --metrics-port`)
    assert re.search(r'CMD \[.*"--metrics-host", "0.0.0.0", "--metrics-port", "9092"', text)
    assert "STOPSIGNAL SIGTERM" in text
    users = [i.split()[1] for i in instructions if i.startswith("USER ")]
    assert users and users[-1] not in {"root", "0"}, "the service must not run as root"
    assert re.search(r"HF_HOME=\S+", text) and "VOLUME" in text


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()]
    for p in (".venv/", ".git/", "var/", "**/.env"):
        assert p in patterns, f".dockerignore lacks {p}"


def test_dockerignore_lets_every_package_in() -> None:
    """.dockerignore is an allow-list: a package pyproject.toml builds but the context lacks would
    give an image whose `kame-phone` entry point cannot import."""
    import tomllib

    patterns = {ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()}
    assert "*" in patterns, "expected an allow-list .dockerignore"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for include in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = include.rstrip("*").rstrip(".")
        assert f"!{package}/" in patterns, f".dockerignore must allow {package}/ (built by pip install .)"


@needs_yaml
@pytest.mark.parametrize("layout", [(COMPOSE,), (COMPOSE, COMPOSE_SPLIT)], ids=["all-in-one", "split"])
def test_compose_mounts_the_agents_files_folder_so_an_edit_is_seen_on_sighup(layout: tuple[Path, ...]) -> None:
    """A file bind-mounted alone is pinned to its inode: editors, `sed -i` and `git pull` write a new file, and
    the container went on reading the old one; SIGHUP then "reloaded" stale agents without a word."""
    from knowledge.agents import Agents

    services = load_compose(*layout)["services"]
    for name in ("kame", "engine") if len(layout) > 1 else ("kame",):
        command = services[name]["command"]
        (agents,) = [a.split("=", 1)[1] for a in command if str(a).startswith("--agents=")]
        mounts = [v.split(":") for v in services[name]["volumes"] if str(v).startswith("./")]
        (host, target) = next((h, t) for h, t, *_ in mounts if agents.startswith(t.rstrip("/") + "/"))
        folder = OPS / host
        assert folder.is_dir(), f"{name}: {host} is mounted as a file"
        example = folder / Path(agents).relative_to(target)
        assert example.is_file() and len(Agents.load(example).describe()) > 1  # the example the README points at
