"""Hugging Face idioms on K3ForCausalLM (num_parameters, .device, .dtype, from_pretrained(dtype=...)), sizes
checked before allocating, the default save's round trip, and generate's limits: 1-D prompts, the config's EOS,
max_position_embeddings and the memory-bounded chunked prefill (issue 17, item 5)."""
import pytest
import torch

import k3.memory
from k3 import K3Config, K3ForCausalLM
from k3.memory import NotEnoughMemoryError
from k3.model import generate as gen_module


def tiny_config(**changes) -> K3Config:
    return K3Config.preset("tiny").replace(**changes)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(tiny_config()).eval()


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)  # the default save: bf16, F32 where released
    return path


def prompt(seed: int, T: int, V: int = 8192) -> torch.Tensor:
    return torch.randint(3, V, (T,), generator=torch.Generator().manual_seed(seed))


class ForwardLengths:
    """Records the sequence length of every forward call of a model."""

    def __init__(self, model):
        self.lengths: list[int] = []
        self.handle = model.register_forward_pre_hook(lambda m, args, kw: self.lengths.append(
            (args[0] if args else kw["input_ids"]).shape[1]), with_kwargs=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# ---- introspection --------------------------------------------------------------------------------------------
def test_num_parameters_device_and_dtype(model):
    every = list(model.parameters())
    assert model.num_parameters() == sum(p.numel() for p in every)
    V, D = model.config.vocab_size, model.config.hidden_size
    assert model.num_parameters(exclude_embeddings=True) == model.num_parameters() - V * D
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert K3ForCausalLM.parameter_count(model.config) == model.num_parameters()


def test_only_trainable_and_bf16_dtype_ignore_f32_tensors(saved):
    m = K3ForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    assert m.model.layers[0].self_attn.A_log.dtype == torch.float32  # released F32, kept F32
    m.model.embed_tokens.weight.requires_grad_(False)
    assert m.num_parameters(only_trainable=True) == m.num_parameters() - m.model.embed_tokens.weight.numel()


# ---- from_pretrained(dir, dtype=...) ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,want", [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
                                        ("float32", torch.float32), ("auto", torch.bfloat16),
                                        (torch.bfloat16, torch.bfloat16), (None, torch.float32)])
def test_from_pretrained_dtype_by_name_auto_or_torch(saved, dtype, want):
    m = K3ForCausalLM.from_pretrained(saved, dtype=dtype)  # "auto": the saved config says bfloat16
    assert m.dtype == want and m.lm_head.weight.dtype == want and m.device == torch.device("cpu")


