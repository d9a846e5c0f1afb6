"""k3.ops.tuning: the shipped autotune choices, pinned into kernels' autotune caches (CPU, Autotuner-shaped fakes;
the real Triton Autotuner under the interpreter where triton is installed)."""
import json
import sys
import types

import pytest

from k3 import envs
from k3.ops import tuning

MODULE = "k3.ops._fake_tuned"  # a module under k3.ops that only these tests create
GPU = "NVIDIA H200"


class FakeConfig:
    """The fields of triton.Config that a table names."""

    def __init__(self, kwargs, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None):
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages
        self.num_ctas, self.maxnreg = num_ctas, maxnreg


class FakeAutotuner:
    """What Triton's Autotuner exposes: cache (key tuple -> config), configs, keys, arg_names, base_fn."""

    def __init__(self, configs, keys=("n",), arg_names=("x", "n", "BLOCK"), module=MODULE):
        self.configs, self.keys, self.arg_names, self.cache = list(configs), list(keys), list(arg_names), {}
        self.base_fn = types.SimpleNamespace(__module__=module)


class FakeHeuristics:
    """@triton.heuristics over an autotuner: the tuner is its .fn."""

    def __init__(self, fn):
        self.fn = fn


SMALL = FakeConfig({"BLOCK": 32}, num_warps=4, num_stages=2)
LARGE = FakeConfig({"BLOCK": 128}, num_warps=8, num_stages=3)
KEY = [4096, "torch.bfloat16"]


def config_json(block=128, num_warps=8, num_stages=3, **extra):
    return {"kwargs": {"BLOCK": block}, "num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1,
            "maxnreg": None, **extra}


def table(kernels, gpu=GPU, fla="0.6.0"):
    return {"format": tuning.FORMAT, "gpus": {gpu: {"fla": fla, "triton": "3.6.0", "made_by": "test",
                                                    "kernels": kernels}}}


@pytest.fixture
def kernels(monkeypatch):
    """A fake kernel module: `plain` (an autotuner), `wrapped` (one under heuristics), `single` (one config)."""
    module = types.ModuleType(MODULE)
    module.plain = FakeAutotuner([SMALL, LARGE])
    module.wrapped = FakeHeuristics(FakeAutotuner([SMALL, LARGE]))
    module.single = FakeAutotuner([SMALL])
    module.not_a_kernel = 42
    monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.setattr(tuning, "_pinned_devices", {})
    return module


def pin_table(data):
    parsed = tuning.parse_table(data)
    return tuning.pin(parsed[GPU]["kernels"])


def test_pin_fills_exactly_the_tables_keys_with_the_kernels_own_config(kernels):
    n = pin_table(table({f"{MODULE}.plain": [{"key": KEY, "config": config_json()}],
                         f"{MODULE}.wrapped": [{"key": [1, "torch.float32"], "config": config_json(32, 4, 2)}]}))
    assert n == 2
    assert kernels.plain.cache == {(4096, "torch.bfloat16"): LARGE}
    assert kernels.plain.cache[(4096, "torch.bfloat16")] is LARGE  # the candidate itself, not a copy
    assert kernels.wrapped.fn.cache == {(1, "torch.float32"): SMALL}
    assert (4096, "torch.float32") not in kernels.plain.cache  # another key: Triton autotunes it


def test_pin_keeps_a_result_the_process_tuned_itself(kernels):
    kernels.plain.cache[tuple(KEY)] = SMALL
    pin_table(table({f"{MODULE}.plain": [{"key": KEY, "config": config_json()}]}))
    assert kernels.plain.cache[tuple(KEY)] is SMALL


@pytest.mark.parametrize("name, message", [
    (f"{MODULE}.missing", "has no autotuned kernel 'missing'"),
    (f"{MODULE}.not_a_kernel", "has no autotuned kernel 'not_a_kernel'"),
    ("k3.ops.no_such_module.kernel", "does not import"),
    ("k3.ops.tuning.os", "has no autotuned kernel 'os'"),
])
def test_an_unknown_kernel_is_refused_by_name(kernels, name, message):
    with pytest.raises(tuning.TableError, match=message):
        pin_table(table({name: [{"key": KEY, "config": config_json()}]}))


@pytest.mark.parametrize("name", ["os.system", "subprocess.Popen", "k3.cli.main", "fla", "builtins.eval",
                                  "k3.ops.x;import os", "fla.ops..x"])
