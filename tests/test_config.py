import glob
import os

import pytest
import yaml

from pallas_ring.config import BlockSizes, SequenceParallelConfig

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_defaults_and_hashable():
  cfg = SequenceParallelConfig()
  assert cfg.axis_name == "sp" and cfg.layout == "contiguous" and cfg.strategy == "ring"
  assert hash(cfg) == hash(SequenceParallelConfig())


def test_from_dict_with_nested_block_sizes():
  cfg = SequenceParallelConfig.from_dict({"axis_name": "seq", "layout": "zigzag",
                                          "batch_axes": ["dp"], "block_sizes": {"block_q": 128}})
  assert cfg.batch_axes == ("dp",)
  assert cfg.block_sizes == BlockSizes(block_q=128)


def test_unknown_key_suggests_closest():
  with pytest.raises(ValueError, match="unknown key 'layuot'.*Did you mean 'layout'"):
    SequenceParallelConfig.from_dict({"layuot": "zigzag"})
  with pytest.raises(ValueError, match="unknown key 'layot'.*Did you mean 'layout'"):
    SequenceParallelConfig().replace(layot="zigzag")
  with pytest.raises(ValueError, match="'block_kv'"):
    BlockSizes.from_dict({"block_k": 64})


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("kw, match", [
    (dict(layout="spiral"), r"layout='spiral'.*zigzag"),
    (dict(strategy="tree"), r"strategy='tree'.*all_gather"),
    (dict(backend="cuda"), r"backend='cuda'.*pallas_triton"),
    (dict(scan_unroll=0), r"scan_unroll=0.*>= 1"),
    (dict(axis_name=""), r"axis_name=''"),
    (dict(axis_name="sp", batch_axes=("sp",)), r"axis_name='sp' is also in batch_axes"),
    (dict(head_axis=""), r"head_axis='' must be a mesh axis name \(a non-empty string\)"),
])
def test_invalid_values(kw, match):
  with pytest.raises(ValueError, match=match):
    SequenceParallelConfig(**kw)


def test_invalid_block_size():
  with pytest.raises(ValueError, match=r"BlockSizes.block_q=0"):
    BlockSizes(block_q=0)


PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_presets_exist():
  names = {os.path.basename(p) for p in PRESETS}
  assert {"cpu_8.yaml", "tpu_v5e_8.yaml", "tpu_v6e_8.yaml", "tpu_v5p_16.yaml", "gpu_8xh100.yaml",
          "gpu_4xh200.yaml"} <= names


TPU_PRESETS = [p for p in PRESETS if "topology" in yaml.safe_load(open(p))]


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("path", TPU_PRESETS, ids=os.path.basename)
def test_tpu_presets_compile_the_ring(path):
  from pallas_ring.aot import compile_ring
  topology = yaml.safe_load(open(path))["topology"]
  rep = compile_ring(topology, SequenceParallelConfig.from_yaml(path), seq_len=8192, heads=4,
                     kv_heads=4)
  assert rep.num_devices == 8 and rep.kernels >= 3
  assert rep.permutes_overlap_kernels


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_presets_parse(path):
  cfg = SequenceParallelConfig.from_yaml(path)
  assert isinstance(cfg, SequenceParallelConfig)
  assert cfg.axis_name


def test_yaml_unknown_key(tmp_path):
  p = tmp_path / "bad.yaml"
  p.write_text("sequence_parallel:\n  axis_name: sp\n  stratgy: ring\n")
  with pytest.raises(ValueError, match="Did you mean 'strategy'"):
    SequenceParallelConfig.from_yaml(p)


