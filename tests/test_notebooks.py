"""The notebooks run top to bottom on CPU at smoke size, and each .ipynb matches its .py pair."""

import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_three_notebooks_exist():
  names = [os.path.basename(p) for p in NOTEBOOKS]
  assert names == ["01_quickstart.ipynb", "02_ring_attention.ipynb", "03_flax_swap_in.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_pair_in_sync(path):
  import jupytext
  a = jupytext.read(path)
  b = jupytext.read(path[:-len(".ipynb")] + ".py")
  src = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]
  assert src(a) == src(b), "run `jupytext --sync notebooks/*.py` after editing a notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
  import nbclient
  import nbformat
  nb = nbformat.read(path, as_version=4)
  env_backend = os.environ.get("MPLBACKEND")
  os.environ["MPLBACKEND"] = "Agg"
  try:
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  finally:
    if env_backend is None:
      os.environ.pop("MPLBACKEND", None)
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
