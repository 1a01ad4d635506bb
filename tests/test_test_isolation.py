"""What one test leaves in the process does not reach the next (conftest's fixtures): these tests run in this order."""
import pytest

NOTICES = ["say_once", "print_rank_0_once"]


def say(how, capsys):
    """The test notice said through ``how``: what it printed."""
    from dschat.utils.cli import say_once
    from dschat.utils.dist import print_rank_0_once

    if how == "say_once":
        say_once("note: a notice said once per process")
        return capsys.readouterr().err
    print_rank_0_once(("test notice",), "note: a notice said once per process")
    return capsys.readouterr().out


@pytest.mark.parametrize("how", NOTICES)
def test_a_notice_is_said_once_in_a_test(how, capsys):
    assert say(how, capsys).count("a notice said once per process") == 1
    assert say(how, capsys) == ""


@pytest.mark.parametrize("how", NOTICES)
def test_a_notice_an_earlier_test_said_is_said_again_in_the_next(how, capsys):
    """(run after the test above): each test starts as a fresh process, nothing said (conftest's nothing_said_yet)."""
    assert say(how, capsys).count("a notice said once per process") == 1


def test_the_test_processes_run_torch_on_the_threads_omp_num_threads_says():
    """conftest sets OMP_NUM_THREADS=1 unless the caller set it: torch on a thread per core in each of pytest-xdist's
    workers oversubscribed the cores, and the SFT tests ran 20 times slower on a loaded 2-core machine."""
    import os

    import torch

    assert os.environ.get("OMP_NUM_THREADS"), "conftest sets OMP_NUM_THREADS before torch is imported"
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
