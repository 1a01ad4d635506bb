#!/bin/bash
# DeepSpeed-Chat's script of this name with dschat's flags. Run it from the step's folder (main.py is beside
# training_scripts/), with dschat installed (pip install -e .) or on PYTHONPATH.
# One GPU: an OPT-350m reward model on Dahoas/rm-static.
OUTPUT=$1
ZERO_STAGE=$2
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output
fi
if [ "$ZERO_STAGE" == "" ]; then
    ZERO_STAGE=0
fi
mkdir -p $OUTPUT

deepspeed --num_gpus 1 main.py --model_name_or_path facebook/opt-350m --data_path Dahoas/rm-static \
   --weight_decay 0.1 --dropout 0.0 --gradient_accumulation_steps 4 --zero_stage $ZERO_STAGE \
   --enable_tensorboard \
   --tensorboard_path $OUTPUT \
   --deepspeed --output_dir $OUTPUT &> $OUTPUT/training.log