def test_a_kernel_outside_the_kernel_packages_is_refused_before_any_import(kernels, name, monkeypatch):
    imported = []
    monkeypatch.setattr(tuning.importlib, "import_module", lambda m: imported.append(m))
    with pytest.raises(tuning.TableError, match="is not a kernel of"):
        tuning.parse_table(table({name: [{"key": KEY, "config": config_json()}]}))
    with pytest.raises(tuning.TableError, match="unknown kernel"):
        tuning.resolve_kernel(name)
    assert imported == []


def test_a_config_field_the_kernel_does_not_take_is_refused_and_nothing_is_pinned(kernels):
    bad = config_json()
    bad["kwargs"] = {"BLOCK": 128, "BLOCK_Q": 64}
    data = table({f"{MODULE}.wrapped": [{"key": KEY, "config": config_json()}],
                  f"{MODULE}.plain": [{"key": KEY, "config": bad}]})
    with pytest.raises(tuning.TableError, match=r"\['BLOCK_Q'\] are not parameters of the kernel"):
        pin_table(data)
    assert kernels.wrapped.fn.cache == {} and kernels.plain.cache == {}  # checked all, then pinned: none


@pytest.mark.parametrize("change", [dict(num_warps=16), dict(num_stages=7), dict(block=64), dict(maxnreg=128)])
def test_a_config_that_is_not_one_of_the_kernels_candidates_is_refused(kernels, change):
    block = change.pop("block", 128)
    with pytest.raises(tuning.TableError, match="is not one of the kernel's 2 candidates"):
        pin_table(table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(block, **change)}]}))
    assert kernels.plain.cache == {}


def test_a_key_longer_than_the_kernel_can_build_is_refused(kernels):
    with pytest.raises(tuning.TableError, match="longer than the kernel's autotune key"):
        pin_table(table({f"{MODULE}.plain": [{"key": [1] * 5, "config": config_json()}]}))


