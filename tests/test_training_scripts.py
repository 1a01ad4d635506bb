"""training/stepN/training_scripts/**/*.sh, DeepSpeed-Chat's example launch scripts with dschat's flags: each is run by
bash with a stand-in ``deepspeed`` that records its command line, and the flags after ``main.py`` are parsed by that
step's own parser, so a flag renamed or dropped in a parser (or misspelled in a script) fails here, not at a user's
first launch. Nothing trains."""
import os
import stat
import subprocess
from pathlib import Path

import pytest

from dschat import args as dschat_args
from dschat.rlhf.config import check_accumulation, step3_args
from dschat.rlhf.engine import check_settings
from dschat.steps.common import check_supervised_settings

REPO = Path(__file__).resolve().parents[1]
PARSERS = {"step1_sft": dschat_args.step1_parser, "step2_rm": dschat_args.step2_parser,
           "step2_dpo": dschat_args.step2_dpo_parser, "step3_ppo": dschat_args.step3_parser}
PHASES = {"step1_sft": 1, "step2_rm": 2, "step2_dpo": 2}
SCRIPTS = sorted(REPO.glob("training/*/training_scripts/**/*.sh"))
# the deepspeed launcher's own flags the scripts give before main.py, each with its value
LAUNCHER_FLAGS = {"--num_gpus", "--num_nodes", "--master_port", "--include", "--hostfile"}
# step 3's scripts take the step-1 and step-2 models as $1 $2 (the tiny one defaults them)
STEP3_MODELS = ["/models/actor", "/models/critic"]

STAND_IN = """#!/bin/sh
printf '%s\\0' "$@" > "$DSCHAT_LAUNCHED_ARGV"
"""


def step_of(script):
    return script.relative_to(REPO / "training").parts[0]


def launched(script, tmp_path, argv=()):
    """Run ``script`` under ``bash -e`` in ``tmp_path`` with a stand-in ``deepspeed``: (its exit status, stderr, the
    argv deepspeed got or None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "deepspeed"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    record = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DSCHAT_LAUNCHED_ARGV": str(record)}
    done = subprocess.run(["bash", "-e", str(script), *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=30)
    got = record.read_bytes().decode().split("\0")[:-1] if record.exists() else None
    return done.returncode, done.stderr, got


def main_py_args(argv):
    """The flags after ``main.py``; the launcher's flags before it must be its own."""
    assert "main.py" in argv, f"no main.py in the deepspeed command: {argv}"
    at = argv.index("main.py")
    before = argv[:at]
    flags = before[0::2]
    assert set(flags) <= LAUNCHER_FLAGS and len(before) % 2 == 0, f"not the launcher's flags: {before}"
    return argv[at + 1:]


def parsed_by_step(step, flags, capsys):
    """``flags`` parsed by ``step``'s parser, then through the step's checks that need no model or data (flags that
    contradict each other, the DeepSpeed config they build)."""
    parser = PARSERS[step]()
    try:
        parser.check_given_once(flags)
        parsed = parser.parse_args(flags)
    except SystemExit:
        pytest.fail(f"{step}'s parser refused the script's flags: {capsys.readouterr().err.strip().splitlines()[-1]}")
    if step == "step3_ppo":
        parsed = step3_args(parsed)
        check_settings(parsed)
        check_accumulation(parsed)
    else:
        check_supervised_settings(parsed, PHASES[step], step)
    return parsed


def test_every_step_has_scripts_and_a_tiny_one():
    steps = {step_of(script) for script in SCRIPTS}
    assert steps == set(PARSERS)
    for step in PARSERS:
        assert (REPO / "training" / step / "training_scripts/tiny/run_tiny.sh").is_file(), step
        assert (REPO / "training" / step / "main.py").is_file(), step


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: str(s.relative_to(REPO / "training")))
def test_script_launches_its_step_with_flags_it_parses(script, tmp_path, capsys):
    assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"
    assert script.read_text().startswith("#!/bin/bash\n")
    step = step_of(script)
    argv = STEP3_MODELS if step == "step3_ppo" and script.parent.name != "tiny" else []
    status, err, got = launched(script, tmp_path, argv)
    assert status == 0 and got is not None, err
    parsed = parsed_by_step(step, main_py_args(got), capsys)
    # the OUTPUT default: the folder the script made, its log beside the model
    output = "./output/tiny" if script.parent.name == "tiny" else "./output"
    assert parsed.output_dir == output
    assert (tmp_path / output / "training.log").is_file()
    if step == "step3_ppo" and argv:
        assert [parsed.actor_model_name_or_path, parsed.critic_model_name_or_path] == STEP3_MODELS


