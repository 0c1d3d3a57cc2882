"""Where a group's sharded state lives between the phases of a step, and moving it.

# [Note: offload by phase]
# ``CPUOffloadPolicy(offload_after_forward, offload_after_backward)`` (torch main, pytorch
# PR 192441) names two places for a group's flat sharded buffer (so its sharded parameters)
# and their gradients: at rest (from the group's backward to the next forward: the
# optimizer step) on the host iff ``offload_after_backward``, and from the end of a forward
# with grad enabled to the group's backward ("parked") on the host iff
# ``offload_after_forward``. Both ``True`` (the default) never moves: the state rests on the
# host, as before the flags; both ``False`` is no offloading. When the two differ the group
# moves its state twice per step (``ParamGroup.park`` / ``unpark``):
#
# * ``offload_after_forward=True, offload_after_backward=False``: rests on the device (a
#   device-side optimizer, its state on the device); parked on the host after the forward,
#   so it holds no device memory at the activation peak; back on the device when the
#   group's backward all-gather takes its input (``gather_input``), or at its post-backward
#   when it gathers nothing then (the root, ``reshard_after_forward=False`` or ``int``).
# * ``offload_after_forward=False, offload_after_backward=True``: rests on the host (a CPU
#   optimizer step); parked on the device after the forward, so the backward all-gather
#   reads it there (no host-to-device copy in backward); back on the host at the group's
#   post-backward, before its reduced gradients land (device-to-host, as always).
#
# A move copies the flat buffer into a new one on the other side (pinned on the host with
# ``pin_memory``) and points every sharded parameter at it in place: the DTensor wrapper's
# device through ``.data`` and its local tensor, so the ``nn.Parameter`` objects (which the
# optimizer holds) keep their identity; gradients present move along (a parameter and its
# ``.grad`` are on one device). ``state_dict()`` reports where they are now. Copies between
# pinned and device memory are asynchronous (stream-ordered with the all-gather that reads
# them back) except the one to a host rest, which the optimizer step and the landing
# gradients read on the host next: that one waits (a device-to-host copy the host read
# before it finished would give it stale bytes). So a ``state_dict()`` read on the host
# between a forward and its backward with ``offload_after_backward=False`` should
# synchronize the device first. A forward
# without grad parks nothing (no backward follows). A forward with grad whose backward never
# comes leaves the state parked until the next all-gather (device rest) or post-backward
# (host rest). On a CPU mesh host and device are one memory: the moves are still made (a
# copy within the host), so they are exercised and observable on CPU ("offload to host" /
# "offload to device" regions, [Note: observation] in observe.py). Groups that move never
# alias their unsharded parameters to the flat buffer ([Note: replicated groups] in
# mesh.py), and refuse extension parameters (their own storage; NotImplementedError).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdp2._core.params.param import FSDPParam, _wrap
from fsdp2.api import CPUOffloadPolicy, OffloadPolicy

__all__ = ["Residence", "move_sharded", "point_at"]

_CPU = torch.device("cpu")


class Residence:
    """Where a group's sharded state lives, from its offload policy (see [Note: offload
    by phase]): ``at_rest`` / ``after_forward`` on the host or not, and pinning."""

    __slots__ = ("at_rest", "after_forward", "pin")

    def __init__(self, policy: OffloadPolicy) -> None:
        cpu = isinstance(policy, CPUOffloadPolicy)
        self.at_rest = cpu and policy.offload_after_backward  # type: ignore[attr-defined]
        self.after_forward = cpu and policy.offload_after_forward  # type: ignore[attr-defined]
        self.pin = cpu and policy.pin_memory  # type: ignore[attr-defined]

    @property
    def moves(self) -> bool:
        """Whether the state changes sides between the phases of a step."""
        return self.at_rest != self.after_forward

    def check(self, own_storage: list[str], name: str) -> None:
        """Refuse parameters with storage of their own (extension parameters, named by
        ``own_storage``) in a group whose state moves: ``NotImplementedError``."""
        if self.moves and own_storage:
            raise NotImplementedError(
                f"fully_shard({name}): {own_storage[0]} keeps storage of its own (a tensor "
                "subclass, or frozen with another dtype), which fsdp2 does not move between "
                "phases; give it offload_after_forward == offload_after_backward (e.g. leave "
                "it out of an offload_policy mapping)"
            )


def _copy_to(t: torch.Tensor, device: torch.device, pin: bool, wait: bool) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (always a new tensor; pinned when ``pin``),
    asynchronous between pinned and device memory unless ``wait``."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    out.copy_(t, non_blocking=not wait and (pin or t.is_pinned()))
    return out


def point_at(sharded: DTensor, local: torch.Tensor) -> None:
    """Make the sharded parameter ``sharded`` wrap ``local``, on ``local``'s device: the
    wrapper's device changes through ``.data`` (the object, which optimizers hold, stays)."""
    empty = torch.empty(0, dtype=local.dtype, device=local.device)
    sharded.data = _wrap(local, sharded._spec, False, empty)
    sharded._local_tensor = local


def move_sharded(
    flat: torch.Tensor,
    params: list[FSDPParam],
    host: bool,
    device: torch.device,
    pin: bool,
    wait: bool,
) -> torch.Tensor:
    """Copy a group's flat sharded buffer to the host (``host``) or to ``device``, point
    the sharded parameters (and their gradients) of ``params`` at the copy in place, and
    return it. ``pin``: pin host copies (only off a CPU device); ``wait``: copy
    synchronously (the host reads the copies next: see [Note: offload by phase])."""
    target = _CPU if host else device
    pin = pin and host and device.type != "cpu"
    new = _copy_to(flat, target, pin, wait)
    with torch.no_grad():
        for p in params:
            sp = p.sharded
            grad = sp.grad
            if grad is not None:
                sp.grad = None  # a .grad must be on its parameter's device
            point_at(sp, p.local_view(new))
            if type(grad) is DTensor:
                sp.grad = p.grad_dtensor(_copy_to(grad._local_tensor, target, pin, wait))
            elif grad is not None:  # a DTensor subclass (a replica piece): its own .to
                sp.grad = grad.to(target, copy=True)
    return new
