"""Trains client libraries under Lightning's own ``strategy="ddp"``, one after the other in the same
ranks; rank 0 saves what the tier compares, ``OUT_DIR/MODULE/results.pt``.

Usage: ``python -m tests.clients.reference OUT_DIR MODULE [MODULE ...]`` (each ``MODULE`` one of
``tests.clients.CLIENTS``). One launch for the whole tier, as ``tests.ddp_reference`` runs the
parity cases: the second ``fit`` finds the ranks and the process group of the first, as the
tier's ``monarch`` runs find the warm mesh.
"""

import importlib
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for name in sys.argv[2:]:
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        results = importlib.import_module(f"tests.clients.{name}").train("ddp", out_dir / name)
        if results is not None:
            torch.save(results, out_dir / name / "results.pt")
