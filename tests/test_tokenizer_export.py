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
    assert len(vocab.merges) == len(json.loads((d / "tokenizer.json").read_text())["model"]["merges"]) > 1000
