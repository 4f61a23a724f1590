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


@pytest.mark.ci
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


def _install_cell(path):
  import nbformat
  nb = nbformat.read(path, as_version=4)
  return next(c.source for c in nb.cells if c.cell_type == "code")


def test_install_cell_is_the_same_in_every_notebook():
  cells = {_install_cell(p) for p in NOTEBOOKS}
  assert len(cells) == 1 and "PALLAS_RING_SOURCE" in cells.pop()


def test_install_cell_logic(capsys, monkeypatch):
  ns = {}
  exec(_install_cell(NOTEBOOKS[0]), ns)  # pallas_ring imports here: the cell installs nothing
  assert "pallas_ring is installed" in capsys.readouterr().out
  cmd = ns["install_command"]
  assert cmd("git+https://github.com/o/pallas_ring.git", "tpu", [])[-1] == \
      "pallas-ring[tpu] @ git+https://github.com/o/pallas_ring.git"
  assert cmd("", "gpu", ["/content/pallas_ring-0.1.0-py3-none-any.whl",
                         "/content/pallas_ring-0.2.0-py3-none-any.whl"])[-1] == \
      "/content/pallas_ring-0.2.0-py3-none-any.whl[cuda12]"
  assert cmd("dist/pallas_ring-0.1.0-py3-none-any.whl", "cpu", [])[-1] == \
      "dist/pallas_ring-0.1.0-py3-none-any.whl"
  with pytest.raises(RuntimeError, match="PALLAS_RING_SOURCE is empty.*make wheel"):
    cmd("", "tpu", [])
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
  assert ns["detect_runtime"]() == "tpu"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_installs_what_it_imports_and_says_tpu_is_untimed(path):
  import nbformat
  nb = nbformat.read(path, as_version=4)
  code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
  if "matplotlib" in code.split("PALLAS_RING_SOURCE", 1)[1]:
    assert 'find_spec("matplotlib")' in _install_cell(path)
  assert "have not yet been timed on a TPU" in text.replace("\n", " ")