@pytest.mark.parametrize("data, field", [
    ([], "not an autotune table"),
    ({"format": "k3-autotune-table/0", "gpus": {}}, "not an autotune table"),
    ({"format": tuning.FORMAT, "gpus": {}, "extra": 1}, r"unknown top-level field\(s\) \['extra'\]"),
    ({"format": tuning.FORMAT, "gpus": []}, "gpus must be an object"),
    ({"format": tuning.FORMAT, "gpus": {GPU: {"kernels": []}}}, "must be an object with a 'kernels' object"),
    ({"format": tuning.FORMAT, "gpus": {GPU: {"kernels": {}, "fla": 6}}}, r"\.fla: must be a string"),
    (table({f"{MODULE}.plain": {"key": KEY}}), "must be a list of"),
    (table({f"{MODULE}.plain": [{"key": KEY}]}), "exactly 'key' and 'config'"),
    (table({f"{MODULE}.plain": [{"key": [[1]], "config": config_json()}]}), r"\.key: must be a list of numbers"),
    (table({f"{MODULE}.plain": [{"key": "4096", "config": config_json()}]}), r"\.key: must be a list of numbers"),
    (table({f"{MODULE}.plain": [{"key": KEY, "config": [128]}]}), r"\.config: must be an object"),
    (table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(pre_hook="os.system")}]}),
     r"unknown field\(s\) \['pre_hook'\]"),
    (table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(num_warps="8")}]}), r"\.num_warps: must be an"),
    (table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(num_warps=True)}]}), r"\.num_warps: must be an"),
    (table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(num_stages=10 ** 9)}]}), r"\.num_stages: must be"),
    (table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(maxnreg=-1)}]}), r"\.maxnreg: must be null"),
    (table({f"{MODULE}.plain": [{"key": KEY, "config": dict(config_json(), kwargs={"BLOCK": [1]})}]}),
     r"\.kwargs: must map parameter names"),
])
def test_a_malformed_table_is_refused_naming_the_field(data, field):
    with pytest.raises(tuning.TableError, match=field):
        tuning.parse_table(data, "t.json")


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ('{"format": "k3-autotune-table/1", "gpus": {"g": {"kernels": {"k3.ops.a.b": [{"key": [NaN], '
     '"config": {}}]}}}}', "not valid JSON"),
    ("[" * 200_000 + "]" * 200_000, "not valid JSON"),  # nesting deep enough to exhaust the recursion limit
    ("\udcff", "not valid JSON"),
])
def test_a_hostile_table_file_is_a_table_error_not_a_crash(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(tuning.TableError, match=message):
        tuning.load_table(path)


def test_an_oversized_or_missing_table_file_is_refused(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(" " * (tuning.MAX_TABLE_BYTES + 1))
    with pytest.raises(tuning.TableError, match="larger than"):
        tuning.load_table(path)
    with pytest.raises(tuning.TableError, match="cannot read"):
        tuning.load_table(tmp_path / "absent.json")


def fake_gpu(monkeypatch, name, fla="0.6.0", hardware=("sm_80", 108)):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tuning, "fla_version", lambda: fla)
    monkeypatch.setattr(tuning, "hardware_of", lambda device: hardware)


def write(tmp_path, data):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return path


def test_pin_for_device_pins_the_gpus_section_once(kernels, tmp_path, monkeypatch):
    path = write(tmp_path, table({f"{MODULE}.plain": [{"key": KEY, "config": config_json()}]}))
    fake_gpu(monkeypatch, GPU)
    with envs.override(autotune_table=str(path)):
        assert tuning.pin_for_device("cuda:0") == 1
        kernels.plain.cache.clear()
        assert tuning.pin_for_device("cuda:0") == 1  # once per device: the second call reads nothing
    assert kernels.plain.cache == {} and tuning.pinned_count(0) == 1


@pytest.mark.parametrize("gpu, fla, setting", [("NVIDIA A100-SXM4-80GB", "0.6.0", None),
                                               (GPU, "0.7.0", None), (GPU, "0.6.0", "off")])
def test_another_gpu_fla_version_or_off_leaves_triton_to_autotune(kernels, tmp_path, monkeypatch, gpu, fla,
                                                                  setting):
    path = write(tmp_path, table({f"{MODULE}.plain": [{"key": KEY, "config": config_json()}]}))
    fake_gpu(monkeypatch, gpu, fla)
    with envs.override(autotune_table=setting or str(path)):
        assert tuning.pin_for_device("cuda:0") == 0
    assert kernels.plain.cache == {}


def sections(*gpus):
    """A table with a section per (name, arch, SMs, BLOCK): the choice for KEY each GPU made (BLOCK 128 is the
    fake kernel's LARGE config, 32 its SMALL)."""
    launch = {128: (8, 3), 32: (4, 2)}
    data = table({})
    data["gpus"] = {name: {"fla": "0.6.0", "made_by": "test", **({"arch": arch, "sms": sms} if arch else {}),
                           "kernels": {f"{MODULE}.plain": [{"key": KEY, "config": config_json(block, *launch[block])}]}}
                    for name, arch, sms, block in gpus}
    return data


@pytest.mark.parametrize("hardware, borrowed", [(("sm_90", 132), 128), (("sm_90", 114), 128), (("sm_90", 80), 32),
                                                (("sm_100", 132), None)])
def test_a_gpu_the_table_does_not_name_borrows_the_nearest_section_of_its_architecture(
        kernels, tmp_path, monkeypatch, caplog, hardware, borrowed):
    """An H100 (sm_90, 132 SMs) pins the H200's choices (sm_90, 132), not those of an sm_90 card of 78 SMs; an sm_90
    card of 80 SMs takes the latter's; a section that records no architecture is never borrowed, and a GPU of an
    architecture no section has autotunes."""
    import logging

    path = write(tmp_path, sections(("NVIDIA H200", "sm_90", 132, 128), ("Small Hopper", "sm_90", 78, 32),
                                    ("Unknown card", "", 0, 32)))
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", hardware=hardware)
    with envs.override(autotune_table=str(path)), caplog.at_level(logging.INFO, logger=tuning.__name__):
        assert tuning.pin_for_device("cuda:0") == (borrowed is not None)
    if borrowed is None:
        assert kernels.plain.cache == {} and "or its architecture" in caplog.text
    else:
        (config,) = kernels.plain.cache.values()
        assert config.kwargs["BLOCK"] == borrowed and "pinning those of" in caplog.text


def test_a_gpu_named_in_the_table_pins_its_own_section_over_a_nearer_one(kernels, tmp_path, monkeypatch):
    path = write(tmp_path, sections(("NVIDIA H100 80GB HBM3", "sm_90", 114, 32), ("NVIDIA H200", "sm_90", 132, 128)))
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", hardware=("sm_90", 132))
    with envs.override(autotune_table=str(path)):
        assert tuning.pin_for_device("cuda:0") == 1
    (config,) = kernels.plain.cache.values()
    assert config.kwargs["BLOCK"] == 32


@pytest.mark.parametrize("field, value", [("sms", -1), ("sms", 1.5), ("sms", True), ("arch", 90)])
def test_a_sections_hardware_fields_are_checked(tmp_path, field, value):
    data = sections(("NVIDIA H200", "sm_90", 132, 128))
    data["gpus"]["NVIDIA H200"][field] = value
    with pytest.raises(tuning.TableError, match=rf"\.{field}: must be"):
        tuning.load_table(write(tmp_path, data))


def test_merge_records_the_hardware_and_keeps_it_when_not_given(monkeypatch):
    monkeypatch.setattr(tuning, "fla_version", lambda: "0.6.0")
    entry = {"key": KEY, "config": config_json()}
    made = tuning.merge(None, "NVIDIA H200", {f"{MODULE}.plain": [entry]}, "test", [], ("sm_90", 132))
    again = tuning.merge(made, "NVIDIA H200", {f"{MODULE}.plain": [entry]}, "again", [])
    for t in (made, again):
        section = tuning.parse_table(t)["NVIDIA H200"]
        assert (section["arch"], section["sms"]) == ("sm_90", 132)


def test_the_shipped_tables_sections_record_their_hardware():
    """Every shipped section says its architecture and SMs, so GPUs it does not name can borrow it."""
    for name, section in tuning.load_table(tuning.TABLE_PATH).items():
        assert section["arch"].startswith("sm_") and section["sms"] > 0, name


def test_a_malformed_table_named_by_the_switch_fails_at_the_first_kernel(kernels, tmp_path, monkeypatch):
    path = write(tmp_path, table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(num_warps=3)}]}))
    fake_gpu(monkeypatch, GPU)
    with envs.override(autotune_table=str(path)), pytest.raises(tuning.TableError, match=str(path)):
        tuning.pin_for_device("cuda:0")


