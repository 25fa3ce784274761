"""The PySpark report over task telemetry (optional ``spark`` extra; never imported by a worker)."""
