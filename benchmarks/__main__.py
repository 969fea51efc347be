"""`python -m benchmarks`: every side-by-side comparison (benchmarks/run_all.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_all import main  # noqa: E402

main()
