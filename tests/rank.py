"""One rank of a reference under Lightning's own strategies (``tests.references``): the intra-op
threads that Lightning's launcher gives each of its ``WORLD_SIZE`` ranks on this machine, then
``python -m MODULE ARG...``.

Usage: ``python -m tests.rank MODULE [ARG ...]``

Lightning's launcher (``_SubprocessScriptLauncher``, which ``strategy="ddp"`` uses when it starts
its ranks itself) shares the machine's CPUs out among the ranks (``torch.set_num_threads``, and
``OMP_NUM_THREADS`` for the ranks it starts); the workers of ``strategy="monarch"`` take the same
(``worker.process``). Ranks started as torchrun starts them run no launcher, and a rank forked from
the references' fork server keeps the threads of the server's torch: so each rank sets them here.
"""

import os
import runpy
import sys

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

if __name__ == "__main__":
    _set_num_threads_if_needed(num_processes=int(os.environ["WORLD_SIZE"]))
    module = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
