"""Replica sharding's engine side: HSDP's gradients and optimizer state in pieces over
the replicas (``fsdp2.replica_optim``).

Where a piece of a parameter's flattened shard lies on a replica rank, the all-gather of the
stepped pieces (``pieces``), a piece as the parameter's ``.grad`` that the standard tools
read exactly and the landing of the reduce-scatter's output (``piece_grad``: ``PieceGrad``),
and what the wrapping optimizer keeps per parameter, its state and clipping over the pieces
(``piece_state``).

Imports: ``params``, ``comm`` and ``support``; ``fsdp2.replica_optim`` and ``fsdp2.clip``
above use it, and the runtime's reductions land their output here.
"""
