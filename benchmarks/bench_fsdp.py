"""Step-time and memory benchmark: cfsdp against torch's FSDP1, FSDP2 and DDP.

Launch with torchrun (gloo, CPU), e.g.::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \\
        benchmarks/bench_fsdp.py --model all --warmup 3 --iters 10 \\
        --out benchmarks/out/bench.json

One invocation runs every contender, one after another, on the same model,
seed and data:

* ``local`` -- a plain single-process step on the per-rank batch (no
  communication): the floor.  Run first, in the cleanest process (later
  contenders start from a higher RSS, see Memory below).
* ``cfsdp`` -- ``cfsdp.FullyShardedDataParallel``, one unit per block.
* ``fsdp1`` -- ``torch.distributed.fsdp.FullyShardedDataParallel``, same wrapping.
* ``fsdp2`` -- ``torch.distributed.fsdp.fully_shard`` on each block, then the root.
* ``cfsdp_fs`` -- ``cfsdp.fully_shard``, applied exactly as ``fsdp2``.
* ``ddp``   -- ``DistributedDataParallel``; the loss reference.

A step is forward, cross-entropy, backward, AdamW step, zero_grad.  Each step
is timed on every rank after a ``dist.barrier()``; a step's time is the max
over ranks; a contender's time is the median over the timed steps.

Memory: before each contender, garbage is collected, freed heap is trimmed
(``malloc_trim``) and the RSS high-water mark is reset (write ``5`` to
``/proc/self/clear_refs``).  Peak RSS is VmHWM after the contender (build and
wrap included: the full model exists on every rank before it is sharded);
growth is that peak minus the RSS at the contender's start (the process keeps
some memory from earlier contenders, so later ones start higher).  RSS also
counts freed memory the allocator keeps, so the table adds the bytes of live
tensor storages (params, grads, optimizer state) after the last step, less
those alive at the contender's start (torch's FSDP1 leaves its sharded flat
params alive after the model is deleted).  All are max over ranks; the JSON
also has the peak RSS over the timed steps alone.

Rank 0 prints a markdown table per model and writes everything (per-step
times and losses included) as JSON to ``--out``.

Two switches change what the contenders run (defaults: fp32, FULL_SHARD):

* ``--mp bf16`` -- bf16 mixed precision.  cfsdp and FSDP1 get
  ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)``,
  FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``; DDP and
  local run forward and loss under ``torch.autocast("cpu", dtype=bf16)``.
  Their numerics differ, so the sharded contenders are checked against DDP
  with a loose tolerance and against FSDP1 (cfsdp: bitwise).
* ``--strategy hybrid`` -- HSDP on a ``(world / shard_size, shard_size)``
  mesh: cfsdp and FSDP1 with ``HYBRID_SHARD`` and ``device_mesh=mesh``, FSDP2
  ``fully_shard(..., mesh=mesh)`` on the 2-D mesh; DDP and local unchanged.

* ``--tp DP,TP`` -- 2-D training: every contender's model first goes through
  tensor parallelism on the ``tp`` dimension of a ``(DP, TP)`` mesh
  (``models.parallelize_tp``), then data parallelism on ``dp``: cfsdp and FSDP1
  with ``device_mesh=mesh["dp"]``, FSDP2 and ``cfsdp_fs`` with
  ``mesh=mesh["dp"]``, DDP with ``device_mesh=mesh["dp"]`` (torch's own
  ``_pre_dp_module_transform``).  ``local`` becomes the TP-only floor (the
  tensor-parallel step with no data parallelism: overhead is what data
  parallelism adds above it), and one more contender runs: ``cfsdp_ddp`` --
  ``cfsdp.pre_dp_module_transform`` then DDP on the ``dp`` group (its losses
  are checked against DDP's).  The ranks of one TP group train on the same
  rows (the batch follows the ``dp`` rank).  Not combined with ``--mp`` or
  ``--strategy hybrid``.

* ``--compile BACKEND`` -- every contender's model is compiled after wrapping,
  ``torch.compile(model, backend=BACKEND)`` with dynamo's defaults (``fullgraph=False``;
  ``torch._dynamo.reset()`` before each contender, so no compiled code or recompile
  budget is carried over).  cfsdp and FSDP1 then wrap with ``use_orig_params=True``:
  dynamo compiles nothing inside FSDP-managed modules with ``use_orig_params=False``
  (torch's and cfsdp's alike), so a compiled run with ``False`` would time eager steps.
  The hooks of every sharded contender run eagerly between the compiled blocks (see the
  README's ``torch.compile`` section).  Compilation happens in the first warmup step,
  whose time the JSON keeps as ``first_step_s``.  Not combined with ``--tp``.

``--set KEY=VALUE`` overrides a model config field (e.g. ``n_layer=4``), for
runs with more ranks than cores.  The loss is always computed on fp32 logits
(``logits.float()``, a no-op in fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import (
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import (  # noqa: E402
    GPTConfig,
    ModelConfig,
    SmallConfig,
    build_model,
    config_dict,
    make_batch,
    parallelize_tp,
    wrap_unit_class,
)

CONTENDERS = ("local", "cfsdp", "cfsdp_fs", "fsdp1", "fsdp2", "ddp", "cfsdp_ddp")
TP_ONLY = ("cfsdp_ddp",)  # contenders that run only under --tp
SHARDED = ("cfsdp", "cfsdp_fs", "fsdp1", "fsdp2")
CFSDP_CONTENDERS = ("cfsdp", "cfsdp_fs")
# cfsdp.optim.AdamW against torch's: the same states bit for bit, parameters a few ulps
# apart per step (torch's CPU sqrt is MKL's 1-ulp one, cfsdp's the IEEE one), so cfsdp's
# losses are held to this bound instead of bitwise equality when it runs its own AdamW
# (the 64-block "small" model drifts up to 1.5e-5 relative in 8 steps)
LOSS_RTOL_OPTIM = 1e-4
MODELS: dict[str, ModelConfig] = {"gpt2": GPTConfig(), "small": SmallConfig()}
LOSS_RTOL = 1e-4  # sharded contenders vs DDP, relative, on every step
# --mp bf16: DDP runs under autocast, the sharded contenders under FSDP mixed
# precision (bf16 parameters in compute, bf16 gradient reduction): different
# numerics, so only a loose agreement is expected; the same loose bound holds
# FSDP2 against FSDP1.  cfsdp against FSDP1 is always expected to be bitwise.
LOSS_RTOL_MP = 2e-2
MP_DTYPES = {"none": None, "bf16": torch.bfloat16}
STRATEGIES = ("full", "hybrid")
COMPILE_BACKENDS = ("eager", "aot_eager", "inductor")  # what torch.compile supports on CPU
SEED = 0
LR = 1e-3


# --------------------------------------------------------------------------
# process memory


def _read_status_kib(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmHWM``), in KiB."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key} field")
    return int(match.group(1))


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark; False if the kernel refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def live_tensor_bytes() -> int:
    """Bytes of the tensor storages reachable from Python objects, overlapping
    storages counted once.

    Counts parameters, gradients, optimizer state and buffers a wrapper keeps
    as Python attributes; misses memory held only in C++ and the allocator's
    retained free memory (which RSS includes).  Storages are merged by address
    range, not by start address: a buffer and the DLPack aliases of its pieces
    (cfsdp's sharded parameters and flat optimizer states) are distinct storage
    objects over the same bytes.
    """
    ranges: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), FakeTensor):
            # type(): no __class__ lookup, no warnings; FakeTensors (kept by --compile's
            # compiled code) have no memory and warn on data_ptr()
            try:
                storage = obj.untyped_storage()
                ptr, n = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor)
                continue
            if ptr and n:
                ranges[ptr] = max(n, ranges.get(ptr, 0))
    total, end = 0, 0
    for ptr in sorted(ranges):
        lo, hi = max(ptr, end), ptr + ranges[ptr]
        if hi > lo:
            total += hi - lo
            end = hi
    return total


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --------------------------------------------------------------------------
# contenders


def _cfsdp_module() -> Any:
    """Import cfsdp lazily: it may be missing or not built yet."""
    import cfsdp

    return cfsdp


@dataclass
class Setup:
    """What every contender of a run shares: precision and sharding strategy."""

    mp: str = "none"  # key of MP_DTYPES
    strategy: str = "full"  # one of STRATEGIES
    mesh: DeviceMesh | None = None  # 2-D (replicate, shard) mesh for "hybrid"
    cfsdp_optim: str = "cfsdp"  # AdamW of cfsdp's contenders: "cfsdp" or "torch"
    tp_mesh: DeviceMesh | None = None  # 2-D ("dp", "tp") mesh of a --tp run
    compile: str | None = None  # torch.compile backend applied after wrapping (--compile)

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The data-parallel sub-mesh of a ``--tp`` run (None otherwise)."""
        return self.tp_mesh["dp"] if self.tp_mesh is not None else None

    def data_rank(self) -> int:
        """Whose rows this rank trains on: its rank, or under ``--tp`` its ``dp`` rank (the
        ranks of one TP group must see the same rows)."""
        dp = self.dp_mesh
        return dp.get_local_rank() if dp is not None else dist.get_rank()

    @property
    def mp_dtype(self) -> torch.dtype | None:
        return MP_DTYPES[self.mp]


def _wrap_policy(cfg: ModelConfig) -> ModuleWrapPolicy:
    """One FSDP unit per block (plus the root's own unit)."""
    return ModuleWrapPolicy({wrap_unit_class(cfg)})


def _fsdp1_kwargs(setup: Setup) -> dict[str, Any]:
    """Precision and strategy arguments shared by cfsdp and torch FSDP1
    (empty in the default run, so that run is unchanged)."""
    kwargs: dict[str, Any] = {}
    dtype = setup.mp_dtype
    if dtype is not None:
        kwargs["mixed_precision"] = MixedPrecision(
            param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype
        )
    if setup.strategy == "hybrid":
        kwargs["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
        kwargs["device_mesh"] = setup.mesh
    if setup.dp_mesh is not None:  # FSDP1's DTensor extension: shard over dp, TP kept
        kwargs["device_mesh"] = setup.dp_mesh
    return kwargs


def wrap_cfsdp(model: nn.Module, cfg: ModelConfig, setup: Setup) -> nn.Module:
    return _cfsdp_module().FullyShardedDataParallel(
        model,
        auto_wrap_policy=_wrap_policy(cfg),
        use_orig_params=setup.compile is not None,  # dynamo compiles nothing under False
        device_id=torch.device("cpu"),
        **_fsdp1_kwargs(setup),
    )


def wrap_fsdp1(model: nn.Module, cfg: ModelConfig, setup: Setup) -> nn.Module:
    return TorchFSDP(
        model,
        auto_wrap_policy=_wrap_policy(cfg),
        use_orig_params=setup.compile is not None,  # dynamo compiles nothing under False
        device_id=torch.device("cpu"),  # torch refuses a CPU-only machine without it
        **_fsdp1_kwargs(setup),
    )


def wrap_fsdp2(model: nn.Module, cfg: ModelConfig, setup: Setup, shard: Callable = fully_shard) -> nn.Module:
    kwargs: dict[str, Any] = {}
    dtype = setup.mp_dtype
    if dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if setup.strategy == "hybrid":
        kwargs["mesh"] = setup.mesh  # 2-D mesh: HSDP (replicate dim 0, shard dim 1)
    if setup.dp_mesh is not None:
        kwargs["mesh"] = setup.dp_mesh
    for module in model.modules():
        if isinstance(module, wrap_unit_class(cfg)):
            shard(module, **kwargs)
    return shard(model, **kwargs)


def wrap_cfsdp_fs(model: nn.Module, cfg: ModelConfig, setup: Setup) -> nn.Module:
    return wrap_fsdp2(model, cfg, setup, shard=_cfsdp_module().fully_shard)


def wrap_ddp(model: nn.Module, cfg: ModelConfig, setup: Setup) -> nn.Module:
    if setup.dp_mesh is not None:  # calls torch's _pre_dp_module_transform itself
        return DistributedDataParallel(model, device_mesh=setup.dp_mesh)
    return DistributedDataParallel(model)


def wrap_cfsdp_ddp(model: nn.Module, cfg: ModelConfig, setup: Setup) -> nn.Module:
    """DDP on a tensor-parallel model through ``cfsdp.pre_dp_module_transform``."""
    if setup.dp_mesh is None:
        raise ValueError("cfsdp_ddp runs only under --tp")
    _cfsdp_module().pre_dp_module_transform(model)
    return DistributedDataParallel(model, process_group=setup.dp_mesh.get_group())


def wrap_local(model: nn.Module, cfg: ModelConfig, setup: Setup) -> nn.Module:
    return model


# contender name -> wrap(fresh model, config, setup) -> the module to train
WRAPPERS: dict[str, Callable[[nn.Module, ModelConfig, Setup], nn.Module]] = {
    "local": wrap_local,
    "cfsdp": wrap_cfsdp,
    "fsdp1": wrap_fsdp1,
    "fsdp2": wrap_fsdp2,
    "cfsdp_fs": wrap_cfsdp_fs,
    "ddp": wrap_ddp,
    "cfsdp_ddp": wrap_cfsdp_ddp,
}


def check_preconditions(name: str) -> None:
    """Raise here, before any collective, what would otherwise fail mid-step."""
    if name == "cfsdp":
        cfsdp = _cfsdp_module()
        if not hasattr(cfsdp, "FullyShardedDataParallel"):
            raise ImportError(
                f"cfsdp {cfsdp_version()} ({cfsdp.__file__}) has no FullyShardedDataParallel"
            )


# --------------------------------------------------------------------------
# one contender


@dataclass
class Outcome:
    """What one rank measured for one contender (before the cross-rank reduce)."""

    wrap_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # timed steps only
    losses: list[float] = field(default_factory=list)  # every step, warmup included
    start_rss_kib: int = 0  # RSS right after the high-water mark was reset
    peak_rss_kib: int = 0  # high-water mark over the whole contender
    steps_rss_kib: int = 0  # high-water mark over the timed steps only
    live_bytes: int = 0  # tensor storages after the last step minus those at the start
    first_step_s: float = 0.0  # the first warmup step (it compiles under --compile)
    error: str | None = None


def train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Forward, cross-entropy, backward, optimizer step, zero_grad.

    With ``autocast_dtype``, forward and loss run under CPU autocast.  The
    loss is taken on fp32 logits (a no-op in fp32 runs; under mixed precision
    the logits are bf16 and a bf16 loss would hide differences).
    """
    ctx = (
        torch.autocast("cpu", dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with ctx:
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def make_optim(name: str, model: nn.Module, setup: Setup) -> torch.optim.Optimizer:
    """AdamW: cfsdp's fused ``cfsdp.optim.AdamW`` for cfsdp's contenders (``--cfsdp-optim
    cfsdp``, the default), torch's default ``torch.optim.AdamW`` for everyone else."""
    if name in CFSDP_CONTENDERS and setup.cfsdp_optim == "cfsdp":
        return _cfsdp_module().optim.AdamW(model.parameters(), lr=LR)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def run_contender(
    name: str, cfg: ModelConfig, warmup: int, iters: int, setup: Setup | None = None
) -> Outcome:
    """Build, wrap, warm up and time one contender on this rank."""
    setup = setup or Setup()
    # mixed precision: the sharded contenders get it from their wrapper, the
    # unsharded ones (DDP, local) from autocast around forward and loss
    autocast_dtype = None if name in SHARDED else setup.mp_dtype
    out = Outcome()
    rank = dist.get_rank()
    release_memory()
    reset_peak_rss()
    out.start_rss_kib = _read_status_kib("VmRSS")
    start_live_bytes = live_tensor_bytes()  # tensors earlier contenders left behind
    try:
        check_preconditions(name)
        model = build_model(cfg, SEED)
        if setup.tp_mesh is not None:  # every contender, the TP-only floor included
            parallelize_tp(model, setup.tp_mesh["tp"])
        dist.barrier()
        t0 = time.perf_counter()
        model = WRAPPERS[name](model, cfg, setup)
        out.wrap_s = time.perf_counter() - t0
        optim = make_optim(name, model, setup)
        if setup.compile is not None:
            torch._dynamo.reset()  # nothing compiled for an earlier contender is reused
            model = torch.compile(model, backend=setup.compile)
        setup_peak_kib = 0
        for step in range(warmup + iters):
            if step == warmup:  # set-up peak (build, wrap, warmup) apart from steady state
                setup_peak_kib = _read_status_kib("VmHWM")
                reset_peak_rss()
            x, y = make_batch(cfg, SEED, setup.data_rank(), step)
            dist.barrier()
            t0 = time.perf_counter()
            loss = train_step(model, optim, x, y, autocast_dtype)
            dt = time.perf_counter() - t0
            out.losses.append(loss.item())
            if step == 0:
                out.first_step_s = dt
            if step >= warmup:
                out.step_s.append(dt)
        out.steps_rss_kib = _read_status_kib("VmHWM")
        out.peak_rss_kib = max(setup_peak_kib, out.steps_rss_kib)
        out.live_bytes = live_tensor_bytes() - start_live_bytes
        del model, optim
    except Exception as e:  # recorded, the run goes on with the next contender
        out.error = f"{type(e).__name__}: {e}"
        print(f"[rank {rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    release_memory()
    return out


def reduce_outcome(out: Outcome, warmup: int, iters: int, rss_reset: bool) -> dict[str, Any]:
    """Combine all ranks' outcomes into one result (same on every rank).

    A failure on any rank fails the contender everywhere, so every rank takes
    the same branch (and issues the same collectives) from here on.
    """
    world = dist.get_world_size()  # under --tp a TP group's ranks share their loss
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, out.error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        return {"error": "; ".join(f"rank {r}: {e}" for r, e in failed)}
    step_s = torch.tensor(out.step_s, dtype=torch.float64)
    losses = torch.tensor(out.losses, dtype=torch.float64)
    scalars = torch.tensor(
        [
            out.wrap_s,
            out.start_rss_kib,
            out.peak_rss_kib,
            out.steps_rss_kib,
            out.peak_rss_kib - out.start_rss_kib,
            out.live_bytes,
            out.first_step_s,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # per step: the slowest rank
    dist.all_reduce(scalars, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    losses /= world  # per step: the mean loss over the global batch
    return {
        "step_ms": statistics.median(step_s.tolist()) * 1e3,
        "step_ms_all": [t * 1e3 for t in step_s.tolist()],
        "wrap_s": scalars[0].item(),
        "start_rss_mib": scalars[1].item() / 1024,
        "peak_rss_mib": scalars[2].item() / 1024,
        "steps_peak_rss_mib": scalars[3].item() / 1024,
        "rss_growth_mib": scalars[4].item() / 1024,
        "live_tensor_mib": scalars[5].item() / 2**20,
        "first_step_s": scalars[6].item(),
        "rss_reset": rss_reset,
        "losses": losses.tolist(),
        "final_loss": losses[-1].item(),
        "warmup": warmup,
        "iters": iters,
    }


def _max_rel_diff(losses: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))


def add_ratios(results: dict[str, dict[str, Any]], mp: str = "none", cfsdp_optim: str = "torch") -> list[str]:
    """Fill overhead and ratios in place; return warnings on loss disagreement.

    Every sharded contender is compared with DDP (``LOSS_RTOL``, or the loose
    ``LOSS_RTOL_MP`` under mixed precision, where DDP runs under autocast) and
    with torch FSDP1 (cfsdp: bitwise; FSDP2: ``LOSS_RTOL_MP`` under mixed
    precision, ``LOSS_RTOL`` otherwise); cfsdp's ``fully_shard`` also with
    torch FSDP2 (bitwise).  With cfsdp's own AdamW (``cfsdp_optim="cfsdp"``) cfsdp's
    bitwise checks become ``LOSS_RTOL_OPTIM`` (``LOSS_RTOL_MP`` under mixed precision).
    """
    exact = 0.0 if cfsdp_optim == "torch" else (LOSS_RTOL_OPTIM if mp == "none" else LOSS_RTOL_MP)
    ok = {k: v for k, v in results.items() if "error" not in v}
    local = ok.get("local", {}).get("step_ms")
    fsdp2 = ok.get("fsdp2", {}).get("step_ms")
    for res in ok.values():
        res["overhead_ms"] = res["step_ms"] - local if local is not None else None
        res["ratio_vs_fsdp2"] = res["step_ms"] / fsdp2 if fsdp2 else None
    fsdp2_over = ok.get("fsdp2", {}).get("overhead_ms")
    for res in ok.values():
        over = res.get("overhead_ms")
        usable = over is not None and fsdp2_over is not None and fsdp2_over > 0
        res["overhead_ratio_vs_fsdp2"] = over / fsdp2_over if usable else None

    warnings: list[str] = []
    ref = ok.get("ddp", {}).get("losses")
    rtol_ddp = LOSS_RTOL if mp == "none" else LOSS_RTOL_MP
    for name in SHARDED:
        if name not in ok:
            continue
        if ref is None:
            warnings.append(f"WARNING: no DDP reference; {name}'s losses are unchecked")
            continue
        rel = _max_rel_diff(ok[name]["losses"], ref)
        ok[name]["max_rel_loss_diff_vs_ddp"] = rel
        if rel > rtol_ddp:
            warnings.append(
                f"WARNING: {name} losses differ from DDP's by up to {rel:.3e} "
                f"relative (> {rtol_ddp:g})"
            )
    fsdp1 = ok.get("fsdp1", {}).get("losses")
    for name in SHARDED:
        if name not in ok or fsdp1 is None:
            continue
        rel = _max_rel_diff(ok[name]["losses"], fsdp1)
        ok[name]["max_rel_loss_diff_vs_fsdp1"] = rel
        rtol = exact if name == "cfsdp" else (LOSS_RTOL if mp == "none" else LOSS_RTOL_MP)
        if rel > rtol:
            what = "not bitwise equal to FSDP1's" if rtol == 0.0 else "differ from FSDP1's"
            warnings.append(
                f"WARNING: {name} losses {what}: up to {rel:.3e} relative (> {rtol:g})"
            )
    fsdp2_losses = ok.get("fsdp2", {}).get("losses")
    if "cfsdp_fs" in ok and fsdp2_losses is not None:
        rel = _max_rel_diff(ok["cfsdp_fs"]["losses"], fsdp2_losses)
        ok["cfsdp_fs"]["max_rel_loss_diff_vs_fsdp2"] = rel
        if rel > exact:
            warnings.append(f"WARNING: cfsdp_fs losses differ from FSDP2's: up to {rel:.3e} "
                            f"relative (> {exact:g})")
    if "cfsdp_ddp" in ok and ref is not None:  # the same DDP, torch's AdamW: bitwise
        rel = _max_rel_diff(ok["cfsdp_ddp"]["losses"], ref)
        ok["cfsdp_ddp"]["max_rel_loss_diff_vs_ddp"] = rel
        if rel > 0.0:
            warnings.append(f"WARNING: cfsdp_ddp losses not bitwise equal to DDP's: up to "
                            f"{rel:.3e} relative")
    return warnings


# --------------------------------------------------------------------------
# reporting


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(results: dict[str, dict[str, Any]], vs_fsdp1: bool = False) -> str:
    """One row per contender; failed contenders show their error.

    ``vs_fsdp1`` adds a last column, the max relative loss difference against
    torch FSDP1 (shown for ``--mp``/``--strategy`` runs; the default table is
    unchanged).
    """
    head = (
        "| contender | step ms (median) | overhead ms (step - local) | step / fsdp2 "
        "| overhead / fsdp2 overhead | peak RSS MiB | peak - start RSS MiB "
        "| live tensors MiB | wrap s | final loss | max rel loss diff vs ddp |"
        + (" max rel loss diff vs fsdp1 |" if vs_fsdp1 else "")
        + "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|" if vs_fsdp1 else "")
    )
    rows = [head]
    for name, res in results.items():
        if "error" in res:
            error = res["error"].replace("|", "\\|").replace("\n", " ")
            rows.append(f"| {name} | error: {error} ||||||||||" + ("|" if vs_fsdp1 else ""))
            continue
        flag = "" if res["rss_reset"] else " (*)"
        row = (
            f"| {name} | {res['step_ms']:.1f} | {_fmt(res.get('overhead_ms'), '.1f')} "
            f"| {_fmt(res.get('ratio_vs_fsdp2'), '.2f')} "
            f"| {_fmt(res.get('overhead_ratio_vs_fsdp2'), '.2f')} "
            f"| {res['peak_rss_mib']:.0f}{flag} | {res['rss_growth_mib']:.0f}{flag} "
            f"| {res['live_tensor_mib']:.1f} "
            f"| {res['wrap_s']:.3f} | {res['final_loss']:.6f} "
            f"| {_fmt(res.get('max_rel_loss_diff_vs_ddp'), '.1e')} |"
        )
        if vs_fsdp1:
            row += f" {_fmt(res.get('max_rel_loss_diff_vs_fsdp1'), '.1e')} |"
        rows.append(row)
    return "\n".join(rows)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        return match.group(1).strip() if match else "unknown"
    except OSError:
        return "unknown"


def cfsdp_version() -> str:
    """``<version> (backend <c|python>)`` of the installed cfsdp, or why not."""
    try:
        cfsdp = _cfsdp_module()
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"
    try:
        from importlib.metadata import version

        ver = version("cfsdp")
    except Exception:
        ver = getattr(cfsdp, "__version__", "unknown")
    return f"{ver} (backend {getattr(cfsdp, 'backend', 'unknown')})"


def machine_info_basic() -> dict[str, Any]:
    """Machine, versions, date and launch command (shared by every benchmark)."""
    return {
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cfsdp": cfsdp_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads_per_rank": torch.get_num_threads(),
        "command": "torchrun --standalone --nproc_per_node "
        f"{dist.get_world_size()} " + " ".join(sys.argv),
    }


def machine_info(args: argparse.Namespace, rss_reset: bool, setup: Setup) -> dict[str, Any]:
    return {
        **machine_info_basic(),
        "rss_reset": rss_reset,
        "warmup": args.warmup,
        "iters": args.iters,
        "mixed_precision": setup.mp,
        "cfsdp_optim": setup.cfsdp_optim,
        "strategy": setup.strategy,
        "mesh_shape": list(setup.mesh.mesh.shape) if setup.mesh is not None else None,
        "tp_mesh_shape": list(setup.tp_mesh.mesh.shape) if setup.tp_mesh is not None else None,
        "compile": setup.compile,
        "config_overrides": args.set,
    }


# --------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated subset of {','.join(CONTENDERS)} (run in that order)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--mp",
        choices=list(MP_DTYPES),
        default="none",
        help="mixed precision: bf16 = FSDP MixedPrecision / FSDP2 MixedPrecisionPolicy for "
        "the sharded contenders, torch.autocast for ddp and local",
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="full",
        help="full = FULL_SHARD over all ranks; hybrid = HSDP on a "
        "(world / shard-size, shard-size) mesh (HYBRID_SHARD, FSDP2 on the 2-D mesh)",
    )
    p.add_argument(
        "--shard-size", type=int, default=2, help="ranks per shard group for --strategy hybrid"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an integer model config field (e.g. n_layer=4) in every selected "
        "model that has it; repeatable",
    )
    p.add_argument(
        "--tp", default=None, metavar="DP,TP",
        help="2-D training on a (DP, TP) mesh: tensor parallelism on tp, then each contender's "
        "data parallelism on dp (DP * TP = world size); adds the cfsdp_ddp contender",
    )
    p.add_argument(
        "--compile", default=None, metavar="BACKEND", choices=COMPILE_BACKENDS,
        help=f"torch.compile every contender after wrapping with this backend "
        f"({', '.join(COMPILE_BACKENDS)}); the wrappers then use use_orig_params=True",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, s")
    p.add_argument(
        "--cfsdp-optim", choices=["cfsdp", "torch"], default="cfsdp",
        help="AdamW of cfsdp's contenders: cfsdp.optim.AdamW (fused C step over each flat "
        "shard) or torch.optim.AdamW (torch's contenders always run torch's default AdamW)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/bench.json"))
    args = p.parse_args()
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        p.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    args.contenders = [c for c in CONTENDERS if c in names]
    if args.tp is not None:
        try:
            dp, tp = (int(v) for v in args.tp.split(","))
        except ValueError:
            p.error(f"--tp {args.tp!r}: expected DP,TP (two integers)")
        if dp < 1 or tp < 1:
            p.error(f"--tp {args.tp!r}: both sizes must be at least 1")
        if args.mp != "none" or args.strategy != "full":
            p.error("--tp is not combined with --mp or --strategy hybrid")
        if args.compile is not None:
            p.error("--tp is not combined with --compile")
        args.tp = (dp, tp)
    else:
        named = [c for c in args.contenders if c in TP_ONLY]
        if named and names != list(CONTENDERS):  # asked for by name, not by the default
            p.error(f"contenders {named} run only under --tp")
        args.contenders = [c for c in args.contenders if c not in TP_ONLY]
    if args.iters < 1:
        p.error("--iters must be at least 1")
    if args.shard_size < 1:
        p.error("--shard-size must be at least 1")
    model_names = list(MODELS) if args.model == "all" else [args.model]
    args.configs = {}
    overrides: dict[str, int] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        try:
            overrides[key.strip()] = int(value)
        except ValueError:
            sep = ""
        if not sep:
            p.error(f"--set {item!r}: expected KEY=INTEGER")
    for key in overrides:
        if not any(key in {f.name for f in dataclasses.fields(MODELS[m])} for m in model_names):
            p.error(f"--set {key}: no selected model ({', '.join(model_names)}) has that field")
    for m in model_names:
        cfg = MODELS[m]
        fields = {f.name for f in dataclasses.fields(cfg)}
        args.configs[m] = dataclasses.replace(
            cfg, **{k: v for k, v in overrides.items() if k in fields}
        )
    return args


def make_setup(args: argparse.Namespace) -> Setup:
    """The run's precision and strategy; builds the HSDP mesh (collective)."""
    setup = Setup(mp=args.mp, strategy=args.strategy, cfsdp_optim=args.cfsdp_optim,
                  compile=args.compile)
    if args.strategy == "hybrid":
        world = dist.get_world_size()
        if world % args.shard_size != 0:
            raise SystemExit(
                f"--strategy hybrid: world size {world} is not divisible by "
                f"--shard-size {args.shard_size}"
            )
        setup.mesh = init_device_mesh(
            "cpu", (world // args.shard_size, args.shard_size),
            mesh_dim_names=("replicate", "shard"),
        )
    if args.tp is not None:
        world = dist.get_world_size()
        if args.tp[0] * args.tp[1] != world:
            raise SystemExit(f"--tp {args.tp[0]},{args.tp[1]}: DP * TP must be the world size {world}")
        setup.tp_mesh = init_device_mesh("cpu", args.tp, mesh_dim_names=("dp", "tp"))
    return setup


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    rss_reset = reset_peak_rss()
    if rank == 0 and not rss_reset:
        print(
            "NOTE: /proc/self/clear_refs is not writable: peak RSS is the process-lifetime "
            "peak (flagged (*)), not the contender's own",
            flush=True,
        )
    setup = make_setup(args)
    report: dict[str, Any] = {"machine": machine_info(args, rss_reset, setup), "models": {}}
    vs_fsdp1 = (setup.mp != "none" or setup.strategy != "full" or setup.tp_mesh is not None
                or setup.compile is not None)
    if rank == 0 and vs_fsdp1:
        mesh = f", mesh {tuple(setup.mesh.mesh.shape)}" if setup.mesh is not None else ""
        if setup.tp_mesh is not None:
            mesh += f", (dp, tp) mesh {tuple(setup.tp_mesh.mesh.shape)}; local = TP only"
        if setup.compile is not None:
            mesh += (f", every contender compiled (backend {setup.compile}; "
                     "wrappers use_orig_params=True)")
        print(f"mixed precision {setup.mp}, strategy {setup.strategy}{mesh}", flush=True)
    for model_name, cfg in args.configs.items():
        results: dict[str, dict[str, Any]] = {}
        for name in args.contenders:
            if rank == 0:
                print(f"[{model_name}] {name} ...", flush=True)
            out = run_contender(name, cfg, args.warmup, args.iters, setup)
            results[name] = reduce_outcome(out, args.warmup, args.iters, rss_reset)
            if rank == 0 and "error" in results[name]:
                print(f"[{model_name}] {name} error: {results[name]['error']}", flush=True)
        warnings = add_ratios(results, setup.mp, setup.cfsdp_optim)
        n_params = sum(p.numel() for p in build_model(cfg, SEED).parameters())
        report["models"][model_name] = {
            "config": {**config_dict(cfg), "n_params": n_params},
            "contenders": results,
            "warnings": warnings,
        }
        if rank == 0:
            print(f"\n### {model_name}: {config_dict(cfg)}, {n_params:,} params\n")
            print(markdown_table(results, vs_fsdp1))
            for line in warnings:
                print(line)
            if not rss_reset:
                print("(*) process-lifetime peak: /proc/self/clear_refs was not writable")
            print(flush=True)
    finish(report if rank == 0 else None, args.out)


def finish(report: dict[str, Any] | None, out: Path) -> None:
    """Write ``report`` (rank 0) as JSON to ``out``, then leave the process group."""
    if report is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def exit_now() -> None:
    """Leave without interpreter shutdown: torch 2.13's gloo can abort a rank there
    ("terminate called without an active exception"); every result is written by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_now()
