"""The command line: demo checks itself against the reference; compile reports a TPU program."""

import pytest

from pallas_ring import cli, layouts


# The demo compiles a ring program per layout and mask: CI runs it over the layouts the checks
# read, make test-all over every layout (as `make demo` does).
@pytest.mark.ci
@pytest.mark.parametrize("only", [("zigzag", "striped"), None],
                         ids=["zigzag_striped", "every_layout"])
def test_demo_passes(capsys, monkeypatch, only):
  if only:
    monkeypatch.setattr(layouts, "LAYOUTS", only)
  with pytest.raises(SystemExit) as e:
    cli.main(["demo"])  # T=256: two tiles per shard, so zigzag can skip the empty ones
  out = capsys.readouterr().out
  assert e.value.code == 0
  assert "zigzag" in out and "-> OK" in out
  # Causal zigzag balances work: its max/mean column reads 1.00; both error columns are small.
  line = [l for l in out.splitlines() if l.startswith("causal     zigzag")][0]
  total, balance, err, grad_err = line.split()[-4:]
  assert balance == "1.00" and float(err) < 1e-4 and float(grad_err) < 1e-4
  # ...and the table shows that striped, though balanced too, does more work in total.
  striped = [l for l in out.splitlines() if l.startswith("causal     striped")][0]
  assert float(striped.split()[-4]) > float(total)
  assert "max/mean = imbalance" in out


@pytest.mark.xdist_group("libtpu")
def test_compile_reports_memory_and_overlap(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["compile", "--topology", "v5e:2x2", "--config", "configs/tpu_v5e_8.yaml",
              "--seq-len", "4096", "--heads", "4", "--kv-heads", "4"])
  out = capsys.readouterr().out
  assert e.value.code == 0
  assert "4 x TPU v5 lite" in out and "collective permutes: some overlap the kernels" in out
  assert "causal mask, bfloat16" in out and out.count("compiled in ") == 2
  assert "temporaries" in out
  # Bytes per strategy: the ring sends its 1k-token K/V shard (4 heads of 128, bf16) 3 times.
  ring = [l for l in out.splitlines() if l.strip().startswith("ring ")][0]
  assert f"forward {3 * 2 * 1024 * 4 * 128 * 2 / 2**20:9.1f} MiB" in ring
  assert "ulysses " in out and "ulysses_ring (2 x 2)" in out


def test_compile_prints_what_auto_chose(capsys):
  """``--strategy auto``: the choice and its modelled costs, before the compiled report (a
  short causal sequence over 4 chips: Ulysses' two all-to-alls beat the ring's three steps)."""
  from pallas_ring import SequenceParallelConfig
  _, args = cli._parse_args(["compile", "--topology", "v5e:2x2", "--strategy", "auto",
                             "--seq-len", "4096"])
  cli._print_auto_choice(SequenceParallelConfig(axis_name="sp", layout="zigzag"), 4, args)
  out = capsys.readouterr().out
  assert "strategy='auto' chose 'ulysses'" in out and "ring hops forward/backward 3/0" in out


@pytest.mark.ci
@pytest.mark.parametrize("only", [("zigzag",), None], ids=["zigzag", "every_layout"])
def test_demo_runs_ulysses(capsys, monkeypatch, only):
  if only:
    monkeypatch.setattr(layouts, "LAYOUTS", only)
  with pytest.raises(SystemExit) as e:
    cli.main(["demo", "--strategy", "ulysses", "--seq-len", "128"])
  out = capsys.readouterr().out
  assert e.value.code == 0 and "strategy ulysses" in out and "-> OK" in out


@pytest.mark.parametrize("arg, value, names", [
    ("--topology", "v9z:2x4", "v5e:2x4"), ("--config", "tpu_v9", "tpu_v5e_8")])
def test_compile_bad_topology_or_preset_is_one_line(capsys, arg, value, names):
  with pytest.raises(SystemExit) as e:
    cli.main(["compile", arg, value])
  err = capsys.readouterr().err
  assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
  assert value in err and names in err and "Traceback" not in err


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("argv, says", [
    (["tune", "--batch", "0"], "--batch: '0' is not an integer >= 1"),
    (["tune", "--iters", "x"], "--iters: 'x' is not an integer >= 1"),
    (["tune", "--passes", "sideways"], "expected fwd, bwd or fwd,bwd"),
    (["tune", "--dtype", "foo"], "invalid choice: 'foo'"),
    (["tune", "--backend", "cuda"], "--backend: 'cuda': expected one of auto, pallas_tpu"),
    (["demo", "--seq-len", "100"], "--seq-len 100 must be a multiple of 16"),
    (["demo", "--backend", "bogus"], "--backend: 'bogus': expected one of auto"),
    (["demo", "--dtype", "float64"], "--dtype: invalid choice: 'float64'"),
    (["tune", "--mask", "banana"], "tune: error: --mask='banana' is not known"),
    (["compile", "--strategy", "ulysses_ring"], "needs a --config whose mesh has a Ulysses axis"),
    (["compile", "--seq-len", "100"], "compile: error: `q.shape[1] (sequence length)`=100"),
    (["tune", "--heads", "16", "--kv-heads", "3"], "--heads 16 must be a multiple of --kv-heads 3"),
    (["compile", "--heads", "8", "--kv-heads", "3"],
     "pallas_ring compile: error: --heads 8 must be a multiple of --kv-heads 3")])
