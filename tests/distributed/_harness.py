"""In-worker harness: one torchrun spawn runs a grid of named subtests on every rank.

Spawning ranks is the slow part of a distributed test (importing torch on W processes that
share 2 cores), so a worker script registers many subtests and runs them all in one spawn
(torch's ``run_subtests`` idea)::

    import _harness as h

    @h.subtest(grid={"use_orig_params": [False, True]})
    def parity(ctx, use_orig_params): ...

    if __name__ == "__main__":
        h.main()

Contract
--------
* ``main()`` initialises the default gloo process group (``timeout=60 s``) from torchrun's
  env, runs every subtest (optionally filtered by ``--only SUBSTR``, or ``--only A|B`` for
  either), destroys the process
  group and exits 0 only if every subtest passed on every rank.
* A worker with many subtests keeps them in *feature modules* (e.g. ``fully_shard/parity.py``)
  and runs them in one launch: ``main(modules=["fully_shard.parity", ...])`` imports them in
  that order and runs their subtests after the script's own; ``--modules A,B`` runs only those
  modules' subtests, ``--subtests NAME,...`` only the subtests registered under those names
  (every point of a grid). Subtests registered by any other module never run.
* Each subtest gets a fresh gloo group ``ctx.pg`` over all ranks (created by all ranks at the
  same point, between subtests). Subtests pass it as ``process_group`` to the code under test,
  so a subtest that fails half-way through its collectives (one rank raised, the others are
  left waiting or with unmatched collectives) cannot desynchronise the next one: the waiting
  rank gets the 60 s process-group timeout, and the next subtest uses a new group.
* After each subtest, the ranks agree *out of band*, through the rendezvous store rather than
  a collective: each rank publishes "ok" or its traceback, then waits for all the others (up
  to ``AGREE_TIMEOUT_S``, longer than the process-group timeout so a rank blocked in a
  collective still gets to report). So a failure on one rank fails the subtest on all ranks
  with that rank's traceback, and a rank that never reports fails the run with a message
  naming it instead of hanging.
* Every rank prints its own failures as they happen (``[rank r] FAIL name``); rank 0 prints
  a summary of all subtests at the end. The output of the whole run is what the pytest
  launcher shows on failure.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

# CFSDP_TEST_PG_TIMEOUT_S only exists for the harness self-test (a short wait for a rank that
# raised before a collective its peers entered); real tests use the 60 s default
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "60")))
AGREE_TIMEOUT_S = PG_TIMEOUT.total_seconds() + 30  # a rank stuck in a collective reports after PG_TIMEOUT
_KEY_PREFIX = "cfsdp_harness"


@dataclass
class Context:
    rank: int
    world_size: int
    pg: Any  # the subtest's own gloo process group over all ranks
    name: str
    seed: int = 0

    def log(self, *args: Any) -> None:
        print(f"[rank {self.rank}] [{self.name}]", *args, flush=True)


@dataclass
class _Subtest:
    name: str
    fn: Callable[..., None]
    base: str  # the registered name without its grid point (``--subtests`` selects by it)
    kwargs: dict[str, Any] = field(default_factory=dict)


_REGISTRY: list[_Subtest] = []


def _fmt(v: Any) -> str:
    if isinstance(v, type):
        return v.__name__
    if hasattr(v, "name") and hasattr(v, "value"):  # enums
        return str(v.name)
    return str(v)


def subtest(fn: Callable | None = None, *, grid: dict[str, list] | None = None, name: str | None = None):
    """Register ``fn(ctx, **kwargs)`` once per point of the cartesian ``grid``."""

    def deco(f: Callable) -> Callable:
        base = name or f.__name__
        keys = list((grid or {}).keys())
        for values in itertools.product(*[(grid or {})[k] for k in keys]):
            kwargs = dict(zip(keys, values))
            label = base + (
                "[" + ",".join(f"{k}={_fmt(v)}" for k, v in kwargs.items()) + "]" if kwargs else ""
            )
            _REGISTRY.append(_Subtest(label, f, base, kwargs))
        return f

    if fn is not None:
        return deco(fn)
    return deco


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _agree(store: dist.Store, run_id: str, idx: int, rank: int, world: int, status: str) -> dict[int, str]:
    """Publish this rank's status for subtest ``idx``; return every rank's status.

    A rank that does not publish within AGREE_TIMEOUT_S gets a status saying so.
    """
    store.set(f"{_KEY_PREFIX}/{run_id}/{idx}/{rank}", status)
    statuses: dict[int, str] = {}
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    for r in range(world):
        key = f"{_KEY_PREFIX}/{run_id}/{idx}/{r}"
        remaining = max(0.1, deadline - time.monotonic())
        try:
            store.wait([key], timedelta(seconds=remaining))
            statuses[r] = store.get(key).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - a timeout is reported, whatever its type
            statuses[r] = (
                f"NO REPORT: rank {r} did not finish this subtest within {AGREE_TIMEOUT_S:g} s "
                f"(hung or died); waiting for it raised {type(e).__name__}: {e}"
            )
    return statuses


def select(only: str | None = None, modules: Sequence[str] = (),
           subtests: Sequence[str] | None = None) -> list[_Subtest]:
    """The registered subtests a run takes, in registration order: those of the launched script
    and of the feature ``modules`` it names (a guard: workers import only helper modules, which
    register none, and feature modules; tests/unit/test_harness_imports.py checks it), whose
    registered name (without the grid point) is one of ``subtests`` (all when None), and whose
    full name contains ``only`` (``A|B``: A or B; all when None)."""
    owners = {"__main__", *modules}
    wanted = None if only is None else [w for w in only.split("|") if w]
    return [st for st in _REGISTRY if st.fn.__module__ in owners
            and (subtests is None or st.base in subtests)
            and (wanted is None or any(w in st.name for w in wanted))]


def run_subtests(only: str | None = None, modules: Sequence[str] = (),
                 subtests: Sequence[str] | None = None) -> tuple[int, bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store()
    # all ranks share the run id (torchrun's run id is the same on all ranks of one launch)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    if subtests is not None:
        missing = sorted(set(subtests) - {st.base for st in select(None, modules)})
        if missing:
            print(f"[rank {rank}] --subtests {missing}: no such subtest registered by "
                  f"{sorted({'__main__', *modules})} at world size {world}", flush=True)
            return 1, False
    selected = select(only, modules, subtests)
    if not selected:
        print(f"[rank {rank}] no subtest matches --only {only!r}"
              + ("" if subtests is None else f" and --subtests {','.join(subtests)!r}")
              + f" among the subtests of {sorted({'__main__', *modules})}", flush=True)
        return 1, False
    results: list[tuple[str, dict[int, str], float]] = []
    aborted_at: int | None = None
    t_all = time.monotonic()
    for idx, st in enumerate(selected):
        t0 = time.monotonic()
        pg = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
        ctx = Context(rank=rank, world_size=world, pg=pg, name=st.name)
        try:
            st.fn(ctx, **st.kwargs)
            status = "ok"
        except BaseException as e:  # noqa: BLE001 - report everything, incl. KeyboardInterrupt
            status = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            print(f"[rank {rank}] FAIL {st.name}\n{status}", file=sys.stderr, flush=True)
            if not isinstance(e, Exception):
                raise
        statuses = _agree(store, run_id, idx, rank, world, status)
        results.append((st.name, statuses, time.monotonic() - t0))
        if any(s.startswith("NO REPORT") for s in statuses.values()):
            aborted_at = idx  # a rank is gone or hung: nothing after this can be trusted
            break

    failed = [(n, s) for n, s, _ in results if any(v != "ok" for v in s.values())]
    if rank == 0:
        lines = [f"\n==== subtests: {len(results) - len(failed)}/{len(selected)} passed "
                 f"(world size {world}, CFSDP_IMPL={os.environ.get('CFSDP_IMPL', 'c')}, "
                 f"{time.monotonic() - t_all:.1f} s) ===="]
        for n, s, dt in results:
            bad = sorted(r for r, v in s.items() if v != "ok")
            lines.append(f"  {'PASS' if not bad else 'FAIL'} {n} ({dt:.2f} s)"
                         + (f"  failing ranks: {bad}" if bad else ""))
        if aborted_at is not None:
            for st in selected[aborted_at + 1:]:
                lines.append(f"  NOT RUN {st.name} (a rank stopped reporting at "
                             f"{selected[aborted_at].name})")
        for n, s in failed:
            lines.append(f"\n---- FAILED {n} ----")
            for r in sorted(s):
                if s[r] != "ok":
                    lines.append(f"[rank {r}] {s[r].rstrip()}")
        print("\n".join(lines), flush=True)
    return (0 if not failed and aborted_at is None else 1), aborted_at is not None


def _names(arg: str) -> list[str]:
    return [n for n in arg.split(",") if n]


def main(modules: Sequence[str] = ()) -> None:
    """Run the launched script's subtests and those of the feature ``modules`` (imported here,
    in order: their subtests run in registration order); ``--modules`` names a subset of
    them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None,
                        help="run only subtests whose name contains this (A|B: either)")
    parser.add_argument("--modules", type=_names, default=None,
                        help="comma-separated: run only the subtests of these of the script's "
                             f"feature modules {list(modules)}")
    parser.add_argument("--subtests", type=_names, default=None,
                        help="comma-separated registered names (a grid's every point): run only "
                             "these subtests")
    args = parser.parse_args()
    if args.modules is not None:
        unknown = sorted(set(args.modules) - set(modules))
        if unknown:
            parser.error(f"--modules {unknown}: not feature modules of this worker; "
                         f"choose among {list(modules)}")
        modules = [m for m in modules if m in args.modules]
    for m in modules:
        importlib.import_module(m)
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo", timeout=PG_TIMEOUT)
    rc, aborted = run_subtests(args.only, modules, args.subtests)
    if not aborted:
        # every rank reported on every subtest, so every rank gets here: safe to tear down.
        # The barrier first: torch 2.13 gloo can abort a rank at teardown ("terminate
        # called without an active exception") when one rank destroys its group while
        # another still has work in flight.
        dist.barrier()
        dist.destroy_process_group()
    # else a rank is hung or dead; tearing down could block on it, so just exit (torchrun
    # stops the other ranks once one exits non-zero)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
