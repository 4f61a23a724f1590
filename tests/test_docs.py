"""Every Python block of the README runs as written on a plain CPU machine (one device)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks():
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_blocks():
  assert len(_python_blocks()) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_block_runs(index, tmp_path):
  script = tmp_path / f"readme_{index}.py"
  script.write_text(_python_blocks()[index])
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a plain CPU: one device
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