def test_presets_by_name_and_their_mesh():
  from pallas_ring.config import load_preset, preset_names
  assert "tpu_v5e_8" in preset_names()
  assert SequenceParallelConfig.preset("tpu_v5e_8") == SequenceParallelConfig.from_yaml(
      os.path.join(ROOT, "configs", "tpu_v5e_8.yaml"))
  preset = load_preset("cpu_8")
  mesh = preset.make_mesh()  # conftest gives 8 CPU devices
  assert dict(mesh.shape) == dict(zip(preset.mesh_axes, preset.mesh_shape))
  assert load_preset("tpu_v6e_8").topology == "v6e:2x4"
  with pytest.raises(ValueError, match=r"unknown preset 'tpu_v5e8'.*Did you mean 'tpu_v5e_8'"):
    SequenceParallelConfig.preset("tpu_v5e8")


def test_design_preset_paths_load_from_any_directory(tmp_path, monkeypatch):
  """``from_yaml("configs/tpu_v5e_8.yaml")`` (DESIGN's example) reads the shipped file from any
  working directory; a missing file names the presets."""
  monkeypatch.chdir(tmp_path)
  want = SequenceParallelConfig.preset("tpu_v5e_8")
  assert SequenceParallelConfig.from_yaml("configs/tpu_v5e_8.yaml") == want
  assert SequenceParallelConfig.from_yaml("./configs/tpu_v5e_8.yaml") == want
  with pytest.raises(FileNotFoundError, match=r"no YAML file at 'nope/x.yaml'.*tpu_v5e_8"):
    SequenceParallelConfig.from_yaml("nope/x.yaml")


def test_presets_ship_as_package_data():
  import pallas_ring.config as config_lib
  assert os.path.isdir(config_lib.PRESETS_DIR)
  assert os.path.dirname(config_lib.PRESETS_DIR) == os.path.dirname(config_lib.__file__)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("text, says", [
    ("mesh: {shape: 8, axes: sp}", r"`mesh` must be \{shape: \[...\], axes: \[...\]\}"),
    ("sequence_parallel: {batch_axes: [dp]}\nmesh: {shape: [8], axes: [sp]}",
     r"names mesh axes \['dp'\] that the preset's mesh \(axes \['sp'\]\) lacks"),
    ("sequence_parallel: {strategy: ulysses_ring, ulysses_axis: 5}",
     r"ulysses_axis=5 must be a mesh axis name"),
    ("topology: 12", r"`topology` must be a TPU topology such as 'v5e:2x4', got 12"),
    ("topology: banana", r"`topology` must be a TPU topology such as 'v5e:2x4', got 'banana'"),
    # (never silently absent: an empty or false section, a bool count, an axis named twice)
    ("mesh: []", r"`mesh` must be \{shape: \[...\], axes: \[...\]\}.*got \[\]"),
    ("mesh: false", r"`mesh` must be .*got False"),
    ("mesh: {shape: [true, 4], axes: [dp, sp]}", r"`mesh` must be .*got \{'shape': \[True"),
    ("mesh: {shape: [2, 2], axes: [sp, sp]}", r"distinct axis names, got"),
    ("sequence_parallel: []", r"SequenceParallelConfig expects a mapping"),
    ("sequence_parallel:\n  layout: zigzag\n  layout: striped",
     r"key 'layout' appears more than once in one mapping \(again on line 3\)"),
    ("mesh: {shape: [4], axes: [sp]}\nlayout: zigzag",
     r"'layout' is a config field beside the sections .* move it under sequence_parallel:")])
def test_yaml_bad_values_name_the_field(tmp_path, text, says):
  p = tmp_path / "bad.yaml"
  p.write_text(("sequence_parallel: {axis_name: sp}\n" if "sequence_parallel" not in text
                else "") + text + "\n")
  with pytest.raises(ValueError, match=says):
    SequenceParallelConfig.from_yaml(p)


def test_yaml_misspelled_section(tmp_path):
  p = tmp_path / "bad.yaml"
  p.write_text("sequence_paralel:\n  axis_name: sp\nmesh: {shape: [8], axes: [sp]}\n")
  with pytest.raises(ValueError, match=r"unknown top-level section 'sequence_paralel'.*"
                                       r"Did you mean 'sequence_parallel'"):
    SequenceParallelConfig.from_yaml(p)
