"""Celery's own integration tests on Redis, plain and with celery-fair, compared test by test.

Run ``python -m bench.celery_integration --help``; see README.md beside this file.
"""
