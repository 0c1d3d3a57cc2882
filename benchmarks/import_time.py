"""What ``import fsdp2`` costs, against ``import torch.distributed.fsdp`` (torch's FSDP2).

Each import runs in a fresh interpreter (``python -c "import X"``), the two in turn
(A B A B ...), so the machine's drift hits both alike; the ratio is taken pair by pair.
Prints the median wall time of each, and the median and range of the per-pair ratio.

    python benchmarks/import_time.py --repeats 20
    python benchmarks/import_time.py --a "import fsdp2, fsdp2.checkpoint" --repeats 10
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _once(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="import fsdp2")
    parser.add_argument("--b", default="import torch.distributed.fsdp")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    _once(args.a), _once(args.b)  # warm the file cache
    a_times, b_times = [], []
    for _ in range(args.repeats):
        a_times.append(_once(args.a))
        b_times.append(_once(args.b))
    ratios = [a / b for a, b in zip(a_times, b_times, strict=True)]
    print(f"A: {args.a!r}: median {statistics.median(a_times):.3f} s")
    print(f"B: {args.b!r}: median {statistics.median(b_times):.3f} s")
    print(
        f"A/B: median {statistics.median(ratios):.3f}x "
        f"(min {min(ratios):.3f}x, max {max(ratios):.3f}x, {args.repeats} pairs)"
    )


if __name__ == "__main__":
    main()
