"""pytest set-up: the worktree's own minipar first on the path, CUDA hidden from the gloo worlds, and pyplot
imported once before the ranks fork."""

import os
import sys

# The suite runs gloo worlds on the CPU (forked ranks); on a GPU machine keep CUDA out of it, so
# that forked children never inherit an initialised CUDA context.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# One thread in the test process too: ranks are forked from it, and a forked OpenMP pool is unsafe.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The prepared datasets of the suite's runs (minipar/trainer/data/prepared.py's default folder) go to
# one temporary folder, not the user's ~/.cache/minipar.
if "MINIPAR_CACHE" not in os.environ:
    import tempfile
    os.environ["MINIPAR_CACHE"] = tempfile.mkdtemp(prefix="minipar-test-cache-")
# matplotlib's pyplot (0.5 s), imported once here with the Agg backend minipar/trainer/metrics_file.py
# selects, so that the forked ranks of a run that draws its loss-curve PNG inherit it
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
except ImportError:               # the plot extra is optional: the runs then skip the PNG
    pass
