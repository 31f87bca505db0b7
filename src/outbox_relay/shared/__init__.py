"""Parts every component shares: settings, schema, envelope, errors, keys, state machine.

This package imports nothing else of ours; every other package may import it.
"""
