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
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import parse_qs, urlsplit

import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

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
MAKE_CERTS = ROOT / "scripts" / "make_certs.sh"
# What scripts/make_certs.sh writes into redis.env, with a sample password: the Secret
# pagedserve-state-store (Kubernetes) and the env_file (Compose) hold it.
SAMPLE_STATE_STORE = (
    "rediss://pagedserve:sample-password@redis:6379/0?ssl_ca_certs=/etc/pagedserve/tls/ca.crt"
)


def require_tool(name: str) -> str:
    """The path of a validator the dev extras install; a missing one fails the test, never
    skips it."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed: `make install` brings it with the dev extras")
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
    then env; a downward-API field and a Secret (made by hand, deploy/README.md) stand in
    as sample values."""
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
        elif "secretKeyRef" in var.get("valueFrom", {}):
            key = var["valueFrom"]["secretKeyRef"]["key"]
            env[var["name"]] = SAMPLE_STATE_STORE if key == "PAGEDSERVE_STATE_STORE" else "sample"
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


def parse_cli(argv: list[str], env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``argv`` through pagedserve's own parser, with ``env`` (and nothing of the test's own)
    as the environment its PAGEDSERVE_* variables come from; a rejected flag fails with
    argparse's words.

    Every flag must be spelled out: argparse would accept an abbreviation, a deployment file
    should not rely on one.
    """
    stderr = io.StringIO()
    with mock.patch.dict(os.environ, env or {}, clear=True):
        parser = build_parser()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`pagedserve {' '.join(argv)}` is rejected by the CLI:\n{stderr.getvalue()}")
    command = parser._subparsers._group_actions[0].choices[args.command]
    for token in argv:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            assert flag in command._option_string_actions, f"{flag} is not a full flag name"
    return args


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def redis_url_host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.scheme in ("redis", "rediss") and parts.port, f"not a Redis URL: {url!r}"
    return parts.hostname, parts.port


def redis_url_ca(url: str) -> str | None:
    """The CA file a rediss:// URL checks the server's certificate against."""
    (ca,) = parse_qs(urlsplit(url).query).get("ssl_ca_certs", [None])
    return ca


def make_secrets(directory: Path) -> Path:
    """What scripts/make_certs.sh writes, in ``directory``."""
    subprocess.run(["sh", str(MAKE_CERTS), str(directory)], check=True, capture_output=True)
    return directory


_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_]\w*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``${VAR:+other}`` (and
    the forms without the colon, which test set rather than set and non-empty) and ``$$``,
    in every string value. A variable that is unset without a default raises ValueError:
    Compose would warn and use an empty string."""
    if isinstance(value, dict):
        return {key: interpolate(v, env) for key, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return _VARIABLE.sub(lambda match: _substitute(match, env), value)
    return value


def _substitute(match: re.Match[str], env: Mapping[str, str]) -> str:
    if match["escaped"]:
        return "$"
    braced = _BRACED.fullmatch(match["named"] or match["braced"])
    if braced is None:
        raise ValueError(f"invalid interpolation: {match[0]!r}")
    name, op, arg = braced["name"], braced["op"] or "", braced["arg"] or ""
    value = env.get(name)
    present = value is not None and (value != "" or not op.startswith(":"))
    if op.endswith("-"):
        return value if present else arg
    if op.endswith("+"):
        return arg if present else ""
    if not present and (op.endswith("?") or value is None):
        raise ValueError(arg or f"${{{name}}} is not set and has no default")
    return value


def compose_errors(document: Any) -> list[str]:
    """Why Compose would refuse a document, if it would: what breaks the Compose
    Specification's schema (as vendored in check-jsonschema), then a ``depends_on`` naming
    no service of the document or a named volume it does not declare."""
    schema = get_builtin_schema("vendor.compose-spec")
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    ]
    if errors:
        return errors
    services, volumes = document.get("services", {}), document.get("volumes") or {}
    for name, service in services.items():
        depends_on = service.get("depends_on", [])
        errors += [
            f"{name}: depends on undefined service {d!r}" for d in depends_on if d not in services
        ]
        sources = [compose_volume(v)[0] for v in service.get("volumes", [])]
        named = [source for source in sources if source and not _is_host_path(source)]
        errors += [f"{name}: undefined volume {v!r}" for v in named if v not in volumes]
    return errors


def compose_config(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """A Compose file as Compose reads it with an empty environment (the file's own
    defaults, not the caller's GRAFANA_ADMIN_PASSWORD and the like): interpolated, and
    valid, else the test fails with what is wrong."""
    document = interpolate(yaml.safe_load(path.read_text()), env={})
    errors = compose_errors(document)
    assert not errors, f"{path.name} is not a valid Compose file:\n" + "\n".join(errors)
    return document


def compose_volume(volume: str | dict[str, Any]) -> tuple[str | None, str]:
    """(source, target) of a service's volume in either syntax: "[SRC:]DST[:MODE]" or a
    mapping; the source is None for an anonymous volume."""
    if isinstance(volume, dict):
        return volume.get("source"), volume["target"]
    parts = volume.split(":")
    return (parts[0], parts[1]) if len(parts) > 1 else (None, parts[0])


def _is_host_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def compose_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Mount target -> source, a host path made absolute against the Compose file's folder
    as Compose does; a named volume by its name."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = compose_volume(volume)
        if source and _is_host_path(source):
            source = os.path.normpath(COMPOSE_FILE.parent / os.path.expanduser(source))
        mounts[target] = source
    return mounts


def compose_published_ports(service: dict[str, Any]) -> set[int]:
    """Container ports published to the host, short ("[IP:]HOST:CONTAINER[/PROTO]") or long
    syntax."""
    ports = set()
    for p in service.get("ports", []):
        target = p.split(":")[-1].split("/")[0] if isinstance(p, str) else p["target"]
        ports.add(int(target))
    return ports
