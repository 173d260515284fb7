"""Runs on the controller: the transport to the workers, from their hosts and processes to each message, its answers and the weights it carries."""
