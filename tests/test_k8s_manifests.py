"""The KubeRay manifests in k8s/, checked without a Kubernetes cluster: every field of the RayJob
against the RayJob CRD's schema (vendored from the KubeRay repository in k8s/schemas/, with its
source), the rules KubeRay's validation adds on top for autoscaler v2, and the worker group sized
for the job config it runs, which is itself parsed by elastic's own config loader. And the
hardening: every container unprivileged, a NetworkPolicy that admits only the Ray cluster's own
pods (and KubeRay's submitter and operator to the job API), credentials from a Secret, never in a
job config."""
from __future__ import annotations

import copy
import re

import pytest
import ray
import yaml

from elastic.config import parse_job
from elastic.config.secrets import is_secret_key, named_secrets
from tests.support.k8s import CRD_SCHEMAS, K8S, SCHEMAS, Schema, documents, render

# Every file of objects under k8s/ (not the schemas, the kustomizations or the job configs they
# put into a ConfigMap), and every kustomization, rendered as `kubectl apply -k` would.
MANIFESTS = sorted(p for p in K8S.rglob("*.yaml")
                   if "schemas" not in p.parts and p.name not in ("kustomization.yaml", "job.yaml"))
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def kustomization_id(path) -> str:
    return str(path.relative_to(K8S))


def job_config(objects: list[dict]) -> dict:
    """The job YAML the RayJob's head mounts: the `elastic-job` ConfigMap's job.yaml."""
    (cm,) = [d for d in objects if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "elastic-job"]
    return yaml.safe_load(cm["data"]["job.yaml"])


def rayjob(objects: list[dict] | None = None) -> dict:
    """The RayJob of a rendered kustomization (k8s/base by default)."""
    (job,) = [d for d in (objects or render(K8S / "base")) if d["kind"] == "RayJob"]
    return job


def worker_group(job: dict) -> dict:
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return group


def ray_containers(job: dict) -> dict[str, dict]:
    """The Ray container of the head and of the worker group (KubeRay's is the first one)."""
    rc = job["spec"]["rayClusterSpec"]
    return {"head": rc["headGroupSpec"]["template"]["spec"]["containers"][0],
            "workers": worker_group(job)["template"]["spec"]["containers"][0]}


@pytest.fixture(scope="module")
def schema() -> Schema:
    return Schema()


def test_the_rayjob_matches_the_crd_schema_field_by_field(schema):
    assert schema.errors(rayjob()) == []


def test_the_validator_rejects_what_the_api_server_would(schema):
    """Not a vacuous check: misspelt, mistyped, missing and out-of-enum fields are all caught."""
    def broken(edit) -> list[str]:
        job = copy.deepcopy(rayjob())
        edit(job["spec"])
        return schema.errors(job)

    def misspelt(spec):
        worker_group({"spec": spec}).update(minReplica=worker_group({"spec": spec}).pop("minReplicas"))
    assert any("minReplica: unknown field" in e for e in broken(misspelt))
    assert any("missing" in e and "minReplicas" in e for e in broken(misspelt))
    assert any("expected integer" in e for e in broken(lambda s: s.update(backoffLimit="1")))
    assert any("not one of" in e
               for e in broken(lambda s: s["rayClusterSpec"]["autoscalerOptions"].update(version="v3")))
    assert any("unknown field" in e for e in broken(lambda s: s["rayClusterSpec"].update(enableAutoscaling=True)))
    assert any("does not match" in e for e in broken(
        lambda s: ray_containers({"spec": s})["workers"]["resources"]["limits"].update(memory="4 GiB")))
    assert any("not vendored" in e for e in broken(
        lambda s: worker_group({"spec": s})["template"]["spec"].update(affinity={})))
    assert any("expected boolean" in e for e in broken(lambda s: s.update(shutdownAfterJobFinishes="true")))


