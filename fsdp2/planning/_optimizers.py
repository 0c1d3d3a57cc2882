"""Optimizers ``fsdp2 estimate`` (fsdp2/cli/_estimate.py) hands :func:`fsdp2.estimate_memory`
for ``--optim-dtype`` and ``--optimizer muon``: builders ``params -> Optimizer`` whose state is
what training keeps."""

from __future__ import annotations

from typing import Any

import torch


def states_in(kind: str, dtype: Any, over_replicas: bool = False) -> Any:
    """An optimizer that keeps ``kind``'s state (AdamW's and Adam's two moments, SGD's
    momentum) in ``dtype`` whatever the parameters' dtype: what the estimate needs of
    ``--optim-dtype`` (fp32 moments of bf16 parameters, as torchao's and Megatron's
    optimizers keep them). Its step only writes the state (the update's bytes are the
    parameters'). ``over_replicas``: wrapped by ``shard_over_replicas`` (it is elementwise)."""
    if kind == "sgd":  # plain SGD keeps no state
        return kind
    moments = ("exp_avg", "exp_avg_sq")  # adamw, adam

    class StatesIn(torch.optim.Optimizer):
        def __init__(self, params: list[Any]) -> None:
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    for name in moments:
                        if name not in state:
                            state[name] = torch.zeros_like(p, dtype=dtype)
                        state[name].add_(p.grad.to(dtype))

    if not over_replicas:
        return StatesIn
    from fsdp2.replica_optim import shard_over_replicas

    return lambda params: shard_over_replicas(StatesIn(params), elementwise=True)


def muon_and_adamw(model: Any) -> Any:
    """``estimate_memory``'s optimizer for ``--optimizer muon``: ``fsdp2.optim.Muon`` on the
    hidden matrices and AdamW on the rest (embeddings, the output head, norms, biases), as
    ``muon_param_groups`` splits them and a Muon training script steps them."""
    from fsdp2.optim import Muon, muon_param_groups

    muon_groups, _ = muon_param_groups(model)
    muon_ids = {id(p) for p in muon_groups[0]["params"]}
    # estimate_memory builds the optimizer from its own copy's trainable parameters, in
    # model.parameters() order: which of them are Muon's is read off the original's order.
    is_muon = [id(p) in muon_ids for p in model.parameters() if p.requires_grad]

    class MuonAndAdamW(torch.optim.Optimizer):
        """Two optimizers stepped as one (estimate_memory steps one); ``state`` holds
        both's, which is where the estimate finds the optimizer state."""

        def __init__(self, params: list[Any]) -> None:
            if len(params) != len(is_muon):
                raise ValueError("--optimizer muon: the model's parameters changed")
            muon = [p for p, m in zip(params, is_muon, strict=True) if m]
            adamw = [p for p, m in zip(params, is_muon, strict=True) if not m]
            super().__init__([{"params": muon}, {"params": adamw}], {})
            self.parts: list[torch.optim.Optimizer] = []
            if muon:
                self.parts.append(Muon(muon))
            if adamw:
                self.parts.append(torch.optim.AdamW(adamw))

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for opt in self.parts:
                opt.step()
            for opt in self.parts:
                self.state.update(opt.state)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for opt in self.parts:
                opt.zero_grad(set_to_none=set_to_none)

    return MuonAndAdamW
