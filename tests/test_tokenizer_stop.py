"""Generation stops at the end of a turn (<|end_of_msg|>, config.json's eos) and at a document end ([EOS]), and
neither marker reaches the text: a tiny K3 whose lm_head is edited so that the stop id wins at the second step."""
import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import load_tokenizer
from k3.serve import EngineConfig, LLMEngine, SamplingParams

pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
from test_tokenizer_interface import write_released_style_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_released_style_tokenizer(tmp_path_factory.mktemp("released")))


def model_stopping_at(tok, prompt: list[int], stop: int):
    """A tiny random K3 that writes one ordinary token after `prompt`, then `stop` (→ the model, that token)."""
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.preset("tiny")).eval()
    m.reset_parameters(seed=0)
    vocab = tok.vocab_size
    with torch.no_grad():
        w = m.lm_head.weight
        w[vocab:] = 0  # ids the tokenizer lacks are never sampled anyway
        h1 = m.model(torch.tensor([prompt]))[0, -1]
        first = int((w[:vocab] @ h1).argmax())
        assert first not in tok.special_tokens.values()
        h2 = m.model(torch.tensor([prompt + [first]]))[0, -1]
        # the stop row sees nothing of step 1's state (orthogonal to it) and wins step 2 by a wide margin
        u = h2 - (h2 @ h1) / (h1 @ h1) * h1
        w[stop] = u * ((w[:vocab] @ h2).max() + 5.0) / (u @ h2)
        assert (w[stop] @ h1).abs() < 1e-3 < (w[:vocab] @ h1).max()
    return m, first


@pytest.mark.parametrize("which", ["<|end_of_msg|>", "[EOS]"])
def test_engine_stops_at_end_of_turn_and_document_end_without_marker_text(tok, which):
    stop = tok.convert_tokens_to_ids(which)
    prompt = tok.encode("hello world")
    model, first = model_stopping_at(tok, prompt, stop)
    eng = LLMEngine(model, tok, EngineConfig(memory_bytes=16 << 20, block_size=16, match_unit=4, max_batch_tokens=64, max_num_seqs=2))
    out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.output_ids[:2] == [first, stop] and out.finish_reason == "stop" and len(out.output_ids) == 2
    assert out.text == tok.decode([first]) and which not in out.text
    # ignore_eos runs past it, and the marker still never shows up in the text
    out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.output_ids[:2] == [first, stop] and len(out.output_ids) == 6 and out.finish_reason == "length"
    assert which not in out.text and out.text.startswith(tok.decode([first]))
