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


def _readme():
  with open(os.path.join(ROOT, "README.md")) as f:
    return f.read()


def test_readme_reads_as_a_user_guide():
  """Install comes first; prose paragraphs are at most 10 lines of at most 100 characters
  (code blocks and tables aside); results name their command."""
  text = _readme()
  sections = re.findall(r"^## (.+)$", text, flags=re.M)
  assert sections[:3] == ["Install", "The two commands", "Use"], sections
  for word in ("pip install \".[tpu]\"", "[cuda12]", "Python 3.11", "JAX 0.10.2", "Glossary"):
    assert word in text, word
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  paragraphs = [p for p in prose.split("\n\n") if p.strip() and not p.lstrip().startswith("|")]
  items = [i for p in paragraphs for i in re.split(r"\n(?=- )", p.strip())]  # (list items)
  for item in items:
    lines = item.splitlines()
    assert len(lines) <= 10, item[:200]
    assert all(len(l) <= 100 for l in lines), item[:200]
  results = text.split("## Results")[1].split("\n## ")[0]
  assert results.count("(`python") >= 3  # each table's reproducing command


@pytest.mark.ci
@pytest.mark.parametrize("index, devices", [(i, 1) for i in range(len(_python_blocks()))]
                         + [(0, 8)])
def test_readme_block_runs(index, devices, tmp_path):
  """On a plain CPU (one device) and the ring example on 8 devices (a real ring)."""
  script = tmp_path / f"readme_{index}.py"
  script.write_text(_python_blocks()[index])
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if devices > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
