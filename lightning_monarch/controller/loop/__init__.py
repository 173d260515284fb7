"""Runs on the controller: Lightning's loop here following rank 0's entries, with the mirrors, metrics, callbacks, predictions and checkpoints it works with."""
