"""Pure planning: no I/O, no clock (``now`` is passed in), frozen results.

- ``perf_model``: the performance model (hardware and model data with sources, decode,
  prefill, transfers, training, weight sync; calibratable from a measured profile);
- ``forecast``: remaining response lengths within a step, drift across steps;
- ``compute_state`` / ``compute`` / ``milp`` / ``replan``: the adaptive compute scheduler
  (TP layouts and request placement; heuristic, exact MILP, when to re-plan);
- ``circuits`` / ``network`` / ``weight_sync`` / ``gate``: RFabric's network planner
  (demand, OCS circuits, routes, the slack gate, the weight-sync schedule).
"""
