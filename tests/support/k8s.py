"""Kubernetes manifests checked offline, without a cluster.

* `render(dir)`: what `kubectl apply -k dir` would apply, for the kustomize features k8s/ uses
  (resources, JSON 6902 patches, images, configMapGenerator with replace). Anything else in a
  kustomization is refused by name, so a new feature cannot be silently skipped. Where kubectl is
  installed, the tests also compare this with `kubectl kustomize`.
* `Schema`: a CRD's `openAPIV3Schema` (vendored in k8s/schemas/), the subset of OpenAPI v3 CRDs use.
* `core_errors(doc)`: a core kind (ConfigMap, Deployment, Job, NetworkPolicy, ...) against the
  field names, types and required fields of the Kubernetes API models in the `kubernetes` client
  package, which are generated from the API server's OpenAPI spec.
* `errors(doc)`: whichever of the two applies to a document's kind.
"""
from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"
SCHEMAS = K8S / "schemas"
CRD_SCHEMAS = {
    ("ray.io/v1", "RayJob"): "rayjob.ray.io-v1.schema.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.monitoring.coreos.com-v1.schema.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.monitoring.coreos.com-v1.schema.yaml",
    ("chaos-mesh.org/v1alpha1", "PodChaos"): "podchaos.chaos-mesh.org-v1alpha1.schema.yaml",
    ("chaos-mesh.org/v1alpha1", "NetworkChaos"): "networkchaos.chaos-mesh.org-v1alpha1.schema.yaml",
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# ---------------------------------------------------------------------------------- kustomize
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "images", "configMapGenerator"}


def render(path: Path) -> list[dict]:
    """The objects of the kustomization in `path`, its resources rendered first (depth first)."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    if set(k) - KUSTOMIZATION_FIELDS:
        raise NotImplementedError(f"{path}: kustomization fields {sorted(set(k) - KUSTOMIZATION_FIELDS)} are not "
                                  f"rendered by tests/support/k8s.py; add them there")
    docs: list[dict] = []
    for res in k.get("resources", []):
        p = (path / res).resolve()
        docs += render(p) if p.is_dir() else documents(p)
    for gen in k.get("configMapGenerator", []):
        _generate_configmap(path, gen, docs)
    for patch in k.get("patches", []):
        targets = [d for d in docs if _matches(d, patch["target"])]
        if not targets:
            raise ValueError(f"{path}: patch target {patch['target']} matches no object")
        for d in targets:
            for op in yaml.safe_load(patch["patch"]):
                _json_patch(d, op)
    for image in k.get("images", []):
        for d in docs:
            _set_images(d, image)
    return docs


def _generate_configmap(path: Path, gen: dict, docs: list[dict]) -> None:
    if set(gen) - {"name", "behavior", "files", "options"} or gen.get("options") != {"disableNameSuffixHash": True}:
        raise NotImplementedError(f"{path}: configMapGenerator {gen}: only name, behavior, files and "
                                  f"options.disableNameSuffixHash are rendered")
    data = {Path(f).name: (path / f).read_text() for f in gen["files"]}
    existing = [i for i, d in enumerate(docs) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == gen["name"]]
    behavior = gen.get("behavior", "create")
    if behavior == "replace":
        (i,) = existing
        docs[i] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
    elif behavior == "create" and not existing:
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    else:
        raise NotImplementedError(f"{path}: configMapGenerator behavior {behavior!r} on {gen['name']!r}")


def _matches(doc: dict, target: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    want = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    if set(target) - set(want):
        raise NotImplementedError(f"patch target fields {sorted(set(target) - set(want))}")
    return all(want[k] == v for k, v in target.items())


def _json_patch(doc: dict, op: dict) -> None:
    """One RFC 6902 operation (add, remove, replace), as kustomize's `patches` apply them."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif op["op"] == "replace":
        key = int(last) if isinstance(node, list) else last
        node[key]  # noqa: B018 -- replace needs the target to exist, as in RFC 6902
        node[key] = copy.deepcopy(op["value"])
    elif op["op"] == "add":
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        else:
            node[last] = copy.deepcopy(op["value"])
    else:
        raise NotImplementedError(f"JSON patch op {op['op']!r}")


