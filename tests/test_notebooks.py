"""Execute every notebook in notebooks/ with nbclient (a python3 kernel of the running interpreter);
a cell that raises fails the test. The notebooks are committed with their outputs, so they render
on GitHub: the test checks the committed copy was fully executed without errors, then executes it
again (outputs are compared for errors, not for bytes; under the suite's codegen flag, and the
Megatron notebook's benchmark cell without its XLA compiles: see UNCOMPILED). Refresh the
committed outputs with ``python tests/test_notebooks.py``."""
import glob
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
DEVICES = "--xla_force_host_platform_device_count=8"  # what the first cell of each sets
# Under test, the Megatron notebook's benchmark cell plans as committed but compiles nothing: its
# compiled path (bm.run(quick=True) on the tiny model, mesh 2x4, XLA's figures in the rows, the
# Markdown table and plots made of them) is what tests/benchmarks/test_megatron_quick.py runs and
# asserts; compiling it again here took half of this notebook's run.
UNCOMPILED = {"02_megatron_reproduction.ipynb": ('meshes=("2x4",))', 'meshes=("2x4",), compile=False)')}


def errors(nb) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", ()) if o.get("output_type") == "error"]


def execute(path: str, test_codegen: bool = False):
    """The notebook at ``path`` executed afresh (outputs cleared first); with ``test_codegen``, under
    the suite's XLA codegen flag (conftest.py), not committed."""
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    if test_codegen:
        nb.cells[0].source = nb.cells[0].source.replace(DEVICES, DEVICES + " --xla_backend_optimization_level=0")
        call, uncompiled = UNCOMPILED.get(os.path.basename(path), ("", ""))
        for c in nb.cells[1:] if call else ():
            c.source = c.source.replace(call, uncompiled)
    # the kernel is a subprocess: it must import this checkout and use matplotlib's file backend
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "MPLBACKEND": "Agg"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # ipykernel's built-in "python3" spec runs the current interpreter (sys.executable)
        client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                         resources={"metadata": {"path": os.path.dirname(path)}})
        client.execute()  # raises CellExecutionError naming the failing cell
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def test_notebooks_found():
    assert [os.path.basename(p)[:2] for p in NOTEBOOKS] == ["01", "02", "03"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), \
        f"{os.path.basename(path)}: commit it executed, with its outputs (python tests/test_notebooks.py)"
    assert not errors(committed), errors(committed)
    assert f'os.environ["XLA_FLAGS"] = "{DEVICES}"' in committed.cells[0].source
    call, _ = UNCOMPILED.get(os.path.basename(path), ("", ""))
    assert not call or sum(c.source.count(call) for c in code) == 1  # the cell the test runs uncompiled
    assert not errors(execute(path, test_codegen=True))


if __name__ == "__main__":  # refresh the committed outputs
    for p in sys.argv[1:] or NOTEBOOKS:
        nbformat.write(execute(p), p)
        print("executed", os.path.relpath(p, ROOT))
