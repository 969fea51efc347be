#!/usr/bin/env bash
# The GPU checks, prepared as one command for a lent CUDA machine (its python3 holds PyTorch with
# CUDA, transformers and tensorboard; nothing can be installed there), so that a short lease is spent
# measuring, not typing. From the repository root:
#
#     bash benchmarks/device_check.sh            on the GPU machine: results under $OUT (or out/device_check)
#     DEVICE=cpu bash benchmarks/device_check.sh the same steps on this CPU, small, to check the script
#
# Each step has its own time limit and the script goes on when one fails, printing which:
#   1. the device, as nvidia-smi and torch see it;
#   2. benchmarks/bench_gpu.py: a ~1 B Llama in bf16 on an NCCL world of one: tokens/s, MFU against
#      the device's data sheet (minipar/gpus.py), peak memory beside the planner's estimate for the
#      same run (--gpu preset), and the fused block attention against SDPA -> bench_gpu.json;
#   3. train.py under torchrun on one GPU (NCCL): the trainer's CUDA path end to end, 40 steps of the
#      default config in bf16, with the closing summary's MFU and the planner's prediction on that GPU
#      -> train.log, metrics.jsonl (the run itself under $RUN);
#   4. benchmarks/sync_check.py (before 3): the host syncs of each steady-state step under
#      torch.cuda.set_sync_debug_mode("warn"), dense and MoE, against docs/design.md's numbers
#      -> sync_check.json, sync_check_moe.json.
# One GPU cannot host an NCCL world of several ranks (NCCL refuses two ranks on one device), so the
# multi-rank proofs stay the gloo tests'. Copy bench_gpu.json to benchmarks/results/ to publish it.
set -u
OUT=${OUT:-out/device_check}
RUN=${RUN:-/tmp/device_check_run}      # the run's own output_dir, outside $OUT: a lease returns few files
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=()

step() {    # step NAME SECONDS COMMAND...: run it with a limit, log it, note a failure and go on
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name FAILED (exit $rc)"; failed+=("$name"); }
}

if [ "$DEVICE" = cuda ]; then
    step device 60 bash -c "nvidia-smi -L; $PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'"
    step bench_gpu 300 "$PY" benchmarks/bench_gpu.py --out "$OUT/bench_gpu.json"
    step sync_check 120 bash -c "$PY benchmarks/sync_check.py --out $OUT/sync_check.json && \
        $PY benchmarks/sync_check.py --moe --out $OUT/sync_check_moe.json"
    step train 300 "$PY" -m torch.distributed.run --nproc-per-node 1 train.py configs/default.yaml \
        --max_steps 40 --dtype bfloat16 --eval_steps 0 --progress_bar false --save_final_checkpoint false \
        --export_hf false --output_dir "$RUN"
else
    step device 60 "$PY" -c 'import torch; print(torch.__version__, "cpu")'
    step bench_gpu 300 "$PY" benchmarks/bench_gpu.py --device cpu --tiny --out "$OUT/bench_gpu.json"
    step sync_check 300 "$PY" benchmarks/sync_check.py --steps 5 --logging_steps 2 --out "$OUT/sync_check.json"
    step train 300 "$PY" -m torch.distributed.run --nproc-per-node 1 train.py configs/default.yaml \
        --max_steps 4 --eval_steps 0 --progress_bar false --save_final_checkpoint false --export_hf false \
        --model.num_hidden_layers 1 --output_dir "$RUN"
fi
[ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl"
if [ ${#failed[@]} -eq 0 ]; then
    echo "device_check: every step passed; results in $OUT"
else
    echo "device_check: failed: ${failed[*]}; logs in $OUT"
    exit 1
fi
