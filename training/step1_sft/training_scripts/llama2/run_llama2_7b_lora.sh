#!/bin/bash
# DeepSpeed-Chat's script of this name with dschat's flags. Run it from the step's folder (main.py is beside
# training_scripts/), with dschat installed (pip install -e .) or on PYTHONPATH.
# One node: Llama-2-7B, LoRA (rank 128) on the decoder layers only, base weights frozen (the model is gated on the hub).
OUTPUT=$1
ZERO_STAGE=$2
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output
fi
if [ "$ZERO_STAGE" == "" ]; then
    ZERO_STAGE=3
fi
mkdir -p $OUTPUT

deepspeed main.py \
   --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
   --data_split 2,4,4 \
   --model_name_or_path meta-llama/Llama-2-7b-hf \
   --per_device_train_batch_size 4 \
   --per_device_eval_batch_size 4 \
   --max_seq_len 512 \
   --learning_rate 9.65e-6 \
   --lora_dim 128 \
   --lora_module_name "layers." \
   --only_optimize_lora \
   --lora_learning_rate 5e-4 \
   --weight_decay 0. \
   --num_train_epochs 4 \
   --gradient_accumulation_steps 1 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --gradient_checkpointing \
   --zero_stage $ZERO_STAGE \
   --deepspeed \
   --output_dir $OUTPUT \
   &> $OUTPUT/training.log
