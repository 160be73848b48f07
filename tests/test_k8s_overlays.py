"""k8s/ as a platform team applies it: a kustomize base and overlays (CPU image, GPU, in-cluster
MinIO, the in-job drill, development), the Dockerfile their image comes from, what installs code
at start (only the dev overlay, from one index), which pods mount a service-account token, and
the Chaos Mesh drills.
Every object of every file and of every rendered kustomization passes its schema, offline: the
vendored CRD schemas (RayJob, PodMonitor, PrometheusRule, PodChaos, NetworkChaos) and, for core
kinds, the Kubernetes API models of the `kubernetes` client package."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys

import pytest
import ray
import yaml

import elastic
from elastic.config import parse_job
from tests.support import k8s
from tests.test_k8s_manifests import KUSTOMIZATIONS, MANIFESTS, job_config, kustomization_id, ray_containers, rayjob

ROOT = k8s.K8S.parent


def objects_of_every_file_and_kustomization():
    for path in MANIFESTS:
        for doc in k8s.documents(path):
            yield f"{path.relative_to(ROOT)}", doc
    for path in KUSTOMIZATIONS:
        for doc in k8s.render(path):
            yield f"kubectl kustomize {path.relative_to(ROOT)}", doc


def test_every_object_passes_its_schema():
    seen = set()
    for where, doc in objects_of_every_file_and_kustomization():
        assert doc.get("metadata", {}).get("name"), f"{where}: {doc.get('kind')} without metadata.name"
        assert k8s.errors(doc) == [], (where, doc["kind"], k8s.errors(doc))
        seen.add(doc["kind"])
    assert seen >= {"RayJob", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "PriorityClass", "Deployment",
                    "Service", "PersistentVolumeClaim", "Job", "Role", "RoleBinding", "ServiceAccount", "Secret",
                    "PodMonitor", "PrometheusRule", "PodChaos", "NetworkChaos"}, seen


def test_the_core_kind_check_catches_what_the_api_server_would_refuse():
    (deployment,) = [d for d in k8s.render(k8s.K8S / "overlays" / "minio") if d["kind"] == "Deployment"]

    def broken(edit) -> list[str]:
        d = copy.deepcopy(deployment)
        edit(d["spec"], d["spec"]["template"]["spec"]["containers"][0])
        return k8s.errors(d)
    assert any("required" in e or "must not be `None`" in e for e in broken(lambda s, c: s.pop("selector")))
    assert any("did you mean 'volumeMounts'" in e for e in broken(lambda s, c: c.update(volumeMount=[])))
    assert any("expected str" in e for e in broken(lambda s, c: c.update(imagePullPolicy=3)))
    assert any("must not be `None`" in e for e in broken(lambda s, c: c.pop("name")))
    assert any("expected quantity" in e for e in broken(lambda s, c: c["resources"]["limits"].update(cpu=True)))
    assert k8s.errors({"apiVersion": "example.com/v1", "kind": "Foo", "metadata": {"name": "x"}})


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=kustomization_id)
def test_the_rendering_is_what_kubectl_kustomize_renders(path):
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]

    def key(d):
        return d["kind"], d["metadata"]["name"]
    assert sorted(k8s.render(path), key=key) == sorted(theirs, key=key)


def test_the_renderer_refuses_what_it_does_not_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [../x]\nnamePrefix: dev-\n")
    with pytest.raises(NotImplementedError, match="namePrefix"):
        k8s.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{k8s.K8S / 'base'}]\npatches:\n  - target: {{kind: RayJob, name: nope}}\n    patch: '[]'\n")
    with pytest.raises(ValueError, match="matches no object"):
        k8s.render(tmp_path)


# ---------------------------------------------------------------------------------- images and the Dockerfile
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_the_dockerfile_builds_on_the_ray_version_and_python_the_project_pins():
    (default,) = re.findall(r"^ARG RAY_IMAGE=(\S+)$", dockerfile(), re.M)
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert default == f"rayproject/ray:{ray.__version__}-{py}-cpu"
    assert rayjob()["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__
    constraints = (ROOT / "constraints.txt").read_text()
    assert f"ray=={ray.__version__}" in constraints.split()
    assert "-c constraints.txt" in dockerfile()  # the image installs the versions the tests ran
    # Everything it copies exists, and .dockerignore lets it into the build context.
    admitted = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().split() if line.startswith("!")}
    for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", dockerfile(), re.M):
        for src in line.split():
            assert (ROOT / src).exists() and src.rstrip("/") in admitted, src


BAKED = [("base", "cpu", "cpu"), ("overlays/cpu", "cpu", "cpu"), ("overlays/gpu", "cpu", "gpu"),
         ("overlays/minio", "cpu", "cpu"), ("chaos/in-job", "cpu", "cpu")]


@pytest.mark.parametrize("path,head,workers", BAKED)
def test_every_kustomization_but_dev_runs_the_image_the_dockerfile_builds(path, head, workers):
    objects = k8s.render(k8s.K8S / path)
    job = rayjob(objects)
    images = {group: c["image"] for group, c in ray_containers(job).items()}
    want = {"head": f"elastic-trainer:{elastic.__version__}-{head}",
            "workers": f"elastic-trainer:{elastic.__version__}-{workers}"}
    assert images == want
    for tag in set(want.values()):  # the Dockerfile says how to build each tag the overlays name
        assert f"docker build -t {tag}" in dockerfile(), tag
    assert "runtimeEnvYAML" not in job["spec"]  # baked in: nothing installed when a pod starts


def test_only_the_dev_overlay_installs_at_start_and_from_one_index():
    """A pod that pip-installs at start runs whatever its indexes serve then; with a second index
    (`--extra-index-url`) pip takes the highest version of a name from either, so a public package
    named like a private one wins. Only the dev overlay installs at start, from one index, pinned
    versions only (no git URL, no wheel URL)."""
    assert {kustomization_id(p) for p in KUSTOMIZATIONS} == {path for path, _, _ in BAKED} | {"overlays/dev"}
    dev = rayjob(k8s.render(k8s.K8S / "overlays" / "dev"))
    pip = yaml.safe_load(dev["spec"]["runtimeEnvYAML"])["pip"]
    options = [line.split() for line in pip if line.startswith("-")]
    requirements = [line for line in pip if not line.startswith("-")]
    assert [o[0] for o in options] == ["--index-url"] and options[0][1].startswith("https://")
    assert f"elastic-trainer=={elastic.__version__}" in requirements
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*==[A-Za-z0-9_.+\-]+", r) for r in requirements), requirements
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert {c["image"] for c in ray_containers(dev).values()} == {f"rayproject/ray:{ray.__version__}-{py}-cpu"}
    for where, doc in objects_of_every_file_and_kustomization():
        text = yaml.safe_dump(doc)
        assert "--extra-index-url" not in text and "git+" not in text, where


def pod_specs(doc: dict):
    """(which pod, its spec, whether it calls the Kubernetes API) for each pod an object makes."""
    if doc["kind"] == "RayJob":
        rc = doc["spec"]["rayClusterSpec"]
        # The head runs the autoscaler sidecar, which scales the worker group through the API.
        yield "head", rc["headGroupSpec"]["template"]["spec"], rc.get("enableInTreeAutoscaling") is True
        for group in rc["workerGroupSpecs"]:
            yield f"workers {group['groupName']}", group["template"]["spec"], False
    elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        spec = doc["spec"]["template"]["spec"]
        yield doc["kind"], spec, "serviceAccountName" in spec  # an account of its own: it uses it


def test_no_pod_mounts_a_service_account_token_it_does_not_use():
    """Training code runs on the worker pods (a job file is code) and calls no Kubernetes API:
    a token mounted there would hand it the pod's service account for nothing."""
    checked = []
    for where, doc in objects_of_every_file_and_kustomization():
        for pod, spec, calls_api in pod_specs(doc):
            if not calls_api:
                assert spec.get("automountServiceAccountToken") is False, (where, pod)
                checked.append((where, pod))
    workers = [c for c in checked if c[1].startswith("workers")]
    assert len(workers) >= len(KUSTOMIZATIONS) and any(pod == "Deployment" for _, pod in checked)


