"""``make gpu-check``: everything a lent GPU should tell us, in one call, into one file.

On a machine with one GPU and its own torch (no package registry; fsdp2 need not be
installed: the repository root goes on ``PYTHONPATH``), this runs

1. every ``gpu``-marked test (``pytest -m gpu`` over the test files that have any), each
   training run repeated ``--repeats`` times (``FSDP2_GPU_REPEATS``): world size 1 on NCCL,
   parity with torch's FSDP2 and the unsharded model, streams and events, CPU offload with
   pinned memory, the process group's allocator, checkpoints, the CUDA memory estimate, the
   timeline (``tests/core/test_gpu.py``, ``tests/core/params/test_offload.py``);
2. the numbers of ``benchmarks/gpu_bench.py``: ``step`` (world size 1 against the unsharded
   model and torch's FSDP2), ``memory`` (rank 0 of 8 through the fake process group, ~1B
   parameters), ``offload`` (``CPUOffloadPolicy``), ``sync`` (RL weight sync: the per-tensor
   loop against ``iter_full_tensors``, rank 0 of 8 through the fake process group),
   ``deterministic`` (``fsdp2.reduction.set_deterministic`` against the default, 4
   micro-batches) and ``traced`` (fsdp2's traced mode compiled whole at world size 1 against
   the unsharded model compiled whole and both FSDP2s with their blocks compiled: step,
   compile time, recompiles; and its memory on rank 0 of 8 through the fake process group;
   ``benchmarks/_gpu_traced.py``);

and writes ``<out>/gpu-check.md``: versions, GPU, the command, each test's outcome (failures
with their message), the benchmark tables and, at the end, all of it as JSON. The file is
rewritten after each stage, so a run cut short still leaves what it measured. Every stage has
a time limit inside ``--budget`` (default 560 s: the device tool allows 600 s a command): the
tests get what the benchmark parts' reserves (``RESERVE_S``) leave, and each part a share of
what is left when it starts, in proportion to its reserve. A part fails when its process
fails or, for ``traced``, when one of its checks does not hold (its table says which).

``--device cpu`` runs the same stages on the CPU (gloo, tiny models): CI runs it, so the
harness is tested where there is no GPU; only the CUDA-only tests skip, with their reason.

    make gpu-check                  # on the GPU machine: results in $OUT or runs/gpu-check
    make gpu-check DEVICE=cpu       # what CI runs
    python benchmarks/gpu_check.py --device cpu --out runs/gpu-check --skip-bench
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PACKAGES = ("torch", "safetensors", "hypothesis", "pytest", "torchao", "transformers", "peft")
RESULTS = "gpu-check.md"
PARTS = "step,memory,offload,sync,deterministic,traced"
# Seconds a benchmark part is given before the tests take the rest (with all six parts the
# tests get 210 s, as they had before ``traced``): on an H200 the tests (repeats 2) and the
# first five parts took 211 s together (docs/benchmarks.md, "GPU"); ``traced`` compiles two
# whole models and two blocks with inductor, then one of each again (about 3 minutes,
# estimated: benchmarks/_gpu_traced.py). The last part gets all that is left.
RESERVE_S = {"traced": 150.0}
RESERVE_DEFAULT_S = 40.0


def reserve(part: str) -> float:
    """The seconds ``part`` is given before the tests take the rest (``RESERVE_S``)."""
    return RESERVE_S.get(part, RESERVE_DEFAULT_S)


def gpu_test_files() -> list[str]:
    """The test files holding ``gpu``-marked tests (only these are collected: the others may
    import packages the GPU machine lacks)."""
    files = []
    for folder, dirs, names in os.walk(TESTS):  # tests/ and its subfolders (tests/core/...)
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(names):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                if "pytest.mark.gpu" in text:
                    files.append(os.path.relpath(path, ROOT))
    return sorted(files)


def _cuda_environment(env: dict[str, Any]) -> None:
    import torch

    props = torch.cuda.get_device_properties(0)
    env["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    env["gpus"] = torch.cuda.device_count()
    try:
        nccl = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (AttributeError, RuntimeError):
        env["nccl"] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        env["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = None


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "device": device,
        "cpus": os.cpu_count(),
        "packages": {},
    }
    for name in PACKAGES:
        try:
            env["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env["packages"][name] = None
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda
    if device == "cuda":
        try:
            _cuda_environment(env)
        except Exception as e:  # the report must still be written
            env["gpu"] = f"unknown ({type(e).__name__}: {e})"
    try:
        rev = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain"], capture_output=True, text=True
        )
        env["commit"] = (rev.stdout.strip() or "unknown") + (" (+ changes)" if dirty.stdout else "")
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = "unknown"
    return env


def _child_env(device: str, repeats: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["FSDP2_TEST_DEVICE"] = device
    env["FSDP2_GPU_REPEATS"] = str(repeats)
    env.setdefault("OMP_NUM_THREADS", "1" if device == "cpu" else "4")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, float]:
    """``(exit code or None on timeout, combined output, seconds)``."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout, 1)
        )
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        return None, text, time.monotonic() - t0


