"""The local testbed with a real data plane: a wiring file as network namespaces.

Every node, ToR and OCS of a wiring becomes a namespace; links are veth pairs shaped
with tbf; circuits are tc redirects programmed by ``orl-sim-ocs --netns``; ToRs are
Linux routers programmed by the controller; one node agent runs in every node
namespace. ``plan`` decides (pure), ``lifecycle`` builds and removes, ``traffic``
measures, ``cli`` is ``orl-testbed``.
"""
