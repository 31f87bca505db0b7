"""The torture harness: real daemons, real faults, and a verdict read from the database and Redis.

``python -m torture --help``. docs/guarantees.md ("Guarantees and how we test them") says what
it proves and how.
"""
