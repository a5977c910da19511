"""Eviction policies: what to evict. One small file per policy."""

from .base import Policy, SlotState
from .full import Full
from .h2o import H2O
from .local import Local
from .streaming import StreamingLLM
from .tova import TOVA

__all__ = ["Policy", "SlotState", "Full", "H2O", "Local", "StreamingLLM", "TOVA"]
