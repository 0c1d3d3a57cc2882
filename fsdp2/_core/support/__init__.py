"""Support: what every other wing may use and that uses none of them.

The meshes and their process groups (``mesh``: ``MeshInfo``, ``SPMDMesh``, the per-mesh
caches), the settings a group is driven by (``settings``), what fsdp2 reports (``observe``:
the observers of collectives and memory; ``labels``: profiler ranges; ``debug``: the
debug mode's checks between ranks), the torch releases fsdp2 runs on (``compat``), the
parameters an optimizer must never hold and the step pre-hook that checks them
(``unsharded``), gloo's clean exit (``clean_exit``) and the pipeline schedules' switch
(``pipeline``).

Imports: nothing of ``fsdp2._core`` outside this wing (within it, ``labels`` and ``debug``
use ``observe``); of the package only ``fsdp2.api`` (the policies and comm interfaces).
"""
