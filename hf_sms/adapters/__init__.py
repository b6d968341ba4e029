"""Replicas that train a few parameters and merges that keep a pruned model's zeros (docs/replicas.md)."""

from .folders import load_adapter, save_adapter
from .merge import merge_adapters
from .replica import REPLICA_PARAMS, ReplicaParams, make_replica, soup_of_states, trained_state

__all__ = [
    "REPLICA_PARAMS",
    "ReplicaParams",
    "load_adapter",
    "make_replica",
    "merge_adapters",
    "save_adapter",
    "soup_of_states",
    "trained_state",
]
