#!/usr/bin/env bash
# The GPU checks as one command for a lent CUDA machine (its python3 holds PyTorch with CUDA and
# transformers; nothing can be installed there), so that a short slot is spent measuring, not typing.
# From the repository root:
#
#     bash benchmarks/device_check.sh            on the GPU machine: results under $OUT (or out/device_check)
#     DEVICE=cpu bash benchmarks/device_check.sh the same steps, small, on this CPU, to check the script
#
# The steps, each in a process of its own under its own time limit, 8 minutes in all (device, the
# attention kernels on every ring block shape, ring attention at cp 2 and 4 and ZeRO-3 at dp_shard 2 as
# threads on the GPU, the host syncs of a step, the pipeline's p2p under NCCL with two processes on the
# GPU, bench_gpu's MFU at ~1 B): benchmarks/device_check.py says what each proves. Results:
# $OUT/device_check.json and $OUT/device_check.md; copy both to benchmarks/results/ to publish them.
set -u
OUT=${OUT:-out/device_check}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ]; then
    nvidia-smi -L || true
    exec "$PY" benchmarks/device_check.py --device cuda --out "$OUT"
else
    exec "$PY" benchmarks/device_check.py --device cpu --small --out "$OUT"
fi
