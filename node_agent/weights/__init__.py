"""Weight sync on the node agent: serving checkpoints (``store``), fetching them from
another agent in ranges that survive cut connections (``plan``: the pure decisions;
``fetch``: the I/O), and the UpdateWeights command that fetches, checks and loads one
into the node's engines (``update``)."""
