"""Where the llm model loads its engine: on a thread of its own that exits (see run_on_own_thread)."""
import threading

import pytest

from inflight.serving.triton_models import run_on_own_thread


def test_work_runs_on_a_thread_that_is_gone_afterwards():
    ran_on = []
    assert run_on_own_thread(lambda: ran_on.append(threading.current_thread()) or 42) == 42
    assert ran_on[0] is not threading.current_thread()
    assert not ran_on[0].is_alive()


def test_its_error_is_raised_on_the_calling_thread():
    def load():
        raise FileNotFoundError("no checkpoint at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        run_on_own_thread(load)
