"""Collectives: the plugin's device communicator and the MoE communication
methods (how routed tokens travel between expert-parallel ranks)."""