def test_the_shipped_table_that_does_not_fit_this_install_is_left_out_with_a_warning(kernels, tmp_path,
                                                                                     monkeypatch, caplog):
    path = write(tmp_path, table({f"{MODULE}.plain": [{"key": KEY, "config": config_json(num_warps=3)}]}))
    monkeypatch.setattr(tuning, "TABLE_PATH", path)
    fake_gpu(monkeypatch, GPU)
    with envs.override(autotune_table=None):
        assert tuning.pin_for_device("cuda:0") == 0
    assert kernels.plain.cache == {} and "does not fit this install" in caplog.text


def test_the_switch_is_parsed_from_the_environment():
    assert envs.parse({}).autotune_table is None
    assert envs.parse({"K3_AUTOTUNE_TABLE": "off"}).autotune_table == "off"
    assert envs.parse({"K3_AUTOTUNE_TABLE": " /t/choices.json "}).autotune_table == "/t/choices.json"
    with envs.override(autotune_table="off"):
        assert tuning.table_path() is None
    with envs.override(autotune_table=None):
        assert tuning.table_path() == tuning.TABLE_PATH


def test_record_save_load_pin_round_trip(kernels, tmp_path, monkeypatch):
    kernels.plain.cache[(4096, True, None, "torch.bfloat16")] = LARGE
    kernels.wrapped.fn.cache[(64, "torch.float32")] = SMALL
    kernels.single.cache[(1,)] = SMALL  # one candidate: Triton never tunes it, nothing to record
    other = types.ModuleType("k3.ops._fake_importer")
    other.plain = kernels.plain  # imported from MODULE: recorded once, under MODULE
    monkeypatch.setitem(sys.modules, "k3.ops._fake_importer", other)
    recorded = tuning.record()
    assert sorted(recorded) == [f"{MODULE}.plain", f"{MODULE}.wrapped"]
    monkeypatch.setattr(tuning, "fla_version", lambda: "0.6.0")
    path = tmp_path / "table.json"
    tuning.save(tuning.merge(table({}, gpu="NVIDIA B200"), GPU, recorded, "test"), path)
    tuned = {k: dict(v.cache) for k, v in (("plain", kernels.plain), ("wrapped", kernels.wrapped.fn))}
    kernels.plain.cache.clear()
    kernels.wrapped.fn.cache.clear()
    loaded = tuning.load_table(path)
    assert sorted(loaded) == ["NVIDIA B200", GPU]  # the other GPU's section kept
    assert tuning.pin(loaded[GPU]["kernels"]) == 2
    assert kernels.plain.cache == tuned["plain"] and kernels.wrapped.fn.cache == tuned["wrapped"]


