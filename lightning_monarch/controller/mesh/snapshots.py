"""The recovery snapshots of a sharded stage, in a directory the workers write to.

Runs on the controller: the strategies make one for each stage (``_snapshot_directory``) and the
stage's channel (``controller.mesh.channel``) keeps and removes them.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union


class SnapshotDirectory:
    """Runs on the controller: where the workers write a sharded stage's recovery snapshots.

    Under ``MonarchFSDPStrategy(max_restarts=k)`` no worker holds a replica, so a
    recovery snapshot is a sharded checkpoint directory (``RankState.snapshot``, ``worker.state``)
    that every rank writes its shards into and a replacement worker's ``ModelParallelStrategy``
    resumes from. The stage gets a new temporary directory inside ``root`` (by default the
    system's temporary directory, on this host; workers on several hosts need a path that they and
    this process all reach), one subdirectory per snapshot, of which only the last is kept;
    ``remove`` deletes it all when the stage ends, however it ends.
    """

    def __init__(self, root: Optional[Union[str, Path]] = None) -> None:
        if root is not None:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix="lightning_monarch_snapshots_", dir=root)).absolute()
        self._kept: Optional[Path] = None

    def for_epoch(self, epoch: int) -> str:
        """The directory for the snapshot at the start of training epoch ``epoch``."""
        return str(self.path / f"epoch={epoch}")

    def keep(self, snapshot: str) -> None:
        """``snapshot`` was written: it replaces the one kept before, whose directory is removed."""
        previous, self._kept = self._kept, Path(snapshot)
        if previous is not None and previous != self._kept:
            shutil.rmtree(previous, ignore_errors=True)

    def remove(self) -> None:
        """Remove the stage's snapshots."""
        shutil.rmtree(self.path, ignore_errors=True)