def test_bad_arguments_are_one_line_errors(capsys, argv, says):
  """Bad flags are refused before anything runs (``tune --batch 0`` used to time empty arrays and
  overwrite the tile cache), in one line that names the flag."""
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and says in err and "Traceback" not in err, err


def test_help_for_each_command(capsys):
  for cmd in ("demo", "bench", "compile", "tune"):
    with pytest.raises(SystemExit) as e:
      cli.main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out


def _run(*args, env_extra=None):
  import os
  import subprocess
  import sys
  env = dict(os.environ)
  env.update(env_extra or {})
  return subprocess.run([sys.executable, "-m", "pallas_ring", *args], capture_output=True,
                        text=True, env=env, timeout=300)


def test_help_is_fast_and_bare_call_lists_the_verbs():
  import time
  t0 = time.perf_counter()
  proc = _run("--help")
  assert proc.returncode == 0 and "compile" in proc.stdout
  assert time.perf_counter() - t0 < 2.0  # JAX is not imported to parse arguments
  proc = _run()  # no verb: the verbs listed, and success (nothing went wrong)
  assert proc.returncode == 0 and "{demo,bench,compile,tune}" in proc.stdout
  proc = _run("compile", "--help")
  assert "--seq-len" in proc.stdout and "(default: 32768)" in proc.stdout


def test_compile_without_libtpu_names_the_tpu_extra():
  """Without the [tpu] extra (libtpu hidden from this process), compile says to install it
  instead of blaming a valid topology string."""
  import os
  import subprocess
  import sys
  code = ("import runpy, sys; sys.modules['libtpu'] = None; "  # (import libtpu fails)
          "sys.argv = ['pallas_ring', 'compile', '--topology', 'v5e:2x2']; "
          "runpy.run_module('pallas_ring', run_name='__main__')")
  env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=300)
  err = proc.stderr
  assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
  assert 'pip install ".[tpu]"' in err and "libtpu" in err and "v5e:2x2" in err, err
  assert "rejects" not in err and "Traceback" not in err


@pytest.mark.xdist_group("libtpu")
def test_compile_takes_the_presets_topology_and_libtpu_is_quiet():
  proc = _run("compile", "--config", "tpu_v5e_8", "--seq-len", "4096", "--heads", "4",
              "--kv-heads", "4")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "for v5e:2x4" in proc.stdout and "8 x TPU v5 lite" in proc.stdout
  for noise in ("Failed to find host bounds", "unexpected worker hostname", "Source Location"):
    assert noise not in proc.stderr and noise not in proc.stdout


@pytest.mark.xdist_group("libtpu")
def test_compile_runs_beside_another_jax_process():
  """A live JAX process of the same environment (it loaded libtpu and holds its lock file) does
  not stop `compile` (libtpu refused with "multi-process lockfile" before)."""
  import os
  import subprocess
  import sys
  # (as a user's shell has it: conftest's settings for the test workers left out)
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
  holder = subprocess.Popen([sys.executable, "-c", "import jax, sys, time; jax.devices(); "
                             "print('up', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True, env=env)
  try:
    assert holder.stdout.readline().strip() == "up"
    proc = subprocess.run([sys.executable, "-m", "pallas_ring", "compile", "--topology",
                           "v5e:2x2", "--seq-len", "2048", "--heads", "4", "--kv-heads", "4"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lockfile" not in proc.stderr
  finally:
    holder.kill()


def test_importing_and_using_jax_is_quiet_on_a_host_without_tpu():
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-c", "import pallas_ring, jax; print(jax.devices())"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0
  for noise in ("Failed to find host bounds", "unexpected worker hostname", "Source Location"):
    assert noise not in proc.stderr


def test_console_script_names_itself_and_help_shows_one_default():
  import pathlib
  import subprocess
  import sys
  script = pathlib.Path(sys.executable).parent / "pallas-ring"  # (pip install puts it there)
  assert script.exists(), "pip install -e . installs the pallas-ring console script"
  proc = subprocess.run([str(script), "tune", "--help"], capture_output=True, text=True,
                        timeout=60)
  assert proc.stdout.startswith("usage: pallas-ring tune")
  kv = " ".join(proc.stdout.split("--kv-heads KV_HEADS")[-1].split()[:12])
  assert kv.count("default") == 1, kv


@pytest.mark.xdist_group("libtpu")
def test_compile_says_which_config_fields_it_does_not_use(capsys, monkeypatch):
  """``compile`` builds one sequence-parallel axis over every chip with the TPU kernels: a
  preset's batch axes and non-TPU backend are named as unused, not dropped silently."""
  from pallas_ring import aot

  def stop(*_, **__):
    raise RuntimeError("compiled")

  monkeypatch.setattr(aot, "compile_ring", stop)
  with pytest.raises(RuntimeError, match="compiled"):
    cli.main(["compile", "--topology", "v5e:2x2", "--config", "cpu_8"])
  err = capsys.readouterr().err
  assert "batch_axes=('dp',)" in err and "backend='xla'" in err and "not used" in err, err
