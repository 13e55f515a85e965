"""``orl-sim``: a flow-level simulator of disaggregated RL on a (re)configurable fabric.

Network side: :mod:`.flows` (max-min fair flow model), :mod:`.fabrics` (topologies and
RFabric), :mod:`.collectives` (traffic of collectives and weight sync), :mod:`.cost`.
"""
