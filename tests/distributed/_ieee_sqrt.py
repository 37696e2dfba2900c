"""``install()``: ``torch.Tensor.sqrt`` of float32 rounded as IEEE (through float64) for the
whole worker process.

torch's CPU ``Tensor.sqrt`` is MKL's, within 1 ulp but not correctly rounded; cfsdp.optim's
C Adam step uses the IEEE square root.  With this patch torch.optim's Adam/AdamW computes
cfsdp.optim's bits, so parity workers can compare them bit for bit (nothing else in their
models calls ``Tensor.sqrt``).
"""

import torch

_real_sqrt = torch.Tensor.sqrt


def _ieee_sqrt(self):
    return self.double().sqrt().to(self.dtype) if self.dtype == torch.float32 else _real_sqrt(self)


def install() -> None:
    torch.Tensor.sqrt = _ieee_sqrt
