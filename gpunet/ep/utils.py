"""The names of DeepEP V1's ``deep_ep.utils`` that callers import from it (Megatron's fused_a2a:
``from deep_ep.utils import EventHandle, EventOverlap``): gpunet.ep's own classes, so
``deep_ep.utils.EventOverlap is deep_ep.EventOverlap`` after install_as_deep_ep()."""
from gpunet.ep.buffer import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
