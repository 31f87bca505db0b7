"""Benchmarks of issue 5: relay, consumer, latency, producer overhead, memory, Redis ceiling.

Run ``python -m bench`` (``make bench``) or ``python -m bench --quick``; see ``bench/run.py``.
"""
