"""Trains one client library under Lightning's own ``strategy="ddp"``; rank 0 saves what the tier compares.

Usage: ``python -m tests.clients.reference MODULE OUT_DIR`` (``MODULE`` one of ``tests.clients.CLIENTS``).
"""

import importlib
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    name, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    results = importlib.import_module(f"tests.clients.{name}").train("ddp", out_dir)
    if results is not None:
        torch.save(results, out_dir / "results.pt")
