"""Cascade attention: merging attention states (merge.py). The multi-level cascade wrapper is
added next to it by the prefill work."""

from .merge import merge_state, merge_state_in_place, merge_states
from .multilevel import MultiLevelCascadeAttentionWrapper

__all__: list[str] = ["merge_state", "merge_state_in_place", "merge_states", "MultiLevelCascadeAttentionWrapper"]
