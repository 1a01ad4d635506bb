"""Edge cases of the tools for trained models (chat.py, rw_eval, ppo_eval) met after training."""
import json

import pytest

from dschat.errors import UsageError
from dschat.tools.common import find_policy_path, find_reward_model_path


def _model_folder(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("text", ['{"policy": "step1', "[1, 2]"])
def test_a_damaged_report_json_is_an_error_naming_it_not_a_traceback(tmp_path, text):
    """A run folder whose report.json is cut short or edited into no object: chat.py, prompt_eval, ppo_eval and rw_eval
    failed with json's JSONDecodeError (or AttributeError) traceback."""
    _model_folder(tmp_path / "step1_sft")
    (tmp_path / "report.json").write_text(text)
    for find in (find_policy_path, find_reward_model_path):
        with pytest.raises(UsageError, match="report.json"):
            find(str(tmp_path))
