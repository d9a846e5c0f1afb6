"""k3's own tokenizer as other tools read it: `save_pretrained` (what `k3 train` writes beside the model) gives a
tokenizer.json + tokenizer_config.json that Hugging Face transformers and llama.cpp's converter (the gguf package's
SpecialVocab) load with the same ids and special tokens."""
import json

import pytest

from k3.data import SPECIAL_TOKENS, load_tokenizer

TEXTS = ["ROMEO: But soft, what light through yonder window breaks?", "héllo 日本 🙂\n\n  x", ""]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = load_tokenizer()
    tok.save_pretrained(d)
    return tok, d


def test_tokenizer_config_names_the_class_and_every_special_token(saved):
    tok, d = saved
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|bos|>", "<|end_of_msg|>", "<|pad|>")
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False  # the chat markup adds no BOS
    added = {int(i): e["content"] for i, e in cfg["added_tokens_decoder"].items()}
    assert added == {i: t for i, t in enumerate(SPECIAL_TOKENS)}
    assert all(e["special"] for e in cfg["added_tokens_decoder"].values())
    # the ids agree with tokenizer.json's own added tokens
    in_json = {t["id"]: t["content"] for t in json.loads((d / "tokenizer.json").read_text())["added_tokens"]}
    assert in_json == added
    assert load_tokenizer(d).encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_transformers_loads_it_with_the_same_ids(saved):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    tok, d = saved
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert type(hf).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                     tok.pad_token_id)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)  # no BOS added
        assert hf.decode(tok.encode(text)) == text
    assert hf.convert_tokens_to_ids("<|sep|>") == tok.convert_tokens_to_ids("<|sep|>")


def test_llama_cpp_converter_reads_its_special_tokens(saved):
    gguf = pytest.importorskip("gguf", reason="gguf (llama.cpp's Python package) is not installed")
    tok, d = saved
    vocab = gguf.SpecialVocab(d, load_merges=True)
    assert vocab.special_token_ids == {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    assert vocab.add_special_token == {"bos": False, "eos": False}
    assert vocab.chat_template == json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|open|>" in vocab.chat_template and "<|end_of_msg|>" in vocab.chat_template  # XTML travels into the GGUF
    assert len(vocab.merges) == len(json.loads((d / "tokenizer.json").read_text())["model"]["merges"]) > 1000


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Wetter in einer Stadt",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {
             "city": 'Paris "&"', "days": 2, "ratio": 0.5, "metric": True, "extra": None, "tags": ["a", 1],
             "opts": {"x": "ü"}}}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
CONVERSATIONS = [
    ([{"role": "system", "content": "You are K3."}, {"role": "user", "content": "Hi!"}], {}),
    ([{"role": "developer", "content": "Rules."}, {"role": "user", "content": "2+2?", "name": 'Ann "A&B"'},
      {"role": "assistant", "reasoning_content": "Simple sum.", "content": "4"},
      {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "3+3?"}]},
      {"role": "assistant", "content": "6"}], {}),
    ([{"role": "user", "content": "Weather?"},
      {"role": "assistant", "reasoning_content": "tool", "content": None, "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "c2", "content": "snow"}, {"role": "tool", "tool_call_id": "c1", "content": "sun"},
      {"role": "tool", "tool_call_id": "zz", "name": "get_weather", "content": "late"},
      {"role": "assistant", "content": "Sun and snow."}, {"role": "user", "content": "Thanks"}],
     dict(tools=[WEATHER], thinking_effort="high")),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "dropped", "content": "Hello"},
      {"role": "user", "content": "JSON please"}],
     dict(thinking=False, tools=[WEATHER], tool_choice="required",
          response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}})),
    ([{"role": "user", "content": "U"}],
     dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
          response_format={"type": "json_object"}, thinking_effort="low")),
    ([{"role": "user", "content": "U"}], dict(tool_choice="auto", response_format={"type": "text"})),
]


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_transformers_renders_chats_exactly_as_k3(saved, case, generation_prompt):
    """The Jinja chat_template in tokenizer_config.json gives k3's renderer's exact string (SPEC §1.2)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    tok, d = saved
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    messages, options = CONVERSATIONS[case]
    ours = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **options)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **options) == ours
    got = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, **options)  # tokenized
    got = got["input_ids"] if hasattr(got, "keys") else got
    assert got == tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, **options)
