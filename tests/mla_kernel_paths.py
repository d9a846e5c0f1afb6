"""A tiny MLA layer through one of its training kernels against the same layer with that kernel off: the shared
check of the tests of MLA's Triton kernels (forced on for CPU tensors under the interpreter)."""
import torch

from k3 import K3Config, envs
from k3.model.mla import MultiHeadLatentAttention


def assert_layer_through_kernel_equals_torch_path(monkeypatch, selector_module, kernel: str, function, device: str):
    """`selector_module.use_triton` forced on for `kernel`; `function.apply` (the kernel's autograd Function)
    counted. Output, input and every parameter gradient of a tiny MLA layer (float32), with the kernel and with
    K3_NO_TRITON=<kernel>."""
    real = selector_module.use_triton
    monkeypatch.setattr(selector_module, "use_triton", lambda x, name: real(x, name) or (
        name == kernel and not envs.current().triton_off(name)))
    cfg = K3Config.preset("tiny")
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(cfg, min(cfg.mla_layer_ids)).to(device).train()
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 9, cfg.hidden_size, generator=gen).to(device)
    probe = torch.randn(2, 9, cfg.hidden_size, generator=gen).to(device)
    calls = []
    real_apply = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or real_apply(*a))

    def run():
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = layer(x)
        (out * probe).sum().backward()
        return [out, x.grad] + [p.grad for p in layer.parameters()]

    got = run()
    assert calls  # the kernel ran
    with envs.override(no_triton=[kernel]):
        calls.clear()
        want = run()
        assert not calls
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"tensor {i}: {m}")
