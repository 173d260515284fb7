"""Runs parity cases under Lightning's own ``strategy="ddp"``; rank 0 saves what the tests compare.

Usage: ``python -m tests.ddp_reference OUT_DIR CASE [CASE ...]``
"""

import sys
from pathlib import Path

import torch

from tests.parity_cases import run_case

if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for name in sys.argv[2:]:
        results = run_case(name, "ddp", out_dir / name)
        if results is not None:
            torch.save(results, out_dir / name / "results.pt")
