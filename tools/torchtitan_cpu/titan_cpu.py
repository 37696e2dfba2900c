"""Run torchtitan.train on CPU. torchtitan/tools/utils.py:55 falls back to device_type="cuda"
when no accelerator is present; point it at torch.cpu (+ no-op memory queries) instead."""
import types
import torch
import torchtitan.tools.utils as u

cpu = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
cpu.get_device_name = lambda d=None: "cpu"
cpu.get_device_properties = lambda d=None: types.SimpleNamespace(total_memory=16 * 2**30)
cpu.reset_peak_memory_stats = lambda d=None: None
cpu.empty_cache = lambda: None
cpu.memory_stats = lambda d=None: {}
u.device_type, u.device_module = "cpu", cpu

# torch's FlexAttention has no backward on CPU (torch/nn/attention/flex_attention.py:2082);
# compute the same attention through SDPA (math path) with the BlockMask's dense mask.
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402
from torchtitan.models.common import attention as _att  # noqa: E402


def _dense_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    assert score_mod is None and not return_aux.lse
    dt = q if isinstance(q, DTensor) else None
    ql, kl, vl = (t.to_local() if isinstance(t, DTensor) else t for t in (q, k, v))
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, ql.shape[0], 1, ql.shape[-2], kl.shape[-2], device=ql.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        ql, kl, vl, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    if dt is not None:
        out = DTensor.from_local(out, dt.device_mesh, dt.placements, run_check=False)
    return out, None


# (patch the outer wrapper: --debug.deterministic re-assigns _compiled_flex_attn,
# torchtitan/distributed/utils.py:234)
_att.FlexAttention.compiled_flex_attn = staticmethod(_dense_flex)

# gloo has no ReduceOp.PREMUL_SUM, which torch's FSDP2 picks for set_gradient_divide_factor(1.0)
# (torchtitan/distributed/fsdp.py:316 -> :41). Force SUM reductions too: dividing by 1.0 is a no-op.
import torchtitan.distributed.fsdp as _tt_fsdp  # noqa: E402

_orig_disable = _tt_fsdp.disable_fsdp_gradient_division


def _disable_and_force_sum(model):
    _orig_disable(model)
    for m in model.modules():
        if isinstance(m, _tt_fsdp.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


_tt_fsdp.disable_fsdp_gradient_division = _disable_and_force_sum

# torchtitan/distributed/utils.py:586 passes device_module.current_device() ("cpu" from torch.cpu)
# to barrier(device_ids=...), and :595 calls torch.distributed.set_timeout, which torch 2.13.0
# does not have: keep only the barrier (timeouts stay at their init value).
import torchtitan.distributed.utils as _tt_du  # noqa: E402

_tt_du.set_pg_timeouts = lambda timeout, parallel_dims: torch.distributed.barrier()

# Print full-precision loss / grad_norm (rank 0) and which fully_shard torchtitan uses.
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402

_orig_log = MetricsProcessor.log


def _log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k):
    if torch.distributed.get_rank() == 0:
        print(f"EXACT step={step} loss={float(global_avg_loss)!r} max_loss={float(global_max_loss)!r} "
              f"grad_norm={float(grad_norm)!r} fully_shard={_tt_fsdp.fully_shard.__module__}", flush=True)
    return _orig_log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k)


MetricsProcessor.log = _log

from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    main()
