"""Print the project's runtime requirements from pyproject.toml, one a line, less the named
ones: the scheduler image installs everything but torch (its decisions are pure Python).
Runs in the images' Python 3.12 and the test venv (tomllib: Python 3.11+)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib


def requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalised (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    if name is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def runtime_requirements(pyproject: Path, without: set[str]) -> list[str]:
    with pyproject.open("rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    skip = {requirement_name(name) for name in without}
    return [r for r in requirements if requirement_name(r) not in skip]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--without", nargs="*", default=[], help="distribution names to leave out")
    args = parser.parse_args()
    print("\n".join(runtime_requirements(args.pyproject, set(args.without))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
