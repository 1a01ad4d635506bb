"""Where a run keeps its models: ``train.py``'s folder per step under ``--output_dir``, and step 3's own subfolders.
The pipeline writes these, and the report, ``chat.py`` and the eval tools find a run's models through them."""
SFT_DIR = "step1_sft"
RM_DIR = "step2_rm"
DPO_DIR = "step2_dpo"
PPO_DIR = "step3_ppo"

# Each recipe's steps and the folder each writes (the DPO recipe's step 2 writes DPO_DIR).
RECIPE_STEP_FOLDERS = {"ppo": {1: SFT_DIR, 2: RM_DIR, 3: PPO_DIR}, "grpo": {1: SFT_DIR, 3: PPO_DIR},
                       "dpo": {1: SFT_DIR, 2: DPO_DIR}}

# under step 3's --output_dir
ACTOR_DIR = "actor"
CRITIC_DIR = "critic"
ACTOR_EMA_DIR = "actor_ema"

PPO_ACTOR_DIR = f"{PPO_DIR}/{ACTOR_DIR}"  # the PPO/GRPO policy under train.py's --output_dir

# The steps' folders: a model path through one ("out/step1_sft", "step3_ppo/actor") is a run's, never a hub name.
STEP_FOLDER_NAMES = frozenset({SFT_DIR, RM_DIR, DPO_DIR, PPO_DIR})
