"""Code that runs only in the controller: the user's process, which runs Lightning's loops once.
It never imports from :mod:`lightning_monarch.worker` except the actor class it spawns."""