def _set_images(node, image: dict) -> None:
    """kustomize's images transformer: every container or init container running `name`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    name, _, tag = c.get("image", "").partition(":")
                    if name == image["name"]:
                        c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
            _set_images(value, image)
    elif isinstance(node, list):
        for value in node:
            _set_images(value, image)


# ---------------------------------------------------------------------------------- CRD schemas
INT_RANGE = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
TYPES = {  # JSON types; bool is not an integer here, as in Kubernetes
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


class Schema:
    """A small validator for the subset of OpenAPI v3 that CRD schemas use: type, format (integer
    ranges), enum, pattern, properties, additionalProperties, required, items, anyOf and the
    x-kubernetes-int-or-string / x-kubernetes-preserve-unknown-fields extensions. An object with
    `properties` and no `additionalProperties` is closed: an unknown field is an error, as in
    `kubectl apply` (server-side field validation is strict by default), not silently pruned."""

    def __init__(self, path: Path = SCHEMAS / CRD_SCHEMAS[("ray.io/v1", "RayJob")]):
        doc = yaml.safe_load(path.read_text())
        self.path = path
        self.definitions = doc["definitions"]
        self.root = doc["openAPIV3Schema"]
        self.source = doc["source"]

    def errors(self, value, schema: dict | None = None, path: str = "") -> list[str]:
        schema = self.root if schema is None else schema
        if "$ref" in schema:
            schema = self.definitions[schema["$ref"].removeprefix("#/definitions/")]
        here = path or "<root>"
        if schema.get("x-elastic-not-vendored"):
            return [f"{here}: this field is in the CRD but its schema was not vendored; copy it into "
                    f"{self.path.relative_to(K8S.parent)} from {self.source['repository']} "
                    f"{self.source['path']} @ {self.source['commit']}"]
        if schema.get("x-kubernetes-int-or-string"):
            if not (TYPES["integer"](value) or TYPES["string"](value)):
                return [f"{here}: expected an integer or a string, got {value!r}"]
        elif "type" in schema and not TYPES[schema["type"]](value):
            return [f"{here}: expected {schema['type']}, got {type(value).__name__} {value!r}"]
        out = []
        if "enum" in schema and value not in schema["enum"]:
            out.append(f"{here}: {value!r} is not one of {schema['enum']}")
        if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{here}: {value!r} does not match {schema['pattern']}")
        if TYPES["integer"](value) and schema.get("format") in INT_RANGE:
            lo, hi = INT_RANGE[schema["format"]]
            if not lo <= value <= hi:
                out.append(f"{here}: {value} is out of {schema['format']} range")
        if "minimum" in schema and TYPES["number"](value) and value < schema["minimum"]:
            out.append(f"{here}: {value} < minimum {schema['minimum']}")
        if isinstance(value, dict):
            props = schema.get("properties", {})
            for key in schema.get("required", []):
                if key not in value:
                    out.append(f"{here}: required field {key!r} is missing")
            for key, sub in value.items():
                where = f"{path}.{key}" if path else key
                if key in props:
                    out += self.errors(sub, props[key], where)
                elif isinstance(schema.get("additionalProperties"), dict):
                    out += self.errors(sub, schema["additionalProperties"], where)
                elif props and not schema.get("additionalProperties") \
                        and not schema.get("x-kubernetes-preserve-unknown-fields"):
                    close = difflib.get_close_matches(key, props, n=1)
                    out.append(f"{where}: unknown field" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                out += self.errors(item, schema["items"], f"{path}[{i}]")
        return out


# ---------------------------------------------------------------------------------- core kinds
QUANTITY_MAPS = {"limits", "requests", "overhead", "capacity", "hard"}  # resource.Quantity: int or string


def core_model(doc: dict):
    """The `kubernetes` client model of a core kind: apps/v1 Deployment -> V1Deployment."""
    import kubernetes.client as kc
    version = doc["apiVersion"].rpartition("/")[2]
    return getattr(kc, version[0].upper() + version[1:] + doc["kind"], None)


def core_errors(value, typ, path: str = "", field: str = "") -> list[str]:
    """Unknown fields, wrong types and missing required fields, against the generated API models."""
    import kubernetes.client as kc
    here = path or "<root>"
    if not isinstance(typ, str):  # a model class
        typ = typ.__name__
    if m := re.fullmatch(r"list\[(.+)\]", typ):
        if not isinstance(value, list):
            return [f"{here}: expected a list, got {value!r}"]
        return [e for i, v in enumerate(value) for e in core_errors(v, m[1], f"{path}[{i}]")]
    if m := re.fullmatch(r"dict\[str, (.+)\]", typ):
        if not isinstance(value, dict):
            return [f"{here}: expected a map, got {value!r}"]
        inner = "quantity" if field in QUANTITY_MAPS and m[1] == "str" else m[1]
        return [e for k, v in value.items() for e in core_errors(v, inner, f"{path}.{k}")]
    scalar = {"str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
              "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "quantity": lambda v: isinstance(v, (int, float, str)) and not isinstance(v, bool),
              "datetime": lambda v: isinstance(v, str), "object": lambda v: True}
    if typ in scalar:
        return [] if scalar[typ](value) else [f"{here}: expected {typ}, got {type(value).__name__} {value!r}"]
    cls = getattr(kc, typ)
    if not isinstance(value, dict):
        return [f"{here}: expected an object ({typ}), got {value!r}"]
    by_json = {js: py for py, js in cls.attribute_map.items()}
    out = []
    for key, sub in value.items():
        where = f"{path}.{key}" if path else key
        if key not in by_json:
            close = difflib.get_close_matches(key, by_json, n=1)
            out.append(f"{where}: unknown field of {typ}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        else:
            out += core_errors(sub, cls.openapi_types[by_json[key]], where, key)
    config = kc.Configuration()
    config.client_side_validation = True
    try:  # the generated setters refuse a required field left unset
        cls(local_vars_configuration=config, **{py: value.get(js) for py, js in cls.attribute_map.items()})
    except ValueError as e:
        out.append(f"{here}: {e}")
    return out


def errors(doc: dict) -> list[str]:
    """Every schema error of one manifest, by its kind; an unknown kind is an error."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        return Schema(SCHEMAS / CRD_SCHEMAS[key]).errors(doc)
    group = doc["apiVersion"].rpartition("/")[0]
    if (group in ("", "apps", "batch", "policy") or group.endswith(".k8s.io")) and (model := core_model(doc)):
        return core_errors(doc, model)
    return [f"{key}: no schema for this kind; vendor its CRD schema in k8s/schemas/"]
