#!/bin/bash
# DeepSpeed-Chat's script of this name with dschat's flags. Run it from the step's folder (main.py is beside
# training_scripts/), with dschat installed (pip install -e .) or on PYTHONPATH.
# One node: DPO of an OPT-350m policy (DeepSpeed-Chat's step2_dpo_finetuning); give your step-1 model
# as MODEL ($3) to start from it.
OUTPUT=$1
ZERO_STAGE=$2
MODEL=$3
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output
fi
if [ "$ZERO_STAGE" == "" ]; then
    ZERO_STAGE=0
fi
if [ "$MODEL" == "" ]; then
    MODEL=facebook/opt-350m
fi
mkdir -p $OUTPUT

deepspeed main.py \
   --data_path Dahoas/rm-static \
   --data_split 2,4,4 \
   --model_name_or_path $MODEL \
   --per_device_train_batch_size 2 \
   --per_device_eval_batch_size 2 \
   --max_seq_len 512 \
   --learning_rate 5e-6 \
   --weight_decay 0.1 \
   --num_train_epochs 1 \
   --dropout 0.0 \
   --gradient_accumulation_steps 16 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --beta 0.1 \
   --zero_stage $ZERO_STAGE \
   --deepspeed \
   --output_dir $OUTPUT \
   &> $OUTPUT/training.log
