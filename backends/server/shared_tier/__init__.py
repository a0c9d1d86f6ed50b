"""The shared tier: HiState's L2 tier on a Redis/Valkey Cluster, read by every node.

``plan`` decides what a node writes here (also the fleet simulator's rule), ``cluster``
builds the cluster clients (bounded waits), ``values`` lays an object out as
one value (the disk tier's header + payload) and verifies it on read, ``config`` is the
adapter's validated ``adapter_params`` and ``tier`` the LMCache L2 adapter. The entries,
the one budget and the eviction ranking are the shared index's (``shared_index``), in a
namespace of their own. docs/multi-node.md describes the deployment.
"""
