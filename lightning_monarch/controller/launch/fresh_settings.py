"""``FRESH``: torch's settings in a fresh worker process of this host, against which
``torch_settings.changed`` tells which of them the user's script changed.

Runs on the controller, once per controller process. Where a stage's workers are CPU workers forked
from this process's fork server (``controller.mesh.forkserver.forked_package``), a child forked from
that server reads them (``torch_settings.py`` run as ``__main__``): it holds what a worker holds
before its first stage, and costs a fork, not a new import of torch (about 2 CPU-seconds on this
project's machines). Elsewhere (GPU workers, hosts of other machines, off Linux) the same file runs as
a script in a new interpreter of this environment, started in the background when the launcher is
made, so that the script goes on meanwhile; it is killed at exit if it still runs.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Optional

from lightning_monarch import torch_settings
from lightning_monarch.controller.mesh import forkserver

if TYPE_CHECKING:
    from lightning_monarch.controller.settings import StrategySettings

#: What a new interpreter runs: ``torch_settings.py`` as a script, with neither its folder nor the
#: current one first on ``sys.path``.
_SCRIPT = "import runpy, sys; sys.path.pop(0); runpy.run_path(sys.argv[1], run_name='__main__')"


class FreshSettings:
    """Runs on the controller: a fresh worker process's torch settings, read once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._process: Optional[subprocess.Popen] = None
        self._values: Optional[torch_settings.Values] = None
        self._error: Optional[str] = None
        #: The command line of the reading process, once started.
        self.command: Optional[list[str]] = None

    def read_ahead(self, settings: StrategySettings) -> None:
        """Where the reading takes a new interpreter (the workers of ``settings`` are not forked),
        start it now, in the background. A fork server's child reads in a fraction of a second as
        the stage starts, and the server starts with the stage's mesh anyway."""
        if _forked(settings) is None:
            self._start(None)

    def values(self, settings: StrategySettings) -> torch_settings.Values:
        """The fresh process's settings: read, unless read before, in a child of the fork server
        that forks the workers of ``settings``, or else in a new interpreter. Raises
        ``RuntimeError`` where that process failed."""
        thread = self._start(_forked(settings))
        thread.join()
        if self._values is None:
            raise RuntimeError(
                "strategy='monarch' reads torch's settings in a fresh Python process to tell which the script"
                f" changed, and that process failed: {self._error}. Check that `{sys.executable} -c 'import torch'`"
                " runs in this environment."
            )
        return self._values

    def stop(self) -> None:
        """Kill the reading process if it still runs."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _start(self, forked: Optional[str]) -> threading.Thread:
        with self._lock:
            if self._thread is None:
                if forked is None:
                    self.command = [sys.executable, "-c", _SCRIPT, torch_settings.__file__]
                    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
                else:
                    self.command = forkserver.forked_command(forked, [torch_settings.__name__])
                    environment = None
                self._thread = threading.Thread(
                    target=self._read,
                    args=(self.command, environment),
                    name="lightning-monarch-fresh-settings",
                    daemon=True,
                )
                self._thread.start()
            return self._thread

    def _read(self, command: list[str], environment: Optional[dict[str, str]]) -> None:
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
        out, err = self._process.communicate()
        if self._process.returncode == 0:
            self._values = pickle.loads(out)
        else:
            lines = err.decode(errors="replace").strip().splitlines()
            self._error = lines[-1] if lines else f"exit code {self._process.returncode}"


def _forked(settings: StrategySettings) -> Optional[str]:
    """The Lightning package of the workers of ``settings`` where this process's fork server forks them."""
    return forkserver.forked_package(settings.host_mesh, settings.gpu_indices)


#: The controller's one reading of a fresh worker process.
FRESH = FreshSettings()
atexit.register(FRESH.stop)
