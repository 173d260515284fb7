"""Code that runs in the Monarch worker processes, one per device. It imports only the package's
shared modules and this package (``tests/test_layout.py``); the controller imports from it only
what it hands to Monarch: the actor class and the process bootstrap."""