def run_tests(device: str, repeats: int, out: str, timeout: float) -> dict[str, Any]:
    junit = os.path.join(out, "junit.xml")
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={junit}", *files]
    code, text, secs = _run(cmd, _child_env(device, repeats), timeout)
    cases: list[dict[str, Any]] = []
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            entry: dict[str, Any] = {"test": name, "s": float(case.get("time") or 0.0)}
            entry["outcome"] = "passed"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    entry["outcome"] = {"skipped": "skipped"}.get(tag, "failed")
                    message = node.get("message") or ""
                    detail = "" if tag == "skipped" else (node.text or "").strip()
                    entry["message"] = (message + ("\n" + detail[-3000:] if detail else ""))[-4000:]
            cases.append(entry)
        os.remove(junit)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    ok = code == 0 and counts["failed"] == 0
    return {
        "command": " ".join(shlex.quote(c) for c in cmd),
        "files": files,
        "exit_code": code,
        "timed_out": code is None,
        "seconds": round(secs, 1),
        "counts": counts,
        "ok": ok,
        "cases": cases,
        "output_tail": text[-6000:],
    }


def run_bench(device: str, part: str, out: str, timeout: float) -> dict[str, Any]:
    path = os.path.join(out, f"bench-{part}.json")
    cmd = [sys.executable, os.path.join("benchmarks", "gpu_bench.py"), "--part", part]
    cmd += ["--device", device, "--json", path]
    code, text, secs = _run(cmd, _child_env(device, 1), timeout)
    result: dict[str, Any] = {
        "command": " ".join(shlex.quote(c) for c in cmd),
        "exit_code": code,
        "timed_out": code is None,
        "seconds": round(secs, 1),
        "ok": code == 0 and os.path.exists(path),
    }
    if os.path.exists(path):
        with open(path) as f:
            result["result"] = json.load(f)
        os.remove(path)
    if not result["ok"]:
        result["output_tail"] = text[-4000:]
    return result


def render(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# fsdp2 gpu-check: {'PASS' if report.get('ok') else 'FAIL'}"
        + ("" if report.get("finished") else " (unfinished: cut short)"),
        "",
        f"- date: {env['date']}",
        f"- command: `{report['command']}`",
        f"- device: {env['device']}"
        + (
            f", {env.get('gpu')} x{env.get('gpus')}, driver {env.get('driver')}"
            if env.get("gpu")
            else ""
        ),
        f"- torch {env['torch']} (CUDA {env['cuda']}"
        + (f", NCCL {env['nccl']}" if env.get("nccl") else "")
        + f"), Python {env['python']}, {env['cpus']} CPUs, fsdp2 {env['commit']}",
        "- packages: " + ", ".join(f"{k} {v or 'missing'}" for k, v in env["packages"].items()),
        "",
    ]
    tests = report.get("tests")
    if tests is not None:
        c = tests["counts"]
        lines += [
            f"## Tests: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped "
            f"({tests['seconds']} s{', TIMED OUT' if tests['timed_out'] else ''})",
            "",
            f"`{tests['command']}`",
            "",
            "| test | outcome | s |",
            "| --- | --- | ---: |",
        ]
        for case in tests["cases"]:
            lines.append(f"| {case['test']} | {case['outcome']} | {case['s']:.1f} |")
        for case in tests["cases"]:
            if case["outcome"] != "passed" and case.get("message"):
                lines += ["", f"### {case['outcome']}: {case['test']}", "", "```"]
                lines += [case["message"], "```"]
        if not tests["ok"] and not tests["cases"]:
            lines += ["", "```", tests["output_tail"], "```"]
        lines.append("")
    for part, bench in report.get("benchmarks", {}).items():
        lines += [f"## Benchmark {part} ({bench['seconds']} s)", "", f"`{bench['command']}`", ""]
        if "result" in bench:
            sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
            from gpu_bench import table

            lines += [table(bench["result"]), ""]
        if not bench["ok"]:
            what = "timed out" if bench["timed_out"] else f"exit code {bench['exit_code']}"
            lines += [f"FAILED ({what}):", "", "```", bench.get("output_tail", ""), "```", ""]
    lines += ["## Everything above as JSON", "", "```json", json.dumps(report, indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda")
    ap.add_argument(
        "--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu-check")
    )
    ap.add_argument("--repeats", type=int, default=None, help="per training run (cuda: 3)")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for everything")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--parts", default=PARTS, help=f"benchmark parts to run (default {PARTS})")
    args = ap.parse_args(argv)
    import torch

    device = args.device or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error(
            "no GPU here (torch.cuda.is_available() is False): run it on a GPU machine, or "
            "with --device cpu (make gpu-check DEVICE=cpu) to check the harness"
        )
    repeats = args.repeats or (3 if device == "cuda" else 1)
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, RESULTS)
    start = time.monotonic()
    report: dict[str, Any] = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *(argv or sys.argv[1:])]),
        "environment": environment(device),
        "ok": False,
        "finished": False,
    }

    def save() -> None:
        with open(results, "w") as f:
            f.write(render(report))

    save()
    parts = [] if args.skip_bench else [p for p in args.parts.split(",") if p]
    ok = True
    if not args.skip_tests:
        # The tests get what the benchmarks will not need (RESERVE_S).
        left = args.budget - (time.monotonic() - start) - sum(map(reserve, parts))
        report["tests"] = run_tests(device, repeats, args.out, max(left, 60))
        ok &= report["tests"]["ok"]
        save()
        c = report["tests"]["counts"]
        print(f"tests: {c} in {report['tests']['seconds']} s", flush=True)
    report["benchmarks"] = {}
    for i, part in enumerate(parts):
        left = args.budget - (time.monotonic() - start)
        share = left * reserve(part) / sum(map(reserve, parts[i:]))
        report["benchmarks"][part] = run_bench(device, part, args.out, share)
        ok &= report["benchmarks"][part]["ok"]
        save()
        print(f"benchmark {part}: ok={report['benchmarks'][part]['ok']}", flush=True)
    report["ok"], report["finished"] = ok, True
    save()
    print(f"gpu-check {'PASS' if ok else 'FAIL'}: {results}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
