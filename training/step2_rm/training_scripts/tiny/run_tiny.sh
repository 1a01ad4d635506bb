#!/bin/bash
# dschat's embedded tiny default (a tiny Llama-shaped model, the bundled synthetic data): runs offline, on a CPU
# too, in the shape of DeepSpeed-Chat's scripts; run it from the step's folder (main.py is beside training_scripts/),
# with dschat installed (pip install -e .) or on PYTHONPATH. The settings are train.py's tiny recipe.
# MODEL ($3): the model the reward model starts from, by default step 1's tiny script's output, as train.py's tiny
# default starts it from the SFT model (a 0.5M-parameter model trained from scratch learns only an answer's form).
OUTPUT=$1
ZERO_STAGE=$2
MODEL=$3
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output/tiny
fi
if [ "$ZERO_STAGE" == "" ]; then
    ZERO_STAGE=0
fi
if [ "$MODEL" == "" ]; then
    MODEL=../step1_sft/output/tiny
fi
mkdir -p $OUTPUT
# shown as it runs and kept in training.log (DeepSpeed-Chat's scripts only write the log, so a step that failed,
# e.g. on a missing earlier step's output, said nothing); the exit status is the step's, not tee's
set -o pipefail

deepspeed --num_gpus 1 main.py --model_name_or_path $MODEL --data_path tiny --data_split 4,4,2 \
   --max_seq_len 96 --per_device_train_batch_size 16 --per_device_eval_batch_size 32 \
   --learning_rate 1e-3 --num_train_epochs 4 --num_warmup_steps 10 --dtype fp32 --dropout 0.0 \
   --zero_stage $ZERO_STAGE --deepspeed --output_dir $OUTPUT 2>&1 | tee $OUTPUT/training.log
