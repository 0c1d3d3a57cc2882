"""Parameter storage: one parameter, one group of them, and their buffers.

A managed parameter's shard and unsharded copy (``param``: ``FSDPParam``), a group's flat
sharded buffer, unsharded buffers and registrations (``layout``: ``GroupLayout``), the group
itself with its unshard / wait / reshard and release (``group``: ``ParamGroup``), where each
parameter goes (``placement``: ``shard_placement_fn``, per-parameter meshes), the copy kept
on a smaller mesh between forward and backward (``small_shard``: ``reshard_after_forward=k``),
tensor-subclass all-gather extensions (``extension``), where the sharded state lives between
the phases of a step under CPU offload (``residence``), a group's dtypes and each parameter's
gradient dtype policy (``dtypes``) and freeing storage in place (``storage``).

Imports: ``comm`` and ``support``. Nothing here knows the step: a group is driven from
above (the runtime wing).
"""
