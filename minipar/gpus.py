"""GPUs as their vendors' data sheets give them: the peak a run's MFU divides by, and the hardware the
planner plans a cluster of them on.

    GPU_PEAK_TFLOPS    (words that must all appear in the name torch reports, dense bf16 TFLOP/s):
                       tensor-core peaks without sparsity (NVIDIA prints "with sparsity" figures
                       twice as large; those are not what a training step can reach). First match
                       wins, so a specific variant stands before its family (H100 PCIe before H100,
                       GH200 before H200, A100 40GB before A100).
    PRESETS            `python -m minipar.plan --gpu NAME`: one GPU of a node of 8 (SXM boards
                       joined by NVLink switches), as the planner's Cluster fields:

        name   dense bf16   HBM            memory    NVLink, one way   data sheet
        h100   989 TF/s     3,350 GB/s     80 GiB    450 GB/s          NVIDIA H100 Tensor Core GPU (SXM5)
        h200   989          4,800          141 GiB   450               NVIDIA H200 Tensor Core GPU (SXM)
        a100   312          2,039          80 GiB    300               NVIDIA A100 Tensor Core GPU (SXM4 80GB)
        b200   2,250        8,000          180 GiB   900               NVIDIA DGX B200 / HGX B200

The memory is the card's label read as GiB, as `--gpu-memory` reads a bare number: torch reports
an "80GB" H100 as 79.6 GiB and a "141GB" H200 as 140.4 GiB, and the planner keeps a reserve
(`--reserve`, 10 %) below it anyway. NVLink is the data sheet's per-GPU figure (both directions)
halved, what one direction of a ring carries. The planner's efficiencies (`--efficiency`,
`--attention-efficiency`) are not the GPU's: they were held against H100 runs
(benchmarks/plan_vs_published.py), and on another GPU they are an assumption to set.

A device that maps to no preset (a PCIe card, an H100 NVL pair, an AMD GPU) has no planner preset;
its peak may still be in GPU_PEAK_TFLOPS. Nothing here touches a device.
"""
from __future__ import annotations

from typing import Optional

GiB = 2 ** 30

GPU_PEAK_TFLOPS = (
    (("H100", "PCIe"), 756.0), (("H100", "NVL"), 835.0), (("H100",), 989.0), (("H800",), 989.0),
    (("GH200",), 989.0), (("H200",), 989.0), (("B200",), 2250.0), (("B100",), 1750.0),
    (("A100",), 312.0), (("A800",), 312.0), (("L40S",), 362.0), (("L40",), 181.0), (("L4",), 121.0),
    (("A10",), 125.0), (("MI300X",), 1307.0), (("MI325X",), 1307.0), (("MI250X",), 383.0),
)

PRESETS = {
    "h100": dict(peak_tflops=989.0, hbm_gbps=3350.0, gpu_memory_bytes=80 * GiB, intra_gbps=450.0),
    "h200": dict(peak_tflops=989.0, hbm_gbps=4800.0, gpu_memory_bytes=141 * GiB, intra_gbps=450.0),
    "a100": dict(peak_tflops=312.0, hbm_gbps=2039.0, gpu_memory_bytes=80 * GiB, intra_gbps=300.0),
    "b200": dict(peak_tflops=2250.0, hbm_gbps=8000.0, gpu_memory_bytes=180 * GiB, intra_gbps=900.0),
}

# (words in the device name, preset): the SXM boards the presets describe, variants excluded first
_DEVICE_PRESET = ((("H100", "PCIe"), None), (("H100", "NVL"), None), (("H100",), "h100"),
                  (("GH200",), None), (("H200", "NVL"), None), (("H200",), "h200"),
                  (("A100", "PCIe"), None), (("A100", "40GB"), None), (("A100",), "a100"),
                  (("B200",), "b200"))


def _first(table, name: str):
    words = name.upper()
    for keys, value in table:
        if all(k.upper() in words for k in keys):
            return value
    return None


def gpu_peak_tflops(name: str) -> Optional[float]:
    """The table's dense bf16 peak for a device name ("NVIDIA H100 80GB HBM3" -> 989.0), or None."""
    return _first(GPU_PEAK_TFLOPS, name)


def preset_for_device(name: str) -> Optional[str]:
    """The preset a device name is ("NVIDIA H200" -> "h200", "NVIDIA H100 PCIe" -> None)."""
    return _first(_DEVICE_PRESET, name)
