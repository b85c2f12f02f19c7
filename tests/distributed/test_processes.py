"""How workers start (polytrain/distributed/processes.py): a function that a fresh process cannot import by name
(defined in ``python -c``, a REPL or a notebook, or a lambda) runs in workers forked from the launching process;
where they cannot be forked, one line says to put the function in a file."""

import json
import os
import subprocess
import sys

import pytest

import polytrain
from polytrain.errors import ConfigError

# a user's own loop, as README.md's Python section writes it, with what the workers hold at the end
LOOP = """
import torch, torch.nn.functional as F, polytrain

def train(ctx):
    sync = polytrain.strategy("sync", ctx)
    data = polytrain.build_data("digits")
    model = sync.prepare_model(polytrain.models.mlp(data.input_shape, data.num_classes, hidden=16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(sync.batches(data.train, batch_size=64, epochs=1)):
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        if step == 2:
            break
    return [float(p.sum()) for p in model.parameters()]
"""


def test_a_loop_defined_in_python_c_trains_in_forked_workers(cli_env):
    code = LOOP + "import json; print(json.dumps(polytrain.launch(train, workers=2)))"
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rank0, rank1 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rank0 == rank1  # one synchronous model: the workers really trained together


def test_where_workers_cannot_be_forked_one_line_says_to_put_the_function_in_a_file(monkeypatch):
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "spawn")
    with pytest.raises(ConfigError) as caught:
        polytrain.launch(lambda ctx: ctx.rank, workers=2)
    assert str(caught.value).startswith("launch: <lambda> cannot be sent to a fresh process (")
    assert str(caught.value).endswith("so a fresh process cannot import it, and this process cannot fork the workers "
                                      "instead (POLYTRAIN_START_METHOD=spawn starts fresh processes); put the "
                                      "function in a file (a module) and import it from there")
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.delenv("POLYTRAIN_START_METHOD")
    with pytest.raises(ConfigError, match=r"^launch: <lambda> .* cannot fork the workers instead \(forking a process "
                                          r"with threads is safe only on Linux, not on darwin\); put the function"):
        polytrain.launch(lambda ctx: ctx.rank, workers=2)
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "fork")
    with pytest.raises(ConfigError, match=r"^POLYTRAIN_START_METHOD=fork: this process cannot fork its workers "
                                          r"\(forking a process with threads is safe only on Linux, not on darwin\); "
                                          r"unset it$"):
        polytrain.launch(os.getpid, workers=2)  # importable by name: only the asked-for fork is refused


def test_a_jupyter_kernel_trains_with_launch(tmp_path, cli_env, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for key in ("PYTHONPATH",):  # the kernel is a fresh interpreter: it must find this checkout
        monkeypatch.setenv(key, cli_env[key])
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(LOOP),
        nbformat.v4.new_code_cell("ranks = polytrain.launch(train, workers=2)\nprint(ranks[0] == ranks[1], len(ranks))"),
    ])
    client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3", resources={
        "metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = notebook.cells[1].outputs
    assert [o.get("text", "").strip() for o in outputs if o.output_type == "stream" and o.name == "stdout"] == \
        ["True 2"], outputs



def _nothing():
    pass


def test_a_command_run_inside_a_program_leaves_the_helpers_it_found_and_ends_the_others(capsys):
    """``main`` in a process that had a forkserver before (a notebook, a script, this test's process) keeps it:
    the program's next workers start from it without another import of torch. Helpers not kept end (as a
    command's own do at its end: tests/cli/test_signals.py checks that no process outlives the command)."""
    from polytrain.cli.main import main
    from polytrain.distributed.mp_helpers import forkserver_pid, helper_processes
    from polytrain.distributed.processes import start_context, stop_helper_processes
    from tests.helpers.procs import alive

    proc = start_context().Process(target=_nothing)  # the forkserver and the resource tracker, running
    proc.start()
    proc.join(120)
    found = helper_processes()
    assert len(found) == 2 and alive(sorted(found)) == sorted(found)
    assert main(["checkpoint", "inspect", "/nonexistent"]) != 0
    capsys.readouterr()
    assert helper_processes() == found and alive(sorted(found)) == sorted(found)
    kept = {forkserver_pid()}  # (this process's next tests start their workers from it)
    stop_helper_processes(keep=kept)
    assert helper_processes() == kept and alive(sorted(found)) == sorted(kept)  # the resource tracker ended
