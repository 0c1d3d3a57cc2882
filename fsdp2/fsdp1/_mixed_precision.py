"""What ``shard_model`` adds around ``fully_shard`` for FSDP1's ``MixedPrecision``:
``keep_low_precision_grads``, the output casts of full-precision units and the buffer casts.
See the ``MixedPrecision`` item of [Note: FSDP1 mapping] in ``fsdp2/fsdp1/__init__.py``. The core
never imports it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from fsdp2._core.front.seam import managed_params, on_backward_end


def relax_grad_dtype(unit: nn.Module, ignored: set[nn.Parameter]) -> None:
    """Before ``fully_shard(unit)``: the floating-point parameters it will manage accept a
    gradient of any dtype (``grad_dtype = None``), the policy fully_shard then captures and
    keeps ([Note: gradient dtypes] in fsdp2/_core/params/dtypes.py): ``LowPrecisionGrads``
    stores ``param_dtype`` gradients on them. Parameters already sharded (by a child unit)
    and ignored ones are left alone."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        return
    for param in unit.parameters():
        if not isinstance(param, DTensor) and param.is_floating_point() and param not in ignored:
            param.grad_dtype = None


class LowPrecisionGrads:
    """``MixedPrecision.keep_low_precision_grads``, as FSDP1: when a backward ends (in fsdp2's
    backward-end hooks, ``seam.on_backward_end``: after the gradients landed), the sharded
    parameters' gradients become ``param_dtype`` tensors (the parameters keep their dtype:
    ``grad_dtype`` is relaxed); when the next backward starts (the gradient of the root's
    outputs arrives) they are cast back, so that accumulation runs in full precision."""

    def __init__(self, root: nn.Module, units: list[tuple[nn.Module, torch.dtype]]) -> None:
        self.units = units
        self.started = False  # a backward through the root's outputs is running
        root.register_forward_hook(self._hook_outputs)
        on_backward_end(root, self._backward_ends)

    def _params(self) -> Iterator[tuple[DTensor, torch.dtype]]:
        for unit, dtype in self.units:
            for p in managed_params(unit):
                yield p.sharded, dtype

    def _hook_outputs(self, module: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled():
            return
        self.started = False  # a backward that raised never reached its end
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_starts)

    def _backward_starts(self, grad: torch.Tensor) -> None:
        if self.started:
            return
        self.started = True
        with torch.no_grad():
            for param, _ in self._params():
                g = param.grad
                if g is not None and g.dtype != param.dtype:
                    param.grad = g.to(param.dtype)

    def _backward_ends(self) -> None:
        if not self.started:  # a backward that did not go through the root's outputs
            return
        self.started = False
        with torch.no_grad():
            for param, dtype in self._params():
                g = param.grad
                if g is not None and g.dtype != dtype:
                    if not hasattr(torch.Tensor, "grad_dtype"):  # older torch checks .grad
                        param.grad_dtype = None  # let a full-precision parameter hold it
                    param.grad = g.to(dtype)


def cast_outputs_to_input_dtype(module: nn.Module) -> None:
    """As FSDP1 does for ``_module_classes_to_ignore`` modules: cast the floating-point outputs
    back to the dtype of the first floating-point input (before ``fully_shard`` casts it), so
    the units after it see low-precision activations again."""
    seen: list[torch.dtype | None] = []

    def pre(mod: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        floats = [
            t
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        seen.append(floats[0].dtype if floats else None)

    def post(
        mod: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object
    ) -> object:
        dtype = seen.pop() if seen else None
        if dtype is None:
            return output

        def cast(t: object) -> object:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                return t.to(dtype)
            return t

        return tree_map(cast, output)

    module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)  # before fsdp2's cast
    module.register_forward_hook(post, with_kwargs=True)


def cast_buffers(
    model: nn.Module,
    dtype: torch.dtype,
    ignored: set[nn.Module],
    full_precision_classes: tuple[type[nn.Module], ...],
) -> None:
    def walk(m: nn.Module) -> None:
        if m in ignored or isinstance(m, full_precision_classes):
            return
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(m, name, buf.to(dtype))
        for child in m.children():
            walk(child)

    walk(model)
