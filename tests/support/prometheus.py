"""A real Prometheus server for the tests, on loopback only, and `promtool`.

The binaries come from Debian's `prometheus` package, unpacked (not installed: no service, no
user) into `.tools/prometheus` by `make test` (the Makefile's `tools` target); `find_prometheus`
also takes them from PATH. The server scrapes the targets it is given every second, evaluates the
rules it is given as often, keeps its data in a temporary folder, and is stopped with its process
group."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tests.ray_fixtures import free_port
from tests.support.processes import answers, stop_group

ROOT = Path(__file__).resolve().parents[2]
UNPACKED = ROOT / ".tools" / "prometheus" / "usr" / "bin"
HOW = "run `make tools` (Debian's prometheus package, unpacked into .tools/prometheus), or put prometheus on PATH"


def find_prometheus() -> tuple[str, str] | None:
    """(prometheus, promtool), or None when neither place has them."""
    for folder in (UNPACKED, *(Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p)):
        server, tool = folder / "prometheus", folder / "promtool"
        if server.is_file() and tool.is_file() and os.access(server, os.X_OK):
            return str(server), str(tool)
    return None


@dataclass
class Prometheus:
    url: str
    promtool: str
    targets_file: Path

    def set_targets(self, targets: list[str]) -> None:
        """The scrape targets (host:port), through file-based discovery: re-read within a second."""
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": sorted(targets), "labels": {"job": "ray"}}]))
        tmp.replace(self.targets_file)

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; the answer's data. A query Prometheus refuses raises ValueError
        with its error (a PromQL syntax error, an unknown function)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"{params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return self.api("query", query=expr, **({"time": at} if at is not None else {}))["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step_s)["result"]

    def alerts(self) -> list[dict]:
        """The alerts of the loaded rules, pending or firing, each with its labels and state."""
        return self.api("alerts")["alerts"]


@contextlib.contextmanager
def prometheus_server(scrape_interval_s: float = 1.0,
                      rule_groups: list[dict] | None = None) -> Iterator[Prometheus]:
    """`rule_groups`: alerting and recording rule groups (a rules file's `groups`) to load,
    evaluated at the scrape interval."""
    found = find_prometheus()
    if found is None:
        raise FileNotFoundError(f"no prometheus binary: {HOW}")
    server, promtool = found
    folder = Path(tempfile.mkdtemp(prefix="elastic-prom-"))
    targets = folder / "targets.json"
    targets.write_text("[]")
    rules = folder / "rules.yml"
    rules.write_text(json.dumps({"groups": rule_groups or []}))  # JSON is YAML
    (folder / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": f"{scrape_interval_s:g}s", "evaluation_interval": f"{scrape_interval_s:g}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}],
    }))
    port = free_port()
    log = open(folder / "prometheus.log", "w")
    proc = subprocess.Popen([server, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not answers(url + "/-/ready", proc, timeout_s=60, every_s=0.2):
            log.flush()
            raise RuntimeError("prometheus did not start:\n" + (folder / "prometheus.log").read_text()[-3000:])
        yield Prometheus(url, promtool, targets)
    finally:
        stop_group(proc, term_wait_s=20)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def wait_for(check: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    """`check()`'s first truthy answer, polled until `timeout_s` has passed (then its last)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every_s)


def alert_states(prom: Prometheus, alert: str, run: str) -> set[str]:
    """The states (pending, firing) in which `alert` is active for `run` now."""
    return {a["state"] for a in prom.alerts() if a["labels"].get("alertname") == alert
            and a["labels"].get("run") == run}
