"""Tools for trained models (DeepSpeed-Chat's ``inference/chatbot.py``, ``prompt_eval.py``, ``rw_eval.py``).

* ``chat``: interactive multi-turn chat with a trained policy (``python chat.py --path output``).
* ``prompt_eval``: step-1 check, baseline vs fine-tuned answers to the same prompts.
* ``rw_eval``: step-2 check, reward-model scores of answers and pair accuracy.
* ``ppo_eval``: step-3 check, held-out reward and rule score of a policy (and a baseline).

All of them run in one plain process (CPU, or the GPU when there is one), without DeepSpeed, and format text
with ``dschat.data.formatting`` so that they see exactly what training saw.
"""
