"""``cfsdp.optim``: torch's optimizers with cfsdp's fused C step, and ZeRO.

* ``Adam``, ``AdamW``, ``SGD`` (``_fused.py``): ``torch.optim``'s classes whose
  ``step()`` is one C pass over flat buffers (see that module's docstring).
"""

from ._fused import SGD, Adam, AdamW

__all__ = ["Adam", "AdamW", "SGD"]
