"""The benchmark's timing and plotting helpers (the GPU benchmarks themselves run on GPUs
only)."""

import time

import jax.numpy as jnp
import pytest

from pallas_ring import bench


def test_interleaved_timing_calls_every_implementation_alike():
  calls = []

  def make(name):
    def f(x):
      calls.append(name)
      return x + 1
    return f

  res = bench.timeit_interleaved({"a": (make("a"), (jnp.ones(3),)),
                                  "b": (make("b"), (jnp.ones(3),))}, iters=3, reps=4,
                                 min_batch_s=0.0)  # batches of exactly `iters` calls
  assert set(res) == {"a", "b"} and all(t > 0 for t in res.values())
  # Two warm-up calls and one sizing batch each, then the repetitions alternate, every other
  # one in reverse order (the place in the order matters too): a a a b b b b b b a a a ...
  assert calls[:10] == ["a"] * 5 + ["b"] * 5
  assert calls[10:] == (["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3) * 2


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_give_every_place_and_predecessor_alike(n):
  orders = bench.balanced_orders(n)
  assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
  assert all(sorted(o) == list(range(n)) for o in orders)
  for impl in range(n):  # every place equally often
    places = [o.index(impl) for o in orders]
    assert all(places.count(p) == len(orders) // n for p in range(n))
  pairs = [(a, b) for o in orders for a, b in zip(o, o[1:])]
  if n > 1:  # every ordered pair of neighbours equally often
    assert len(set(pairs)) == n * (n - 1)
    assert all(pairs.count(p) == len(pairs) // (n * (n - 1)) for p in set(pairs))


def test_interleaved_timing_rounds_reps_up_to_whole_rounds():
  calls = {c: (lambda x: x + 1, (jnp.ones(3),)) for c in "abc"}
  samples = bench.interleaved_samples(calls, iters=1, reps=4, min_batch_s=0.0)  # 6 orders of 3
  assert all(len(ts) == 6 for ts in samples.values())


def test_short_calls_are_timed_in_longer_batches():
  assert bench.MIN_BATCH_S == 0.05
  calls = []

  def f(x):  # at least 1 ms a call: a 50 ms batch is at most 50 calls
    calls.append(1)
    time.sleep(1e-3)
    return x

  secs = bench.timeit(f, jnp.ones(3), iters=2, reps=1)
  batch = len(calls) - 2 - 2  # minus the warm-up calls and the sizing batch
  assert 4 <= batch <= 50, batch  # (4: even with calls of 6 ms on a busy machine)
  assert secs >= 1e-3


def test_given_batch_sizes_time_lone_calls_beside_sustained_batches():
  counts = {"lone": 0, "batch": 0}

  def f(name):
    def call(x):
      counts[name] += 1
      time.sleep(1e-3)
      return x
    return call

  calls = {name: (f(name), (jnp.ones(3),)) for name in counts}
  bench.interleaved_samples(calls, iters=3, reps=2, batches={"lone": 1})
  assert counts["lone"] == 2 + 2 * 1  # two warm-ups, then 2 repetitions of one call
  assert counts["batch"] >= 2 + 3 + 2 * 3  # warm-ups, the sizing batch, 2 batches of >= 3


def _write_trace(path, events):
  import gzip
  import json
  path.mkdir(parents=True)
  with gzip.open(path / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_device_spans_take_every_gpus_ops_inside_each_annotation(tmp_path):
  meta = lambda pid, name: {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
  op = lambda ts, dur, pid=2: {"ph": "X", "pid": pid, "name": "k", "ts": ts, "dur": dur}
  _write_trace(tmp_path / "plugins" / "profile" / "run", [
      meta(1, "/host:CPU"), meta(2, "/device:GPU:0 (pid 2)"), meta(3, "/device:GPU:1"),
      {"ph": "X", "pid": 1, "name": "sample 0", "ts": 100.0, "dur": 50.0},
      {"ph": "X", "pid": 1, "name": "sample 1", "ts": 200.0, "dur": 50.0},
      op(110.0, 10.0), op(125.0, 5.0),  # sample 0: span 20 us, busy 15 us
      op(210.0, 30.0), op(215.0, 35.0, pid=3),  # sample 1: GPU 1 ends last, busiest
      op(160.0, 1.0)])  # between the samples
  spans = bench.device_spans(str(tmp_path), ["sample 0", "sample 1"])
  assert spans == [pytest.approx((20e-6, 15e-6, 2)), pytest.approx((40e-6, 35e-6, 2))]


def test_device_clock_without_gpu_ops_names_the_problem():
  with bench.clock("device"), pytest.raises(RuntimeError, match="no GPU op inside 'sample 0'"):
    bench.interleaved_samples({"a": (lambda x: x + 1, (jnp.ones(3),))}, iters=1, reps=1,
                              min_batch_s=0.0)
  with pytest.raises(ValueError, match="use 'wall' or 'device'"):
    with bench.clock("host"):
      pass


def test_visible_pairs_of_each_mask_kind():
  assert bench.visible_pairs(8, "full") == 64
  assert bench.visible_pairs(8, "causal") == 36
  assert bench.visible_pairs(8, "window", window=2) == 1 + 2 + 3 * 6
  assert bench.visible_pairs(8, "documents", doc=4) == 2 * 10


def test_plot_groups_each_case_and_pass(tmp_path, monkeypatch):
  """``bench.plot``: one bar group per (case, pass), one labelled bar per implementation."""
  pytest.importorskip("matplotlib")
  import matplotlib.pyplot as plt
  rows = [bench.Row(case, impl, pass_, 1.0, tflops)
          for case, pass_, tflops in (("dense", "fwd", 600.0), ("dense", "fwd+bwd", 500.0),
                                      ("causal", "fwd", 550.0))
          for impl in ("ours", "cuDNN")]
  seen = {}
  real_savefig = plt.Figure.savefig

  def savefig(fig, path, **kw):
    ax = fig.axes[0]
    seen["ticks"] = [t.get_text() for t in ax.get_yticklabels()]
    seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
    seen["bars"] = len(ax.patches)
    return real_savefig(fig, path, **kw)

  monkeypatch.setattr(plt.Figure, "savefig", savefig)
  bench.plot(rows, str(tmp_path / "p.png"), "title")
  assert (tmp_path / "p.png").stat().st_size > 0
  assert seen == {"ticks": ["dense, fwd", "dense, fwd+bwd", "causal, fwd"],
                  "legend": ["ours", "cuDNN"], "bars": 6}


def test_main_without_a_gpu_says_so_and_fails():
  import argparse
  from pallas_ring import bench
  assert bench.main(argparse.Namespace()) == 1  # (CPU: nothing is timed)


def test_main_writes_the_rows_as_json_and_a_table(tmp_path, monkeypatch, capsys):
  """``bench.main`` (``python -m pallas_ring bench``) after its measurements: the rows go to
  ``OUT/NAME.json`` and a markdown table (the GPU and its timings faked)."""
  import argparse
  import json
  from pallas_ring import bench
  from pallas_ring.timing import Row
  rows = [Row("causal T=8k", "cudnn", "fwd", 1.5, 600.0),
          Row("causal T=8k", "ours", "fwd", 1.25, 720.0, "1.2x")]
  monkeypatch.setattr(bench.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(bench, "model_shapes", lambda log: rows)
  monkeypatch.setattr(bench, "plot", lambda *a: None)
  args = argparse.Namespace(out=str(tmp_path), device_time=False, long_context=0, ring=False,
                            extras=False, models=True, decode=False)
  assert bench.main(args) == 0
  saved = json.loads((tmp_path / "models.json").read_text())
  assert [r["ms"] for r in saved["rows"]] == [1.5, 1.25]
  assert "| causal T=8k | ours | fwd | 1.250 | 720.0 | 1.2x |" in capsys.readouterr().out