def test_the_worker_group_autoscales_with_autoscaler_v2():
    spec = rayjob()["spec"]
    rc = spec["rayClusterSpec"]
    group = worker_group(rayjob())
    assert rc["enableInTreeAutoscaling"] is True
    assert group["minReplicas"] < group["maxReplicas"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # Autoscaler v2 is chosen one way only: KubeRay (ray-operator/pkg/utils/validation.go) rejects
    # autoscalerOptions.version together with the head container's RAY_enable_autoscaler_v2 env var.
    head_env = {e["name"] for e in ray_containers(rayjob())["head"].get("env", [])}
    assert rc["autoscalerOptions"]["version"] == "v2" and "RAY_enable_autoscaler_v2" not in head_env
    # ...and requires restartPolicy Never (or unset) on the head and every worker group with v2.
    for template in (rc["headGroupSpec"]["template"], group["template"]):
        assert template["spec"].get("restartPolicy", "Never") == "Never"


def test_a_lost_head_pod_is_retried_on_a_fresh_cluster_that_resumes():
    """backoffLimit >= 1: KubeRay submits the job again on a new RayCluster. It resumes only if its
    checkpoints are somewhere that outlives the cluster (object storage) under the same run.name,
    which the job config mounted from a ConfigMap keeps across retries."""
    spec = rayjob()["spec"]
    assert spec["backoffLimit"] >= 1
    assert spec["shutdownAfterJobFinishes"] is True  # KubeRay refuses ttlSecondsAfterFinished without it
    assert spec["entrypoint"] == "elastic train /home/ray/job/job.yaml"
    volumes = {v["name"]: v for v in spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    (mount,) = ray_containers(rayjob())["head"]["volumeMounts"]
    assert mount["mountPath"] == "/home/ray/job" and volumes[mount["name"]]["configMap"]["name"] == "elastic-job"
    for path in KUSTOMIZATIONS:  # every variant keeps its checkpoints in object storage
        job = parse_job(job_config(render(path)))
        assert job.checkpoint.storage_uri.startswith("s3://"), path


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=kustomization_id)
def test_the_worker_group_fits_the_job(path):
    """One rank per worker pod, plus the spares: the group starts at num_workers, the autoscaler
    keeps it between min_workers and max_workers (each + num_spares), and the head takes no rank."""
    objects = render(path)
    sc = parse_job(job_config(objects)).scaling
    job = rayjob(objects)
    group = worker_group(job)
    assert float(group["rayStartParams"]["num-cpus"]) == sc.cpus_per_worker
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert group["replicas"] == sc.num_workers + sc.num_spares
    assert group["minReplicas"] == sc.min_size + sc.num_spares
    assert group["maxReplicas"] == sc.max_size + sc.num_spares
    assert sc.min_size < sc.max_size
    # A GPU job asks for one GPU per rank, and its pods have one each; a CPU job none.
    gpus = ray_containers(job)["workers"]["resources"]["limits"].get("nvidia.com/gpu", 0)
    assert gpus == (1 if sc.use_gpu else 0), (path, gpus, sc.use_gpu)


def test_images_run_the_ray_version_the_package_pins():
    version = rayjob()["spec"]["rayClusterSpec"]["rayVersion"]
    assert version == ray.__version__
    # The dev overlay runs Ray's own image; the others run the Dockerfile's, built on it
    # (tests/test_k8s_overlays.py checks its base image).
    for name, container in ray_containers(rayjob(render(K8S / "overlays" / "dev"))).items():
        assert container["image"].startswith(f"rayproject/ray:{version}-"), (name, container["image"])


def test_the_pod_deleting_drill_pod_is_a_valid_pod_template(schema):
    """Its batch/v1 Job wraps the same core/v1 PodTemplateSpec that the CRD embeds."""
    (job,) = [d for d in documents(K8S / "chaos" / "kill-worker-pod.yaml") if d["kind"] == "Job"]
    assert set(job["spec"]) <= {"backoffLimit", "ttlSecondsAfterFinished", "template"}
    assert schema.errors(job["spec"]["template"], {"$ref": "#/definitions/podTemplateSpec"}, "spec.template") == []
    assert job["metadata"]["name"] == "elastic-chaos-kill-worker"


# ------------------------------------------------------------------ hardening
RAY_UID = 1000  # the rayproject/ray images' user "ray" (uid 1000, gid 100)


def pod_templates(job: dict) -> dict[str, dict]:
    rc = job["spec"]["rayClusterSpec"]
    return {"head": rc["headGroupSpec"]["template"], "workers": worker_group(job)["template"]}


def chaos_job() -> dict:
    (job,) = [d for d in documents(K8S / "chaos" / "kill-worker-pod.yaml") if d["kind"] == "Job"]
    return job


def unprivileged(ctx: dict | None, uid: int | None = None) -> list[str]:
    """Why a container securityContext is not the hardened one (empty: it is)."""
    ctx = ctx or {}
    out = []
    if ctx.get("runAsNonRoot") is not True:
        out.append("runAsNonRoot is not true")
    if uid is not None and ctx.get("runAsUser") != uid:
        out.append(f"runAsUser {ctx.get('runAsUser')} is not {uid}")
    if ctx.get("runAsUser") == 0 or ctx.get("privileged"):
        out.append("runs as root or privileged")
    if ctx.get("allowPrivilegeEscalation") is not False:
        out.append("allowPrivilegeEscalation is not false")
    if ctx.get("capabilities", {}).get("drop") != ["ALL"] or ctx.get("capabilities", {}).get("add"):
        out.append("capabilities: not drop [ALL] (or some added)")
    if ctx.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        out.append("seccompProfile is not RuntimeDefault")
    return out


def test_every_container_runs_unprivileged():
    job = rayjob()
    for name, container in ray_containers(job).items():
        assert unprivileged(container.get("securityContext"), RAY_UID) == [], name
    autoscaler = job["spec"]["rayClusterSpec"]["autoscalerOptions"]  # a sidecar of the head, same image
    assert unprivileged(autoscaler.get("securityContext"), RAY_UID) == []
    for container in chaos_job()["spec"]["template"]["spec"]["containers"]:
        assert unprivileged(container.get("securityContext")) == [], container["name"]
    # ...and the check is not vacuous.
    assert unprivileged({}) and unprivileged({**ray_containers(job)["head"]["securityContext"], "runAsUser": 0})
    assert unprivileged({**ray_containers(job)["head"]["securityContext"], "capabilities": {"drop": ["ALL"],
                                                                                            "add": ["NET_ADMIN"]}})


def network_policy() -> dict:
    (policy,) = documents(K8S / "base" / "networkpolicy.yaml")
    return policy


def selector_errors(sel, where: str) -> list[str]:
    """A metav1.LabelSelector, by hand (NetworkPolicy is core Kubernetes: no vendored schema)."""
    if not isinstance(sel, dict) or set(sel) - {"matchLabels", "matchExpressions"}:
        return [f"{where}: not a label selector: {sel!r}"]
    labels = sel.get("matchLabels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        return [f"{where}.matchLabels: must map strings to strings"]
    return []


def policy_errors(policy: dict) -> list[str]:
    """The networking.k8s.io/v1 NetworkPolicy fields, checked by hand: names, types, enums."""
    out = []
    spec = policy.get("spec", {})
    if set(spec) - {"podSelector", "policyTypes", "ingress", "egress"}:
        out.append(f"spec: unknown fields {sorted(set(spec) - {'podSelector', 'policyTypes', 'ingress', 'egress'})}")
    if "podSelector" not in spec:
        out.append("spec: required field 'podSelector' is missing")
    out += selector_errors(spec.get("podSelector", {}), "spec.podSelector")
    if not set(spec.get("policyTypes", [])) <= {"Ingress", "Egress"}:
        out.append(f"spec.policyTypes: {spec['policyTypes']}")
    for i, rule in enumerate(spec.get("ingress", [])):
        where = f"spec.ingress[{i}]"
        if set(rule) - {"from", "ports"}:
            out.append(f"{where}: unknown fields {sorted(set(rule) - {'from', 'ports'})}")
        for j, peer in enumerate(rule.get("from", [])):
            if not peer or set(peer) - {"podSelector", "namespaceSelector", "ipBlock"}:
                out.append(f"{where}.from[{j}]: not a peer: {peer!r}")
            for key in ("podSelector", "namespaceSelector"):
                if key in peer:
                    out += selector_errors(peer[key], f"{where}.from[{j}].{key}")
        for j, port in enumerate(rule.get("ports", [])):
            if set(port) - {"port", "protocol", "endPort"} or port.get("protocol", "TCP") not in ("TCP", "UDP", "SCTP") \
                    or not isinstance(port.get("port"), (int, str)):
                out.append(f"{where}.ports[{j}]: {port!r}")
    return out


def test_the_network_policy_admits_only_the_clusters_own_pods():
    policy, job = network_policy(), rayjob()
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert policy_errors(policy) == []
    spec = policy["spec"]
    # It selects the RayJob's head and worker pods: every label it asks for is on both templates.
    own = spec["podSelector"]["matchLabels"]
    assert own and "matchExpressions" not in spec["podSelector"]
    for name, template in pod_templates(job).items():
        assert own.items() <= template["metadata"]["labels"].items(), name
    assert "Ingress" in spec["policyTypes"]
    # Every rule names who it admits (a rule without `from` admits everyone), by selector only.
    rules = spec["ingress"]
    assert all(rule.get("from") for rule in rules)
    assert not any("ipBlock" in peer for rule in rules for peer in rule["from"])
    inside = [rule for rule in rules if rule["from"] == [{"podSelector": {"matchLabels": own}}]]
    assert len(inside) == 1 and "ports" not in inside[0]  # Ray needs every port among its own pods
    # Anyone else reaches the job API, 8265/TCP, and nothing more (not GCS 6379): the RayJob's
    # submitter (a Job named after the RayJob) and the KubeRay operator.
    outside = [rule for rule in rules if rule is not inside[0]]
    assert outside and all(rule.get("ports") == [{"port": 8265, "protocol": "TCP"}] for rule in outside)
    peers = [peer for rule in outside for peer in rule["from"]]
    assert {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": job["metadata"]["name"]}}} in peers
    (operator,) = [p for p in peers if "namespaceSelector" in p]
    assert operator["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    assert operator["namespaceSelector"]["matchLabels"]  # one namespace, not every one
    # The head really serves those ports.
    served = {p["containerPort"] for p in ray_containers(job)["head"]["ports"]}
    assert {6379, 8265} <= served


def test_the_policy_check_is_not_vacuous():
    spec = network_policy()["spec"]
    assert policy_errors({"spec": {**spec, "podSelectors": {}}})
    assert policy_errors({"spec": {**spec, "ingress": [{"from": [{}]}]}})
    assert policy_errors({"spec": {**spec, "ingress": [{"ports": [{"port": 8265, "protocol": "HTTP"}]}]}})
    assert policy_errors({"spec": {**spec, "podSelector": {"matchLabel": {"a": "b"}}}})


def _env_entries(obj):
    """Every `env` entry ({name, value|valueFrom}) anywhere in a manifest."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "env" and isinstance(v, list):
                yield from (e for e in v if isinstance(e, dict))
            yield from _env_entries(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _env_entries(v)


def test_credentials_come_from_a_secret_never_from_a_manifest_or_job_config():
    secrets = {d["metadata"]["name"]: d for path in MANIFESTS for d in documents(path) if d["kind"] == "Secret"}
    # The only Secret shipped is an example, with placeholders.
    assert list(secrets) == ["elastic-s3"]
    example = secrets["elastic-s3"]
    assert set(example["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} and "data" not in example
    assert set(example["stringData"].values()) == {"REPLACE-ME"}
    # Every Ray container (the driver on the head, a rank on each worker) takes them from it.
    for name, container in ray_containers(rayjob()).items():
        assert {"secretRef": {"name": "elastic-s3"}} in container.get("envFrom", []), name
    # No manifest sets a secret-looking variable to a literal value.
    for path in MANIFESTS:
        for doc in documents(path):
            literal = [e["name"] for e in _env_entries(doc) if is_secret_key(e.get("name")) and "value" in e]
            assert not literal, f"{path}: {literal} set inline; use a secretRef"
    # No job config carries a credential (storage options, a password in a URI).
    for path in KUSTOMIZATIONS:
        job = parse_job(job_config(render(path)))
        assert named_secrets(job) == [], path
        # ...and no rendered object sets one inline either
        for doc in render(path):
            literal = [e["name"] for e in _env_entries(doc) if is_secret_key(e.get("name")) and "value" in e]
            assert not literal, f"{path}: {literal} set inline; use a secretRef"


# ---------------------------------------------------------------------- Prometheus-operator: scrape and alerts
MONITORING_SCHEMAS = {kind: SCHEMAS / name for (_, kind), name in CRD_SCHEMAS.items()
                      if kind in ("PodMonitor", "PrometheusRule")}


def _monitoring(kind: str) -> dict:
    (doc,) = [d for d in documents(K8S / "monitoring" / ("podmonitor.yaml" if kind == "PodMonitor" else "alerts.yaml"))
              if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("kind", sorted(MONITORING_SCHEMAS))
def test_the_monitoring_manifests_match_the_prometheus_operator_schemas(kind):
    schema = Schema(MONITORING_SCHEMAS[kind])
    doc = _monitoring(kind)
    assert schema.errors(doc) == [], schema.errors(doc)
    # the validator catches what the API server would refuse
    bad = copy.deepcopy(doc)
    bad["spec"]["sampleLimitt"] = 1
    assert any("sampleLimitt: unknown field" in e for e in schema.errors(bad))


def test_the_podmonitor_scrapes_the_rayjobs_pods_on_a_port_they_name():
    monitor = _monitoring("PodMonitor")
    job = rayjob()
    rc = job["spec"]["rayClusterSpec"]
    templates = [rc["headGroupSpec"]["template"], worker_group(job)["template"]]
    assert all(monitor["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items() for t in templates)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for group, container in ray_containers(job).items():
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get(endpoint["port"]) == 8080, (group, ports)
    assert rc["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"
    assert worker_group(job)["rayStartParams"]["metrics-export-port"] == "8080"


def test_every_alert_reads_series_elastic_exports_keeps_the_run_label_and_says_what_to_do():
    from elastic.observability import metrics as m
    defined = {n for metric in m.METRICS.values() for n in metric.prometheus_names}
    rules = [r for g in _monitoring("PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"ElasticRunFailed", "ElasticRunNotTraining", "ElasticCheckpointsFailing",
                                           "ElasticCheckpointStale", "ElasticHostMemoryGrowing", "ElasticGPUMemoryGrowing"}
    for r in rules:
        used = set(re.findall(r"\bray_elastic_\w+", r["expr"]))
        assert used and used <= defined, (r["alert"], sorted(used - defined))
        assert re.search(r"by \(run\b", r["expr"]), r["alert"]  # an alert names its run
        assert r["labels"]["severity"] in ("critical", "warning")
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 40
        assert r["expr"].count("(") == r["expr"].count(")")


def test_the_rayjob_has_a_deadline_so_a_stuck_run_does_not_hold_nodes_forever(schema):
    job = rayjob()
    assert 3600 <= job["spec"]["activeDeadlineSeconds"] <= 7 * 86400
    bad = copy.deepcopy(job)
    bad["spec"]["activeDeadlineSeconds"] = "1d"  # the CRD takes seconds as an int32
    assert any("activeDeadlineSeconds: expected integer" in e for e in schema.errors(bad)), schema.errors(bad)


def test_the_head_pod_is_protected_from_eviction_and_the_workers_are_not():
    (pdb,) = documents(K8S / "base" / "head-pdb.yaml")
    assert pdb["spec"] == {"maxUnavailable": 0, "selector": pdb["spec"]["selector"]}
    want = pdb["spec"]["selector"]["matchLabels"]
    job = rayjob()
    rc = job["spec"]["rayClusterSpec"]
    # KubeRay adds ray.io/node-type (head / worker) to the labels each template sets
    head = {**rc["headGroupSpec"]["template"]["metadata"]["labels"], "ray.io/node-type": "head"}
    worker = {**worker_group(job)["template"]["metadata"]["labels"], "ray.io/node-type": "worker"}
    assert want.items() <= head.items() and not want.items() <= worker.items()
    annotations = rc["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert "annotations" not in worker_group(job)["template"]["metadata"]