@pytest.mark.parametrize("script", [s for s in SCRIPTS if step_of(s) != "step3_ppo"][:1] +
                         [s for s in SCRIPTS if step_of(s) == "step3_ppo"][:1],
                         ids=lambda s: str(s.relative_to(REPO / "training")))
def test_zero_stage_and_output_arguments_reach_the_step(script, tmp_path, capsys):
    step = step_of(script)
    argv = [*STEP3_MODELS, "3", "2", "out/x"] if step == "step3_ppo" else ["out/x", "3"]
    status, err, got = launched(script, tmp_path, argv)
    assert status == 0, err
    parsed = parsed_by_step(step, main_py_args(got), capsys)
    assert parsed.output_dir == "out/x" and (tmp_path / "out/x/training.log").is_file()
    if step == "step3_ppo":
        assert (parsed.actor_zero_stage, parsed.critic_zero_stage) == (3, 2)
    else:
        assert parsed.zero_stage == 3


def test_step3_script_without_the_models_says_how_to_call_it(tmp_path):
    script = REPO / "training/step3_ppo/training_scripts/opt/single_gpu/run_1.3b.sh"
    status, err, got = launched(script, tmp_path)
    assert status == 2 and got is None and "ACTOR_MODEL_PATH CRITIC_MODEL_PATH" in err


def test_a_misspelled_flag_fails_the_check(tmp_path, capsys):
    """The check above is no formality: a script with one flag misspelled is refused."""
    script = tmp_path / "run.sh"
    text = (REPO / "training/step2_rm/training_scripts/opt/single_node/run_350m.sh").read_text()
    script.write_text(text.replace("--weight_decay", "--weight_dacay"))
    status, err, got = launched(script, tmp_path)
    assert status == 0, err
    with pytest.raises(pytest.fail.Exception, match="weight_dacay"):
        parsed_by_step("step2_rm", main_py_args(got), capsys)


# train.py's folders for the models a step starts from, and the tiny scripts' (each run from its step's folder)
TINY_SCRIPT_MODELS = {"step1_sft": "../step1_sft/output/tiny", "step2_rm": "../step2_rm/output/tiny"}
# where a tiny script and train.py differ by design: the script's own folders, and the launcher's --deepspeed
PLACES = {"output_dir", "data_output_path", "tensorboard_path", "deepspeed"}


@pytest.mark.parametrize("step", sorted(PARSERS))
def test_a_tiny_script_runs_train_pys_tiny_step(step, tmp_path, capsys, monkeypatch):
    """run_tiny.sh writes out the step train.py's tiny default runs: a recipe changed in dschat/pipeline.py (what the
    README's numbers come from), a flag train.py adds (dropout off) or the model a step starts from (step 2's reward
    model from the SFT model, not a model from scratch) would leave the script training another run, unsaid. Every
    flag parses to the same value from the script as from train.py's step, but for the folders."""
    from dschat.pipeline import step_argv

    monkeypatch.syspath_prepend(str(REPO))
    import train

    args = train.parse_args(["--recipe", "dpo"] if step == "step2_dpo" else [])
    from_train_py = vars(PARSERS[step]().parse_args(step_argv(int(step[4]), args, tiny=True)))
    status, err, argv = launched(REPO / "training" / step / "training_scripts/tiny/run_tiny.sh", tmp_path)
    assert status == 0, err
    script = vars(parsed_by_step(step, main_py_args(argv), capsys))
    for folder, script_folder in TINY_SCRIPT_MODELS.items():
        train_py_folder = os.path.join(args.output_dir, folder)
        from_train_py = {dest: script_folder if value == train_py_folder else value
                         for dest, value in from_train_py.items()}
    differ = {dest: (script[dest], value) for dest, value in from_train_py.items()
              if dest not in PLACES and script[dest] != value}
    assert not differ, f"{step}'s tiny script (left) and train.py's tiny default (right) differ: {differ}"


FAILING_STAND_IN = """#!/bin/sh
echo "step starts" && echo "error: step 1's output is missing" >&2 && exit 2
"""


@pytest.mark.parametrize("step", sorted(PARSERS))
def test_a_tiny_script_shows_a_failing_steps_error_and_exits_with_its_status(step, tmp_path):
    """The tiny scripts sent everything to training.log (as DeepSpeed-Chat's do): a step run without the earlier step's
    output failed with nothing on the terminal. Its output is shown and kept in training.log, and the script exits
    with the step's status."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(FAILING_STAND_IN)
    (bin_dir / "deepspeed").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(REPO / "training" / step / "training_scripts/tiny/run_tiny.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "error: step 1's output is missing" in done.stdout + done.stderr
    log = (tmp_path / "output/tiny/training.log").read_text()
    assert "step starts" in log and "error: step 1's output is missing" in log
