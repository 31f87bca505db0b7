"""The ``outbox`` command: the only place that wires the components together."""
