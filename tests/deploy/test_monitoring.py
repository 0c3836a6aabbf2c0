"""Grafana and Prometheus files: every series the dashboard and the autoscaling rules query
is one the services export, and the dashboard covers the metric contract (README, "Observe")."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from tests.deploy.manifests import DEPLOY, load_yaml

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedserve.json"
# Where each service defines its metrics; every *Metrics class there is instantiated.
METRICS_MODULES = ("scheduler_svc.metrics", "executor_svc.metrics")
# The metrics the README promises ("Observe"), plus the executor's step time.
CONTRACT = {
    "gauge": {
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_cache_usage_ratio",
        "kv_slot_utilization_ratio",
        "num_requests",
        "token_seconds",
    },
    "counter": {
        "preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "cow_copies_total",
        "swapped_blocks_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "requests_total",
        "requests_refused_total",
    },
    "histogram": {
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "executor_step_seconds",
    },
}
SUFFIXES = {  # the series a metric family exposes, by type
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
SERIES = re.compile(r"\bpagedserve_[a-z0-9_]+")


def _families(registry: CollectorRegistry) -> dict[str, str]:
    return {f.name: f.type for f in registry.collect() if f.name.startswith("pagedserve_")}


def exported_series() -> set[str]:
    """Every series name the services' metrics classes expose, as PromQL sees them."""
    families: dict[str, str] = {}
    for module_name in METRICS_MODULES:
        module = importlib.import_module(module_name)
        classes = [
            cls
            for name, cls in inspect.getmembers(module, inspect.isclass)
            if cls.__module__ == module_name and name.endswith("Metrics")
        ]
        assert classes, f"no *Metrics class in {module_name}"
        for cls in classes:
            try:
                instance = cls()
            except (TypeError, ValueError) as e:
                pytest.fail(f"{module_name}.{cls.__name__}() for listing its metrics: {e}")
            for value in vars(instance).values():
                if isinstance(value, CollectorRegistry):
                    families |= _families(value)
    families |= _families(REGISTRY)  # a class may use the process-wide registry instead
    return {name + suffix for name, kind in families.items() for suffix in SUFFIXES[kind]}


def contract_series() -> set[str]:
    names = set()
    for kind, metrics in CONTRACT.items():
        for metric in metrics:
            base = metric.removesuffix("_total") if kind == "counter" else metric
            names |= {f"pagedserve_{base}{suffix}" for suffix in SUFFIXES[kind]}
    return names


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_series() -> set[str]:
    exprs = [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]
    return {name for expr in exprs for name in SERIES.findall(expr)}


def test_dashboard_queries_only_exported_series() -> None:
    missing = dashboard_series() - exported_series()
    assert not missing, f"the dashboard queries series no service exports: {sorted(missing)}"


def test_dashboard_queries_only_contract_series() -> None:
    outside = dashboard_series() - contract_series()
    assert not outside, f"not in the metric contract: {sorted(outside)}"


def test_dashboard_covers_the_required_panels() -> None:
    required = {
        "pagedserve_kv_cache_usage_ratio",
        "pagedserve_kv_slot_utilization_ratio",
        "pagedserve_preemptions_total",
        "pagedserve_num_requests",
        "pagedserve_prefix_cache_hits_total",
        "pagedserve_prefix_cache_queries_total",
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_time_per_output_token_seconds_bucket",
        "pagedserve_e2e_request_latency_seconds_bucket",
        "pagedserve_generation_tokens_total",
        "pagedserve_prompt_tokens_total",
        "pagedserve_executor_step_seconds_bucket",
    }
    assert required <= dashboard_series()


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "pagedserve"
    (variable,) = dashboard["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_autoscaling_rules_query_exported_series() -> None:
    rules = load_yaml(DEPLOY / "prometheus" / "prometheus-adapter-values.yaml")["rules"]
    queried = {
        r["seriesQuery"].split("{")[0] for kind in ("custom", "external") for r in rules[kind]
    }
    assert queried, "no rules"
    assert queried <= exported_series()
