#!/bin/bash
# dschat's embedded tiny default (a tiny Llama-shaped model, the bundled synthetic data): runs offline, on a CPU
# too, in the shape of DeepSpeed-Chat's scripts; run it from the step's folder (main.py is beside training_scripts/),
# with dschat installed (pip install -e .) or on PYTHONPATH. The settings are train.py's tiny recipe.
# The actor and critic default to step 1's and step 2's tiny scripts' outputs.
ACTOR_MODEL_PATH=$1
CRITIC_MODEL_PATH=$2
ACTOR_ZERO_STAGE=$3
CRITIC_ZERO_STAGE=$4
OUTPUT=$5
if [ "$ACTOR_MODEL_PATH" == "" ]; then
    ACTOR_MODEL_PATH=../step1_sft/output/tiny
fi
if [ "$CRITIC_MODEL_PATH" == "" ]; then
    CRITIC_MODEL_PATH=../step2_rm/output/tiny
fi
if [ "$ACTOR_ZERO_STAGE" == "" ]; then
    ACTOR_ZERO_STAGE=0
fi
if [ "$CRITIC_ZERO_STAGE" == "" ]; then
    CRITIC_ZERO_STAGE=0
fi
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output/tiny
fi
mkdir -p $OUTPUT
# shown as it runs and kept in training.log (DeepSpeed-Chat's scripts only write the log, so a step that failed,
# e.g. on a missing earlier step's output, said nothing); the exit status is the step's, not tee's
set -o pipefail

deepspeed --num_gpus 1 main.py --data_path tiny --data_split 4,4,2 \
   --actor_model_name_or_path $ACTOR_MODEL_PATH --critic_model_name_or_path $CRITIC_MODEL_PATH \
   --actor_zero_stage $ACTOR_ZERO_STAGE --critic_zero_stage $CRITIC_ZERO_STAGE \
   --max_prompt_seq_len 48 --max_answer_seq_len 32 \
   --per_device_generation_batch_size 32 --per_device_training_batch_size 32 \
   --actor_learning_rate 5e-5 --critic_learning_rate 5e-4 --num_warmup_steps 2 --dtype fp32 \
   --enable_hybrid_engine --num_train_epochs 2 --eval_prompts 256 --actor_dropout 0.0 --critic_dropout 0.0 \
   --deepspeed --output_dir $OUTPUT 2>&1 | tee $OUTPUT/training.log
