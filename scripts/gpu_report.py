"""One JSON report from what scripts/gpu_check.sh left in its folder: the GPU, the tests'
outcome (with the agreement figures they recorded), and the benchmarks' results."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def tests_summary(junit: Path) -> dict[str, Any]:
    """Counts, the failed tests by name, and every recorded property."""
    if not junit.is_file():
        return {"error": f"{junit.name} missing: the tests did not finish"}
    summary: dict[str, Any] = {"passed": 0, "failed": [], "skipped": 0, "properties": {}}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            summary["failed"].append(name)
        elif case.find("skipped") is not None:
            summary["skipped"] += 1
        else:
            summary["passed"] += 1
        for prop in case.iter("property"):
            summary["properties"][prop.get("name")] = prop.get("value")
    return summary


def bench_result(path: Path) -> Any:
    if not path.is_file():
        return {"error": f"{path.name} missing: the benchmark did not finish"}
    result = json.loads(path.read_text())
    return {k: v for k, v in result.items() if k != "config"}


def main(out: Path) -> dict[str, Any]:
    gpu = out / "gpu.txt"
    tests = tests_summary(out / "tests.xml")
    report = {
        "gpu": (gpu.read_text().strip() if gpu.is_file() else "") or None,
        "tests": tests,
        "kernels": bench_result(out / "kernels.json"),
        "throughput": bench_result(out / "throughput.json"),
    }
    parts = (report["kernels"], report["throughput"])
    report["ok"] = not tests.get("error") and not tests["failed"] and tests["passed"] > 0
    report["ok"] = report["ok"] and not any("error" in part for part in parts)
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check")), indent=2))
