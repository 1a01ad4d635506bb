"""DeepSpeed-Chat's module path for the engine (``from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine``)."""
from dschat.rlhf.engine import DeepSpeedRLHFEngine

__all__ = ["DeepSpeedRLHFEngine"]
