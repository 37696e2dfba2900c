"""The unit of the composable face (``fully_shard``), split as torch FSDP2's
``_fully_shard/`` package splits it:

* ``unit.py`` — ``ChunkUnit`` (FSDP2's ``FSDPParamGroup``): the layout of one call's
  parameters ([Note: chunk layout]), composed of the three parts below, each owning one
  concern of the unit's state;
* ``param.py`` — ``ChunkParam`` (FSDP2's ``FSDPParam``: one parameter's place in the
  layout, its sharded DTensor's mesh and placements, tensor-parallel and ``dp_mesh_dims``
  parameters), ``DPMesh`` (the data-parallel meshes and groups), ``ShardedParams`` (the
  sharded parameters installed in the modules, taken over when replaced, retyped);
* ``lifecycle.py`` — ``ChunkLifecycle``: unshard / reshard, the registered unsharded
  parameters, the forward views, the requires_grad refresh;
* ``grads.py`` — ``ChunkGrads`` (FSDP2's ``foreach_reduce`` side): reduce-scatter, no-sync
  accumulation, tensor-parallel partial sums, gradient publication and ownership;
* ``group.py`` — ``ChunkUnitGroup``: one call over parameters of several dtypes or meshes.

What the modules show of the parameters (binding table, forward views, TP views) is shared
with the wrapper's unit in ``_runtime/views.py``.  Import from the modules; this package
re-exports nothing.
"""
