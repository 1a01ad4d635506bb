#!/bin/bash
# DeepSpeed-Chat's script of this name with dschat's flags. Run it from the step's folder (main.py is beside
# training_scripts/), with dschat installed (pip install -e .) or on PYTHONPATH.
# One node: PPO with LoRA (rank 128) on the actor's and the critic's decoder layers, only the adapters trained.
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

Actor_Lr=9.65e-6
Critic_Lr=5e-6

deepspeed --master_port 12346 main.py \
   --data_path Dahoas/rm-static \
   --data_split 2,4,4 \
   --actor_model_name_or_path $ACTOR_MODEL_PATH \
   --critic_model_name_or_path $CRITIC_MODEL_PATH \
   --num_padding_at_beginning 1 \
   --per_device_generation_batch_size 16 \
   --per_device_training_batch_size 16 \
   --generation_batches 1 \
   --ppo_epochs 1 \
   --max_answer_seq_len 256 \
   --max_prompt_seq_len 256 \
   --actor_learning_rate ${Actor_Lr} \
   --critic_learning_rate ${Critic_Lr} \
   --actor_weight_decay 0.1 \
   --critic_weight_decay 0.1 \
   --num_train_epochs 1 \
   --lr_scheduler_type cosine \
   --gradient_accumulation_steps 1 \
   --actor_gradient_checkpointing \
   --critic_gradient_checkpointing \
   --offload_reference_model \
   --disable_actor_dropout \
   --num_warmup_steps 100 \
   --deepspeed --seed 1234 \
   --enable_hybrid_engine \
   --actor_zero_stage $ACTOR_ZERO_STAGE \
   --critic_zero_stage $CRITIC_ZERO_STAGE \
   --actor_lora_dim 128 \
   --actor_lora_module_name decoder.layers. \
   --critic_lora_dim 128 \
   --critic_lora_module_name decoder.layers. \
   --only_optimize_lora \
   --actor_lora_learning_rate 5e-4 \
   --critic_lora_learning_rate 5e-4 \
   --output_dir $OUTPUT \
   &> $OUTPUT/training.log
