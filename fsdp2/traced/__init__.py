"""fsdp2's traced mode (first slice): the all-gathers and reduce-scatters as graph ops.

``fully_shard_traced(module, mesh=...)`` shards ``module``'s parameters as eager
``fully_shard`` does (``Shard(0)`` DTensors on the same mesh, the same ``state_dict``), but
gathers each parameter where the module reads it (``module.weight``), through torch's
functional collectives (``torch.ops._c10d_functional``) inside a small autograd function
whose backward reduce-scatters the gradient. There is no hook, no storage move and no
Python-side state per step, so ``torch.compile(model, fullgraph=True)`` captures the
collectives in the forward and backward graphs. docs/compile.md, "Traced mode".
"""

from fsdp2.traced._module import TracedModule
from fsdp2.traced._shard import fully_shard_traced

__all__ = ["TracedModule", "fully_shard_traced"]
