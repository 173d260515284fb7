"""The wire: what the controller and the workers both import to talk to each other.

Runs on both sides. The gate table and a running stage's messages (``protocol``), what the workers
are given (``specs``) and what they report (``reports``), how objects travel (``codec``), the
gates on Lightning's hooks (``gates``) and the loaders fed from the controller (``fed``). The
package's root keeps the public face; ``controller/`` and ``worker/`` each import these, never
each other.
"""
