"""The user-facing layer: what ``fsdp2`` exports from the engine, and the seam the upper
layers read.

``fully_shard`` (``sharding``; each parameter's offload policy: ``offload``), the
``FSDPModule`` mixin every sharded module gains (``module``), ``replicate`` (``replicate``),
the state-dict hooks (``state_dict``) and the
one place the layers built on the engine (``fsdp1/``, ``checkpoint/``, ``planning/``,
``integrations/``) touch its objects (``seam``).

Imports: any wing below (``runtime``, ``replicas``, ``params``, ``comm``, ``support``).
Nothing below imports this wing.
"""
