#!/usr/bin/env bash
# torchtitan 0.3.0's llama3 debugmodel recipe on 2 CPU ranks (gloo), once on torch's FSDP2 and
# once under `python -m cfsdp.run`, with its dp_mesh_dims path (spmd backend full_dtensor);
# fails unless every step's loss and grad norm are the same floats.  `make torchtitan-check`.
#
# Not part of `make test`: the venv is ~2.5 GB (torchtitan imports triton) and torchtitan does not
# run on CPU as shipped; titan_cpu.py patches only torchtitan's CUDA-only code and two torch
# limits on CPU/gloo (see its docstring), nothing of FSDP.  Its true default spmd backend
# ("spmd_types": plain tensors plus dp_mesh_dims) is rejected by torch 2.13.0's own fully_shard
# ("all parameters must be DTensors on the full SPMD mesh"), and by cfsdp the same way.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${TITAN_VENV:-$repo/.venv-titan}
if [ ! -x "$venv/bin/torchrun" ] || ! "$venv/bin/python" -c "import torchtitan" 2>/dev/null; then
    python3.11 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0 torchtitan==0.3.0 \
        triton==3.9.0 rich==15.0.0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/titan_cpu.py" "$work/"
cd "$work"
"$venv/bin/python" "$here/mkassets.py" >/dev/null
args=(--module llama3 --config llama3_debugmodel --hf-assets-path ./tests/assets/tokenizer
      --training.steps 5 --training.seq-len 256 --training.local-batch-size 2
      --checkpoint.no-enable --validator.no-enable --debug.seed 42 --debug.deterministic
      --training.disable-cuda-graphs --compile.no-enable --metrics.no-enable-tensorboard
      --metrics.no-enable-wandb --comm.trace-buf-size 0 --dump-folder ./outputs
      --parallelism.spmd-backend full_dtensor)
export OMP_NUM_THREADS=1 PYTHONPATH="$work:$repo/python"
"$venv/bin/torchrun" --standalone --nproc_per_node 2 -m titan_cpu "${args[@]}" > torch.log 2>&1 \
    || { tail -30 torch.log; exit 1; }
"$venv/bin/torchrun" --standalone --nproc_per_node 2 -m cfsdp.run -m titan_cpu "${args[@]}" \
    > cfsdp.log 2>&1 || { tail -30 cfsdp.log; exit 1; }
grep -o 'EXACT step=.* grad_norm=[^ ]*' torch.log > torch.steps
grep -o 'EXACT step=.* grad_norm=[^ ]*' cfsdp.log > cfsdp.steps
grep -q 'fully_shard=torch.distributed.fsdp' torch.log
grep -q 'fully_shard=cfsdp' cfsdp.log || { echo "cfsdp.run did not put cfsdp's fully_shard in"; exit 1; }
[ "$(wc -l < torch.steps)" -eq 5 ] || { echo "torch: $(wc -l < torch.steps) steps logged"; exit 1; }
if diff torch.steps cfsdp.steps; then
    echo "torchtitan debugmodel, 5 steps at 2 ranks: cfsdp's losses and grad norms = torch's, bit for bit"
    cat cfsdp.steps
else
    echo "torchtitan debugmodel: cfsdp differs from torch (above)"; exit 1
fi
