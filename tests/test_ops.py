"""Checks on the deployment files: Dockerfile, ops/ (compose, Prometheus, Grafana, Kubernetes).

The main guard: every `kame_*` metric named in the alert rules or the dashboard must be one the service
really exports (engine/metrics.py, telephony/metrics.py), so a renamed metric breaks this test and not a
silent panel or an alert that can never fire.

promtool checks run when `promtool` is on PATH (Debian: `apt-get install prometheus`) and are skipped
otherwise; YAML checks need PyYAML and are skipped without it.
"""

from __future__ import annotations

import json
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
ENV_EXAMPLE = OPS / ".env.example"
K8S = OPS / "k8s"

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


# --- helpers ----------------------------------------------------------------------------------------------


def _metric_families() -> list[Any]:
    from prometheus_client import REGISTRY

    import engine.metrics  # noqa: F401  (importing registers the metrics)
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


@pytest.mark.parametrize(
    ("path", "queries"), [(ALERTS, alert_exprs), (DASHBOARD, dashboard_queries)], ids=["alerts.yml", "dashboard"]
)
def test_every_metric_queried_is_exported(path: Path, queries: Any) -> None:
    used = set().union(*(metric_names_in(q) for q in queries()))
    assert len(used) >= 5, f"found almost no kame_* metrics in {path.name}: is the regex still right?"
    unknown = sorted(used - exported_metric_names())
    assert not unknown, (
        f"{path.relative_to(ROOT)} queries metrics the service does not export: {unknown}. "
        "Metric names are defined in engine/metrics.py and telephony/metrics.py."
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
        "kame_engine_slots_total",
        "kame_first_audio_seconds_bucket",
        "kame_turn_latency_seconds_bucket",
        "kame_turn_overlaps_total",
        "kame_oracle_lag_seconds_bucket",
        "kame_llm_ttft_seconds_bucket",
        "kame_engine_tick_seconds_bucket",
        "kame_engine_deadline_misses_total",
        "kame_engine_underruns_total",
        "kame_engine_input_overruns_total",
        "kame_twilio_protocol_errors_total",
        "kame_llm_errors_total",
        "kame_stt_errors_total",
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
        "kame_redis_errors_total",
        "kame_engine_slots_busy",
        "kame_engine_slots_total",
        "kame_media_outbound_dropped_frames_total",
    ):
        assert name in exprs, f"no alert uses {name}"
    assert re.search(r"\bup\{[^}]*job=\"kame\"", exprs), "no instance-down alert on the kame job"


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
            # a: 1 late tick/s and p99 ~79.9 ms. b: healthy.
            _series("kame_engine_deadline_misses_total", {"instance": "a"}, "0+60x30"),
            _series("kame_engine_deadline_misses_total", {"instance": "b"}, "0+0x30"),
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
            # c: requests and no errors. d: no requests at all (0/0 is no ratio, not an alert).
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
            ),
            _alerts("KameLLMErrorRatioCritical", {"instance": "b", "severity": "critical"}),
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
            _series("kame_engine_slots_total", {"instance": "a"}, "8x30"),
            _series("kame_engine_slots_total", {"instance": "b"}, "8x30"),
            _series("kame_engine_slots_busy", {"instance": "a"}, "8x30"),
            _series("kame_engine_slots_busy", {"instance": "b"}, "7x30"),
        ],
        [_alerts("KameCapacityLow", {"severity": "warning"}), _alerts("KameCapacityExhausted")],
        id="capacity-low",
    ),
    pytest.param(
        [
            _series("kame_engine_slots_total", {"instance": "a"}, "8x30"),
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
            # 60 calls/min: 50 completed, 6 rejected (10 %: fires), 2 silent_socket (3 %: no), 2 busy.
            _series("kame_calls_total", {"instance": "a", "outcome": "completed"}, "0+50x30"),
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
    assert 'ENTRYPOINT ["kame-phone"]' in text
    assert "EXPOSE 8080" in text
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
