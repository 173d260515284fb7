"""Runs on the controller: the features built on the loop and the mesh, elastic training, rehearsal, preflight and the workers' stats."""
