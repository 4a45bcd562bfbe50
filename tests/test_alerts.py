"""The Prometheus rules in deploy/prometheus/ load, and their alerts fire when and only when their
unit tests say (promtool, from Debian's prometheus package, which .ci/run installs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
promtool = shutil.which("promtool")
pytestmark = pytest.mark.skipif(promtool is None, reason="promtool is not installed (Debian: apt-get install prometheus)")


@pytest.mark.parametrize("command", [["check", "rules", "rules.yml"], ["test", "rules", "rules_test.yml"]])
def test_promtool(command):
    reply = subprocess.run([promtool, *command], cwd=RULES, capture_output=True, text=True, timeout=120)
    assert reply.returncode == 0, reply.stdout + reply.stderr


def test_the_dashboards_queries_parse_and_name_metrics_that_exist(tmp_path):
    """Each panel's PromQL goes through promtool as a recording rule (its parser); each metric it
    names is one the sidecar or the worker exports, or one of the recording rules."""
    import json
    import re

    repo = RULES.parent.parent
    exported = (repo / "sidecar" / "src" / "metrics.rs").read_text() + (repo / "worker" / "telemetry.py").read_text()
    recorded = set(re.findall(r"record: (\S+)", (RULES / "rules.yml").read_text()))
    dashboard = json.loads((RULES.parent / "grafana" / "cy-llm.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 10
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for index, expr in enumerate(exprs):
        lines += [f"      - record: dashboard:query{index}", f"        expr: {json.dumps(expr)}"]
        for name in re.findall(r"\b(cyllm[:_][\w:]*)", expr):
            base = re.sub(r"_(bucket|total)$", "", name)
            assert name in recorded or f'"{base}' in exported, f"{name} is neither exported nor recorded"
    (tmp_path / "dashboard.yml").write_text("\n".join(lines) + "\n")
    reply = subprocess.run([promtool, "check", "rules", str(tmp_path / "dashboard.yml")], capture_output=True, text=True)
    assert reply.returncode == 0, reply.stdout + reply.stderr
