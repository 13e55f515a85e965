"""Pure planning: no I/O, no clock (``now`` is passed in), frozen results."""
