"""dschat's hybrid engine: the PPO actor trains under DeepSpeed ZeRO and generates through a static-cache decode path
in the same process (see ``engine.py`` for the switch, ``weights.py`` for how generation reads the training weights).
"""
from dschat.hybrid_engine.config import HybridEngineConfig, strip_deepspeed_hybrid_engine
from dschat.hybrid_engine.engine import HybridEngine, wrap_actor

__all__ = ["HybridEngine", "HybridEngineConfig", "wrap_actor", "strip_deepspeed_hybrid_engine"]