def test_save_refuses_an_invalid_table_and_keeps_the_old_file(tmp_path):
    path = write(tmp_path, table({}))
    before = path.read_bytes()
    with pytest.raises(tuning.TableError):
        tuning.save({"format": tuning.FORMAT, "gpus": {GPU: {"kernels": {"os.system": []}}}}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


def test_the_shipped_table_is_valid():
    shipped = tuning.load_table(tuning.TABLE_PATH)
    for section in shipped.values():
        assert all(name.startswith(tuning.KERNEL_PREFIXES) for name in section["kernels"])


def test_k3s_fla_calls_pin_before_fla_runs_and_only_on_a_gpu(monkeypatch):
    import torch

    from k3.ops import kda_fla

    asked = []
    monkeypatch.setattr(tuning, "pin_for_device", lambda device: asked.append(device))
    kda_fla._pin_choices(torch.zeros(1))
    kda_fla._pin_choices(types.SimpleNamespace(is_cuda=True, device="cuda:1"))
    assert asked == ["cuda:1"]


def spec(name=f"{MODULE}.plain", **options):
    """Triton's specialisation data for one compile (the fields JITFunction.preload reads)."""
    return {"name": name, "signature": {"x": "*fp32", "n": "i32"}, "constant_keys": [[2]], "constant_vals": [128],
            "attrs_keys": [[0]], "attrs_vals": [[["tt.divisibility", 16]]],
            "options": {"num_warps": 8, "num_stages": 3, **options}, "key": "k"}


def with_compiles(compiles):
    data = table({})
    data["gpus"][GPU]["compiles"] = compiles
    return data


def test_a_tables_compiles_are_kept_in_order():
    compiles = [spec(), spec(f"{MODULE}.wrapped")]
    assert tuning.parse_table(with_compiles(compiles))[GPU]["compiles"] == compiles


@pytest.mark.parametrize("compiles, field", [
    ({}, "compiles: must be a list"),
    ([dict(spec(), extra=1)], "must be an object with exactly"),
    ([spec("os.system")], r"\.name: 'os.system' is not a kernel of"),
    ([spec("k3.ops.<locals>.f")], r"\.name: .* is not a kernel of"),
    ([spec(ir_override="/tmp/evil.ptx")], "ir_override and extern_libs are not taken from a table"),
    ([spec(extern_libs=[["libdevice", "/tmp/evil.bc"]])], "ir_override and extern_libs are not taken"),
    ([dict(spec(), options=[])], r"\.options: must be an object"),
    ([dict(spec(), constant_keys={})], r"\.constant_keys: must be a list"),
])
def test_a_malformed_compile_is_refused_naming_the_field(compiles, field):
    with pytest.raises(tuning.TableError, match=field):
        tuning.parse_table(with_compiles(compiles))


def test_precompile_splits_the_compiles_round_robin_over_its_workers(monkeypatch):
    from k3.ops import precompile

    started = []

    def popen(argv, **kwargs):
        with open(argv[-1]) as f:
            started.append((argv[1:3], json.load(f)))
        return argv
    monkeypatch.setattr(precompile.subprocess, "Popen", popen)
    specs = [spec(f"{MODULE}.k{i}") for i in range(5)]
    with envs.override(precompile_workers=2):
        assert len(precompile.start(specs)) == 2
    assert [argv for argv, _ in started] == [["-m", "k3.ops.precompile"]] * 2
    # the last needed first: the main process meets the first ones itself
    assert [[s["name"][-2:] for s in share] for _, share in started] == [["k4", "k2", "k0"], ["k3", "k1"]]
    with envs.override(precompile_workers=0):
        assert precompile.start(specs) == []
    with envs.override(precompile_workers=None):
        assert precompile.start([]) == []
        monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on the host share the cores
        assert precompile.worker_count(100) == 4
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        assert precompile.worker_count(100) == 8 and precompile.worker_count(3) == 3


def test_a_precompile_worker_compiles_each_spec_and_reports_what_failed(tmp_path, monkeypatch, capsys):
    from k3.ops import precompile

    compiled = []

    def compile_spec(s):
        if s["name"].endswith("missing"):
            raise AttributeError(f"module {MODULE!r} has no attribute 'missing'")
        compiled.append(s)
    monkeypatch.setattr(precompile, "compile_spec", compile_spec)
    path = tmp_path / "share.json"
    path.write_text(json.dumps([spec(f"{MODULE}.missing"), spec()]))
    assert precompile.main([str(path)]) == 0
    assert compiled == [spec()] and not path.exists()  # a failure does not stop the rest
    err = capsys.readouterr().err
    assert "1 of 2 kernels not compiled ahead" in err and "missing" in err


def test_the_precompile_worker_count_switch():
    assert envs.parse({}).precompile_workers is None
    assert envs.parse({"K3_PRECOMPILE_WORKERS": "0"}).precompile_workers == 0
    for bad in ("-1", "two"):
        with pytest.raises(ValueError, match=f"K3_PRECOMPILE_WORKERS must be a count >= 0, got '{bad}'"):
            envs.parse({"K3_PRECOMPILE_WORKERS": bad})


def test_save_keeps_a_specialisations_parameters_in_their_order(tmp_path):
    compile_ = spec()
    compile_["signature"] = {"z_ptr": "*fp32", "a": "i32", "m_ptr": "*bf16"}  # the kernel's order, not sorted
    path = tmp_path / "table.json"
    tuning.save(with_compiles([compile_]), path)
    assert list(tuning.load_table(path)[GPU]["compiles"][0]["signature"]) == ["z_ptr", "a", "m_ptr"]


def test_merge_adds_a_new_shapes_choices_and_replaces_a_retuned_key(monkeypatch):
    monkeypatch.setattr(tuning, "fla_version", lambda: "0.6.0")
    name = f"{MODULE}.plain"
    old = table({name: [{"key": KEY, "config": config_json(32, 4, 2)}]})
    old["gpus"][GPU]["compiles"] = [spec()]
    other_key = [8192, "torch.bfloat16"]
    new = tuning.merge(old, GPU, {name: [{"key": KEY, "config": config_json()},
                                         {"key": other_key, "config": config_json(32, 4, 2)}]},
                       "k3 tune --autocast", [spec(), spec(f"{MODULE}.wrapped")])
    section = tuning.parse_table(new)[GPU]
    assert dict(section["kernels"][name]) == {tuple(KEY): config_json(), tuple(other_key): config_json(32, 4, 2)}
    assert [c["name"] for c in section["compiles"]] == [f"{MODULE}.plain", f"{MODULE}.wrapped"]
    assert new["gpus"][GPU]["made_by"] == "test; k3 tune --autocast"
    monkeypatch.setattr(tuning, "fla_version", lambda: "0.7.0")  # another fla: its section starts afresh
    newer = tuning.parse_table(tuning.merge(old, GPU, {name: [{"key": other_key, "config": config_json()}]}))
    assert dict(newer[GPU]["kernels"][name]) == {tuple(other_key): config_json()} and newer[GPU]["compiles"] == []


def test_merge_drops_a_kernels_compiles_recorded_with_its_old_parameters(monkeypatch):
    """A kernel whose parameters changed (a new spec lists others) loses its old specs, which would fail to compile
    in every precompile worker; other kernels' specs, and old specs with the same parameters, stay."""
    monkeypatch.setattr(tuning, "fla_version", lambda: "0.6.0")
    stale, other = spec(), spec(f"{MODULE}.wrapped")
    renamed = spec()
    renamed["signature"] = {"x": "*fp32", "y_ptr": "*fp32", "n": "i32"}
    same_params = spec(num_warps=4)  # another compile of the kernel as it still is
    old = table({})
    old["gpus"][GPU]["compiles"] = [stale, other]
    section = tuning.parse_table(tuning.merge(old, GPU, {}, "k3 tune", [renamed]))[GPU]
    assert [(c["name"], list(c["signature"])) for c in section["compiles"]] == [
        (other["name"], list(other["signature"])), (renamed["name"], list(renamed["signature"]))]
    kept = tuning.parse_table(tuning.merge(old, GPU, {}, "k3 tune", [same_params]))[GPU]["compiles"]
    assert stale in kept and same_params in kept and other in kept


def test_precompile_without_a_process_to_spare_leaves_the_compiles_to_the_main_process(monkeypatch, tmp_path):
    from k3.ops import precompile

    def no_process(argv, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(precompile.subprocess, "Popen", no_process)
    monkeypatch.setattr(precompile.tempfile, "tempdir", str(tmp_path))
    with envs.override(precompile_workers=2):
        assert precompile.start([spec(), spec(f"{MODULE}.wrapped")]) == []
    assert list(tmp_path.iterdir()) == []  # the worker's share file removed too
