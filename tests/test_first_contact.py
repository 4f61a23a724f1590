"""What a new user meets first: the README, the Makefile and the notebooks' install cell say true,
consistent things (issue 58, "what a new user trips on")."""

import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
  with open(os.path.join(ROOT, *parts)) as f:
    return f.read()


def _python_blocks():
  return re.findall(r"```python\n(.*?)```", _read("README.md"), flags=re.S)


def test_the_readme_says_near_the_top_that_no_tpu_has_run_the_kernels():
  top = " ".join(_read("README.md").splitlines()[:15])
  assert "never run on a real TPU" in top


def test_no_placeholder_urls_in_the_install_paths():
  """The README and the notebooks' install cell name no URL that does not exist (such as
  ``github.com/<owner>/...``): the path to Colab is an uploaded ``make wheel`` wheel."""
  files = ["README.md"] + [os.path.relpath(p, ROOT) for p in
                           glob.glob(os.path.join(ROOT, "notebooks", "*.*"))]
  for name in files:
    text = _read(name)
    assert not re.search(r"<owner>|github\.com/<|git\+https://github\.com/[^o\s]", text), name
  readme = _read("README.md")
  colab = readme.split("**On Colab**")[1].split("\n\n")[0]
  assert "make wheel" in colab and "upload" in colab


def test_readme_and_makefile_give_the_suite_the_same_time():
  readme, makefile = _read("README.md"), _read("Makefile")
  full = re.search(r"`make test` about (\d+)", readme)
  quick = re.search(r"`make quick` .*?about (\d+)", readme, flags=re.S)
  assert full and quick
  make_full = re.search(r"as CI runs it \(about (\d+) minutes on 2 cores", makefile)
  make_quick = re.search(r"edit-test loop \(about (\d+) minutes on 2 cores", makefile)
  assert make_full and make_quick
  assert full.group(1) == make_full.group(1) and quick.group(1) == make_quick.group(1)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_neither_libtpu_nor_jupyter_and_make_test_does():
  dry = lambda target: subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                                      text=True, check=True).stdout
  demo = dry("demo")
  installs = [l for l in demo.splitlines() if "pip install" in l and "--upgrade pip" not in l]
  assert installs and all("tpu" not in l and "notebooks" not in l for l in installs), demo
  assert "pallas_ring demo" in demo
  assert re.search(r'pip install .*-e "\.\[test,tpu,notebooks\]"', dry("test"))


def test_every_readme_block_prints_something_to_check():
  blocks = _python_blocks()
  assert len(blocks) >= 4
  for block in blocks:
    assert "print(" in block, block[:200]


def test_the_first_examples_window_is_shorter_than_its_documents():
  """A ``SlidingWindow(w)`` over documents of ``w`` tokens or fewer changes nothing."""
  first = _python_blocks()[0]
  t = int(re.search(r"B, T, N, K, H = \d+, (\d+),", first).group(1))
  docs = int(re.search(r"jnp\.repeat\(jnp\.arange\((\d+)\), T // \1\)", first).group(1))
  window = int(re.search(r"SlidingWindow\((\d+)\)", first).group(1))
  assert window < t // docs


def test_the_readme_has_a_whole_decode_generation_loop():
  loops = [b for b in _python_blocks() if "decode=True" in b]
  assert loops, "no RingAttention(decode=True) example"
  loop = loops[0]
  for piece in ('["cache"]', "mutable=[\"cache\"]", "for _ in range(", "jax.make_mesh"):
    assert piece in loop, piece
