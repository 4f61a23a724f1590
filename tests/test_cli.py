"""The command line: demo checks itself against the reference; compile reports a TPU program."""

import pytest

from pallas_ring import cli


def test_demo_passes(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["demo", "--seq-len", "128"])
  out = capsys.readouterr().out
  assert e.value.code == 0
  assert "zigzag" in out and "-> OK" in out
  # Causal zigzag balances work: its max/mean column reads 1.00; both error columns are small.
  line = [l for l in out.splitlines() if l.startswith("causal     zigzag")][0]
  balance, err, grad_err = line.split()[-3:]
  assert balance == "1.00" and float(err) < 1e-4 and float(grad_err) < 1e-4


@pytest.mark.xdist_group("libtpu")
def test_compile_reports_memory_and_overlap(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["compile", "--topology", "v5e:2x2", "--config", "configs/tpu_v5e_8.yaml",
              "--seq-len", "4096", "--heads", "4", "--kv-heads", "4"])
  out = capsys.readouterr().out
  assert e.value.code == 0
  assert "4 x TPU v5 lite" in out and "permutes overlap kernels: yes" in out
  assert "temporaries" in out


def test_help_for_each_command(capsys):
  for cmd in ("demo", "bench", "compile"):
    with pytest.raises(SystemExit) as e:
      cli.main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out