def test_every_image_is_pinned():
    seen = set()
    for where, doc in objects_of_every_file_and_kustomization():
        for image in re.findall(r"'image': '([^']+)'", str(doc)):
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, (where, image)
            seen.add(name)
    assert {"rayproject/ray", "elastic-trainer", "minio/minio", "alpine/k8s"} <= seen, seen


# ---------------------------------------------------------------------------------- overlays
def test_the_gpu_overlay_gives_each_rank_one_gpu_nccl_and_shared_memory():
    objects = k8s.render(k8s.K8S / "overlays" / "gpu")
    job = parse_job(job_config(objects))
    assert job.scaling.use_gpu and job.run.name != parse_job(job_config(k8s.render(k8s.K8S / "base"))).run.name
    pod = rayjob(objects)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    shm = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in worker["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm[mount["name"]]["emptyDir"]["medium"] == "Memory"
    head = rayjob(objects)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]  # the head trains nothing


def test_the_minio_overlay_points_the_job_at_its_own_store_with_the_pods_credentials():
    objects = k8s.render(k8s.K8S / "overlays" / "minio")
    by_kind = {}
    for d in objects:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    job = parse_job(job_config(objects))
    endpoint = job.checkpoint.storage_options["endpoint_url"]
    (service,) = by_kind["Service"].values()
    (port,) = service["spec"]["ports"]
    assert endpoint == f"http://{service['metadata']['name']}:{port['port']}"
    bucket = job.checkpoint.storage_uri.removeprefix("s3://").split("/")[0]
    # The head's init container creates that bucket at that endpoint, before the driver starts.
    head = rayjob(objects)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (init,) = head["initContainers"]
    script = init["args"][0]
    assert f'"{endpoint}"' in script and f'fs.mkdir("{bucket}")' in script
    # MinIO's root user is the key pair every Ray container reads from the elastic-s3 Secret.
    (deployment,) = by_kind["Deployment"].values()
    (minio,) = deployment["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in minio["env"] if "valueFrom" in e}
    assert refs == {"MINIO_ROOT_USER": {"name": "elastic-s3", "key": "AWS_ACCESS_KEY_ID"},
                    "MINIO_ROOT_PASSWORD": {"name": "elastic-s3", "key": "AWS_SECRET_ACCESS_KEY"}}
    for c in [*ray_containers(rayjob(objects)).values(), init]:
        assert {"secretRef": {"name": "elastic-s3"}} in c["envFrom"]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    claim = deployment["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim in by_kind["PersistentVolumeClaim"]
    # Only the RayJob's pods reach it.
    policy = by_kind["NetworkPolicy"]["elastic-minio"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    ray_labels = rayjob(objects)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= ray_labels.items()


def test_the_head_is_scheduled_ahead_of_batch_pods_and_the_workers_are_not():
    objects = k8s.render(k8s.K8S / "base")
    (pc,) = [d for d in objects if d["kind"] == "PriorityClass"]
    rc = rayjob(objects)["spec"]["rayClusterSpec"]
    assert rc["headGroupSpec"]["template"]["spec"]["priorityClassName"] == pc["metadata"]["name"]
    assert "priorityClassName" not in rc["workerGroupSpecs"][0]["template"]["spec"]
    assert 0 < pc["value"] < 1_000_000_000 and pc["globalDefault"] is False  # below system-* classes


# ---------------------------------------------------------------------------------- Chaos Mesh drills
def chaos(kind: str) -> dict:
    (doc,) = [d for p in (k8s.K8S / "chaos").glob("*.yaml") for d in k8s.documents(p) if d["kind"] == kind]
    return doc


def test_the_chaos_mesh_drills_hit_a_worker_pod_never_the_head():
    rc = rayjob()["spec"]["rayClusterSpec"]
    head = {**rc["headGroupSpec"]["template"]["metadata"]["labels"], "ray.io/node-type": "head"}
    worker = {**rc["workerGroupSpecs"][0]["template"]["metadata"]["labels"], "ray.io/node-type": "worker"}
    kill, cut = chaos("PodChaos"), chaos("NetworkChaos")
    for doc in (kill, cut):
        picked = doc["spec"]["selector"]["labelSelectors"]
        assert doc["spec"]["mode"] == "one" and picked.items() <= worker.items() and not picked.items() <= head.items()
    assert kill["spec"]["action"] == "pod-kill" and kill["spec"]["gracePeriod"] == 0
    # the partition cuts the worker off from every pod of its cluster, head included, and heals
    assert cut["spec"]["action"] == "partition" and cut["spec"]["direction"] == "both"
    target = cut["spec"]["target"]["selector"]["labelSelectors"]
    assert target.items() <= head.items() and target.items() <= worker.items()
    assert re.fullmatch(r"\d+s", cut["spec"]["duration"])


def test_the_chaos_mesh_schemas_refuse_what_chaos_mesh_would():
    kill = copy.deepcopy(chaos("PodChaos"))
    kill["spec"]["action"] = "pod-explode"
    assert any("not one of" in e for e in k8s.errors(kill))
    cut = copy.deepcopy(chaos("NetworkChaos"))
    cut["spec"]["directon"] = "both"
    assert any("directon: unknown field" in e for e in k8s.errors(cut))
    del cut["spec"]["mode"]
    assert any("'mode' is missing" in e for e in k8s.errors(cut))


def test_the_readmes_own_overlay_example_renders_with_its_registry_and_job(tmp_path):
    """k8s/README.md's "Your overlay", as a user copies it next to a checkout of this repository."""
    text = (k8s.K8S / "README.md").read_text()
    (example,) = re.findall(r"```yaml\n# my-run/kustomization.yaml\n(.*?)```", text, re.S)
    (tmp_path / "elastic").symlink_to(ROOT)
    mine = tmp_path / "my-run"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(example)
    job = job_config(k8s.render(k8s.K8S / "overlays" / "minio"))
    job["run"]["name"] = "my-run"
    (mine / "job.yaml").write_text(yaml.safe_dump(job))
    objects = k8s.render(mine)
    assert {c["image"] for c in ray_containers(rayjob(objects)).values()} == {
        f"registry.example.com/ml/elastic-trainer:{elastic.__version__}-cpu"}
    assert job_config(objects)["run"]["name"] == "my-run"
    assert all(k8s.errors(d) == [] for d in objects)
