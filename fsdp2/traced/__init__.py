"""fsdp2's traced mode (first slice): the all-gathers and reduce-scatters as graph ops.

``fully_shard_traced(module, mesh=...)`` shards ``module``'s parameters as eager
``fully_shard`` does (DTensors of its placements on the same mesh: FSDP, HSDP on a 2D mesh,
FSDP + TP; the same ``state_dict``), but gathers each parameter where the module reads it
(``module.weight``), through torch's functional collectives (``torch.ops._c10d_functional``)
inside a small autograd function whose backward reduce-scatters the gradient (and, HSDP,
all-reduces it). There is no hook and no storage move per step, so
``torch.compile(model, fullgraph=True)`` captures the collectives in the forward and
backward graphs; ``set_requires_gradient_sync(False)`` picks a gather whose backward does
not communicate. docs/compile.md, "Traced mode".
"""

from fsdp2.traced._module import TracedModule
from fsdp2.traced._shard import fully_shard_traced

__all__ = ["TracedModule", "fully_shard_traced"]
