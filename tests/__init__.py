"""The test suite. ``tests.pl`` is the same suite in ``pytorch_lightning``'s namespace: its models,
cases and helpers, written once against ``lightning.pytorch`` and rewritten on import as
``lightning_monarch.pl`` is (:mod:`lightning_monarch.namespaces`), so that the parity cases run
against ``pytorch_lightning``'s own ``ddp``. Worker processes import it the same way."""

from pathlib import Path

from lightning_monarch import namespaces

namespaces.mirror("tests", Path(__file__).resolve().parent)
