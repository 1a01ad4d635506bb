#!/bin/bash
# DeepSpeed-Chat's script of this name with dschat's flags. Run it from the step's folder (main.py is beside
# training_scripts/), with dschat installed (pip install -e .) or on PYTHONPATH.
# One GPU: PPO of an OPT-1.3B actor (LoRA, rank 128) with an OPT-350m critic through the hybrid engine.
ACTOR_MODEL_PATH=$1
CRITIC_MODEL_PATH=$2
ACTOR_ZERO_STAGE=$3
CRITIC_ZERO_STAGE=$4
OUTPUT=$5
if [ "$ACTOR_MODEL_PATH" == "" ] || [ "$CRITIC_MODEL_PATH" == "" ]; then
    echo "usage: $0 ACTOR_MODEL_PATH CRITIC_MODEL_PATH [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT]" >&2
    echo "(the step-1 and step-2 output folders)" >&2
    exit 2
fi
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output
fi
if [ "$ACTOR_ZERO_STAGE" == "" ]; then
    ACTOR_ZERO_STAGE=0
fi
if [ "$CRITIC_ZERO_STAGE" == "" ]; then
    CRITIC_ZERO_STAGE=0
fi
mkdir -p $OUTPUT

deepspeed --num_gpus 1 main.py --data_path Dahoas/rm-static \
   --actor_model_name_or_path $ACTOR_MODEL_PATH --critic_model_name_or_path $CRITIC_MODEL_PATH \
   --actor_zero_stage $ACTOR_ZERO_STAGE --critic_zero_stage $CRITIC_ZERO_STAGE \
   --num_padding_at_beginning 1 \
   --deepspeed --actor_lora_dim 128 --actor_lora_module_name decoder.layers. --enable_hybrid_engine \
   --actor_gradient_checkpointing --actor_dropout 0.0 \
   --output_dir $OUTPUT &> $OUTPUT/training.log
