"""The unit of the wrapper face (``FullyShardedDataParallel``): torch FSDP1's flat
parameter, split as torch FSDP2's ``_fully_shard/`` package splits its unit (the group engine,
the parameters' lifecycle, the gradients):

* ``unit.py`` — ``Unit`` (torch FSDP1's ``FlatParamHandle``): one wrapped module's parameters,
  composed of the four parts below, each owning one concern of the unit's state; builds a unit,
  takes over tensor-parallel parameters at wrap time ([Note: tensor-parallel wrapper units]) and
  the results of ``nn.Module._apply`` (``model.to(dtype)``);
* ``layout.py`` — ``ParamInfo`` (one original parameter's place), torch FSDP1's checks of the
  parameters, ``FlatLayout``: the flat layout, the unit's buffers ([Note: unit buffers]), the
  binding plan, strided parameters ([Note: strided parameters]);
* ``lifecycle.py`` — ``FlatLifecycle``: unshard / reshard, the forward views, what the modules
  show between steps and while a unit stays unsharded ([Note: kept unsharded units]), the full
  parameters of summon_full_params and state dicts;
* ``grads.py`` — ``FlatGrads``: the flat gradient's reduction, no_sync() accumulation, the
  gradient the optimizer and the original parameters see;
* ``writeback.py`` — ``FlatWriteback``: writes to the original parameters carried into the
  flat parameter ([Note: writeback of original parameters]).
* ``streams.py`` — ``FlatStreams``: torch FSDP1's streams, one per wrapper root, shared by
  its units through the device layer ([Note: FSDP1 streams]).

What the modules show of the parameters (binding table, forward views, TP views) is shared
with the ``fully_shard`` unit in ``_runtime/views.py``.  Import from the modules; this package
re-exports nothing.
"""
