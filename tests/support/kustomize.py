"""`kubectl kustomize DIR` offline, for the features deploy/k8s uses: resources (files and bases), namespace,
configMapGenerator (create or replace, from files; the name gets kustomize's content hash, and references to it from
pod volumes, envFrom and env follow) and images (newName/newTag).

The tests run kubectl's built-in kustomize where it is installed and check that this builder renders the same
objects (but for the hash digits); where it is not (kubectl is no Debian package), they still validate this builder's output. A kustomization
field it does not implement raises, so a new feature cannot be silently left out.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass", "IngressClass"}


def build(folder: Path) -> list[Obj]:
    """The objects `kubectl kustomize folder` prints (generated ConfigMaps named with their hash)."""
    objects, generated = _load(folder)
    names = {}
    for cm in generated:
        base = cm["metadata"]["name"]
        cm["metadata"]["name"] = names[base] = f"{base}-{config_map_hash(cm)}"
    for obj in objects:
        for pod in _pod_specs(obj):
            _rename_config_maps(pod, names)
    return [*generated, *objects]


def config_map_hash(cm: Obj) -> str:
    """A content hash for the name suffix, in kustomize's form (10 characters of sha256 hex, never all digits; the
    digits differ from kustomize's own, so comparisons with kubectl go through `suffixes_blanked`)."""
    encoded = json.dumps({"data": cm.get("data") or {}, "kind": "ConfigMap", "name": cm["metadata"]["name"]},
                         sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()[:10].translate(str.maketrans("013ae", "ghkmt"))


def _load(folder: Path) -> tuple[list[Obj], list[Obj]]:
    """(the resources, the generated ConfigMaps before their hash) of one kustomization, bases included."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise NotImplementedError(f"{folder}: kustomization fields {sorted(unknown)} are not implemented here")
    objects: list[Obj] = []
    generated: list[Obj] = []
    for resource in k.get("resources") or []:
        path = folder / resource
        if path.is_dir():
            sub_objects, sub_generated = _load(path)
            objects += sub_objects
            generated += sub_generated
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for spec in k.get("configMapGenerator") or []:
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": spec["name"]},
              "data": {Path(f).name: (folder / f).read_text() for f in spec.get("files") or []}}
        behavior = spec.get("behavior", "create")
        existing = [g for g in generated if g["metadata"]["name"] == spec["name"]]
        if behavior == "replace":
            assert existing, f"{folder}: configMapGenerator {spec['name']} replaces nothing"
            generated.remove(existing[0])
        elif behavior != "create" or existing:
            raise NotImplementedError(f"{folder}: configMapGenerator behavior {behavior!r} for {spec['name']}")
        generated.append(cm)
    for obj in [*objects, *generated]:
        if k.get("namespace") and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
        for pod in _pod_specs(obj):
            _set_images(pod, k.get("images") or [])
    return objects, generated


def _pod_specs(obj: Obj) -> list[Obj]:
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        return [spec]
    if obj["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    template = spec.get("template") if isinstance(spec, dict) else None
    return [template["spec"]] if isinstance(template, dict) and "spec" in template else []


def _containers(pod: Obj) -> list[Obj]:
    return [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]


def _set_images(pod: Obj, images: list[Obj]) -> None:
    for c in _containers(pod):
        for image in images:
            name = c["image"].split("@", 1)[0]
            name = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
            if name == image["name"]:
                tag = image.get("newTag")
                c["image"] = image.get("newName", name) + (f":{tag}" if tag else c["image"][len(name):])


def _rename_config_maps(pod: Obj, names: dict[str, str]) -> None:
    for volume in pod.get("volumes") or []:
        _rename(volume.get("configMap"), "name", names)
        for source in (volume.get("projected") or {}).get("sources") or []:
            _rename(source.get("configMap"), "name", names)
    for c in _containers(pod):
        for source in c.get("envFrom") or []:
            _rename(source.get("configMapRef"), "name", names)
        for env in c.get("env") or []:
            _rename((env.get("valueFrom") or {}).get("configMapKeyRef"), "name", names)


def _rename(ref: Obj | None, key: str, names: dict[str, str]) -> None:
    if ref and ref.get(key) in names:
        ref[key] = names[ref[key]]


def suffixes_blanked(objects: list[Obj], generated: set[str]) -> list[Obj]:
    """The objects with every generated ConfigMap's hash suffix replaced by `<hash>`, in a stable order (kustomize
    orders them its own way)."""
    text = yaml.safe_dump_all(objects, sort_keys=True)
    for name in generated:
        text = re.sub(rf"\b{re.escape(name)}-[a-z0-9]{{10}}\b", f"{name}-<hash>", text)
    docs = [d for d in yaml.safe_load_all(text) if d]
    return sorted(docs, key=lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]))


def generated_names(folder: Path) -> set[str]:
    return {cm["metadata"]["name"] for cm in _load(folder)[1]}


def kustomized(folder: Path) -> list[Obj]:
    """`kubectl kustomize folder`'s objects where kubectl is installed (this builder must then render the same), this
    builder's where it is not."""
    offline = build(folder)
    if shutil.which("kubectl") is None:
        return offline
    printed = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    real = [d for d in yaml.safe_load_all(printed) if d]
    names = generated_names(folder)
    assert suffixes_blanked(offline, names) == suffixes_blanked(real, names), (
        f"tests/support/kustomize.py renders {folder} differently from kubectl kustomize")
    return real
