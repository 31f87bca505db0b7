"""Benchmarks of issues 5 and 12: relay against the strong serial loop, consumer, cluster rows,
latency and its stages, producer overhead, memory, Redis ceiling; two passes and their spread.

Run ``python -m bench`` (``make bench``) or ``python -m bench --quick``; see ``bench/run.py``.
``python -m bench.compare a.json b.json`` compares two runs; ``python -m bench.profile``
profiles the relay, the consumer or the strong loop.
"""
