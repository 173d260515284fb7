"""The benchmark's model and measurement, shipped with the package for ``lightning-monarch benchmark``.

``models``: the model in three sizes; ``measure``: one timed ``fit`` in a process of its own;
``compare``: ``monarch`` against ``ddp`` on this machine. The repository's full suite under
``benchmarks/`` builds on the first two.
"""
