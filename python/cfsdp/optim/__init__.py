"""``cfsdp.optim``: torch's optimizers with cfsdp's fused C step, and ZeRO.

* ``Adam``, ``AdamW``, ``SGD`` (``_fused.py``): ``torch.optim``'s classes whose
  ``step()`` is one C pass over flat buffers (see that module's docstring).
* ``Muon`` (``_muon.py``): ``torch.optim.Muon`` with a C momentum pass and torch's
  Newton–Schulz per matrix, on parameters of ndim >= 2, whole, ``fully_shard``'s sharded
  DTensors or the wrapper's shards (``_muon_shard.py``: each matrix gathered to one owner
  rank, orthogonalized there, its chunks scattered back; ``_muon_mesh.py``: the same for
  blocks over several mesh dims; ``_muon_bucket.py``: the exchange in bounded buckets);
  ``_muon_owners.py`` assigns each matrix its owner rank by Newton–Schulz FLOPs.
* ``ZeroRedundancyOptimizer`` (``zero.py``): torch's
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1) with flat rank-major
  buckets synced by one all-gather per dtype (``_zero_buckets.py``) and consolidation by
  flat state buffers (``_zero_state.py``).
* ``reduce_scatter_hook`` (``_zero_hook.py``): optional ZeRO-2 under DDP, a DDP
  communication hook that reduce-scatters each gradient bucket to its owners.
"""

from ._fused import SGD, Adam, AdamW
from ._muon import Muon
from ._zero_hook import reduce_scatter_hook
from .zero import ZeroRedundancyOptimizer

__all__ = ["Adam", "AdamW", "Muon", "SGD", "ZeroRedundancyOptimizer", "reduce_scatter_hook"]
