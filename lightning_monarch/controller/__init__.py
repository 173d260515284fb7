"""Code that runs only in the controller: the user's process, which runs Lightning's loops once.
It imports from :mod:`lightning_monarch.worker` only what it hands to Monarch: the actor class
it spawns and the function each worker process runs first (``worker/process.py``)."""
