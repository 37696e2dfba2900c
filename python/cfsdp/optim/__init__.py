"""``cfsdp.optim``: torch's optimizers with cfsdp's fused C step, and ZeRO.

* ``Adam``, ``AdamW``, ``SGD`` (``_fused.py``): ``torch.optim``'s classes whose
  ``step()`` is one C pass over flat buffers (see that module's docstring).
* ``ZeroRedundancyOptimizer`` (``zero.py``): torch's
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1) with flat rank-major
  buckets synced by one all-gather per dtype (``_zero_buckets.py``) and consolidation by
  flat state buffers (``_zero_state.py``).
"""

from ._fused import SGD, Adam, AdamW
from .zero import ZeroRedundancyOptimizer

__all__ = ["Adam", "AdamW", "SGD", "ZeroRedundancyOptimizer"]
