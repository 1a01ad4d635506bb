#!/bin/bash
# DeepSpeed-Chat's script of this name with dschat's flags. Run it from the step's folder (main.py is beside
# training_scripts/), with dschat installed (pip install -e .) or on PYTHONPATH.
# One GPU: OPT-1.3B with LoRA (rank 128) on Dahoas/rm-static (the default --data_path tiny is dschat's).
OUTPUT=$1
ZERO_STAGE=$2
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output
fi
if [ "$ZERO_STAGE" == "" ]; then
    ZERO_STAGE=0
fi
mkdir -p $OUTPUT

deepspeed --num_gpus 1 main.py --model_name_or_path facebook/opt-1.3b --data_path Dahoas/rm-static \
   --gradient_accumulation_steps 8 --lora_dim 128 --lora_module_name decoder.layers. --zero_stage $ZERO_STAGE \
   --enable_tensorboard \
   --tensorboard_path $OUTPUT \
   --deepspeed --output_dir $OUTPUT &> $OUTPUT/training.log
