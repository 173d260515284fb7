"""Code that runs in the Monarch worker processes, one per device. Never imported by the controller
except for :class:`~lightning_monarch.worker.actor.MonarchWorker`, the actor class it spawns."""
