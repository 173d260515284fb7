"""Runs on the controller: where Lightning's calls enter, the launcher each strategy hands its stages to, the stand-in accelerator and the checks of the strategies' arguments."""
