"""Monitoring from the broker: the figures a worker cannot give when none runs."""
