"""DeepSpeed's launcher with its pdsh command shell-quoted: what ``python train.py --deployment-type multi_node`` runs
(``python -m dschat.utils.launcher`` takes the arguments of ``deepspeed.launcher.runner``).

pdsh joins the words it is given with spaces and each node's shell reads the line, so every word must be quoted for
a shell. DeepSpeed 0.19's PDSHRunner left the working directory (``cd /path;``), the interpreter, the script, the
``--venv_script`` it sources and the ``--enable_each_rank_log`` folder bare, put the exported variables and an
argument with a space in double quotes (where the shell still expands ``$``, backquotes and backslashes) and an
argument without a space bare: a folder with a space or a ``$`` in its name, or ``--step1-args "--data_path
$HOME/x"``, reached the ranks as other words, or made the node's shell fail. The lines of ``.deepspeed_env`` stay
shell text, as DeepSpeed gives them (``HF_HOME=$HOME/hf`` is the node's home).
"""
import os
import shlex
import sys

from deepspeed.launcher import multinode_runner, runner


class QuotedPDSHRunner(multinode_runner.PDSHRunner):
    """PDSHRunner whose remote command reaches the ranks word for word."""

    def parse_user_args(self):
        return [shlex.quote(arg) for arg in self.args.user_args]

    def add_export(self, key, var):
        if (key.strip(), var.strip()) in environment_file_lines():
            # a .deepspeed_env line is shell text, as DeepSpeed gives it the node (HF_HOME=$HOME/hf: the node's home)
            super().add_export(key, var)
        else:  # the launching shell's own value, as it is (stripped as DeepSpeed's)
            self.exports[key.strip()] = shlex.quote(var.strip())

    def get_cmd(self, environment, active_resources):
        cmd, kill_cmd, environment = super().get_cmd(environment, active_resources)
        return (quoted_remote_words(cmd, self.user_script, len(self.user_arguments), self.args.venv_script), kill_cmd,
                environment)


def environment_file_lines():
    """The (name, value) lines of the .deepspeed_env files DeepSpeed's runner exports, read as it reads them."""
    lines = set()
    for folder in runner.DEEPSPEED_ENVIRONMENT_PATHS:
        path = os.path.join(folder, runner.DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(path):
            with open(path) as f:
                lines |= {(key.strip(), value.strip()) for key, sep, value in (line.partition("=") for line in f)
                          if sep}
    return lines


EACH_RANK_LOG = "--enable_each_rank_log="  # (DeepSpeed's launcher option of the folder each rank logs into)


def quoted_remote_words(cmd, script, user_words, venv_script=None):
    """PDSHRunner's command with the words it leaves bare quoted: the ``source`` of ``--venv_script`` (where given),
    the ``cd`` folder, the interpreter, the ``--enable_each_rank_log`` folder, the script (its user arguments, last,
    are already quoted)."""
    cmd, here = list(cmd), os.path.abspath(".")
    cd = cmd.index(f"cd {here};") if f"cd {here};" in cmd else None
    source = f"source {venv_script};"
    at_script = len(cmd) - user_words - 1
    if (cd is None or cmd[cd + 1] != sys.executable or cmd[at_script] != script
            or (venv_script is not None and source not in cmd[:cd])):
        raise RuntimeError(f"dschat.utils.launcher: DeepSpeed's pdsh command is not laid out as expected: {cmd}")
    if venv_script is not None:  # (a path with a space was two words to the node's shell)
        cmd[cmd.index(source)] = f"source {shlex.quote(venv_script)};"
    cmd[cd], cmd[cd + 1] = f"cd {shlex.quote(here)};", shlex.quote(sys.executable)
    cmd[at_script] = shlex.quote(script)
    for at, word in enumerate(cmd[cd:at_script], start=cd):  # (the launcher's own options, before the script)
        if word.startswith(EACH_RANK_LOG):
            cmd[at] = EACH_RANK_LOG + shlex.quote(word.removeprefix(EACH_RANK_LOG))
    return cmd


def main():
    runner.PDSHRunner = QuotedPDSHRunner  # (runner.main builds the pdsh runner by this name)
    runner.main()


if __name__ == "__main__":
    main()
