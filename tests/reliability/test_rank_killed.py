"""A rank SIGKILLed while training: the survivor raises within a bound, never hangs.

2 gloo CPU ranks of their own (``faults.run_killing``; the process group's timeout is
``PG_TIMEOUT_S``), ``MLPStack`` from ``helpers.NAME`` sharded per block and at the root,
AdamW. Step 0 runs whole; in step 1 rank 1 kills itself in the forward (before block 1's
computation, its all-gather prefetched or not), in the backward (in block 1's gradient), or in
the optimizer step. Rank 0 must raise within ``BOUND_S`` of the start of its run.

With fsdp2's debug mode on (``set_debug(True, timeout=DEBUG_TIMEOUT_S)``), rank 0's next
collective waits for rank 1 to announce it and raises naming rank 1 and its last collective
("rank(s) 1 did not reach it within 3 s. Their last fsdp2 collective: ..."; measured ~4 s):
in the backward, the words docs/reliability.md quotes.
Had rank 1 died after its announcement, inside gloo's collective, gloo's own error would be
what rank 0 sees. Without debug mode rank 0 gets gloo's error ("Read error ...: Connection
reset by peer", no rank named) as soon as the peer's sockets close (measured ~1 s), or after
the process group's timeout if the peer's process lives on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import PG_TIMEOUT_S, die, run_killing
from helpers import NAME, sharded
from models import make_batch

import fsdp2

DEBUG_TIMEOUT_S = 3.0
BOUND_S = 2 * PG_TIMEOUT_S + 10  # fsdp2's step 0 and setup take ~1 s


def _train_until_killed(rank: int, where: str, debug: bool) -> int:
    torch.manual_seed(0)
    if debug:
        fsdp2.set_debug(True, timeout=DEBUG_TIMEOUT_S)
    model = sharded("fsdp2", NAME)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = 0

    def kill_here(*_: Any) -> None:
        if rank == 1 and step == 1:
            die()

    block = model.layers[1]
    if where == "forward":
        block.lin.register_forward_pre_hook(kill_here)
    elif where == "backward":
        block.lin.register_full_backward_hook(kill_here)
    else:
        optim.register_step_pre_hook(kill_here)
    for step in range(3):
        x, _ = make_batch(NAME, step)
        model(x[rank::2]).sum().backward()
        optim.step()
        optim.zero_grad()
    return step


@pytest.mark.parametrize(
    "where,debug",
    [("forward", False), ("backward", False), ("optimizer step", True), ("backward", True)],
)
def test_survivor_raises(where: str, debug: bool) -> None:
    survivor, killed = run_killing(_train_until_killed, where, debug)
    assert killed["status"] == "killed", killed
    assert survivor["status"] == "raised", f"rank 0 did not raise: {survivor}"
    assert survivor["seconds"] < BOUND_S, survivor
    if debug:  # rank 1 died before announcing its next collective: named
        assert "rank(s) 1 did not reach it" in survivor["error"], survivor["error"]
    if debug and where == "backward":  # the page quotes this error, up to its "..."
        page = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
        (shown,) = re.findall(r"`(RuntimeError: fsdp2 debug: rank 0 .*?) \.\.\.`", page, re.S)
        got = " ".join(survivor["error"].split())
        assert got.startswith(" ".join(shown.split())), (got, shown)
