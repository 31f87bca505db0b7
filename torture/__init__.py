"""The torture harness: real daemons, real faults, and a verdict read from the database and Redis.

``python -m torture --help``. See ``docs/guarantees.md`` for what it proves and how.
"""
