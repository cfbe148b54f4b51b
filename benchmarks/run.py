"""Run every benchmark on this machine and write the results as JSON and as ``docs/benchmarks.md``.

Usage::

    python benchmarks/run.py            # full sizes; writes docs/benchmarks.md and docs/benchmarks.json
    python benchmarks/run.py --quick    # tiny sizes, to check that every benchmark works (under a minute)
    python benchmarks/run.py --out DIR  # write DIR/benchmarks.md and DIR/benchmarks.json instead
    python benchmarks/run.py --only bench_memory_setup  # re-measure that section, keep the others' last results

Every ``benchmarks/sections/bench_*.py`` module is one section, listed in :data:`SECTIONS`: its
``run(quick: bool)`` returns ``{"title": str, "markdown": str, "data": dict}``. A section that fails is reported as
failed and the others still run; the command then exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.report import TARGET_LINE
from sections import (
    bench_accuracy,
    bench_balance,
    bench_bubble,
    bench_emulated,
    bench_gpt2,
    bench_holding,
    bench_memory,
    bench_memory_setup,
    bench_overhead,
    bench_peer,
    bench_pipeline,
    bench_pretrained,
    bench_schedules,
    bench_sharding,
    bench_step_agreement,
    bench_watchdog,
)

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
DOCS = REPO / "docs"
# The sections in reading order (tests/test_benchmarks.py checks that every module of sections/ is here).
SECTIONS: tuple[ModuleType, ...] = (
    bench_pipeline, bench_peer, bench_schedules, bench_emulated, bench_accuracy, bench_overhead, bench_watchdog,
    bench_step_agreement, bench_memory, bench_balance, bench_bubble, bench_memory_setup, bench_holding,
    bench_sharding, bench_pretrained, bench_gpt2,
)
# Written by `benchmarks/gpu_check.py` when it runs on a GPU; the page shows it (or says that CUDA is untested).
GPU_CHECK_SUMMARY = BENCHMARKS / "gpu_check_summary.txt"
# Hand-written record of the engine's optimisations, appended to the generated page (the runner never edits it).
OPTIMISATIONS = BENCHMARKS / "optimisations.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every benchmark runs")
    parser.add_argument("--out", type=Path, default=None, help="write benchmarks.md and benchmarks.json here")
    parser.add_argument(
        "--only", nargs="+", metavar="SECTION", choices=[_name(s) for s in SECTIONS], default=None,
        help="re-measure these sections (bench_*); the others keep their results from the last benchmarks.json",
    )
    args = parser.parse_args(argv)
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "") + (f" --only {' '.join(args.only)}" if args.only else "")
    out = args.out or DOCS
    kept = _last_results(out / "benchmarks.json", args.quick) if args.only else {}
    machine = _machine()
    started = time.perf_counter()
    sections, failed = [], False
    for section in SECTIONS:
        name = _name(section)
        if args.only and name not in args.only:  # kept as last measured; a section never measured stays absent
            if name in kept:
                sections.append(kept[name])
            continue
        start = time.perf_counter()
        load_before = _load_average()
        print(f"[benchmarks] {name} ...", flush=True)
        try:
            result = section.run(args.quick)
        except Exception:  # noqa: BLE001  (one broken section must not hide the others' results)
            failed = True
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
            result = {"title": name, "markdown": f"**Failed:**\n\n```\n{error}```", "data": {"error": error}}
        result = {
            "module": name, "seconds": time.perf_counter() - start, "date": _now(),
            "load_average": [load_before, _load_average()], **result,
        }
        print(f"[benchmarks] {name} done in {result['seconds']:.0f} s", flush=True)
        sections.append(result)
    machine["load_average_after"] = _load_average()
    machine["run_seconds"] = round(time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "quick": args.quick, "machine": machine, "only": args.only, "sections": sections}
    (out / "benchmarks.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "benchmarks.md").write_text(render(report))
    print(f"[benchmarks] wrote {out / 'benchmarks.md'} and {out / 'benchmarks.json'}", flush=True)
    return 1 if failed else 0


def render(report: dict[str, Any]) -> str:
    """The markdown page: the command, the machine, then one section per benchmark module."""
    machine = report["machine"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by:",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        f"- machine: {machine['cpu']}, {machine['cores']} cores ({machine['platform']})",
        f"- torch {machine['torch']}, lightning {machine['lightning']}, Python {machine['python']}",
        f"- date: {machine['date']}, {machine['run_seconds']} s for the whole run"
        if not report.get("only")
        else f"- date: {machine['date']}, {machine['run_seconds']} s to re-measure {', '.join(report['only'])}; the other"
        " sections are kept from earlier runs (each section says when it was measured)",
        f"- load average (1 min) before / after the run: {machine['load_average_before']} /"
        f" {machine['load_average_after']} (other work on a shared machine skews the absolute times; the ratios"
        " are measured side by side)",
        f"- CUDA: {_cuda_status()}",
        "",
        "Sections: " + ", ".join(f"[{s['title']}](#{_anchor(s['title'])})" for s in report["sections"]) + ".",
        "",
    ]
    targets = [line for s in report["sections"] for line in s["markdown"].splitlines() if line.startswith(TARGET_LINE)]
    if targets:
        lines += ["Targets at a glance (each is explained in its section):", "", *(f"- {line}" for line in targets), ""]
    for section in report["sections"]:
        source = f"*Source: `benchmarks/sections/{section['module']}.py`"
        if "date" in section:  # when and under what load this section was measured (sections may be re-run alone)
            before, after = section["load_average"]
            source += f"; measured {section['date']}, load average {before} before, {after} after"
        source += ".*"
        lines += [f"## {section['title']}", "", section["markdown"].strip(), "", source, ""]
    if OPTIMISATIONS.exists():
        lines += [OPTIMISATIONS.read_text().strip(), ""]
    return "\n".join(lines)


def _cuda_status() -> str:
    """Whether the GPU check ran, with its summary; until it has, the page says that CUDA is untested."""
    if not GPU_CHECK_SUMMARY.exists():
        return (
            "untested. Every number on this page is from CPU processes; no run of the pipeline on a GPU has happened"
            " yet. `python benchmarks/gpu_check.py` checks CUDA placement, `bf16-mixed` and `16-mixed` with the"
            " gradient scaler, a traced step and the engine's per-micro-batch overhead on one GPU in under 5 minutes,"
            " and records its summary here."
        )
    summary = GPU_CHECK_SUMMARY.read_text().strip()
    return f"the summary of `python benchmarks/gpu_check.py`:\n\n```text\n{summary}\n```"


def _machine() -> dict[str, Any]:
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": version("torch"),
        "lightning": version("lightning"),
        "date": _now(),
        "load_average_before": _load_average(),
    }


def _name(section: ModuleType) -> str:
    return section.__name__.rpartition(".")[2]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _last_results(path: Path, quick: bool) -> dict[str, dict[str, Any]]:
    """The sections of the last report at ``path``, by module, to keep beside re-measured ones."""
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    if report.get("quick") != quick:
        raise SystemExit(f"{path} holds a {'quick' if report.get('quick') else 'full'} run; --only would mix sizes")
    machine = report["machine"]
    for section in report["sections"]:  # a report written before sections carried their own date has the run's
        section.setdefault("date", machine["date"])
        section.setdefault("load_average", [machine["load_average_before"], machine["load_average_after"]])
    return {section["module"]: section for section in report["sections"]}


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as dashes."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


if __name__ == "__main__":
    sys.exit(main())