def test_from_pretrained_torch_dtype_alias_and_device(saved):
    m = K3ForCausalLM.from_pretrained(saved, torch_dtype="bfloat16", device=torch.device("cpu"))
    assert m.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(dtype="bf16"), ValueError, "dtype='bf16'.*bfloat16, float16, float32, float64, 'auto'"),
    (dict(dtype=torch.int8), ValueError, "dtype=torch.int8"),
    (dict(device_map="auto"), TypeError, "device_map is not supported; pass device="),
    (dict(low_cpu_mem_usage=True), TypeError, "unexpected keyword argument.*low_cpu_mem_usage"),
    (dict(dtype=torch.float16, torch_dtype=torch.float16), TypeError, "not both"),
    pytest.param(dict(device="cuda"), ValueError, "device='cuda': CUDA is not available here; load with device='cpu'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")),
])
def test_from_pretrained_bad_arguments_say_what_to_do(saved, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        K3ForCausalLM.from_pretrained(saved, **kwargs)


# ---- save -> load ----------------------------------------------------------------------------------------------
def test_default_save_is_identity_for_bf16_representable_weights(tmp_path):
    torch.manual_seed(1)
    m = K3ForCausalLM(tiny_config()).eval()
    with torch.no_grad():  # what the default save promises: bf16 values (and every released-F32 tensor) exactly
        for n, p in m.named_parameters():
            p.copy_(p.bfloat16().float())
        m.model.layers[0].self_attn.dt_bias.add_(1e-4)  # not bf16-representable: F32 in the release
    m.save_pretrained(tmp_path)
    back = K3ForCausalLM.from_pretrained(tmp_path)
    a, b = m.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = prompt(2, 9)[None]
    with torch.no_grad():
        assert torch.equal(m(ids).logits, back(ids).logits)


# ---- sizes checked before allocating -----------------------------------------------------------------------------
def test_huge_vocab_is_refused_before_allocating():
    cfg = tiny_config(vocab_size=2 * 10**9)  # a valid config: 2 TB of embedding + head in float32
    with pytest.raises(NotEnoughMemoryError, match=r"vocab 2000000000\) with [0-9,]+ float32 parameters needs "
                                                   r"[0-9.]+ TiB but only .* is free on cpu"):
        K3ForCausalLM(cfg)


def test_huge_vocab_checkpoint_is_refused_before_allocating(tmp_path):
    tiny_config(vocab_size=2 * 10**9).save(tmp_path)  # a config.json alone: nothing is read before the check
    with pytest.raises(NotEnoughMemoryError, match=f"loading {tmp_path}"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_refusal_states_the_bytes_the_model_needs(monkeypatch, model):
    monkeypatch.setattr(k3.memory, "available_bytes", lambda device=None: 1000)
    exact = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert K3ForCausalLM.parameter_bytes(model.config, torch.float32) == exact
    with pytest.raises(NotEnoughMemoryError, match=k3.memory.format_bytes(exact)):
        K3ForCausalLM(tiny_config())
    assert issubclass(NotEnoughMemoryError, MemoryError) and issubclass(NotEnoughMemoryError, ValueError)


# ---- generate ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_one_dimensional_prompt_gives_one_dimensional_result(model):
    p = prompt(3, 6)
    out = model.generate(p, max_new_tokens=4, eos_token_id=None)
    assert out.shape == (10,)
    assert torch.equal(out, model.generate(p[None], max_new_tokens=4, eos_token_id=None)[0])
    assert torch.equal(out[:6], p)


@torch.no_grad()
def test_generate_stops_at_the_config_eos(model):
    p = prompt(4, 5)
    seq = p[None]
    for _ in range(3):  # the greedy continuation by full forwards, no cache
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    third = int(seq[0, -1])
    assert third not in seq[0, 5:7].tolist()
    stopper = K3ForCausalLM(tiny_config(eos_token_id=third)).eval()
    stopper.load_state_dict(model.state_dict())
    out = stopper.generate(p, max_new_tokens=10)  # the config's eos by default
    assert torch.equal(out, seq[0])  # ends with the EOS token itself
    assert stopper.generate(p, max_new_tokens=10, eos_token_id=None).shape == (15,)  # None: never stop early
    listed = K3ForCausalLM(tiny_config(eos_token_id=[8191, third])).eval()
    listed.load_state_dict(model.state_dict())
    assert torch.equal(listed.generate(p, max_new_tokens=10), seq[0])


@torch.no_grad()
def test_prompt_beyond_max_position_embeddings_is_refused_and_generation_stops_there(model):
    short = K3ForCausalLM(tiny_config(max_position_embeddings=16)).eval()
    short.load_state_dict(model.state_dict())
    with ForwardLengths(short) as seen, pytest.raises(ValueError, match="17 tokens; the model's "
                                                                         "max_position_embeddings is 16"):
        short.generate(prompt(5, 17), max_new_tokens=1)
    assert seen.lengths == []  # refused before any forward
    with pytest.raises(ValueError, match="max_position_embeddings"):
        gen_module.stream_generate(short, prompt(5, 17))  # when called, not at the first token
    with pytest.warns(UserWarning, match="at most 4 of max_new_tokens=10 tokens: .*max_position_embeddings is 16"):
        out = short.generate(prompt(5, 12), max_new_tokens=10, eos_token_id=None)
    assert out.shape == (16,)



@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(top_p=0.0), dict(top_p=float("nan")), dict(top_k=-1)])
def test_bad_sampling_arguments_are_refused_when_called(model, bad):
    """Refused by stream_generate's call itself, before any forward: a caller that writes the prompt out before it
    asks for the first token (k3 generate) never writes it for a call that cannot run."""
    (field,) = bad
    with ForwardLengths(model) as seen, pytest.raises(ValueError, match=f"^{field} must be"):
        gen_module.stream_generate(model, prompt(3, 5), max_new_tokens=2, **bad)
    assert seen.lengths == []


