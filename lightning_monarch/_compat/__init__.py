"""The doors to private APIs: one module per library (two for Lightning), and no private name of
Lightning, Monarch, torch or Python's standard library anywhere else in the package.

- ``lightning``: Lightning's Trainer state, connectors and private classes, and the list of every
  private Lightning attribute both Lightning doors use (``PRIVATE_NAMES``);
- ``loops``: the private parts of Lightning's evaluation and prediction loops;
- ``monarch``: Monarch's ``_rust_bindings`` and the attributes its jobs and meshes keep private;
- ``torch``: ``torch.utils._pytree``, the activation-checkpoint wrapper and GPU counters;
- ``python``: ``asyncio``'s running-loop slot.

Each door names the release it was checked against (``CHECKED_WITH``) and lists its private
attributes (``PRIVATE_NAMES``); ``tests/test_compat.py`` resolves every one and fails, naming what
is missing, when an upgrade removes it. Importing a door has no side effects.
"""
