"""The step's runtime: one root's step through its tree of ``fully_shard`` states.

Per-call hooks and lazy init (``state``: ``FSDPState``), one call's place in the step and
its legal moves (``slot``), what one root shares with every state (``step``:
``StepContext``, prefetch, the final callback), gradients from the unsharded parameters to
the sharded ones (``reduce``), double backward (``higher_order``), parameters that change
under a group (``relayout``: ``.to()``, ``to_empty``, ``requires_grad_``) and the checks a
root runs over its tree (``tree_checks``).

Imports: ``replicas``, ``params``, ``comm`` and ``support``.
"""
