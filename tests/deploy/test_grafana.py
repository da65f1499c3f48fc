"""deploy/grafana/ cannot drift from the rest of the deployment: the dashboard is well-formed
Grafana JSON, the labels its panels group by are the ones both scrape configurations give,
and compose's Grafana loads it from compose's Prometheus.

That every metric a panel queries is exported by some service is checked against a real
stack's /metrics endpoints in tests/e2e/test_stack_observability.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from lamina.services.cluster_status import KINDS

ROOT = Path(__file__).resolve().parents[2]
GRAFANA_DIR = ROOT / "deploy" / "grafana"
COMPOSE_DIR = ROOT / "deploy" / "compose"
# Labels the services put on their own series (the rest come from the scrape: kind, instance).
SERVICE_LABELS = {"le", "route", "status", "model", "reason", "stage", "code"}


def _dashboard() -> dict:
    return json.loads((GRAFANA_DIR / "lamina.json").read_text())


def _data_panels(dashboard: dict) -> list[dict]:
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    return [p for p in panels if p["type"] not in ("row", "text")]


def test_dashboard_is_well_formed():
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    panels = _data_panels(dashboard)
    assert len(panels) >= 10
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["description"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], p["title"]


def _grouping_labels(dashboard: dict) -> set[str]:
    """Labels named in the panels' `by (...)` clauses and legends."""
    labels = set()
    for p in _data_panels(dashboard):
        for t in p["targets"]:
            for group in re.findall(r"\bby \(([^)]*)\)", t["expr"]):
                labels |= {label.strip() for label in group.split(",") if label.strip()}
            labels |= set(re.findall(r"\{\{(\w+)\}\}", t["legendFormat"]))
    return labels


def test_the_labels_panels_group_by_come_from_both_scrape_configurations():
    scrape_labels = _grouping_labels(_dashboard()) - SERVICE_LABELS
    assert scrape_labels == {"kind", "instance"}
    # compose: every target is labelled with its kind; instance is Prometheus' own.
    compose = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    kinds = {sc["labels"]["kind"] for job in compose["scrape_configs"] for sc in job.get("static_configs", [])}
    # Replicated services (found by DNS, dns_sd_configs) get their kind by relabelling.
    kinds |= {r["replacement"] for job in compose["scrape_configs"] for r in job.get("relabel_configs", [])
              if r.get("target_label") == "kind"}
    assert kinds == set(KINDS)
    # Kubernetes: both relabelled from the pod; the kind from its name label.
    k8s = yaml.safe_load((GRAFANA_DIR / "prometheus-kubernetes.yml").read_text())
    (job,) = k8s["scrape_configs"]
    targets = {r.get("target_label"): r for r in job["relabel_configs"]}
    assert {"kind", "instance", "__address__"} <= set(targets)
    pods = [doc for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(
        path.read_text()) if doc and doc["kind"] in ("Deployment", "StatefulSet")]
    named = {}
    for doc in pods:
        template = doc["spec"]["template"]["metadata"]
        if template.get("annotations", {}).get("prometheus.io/scrape") == "true":
            name = template["labels"]["app.kubernetes.io/name"]
            match = re.fullmatch(targets["kind"]["regex"], name)
            assert match, f"the pod label {name} gives no kind"
            named[name] = match.expand(targets["kind"]["replacement"].replace("$1", r"\1"))
    assert set(named.values()) == set(KINDS)
    # The dashboard's `up` panel selects the jobs of both.
    jobs = [j["job_name"] for j in compose["scrape_configs"]] + [job["job_name"]]
    assert all(j.startswith("lamina") for j in jobs)
    assert any(t["expr"] == 'up{job=~"lamina.*"}' for p in _data_panels(_dashboard()) for t in p["targets"])


def test_compose_grafana_loads_the_dashboard_from_compose_prometheus():
    compose = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":", 1) for v in grafana["volumes"])
    assert all((COMPOSE_DIR / source).resolve().exists() for source in mounts), mounts
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "lamina.yaml").read_text())
    (dashboards,) = provider["providers"]
    assert mounts["../grafana/lamina.json"] == f"{dashboards['options']['path']}/lamina.json"
    source = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (datasource,) = source["datasources"]
    assert datasource["type"] == "prometheus"
    # Its URL is compose's Prometheus service, on the port that container listens on.
    prometheus_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    assert "prometheus" in grafana["depends_on"]
