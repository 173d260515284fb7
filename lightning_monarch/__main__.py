"""``python -m lightning_monarch``: the same command line as ``lightning-monarch``."""

from lightning_monarch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
