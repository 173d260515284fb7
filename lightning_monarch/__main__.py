"""``python -m lightning_monarch`` and the ``lightning-monarch`` console script: the command line.

``serve`` runs on each worker host, in a process that only relays: it is dispatched here, before
the rest of the command line (``cli``), which imports torch and Lightning, is imported.
"""

import sys
from collections.abc import Sequence
from typing import Optional


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command ``argv`` names (this process's arguments by default); returns the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["serve"]:
        from lightning_monarch import host

        return host.main(arguments[1:])
    from lightning_monarch import cli

    return cli.main(arguments)


if __name__ == "__main__":
    raise SystemExit(main())