@torch.no_grad()
def test_auto_prefill_chunks_shrink_with_context_and_match_one_pass(model, monkeypatch):
    budget = 4 * 2**20
    monkeypatch.setattr(gen_module, "PREFILL_BUDGET_BYTES", budget)
    p = prompt(6, 600)
    with ForwardLengths(model) as seen:
        chunked = model.generate(p, max_new_tokens=3, eos_token_id=None)
    prefill = seen.lengths[:-2]  # then two one-token decode steps
    assert sum(prefill) == 600 and len(prefill) > 3 and seen.lengths[-2:] == [1, 1]
    assert all(a >= b for a, b in zip(prefill, prefill[1:])) and prefill[0] > prefill[-1]  # shrink as S grows
    H, pos = model.config.num_attention_heads, 0
    for c in prefill:  # one chunk's fp32 score matrix over its whole context stays inside the budget
        pos += c
        assert c * pos * H * 4 <= budget
    with ForwardLengths(model) as seen:
        one = model.generate(p, max_new_tokens=3, eos_token_id=None, prefill_chunk=None)
    assert seen.lengths[0] == 600
    assert torch.equal(chunked, one)
    ids = p[None]
    logits = gen_module.chunked_prefill(model, ids, model.new_cache())  # "auto" by default
    torch.testing.assert_close(logits, model(ids).logits[:, -1], rtol=1e-4, atol=1e-4)


def test_generation_that_cannot_fit_is_refused_before_any_forward(model, monkeypatch):
    monkeypatch.setattr(k3.memory, "available_bytes", lambda device=None: 100 * 2**20)
    with ForwardLengths(model) as seen, pytest.raises(NotEnoughMemoryError, match="generating 8 \\+ 2 tokens"):
        model.generate(prompt(7, 8), max_new_tokens=2)
    assert seen.lengths == []


def test_bad_generate_arguments(model):
    with pytest.raises(ValueError, match="eos_token_id"):
        model.generate(prompt(8, 4), max_new_tokens=2, eos_token_id="</s>")
    with pytest.raises(ValueError, match="chunk_size must be a positive int, 'auto' or None"):
        model.generate(prompt(8, 4), max_new_tokens=2, prefill_chunk=0)
    with pytest.raises(ValueError, match="non-empty"):
        model.generate(torch.zeros(0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(TypeError, match="'max_length': give max_new_tokens"):
        model.generate(prompt(8, 4), max_length=20)
    with pytest.raises(TypeError, match="'do_sample': sampling is temperature > 0"):
        model.generate(prompt(8, 4), do_sample=True)
    with pytest.raises(TypeError, match="'attention_mask': rows of one call share their length"):
        model.generate(prompt(8, 4)[None], attention_mask=torch.ones(1, 4))
    with pytest.raises(TypeError, match="unexpected keyword argument 'beam_width'$"):
        model.generate(prompt(8, 4), beam_width=2)


# ---- k3 generate --prompt-file ----------------------------------------------------------------------------------
def test_cli_prompt_file(saved, tmp_path, capsys):
    from k3.cli import main
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n" * 3
    f = tmp_path / "prompt.txt"
    f.write_text(text, encoding="utf-8")
    assert main(["generate", "--model", str(saved), "--prompt-file", str(f), "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith(text)
    assert main(["generate", "--model", str(saved), "--prompt-file", str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prompt-file" in err and "nope.txt" in err and len(err.splitlines()) == 1
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    assert main(["generate", "--model", str(saved), "--prompt-file", str(tmp_path / "bin.txt")]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert main(["generate", "--model", str(saved), "--prompt", "x", "--prompt-file", str(f)]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_prompt_beyond_the_context_is_one_line_and_echoes_nothing(model, tmp_path, capsys):
    from k3.cli import main
    short = K3ForCausalLM(tiny_config(max_position_embeddings=32))
    short.load_state_dict(model.state_dict())
    short.save_pretrained(tmp_path / "model")
    (tmp_path / "long.txt").write_text("ROMEO: " * 40)
    assert main(["generate", "--model", str(tmp_path / "model"), "--prompt-file", str(tmp_path / "long.txt")]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "max_position_embeddings is 32" in out.err and len(out.err.strip().splitlines()) == 1
