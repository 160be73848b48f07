"""The alert rules of k8s/monitoring/alerts.yaml fire when they should: `promtool test rules` on
the series fixtures of tests/alerts/alerts_test.yaml (a failed run fires ElasticRunFailed, a run
whose series vanish mid-run fires ElasticRunLost, a healthy run that recovers from a node kill
fires nothing), and controls that show those fixtures catch the rules as they were before. The
real run against a real Prometheus loaded with the rules is in tests/test_metrics.py (it shares
that module's Ray cluster). promtool comes from `make tools`; without it these tests skip."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "k8s" / "monitoring" / "alerts.yaml"
FIXTURES = ROOT / "tests" / "alerts" / "alerts_test.yaml"
MUST_FIRE = ("ElasticRunFailed", "ElasticRunLost")


def rule_groups() -> list[dict]:
    """The PrometheusRule's groups: its spec is a Prometheus rules file."""
    (doc,) = [d for d in yaml.safe_load_all(ALERTS.read_text()) if d]
    return doc["spec"]["groups"]


def rules_by_alert(groups: list[dict]) -> dict[str, dict]:
    return {r["alert"]: r for g in groups for r in g["rules"]}


def render(text: str, labels: dict[str, str]) -> str:
    """An annotation as Prometheus expands it for an alert with these labels (the rules use
    `{{ $labels.x }}` only)."""
    out = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m.group(1)], text)
    assert "{{" not in out, f"a template construct this test does not expand: {text}"
    return out


def with_rules_expectations(fixtures: dict, rules: dict[str, dict]) -> dict:
    """The fixtures as promtool wants them: each expected alert with its rule's labels and
    annotations (the fixtures name only the run; promtool compares both)."""
    for case in fixtures["tests"]:
        for check in case["alert_rule_test"]:
            rule = rules[check["alertname"]]
            for alert in check["exp_alerts"]:
                labels = {**rule.get("labels", {}), **alert["exp_labels"]}
                alert["exp_labels"] = labels
                annotations = rule.get("annotations", {})
                alert["exp_annotations"] = {k: render(v, labels) for k, v in annotations.items()}
    return fixtures


@pytest.fixture(scope="module")
def promtool() -> str:
    from tests.support.prometheus import HOW, find_prometheus
    found = find_prometheus()
    if found is None:
        pytest.skip(f"no promtool: {HOW}")
    return found[1]


def promtool_test(promtool: str, groups: list[dict], folder: Path) -> subprocess.CompletedProcess:
    fixtures = yaml.safe_load(FIXTURES.read_text())
    (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    assert fixtures["rule_files"] == ["rules.yaml"]
    tests = folder / "alerts_test.yaml"
    tests.write_text(yaml.safe_dump(with_rules_expectations(fixtures, rules_by_alert(groups))))
    return subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True,
                          timeout=120)


def test_the_fixtures_check_every_alert_and_the_ones_that_must_fire_do():
    fixtures = yaml.safe_load(FIXTURES.read_text())
    alerts = set(rules_by_alert(rule_groups()))
    checks = [(case["name"], c) for case in fixtures["tests"] for c in case["alert_rule_test"]]
    assert {c["alertname"] for _, c in checks} <= alerts
    fired = {c["alertname"] for _, c in checks if c["exp_alerts"]}
    assert set(MUST_FIRE) <= fired
    # the healthy run is checked against every alert of the file, after its end too
    healthy = [c for name, c in checks if name == "healthy run with a recovery"]
    assert healthy and all(c["exp_alerts"] == [] for c in healthy)
    assert {c["alertname"] for c in healthy} == alerts


def test_the_alert_rules_fire_on_the_series_fixtures_as_promtool_evaluates_them(promtool, tmp_path):
    out = promtool_test(promtool, rule_groups(), tmp_path)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


# Controls: the fixtures catch a rule that misses. Each rule is replaced by a weaker one, and
# promtool must name that alert among its failures.
OLD_FAILED = {  # the rule before: a state gauge that lapses before its 1 m `for:` is up
    "expr": 'max by (run) (ray_elastic_controller_state{state="Errored"}) == 1', "for": "1m"}
NO_END = {  # the loss without its "never ended" clause: every clean end would look lost
    "expr": "max by (run) (max_over_time(ray_elastic_start_time_seconds[1h]))\n"
            "unless on (run) max by (run) (ray_elastic_start_time_seconds)", "for": "5m"}
PER_RUN_END = {  # a run's ends matched by run, not by process: a resumed run's loss is hidden
    "expr": "max by (run) (max_over_time(ray_elastic_start_time_seconds[1h]))\n"
            "unless on (run) max by (run) (max_over_time(ray_elastic_runs_ended_total[1h])) > 0\n"
            "unless on (run) max by (run) (ray_elastic_start_time_seconds)", "for": "5m"}
ANY_PROCESS = {  # every process of the run, not its newest: a loss a retry healed still fires
    "expr": "max by (run) (max_over_time(ray_elastic_start_time_seconds[1h])\n"
            "  unless ignoring (outcome) max_over_time(ray_elastic_runs_ended_total[1h]) > 0)\n"
            "unless on (run) max by (run) (ray_elastic_start_time_seconds)", "for": "5m"}


@pytest.mark.parametrize("alert,weaker,case", [
    ("ElasticRunFailed", OLD_FAILED, "failed run"),
    ("ElasticRunLost", NO_END, "healthy run with a recovery"),
    ("ElasticRunLost", PER_RUN_END, "resumed run lost"),
    ("ElasticRunLost", ANY_PROCESS, "lost head retried by the platform"),
], ids=["failed-old-rule", "lost-without-end", "lost-per-run", "lost-any-process"])
def test_the_fixtures_catch_a_weaker_rule(promtool, tmp_path, alert, weaker, case):
    groups = rule_groups()
    rules_by_alert(groups)[alert].update(weaker)
    out = promtool_test(promtool, groups, tmp_path)
    assert out.returncode != 0, out.stdout
    failed = re.findall(r"name: ([^,\n]+),\s*alertname: (\w+), time: ", out.stdout + out.stderr)
    assert (case, alert) in failed, out.stdout + out.stderr
