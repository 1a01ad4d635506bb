"""DeepSpeed-Chat's module path for the trainers (``from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer``)."""
from dschat.rlhf.trainer import DeepSpeedPPOTrainer, DeepSpeedPPOTrainerUnsupervised

__all__ = ["DeepSpeedPPOTrainer", "DeepSpeedPPOTrainerUnsupervised"]
