"""The shipped autotune table's precompile specs name each k3 kernel's parameters as the source defines them today,
checked without Triton (CI has none): a kernel that gains a parameter after its specs were recorded makes every GPU
run's precompile workers skip it ("stale"), and a fresh machine's first step compiles it in the main process again.
`tests/test_precompile_table.py` compiles the same specs for sm_90 where Triton is installed."""
import ast
import importlib.util

from k3.ops import tuning


def kernel_parameters(qualified: str) -> list[str]:
    """The parameter names of the function `qualified` (module.function) as written in its source file."""
    module, _, name = qualified.rpartition(".")
    path = importlib.util.find_spec(module).origin
    tree = ast.parse(open(path).read(), path)
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name]
    assert len(found) == 1, f"{qualified}: {len(found)} definitions in {path}"
    args = found[0].args
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]


def test_every_k3_spec_lists_its_kernels_parameters_in_order():
    table = tuning.load_table(tuning.TABLE_PATH)
    specs = [(gpu, spec) for gpu, section in table.items() for spec in section["compiles"]
             if spec["name"].startswith("k3.")]
    assert len({spec["name"] for _, spec in specs}) >= 5  # the training step's kernels are all in it
    stale = [f"{gpu}: {spec['name']}: recorded {list(spec['signature'])}, source {kernel_parameters(spec['name'])}"
             for gpu, spec in specs if list(spec["signature"]) != kernel_parameters(spec["name"])]
    assert not stale, "re-record with `k3 tune` on that GPU:\n" + "\n".join(stale)


def test_a_parameter_added_to_a_kernel_is_caught(tmp_path, monkeypatch):
    """The check reads the source: a copy of a kernel module with one more parameter no longer matches its spec."""
    table = tuning.load_table(tuning.TABLE_PATH)
    spec = next(s for section in table.values() for s in section["compiles"] if s["name"].endswith("_mix_bwd_kernel"))
    source = open(importlib.util.find_spec("k3.ops._attn_res_triton").origin).read()
    edited = source.replace("def _mix_bwd_kernel(", "def _mix_bwd_kernel(new_ptr, ", 1)
    assert edited != source
    (tmp_path / "k3_edited_kernels.py").write_text(edited)
    monkeypatch.syspath_prepend(str(tmp_path))
    params = kernel_parameters("k3_edited_kernels._mix_bwd_kernel")
    assert params[0] == "new_ptr" and params[1:] == list(spec["signature"])
