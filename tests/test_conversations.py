"""Training on conversations (`k3 train --data`): the chat template's rendering with the loss on the assistant's
tokens only, packing, the shipped calculator dataset, and a short run that learns an assistant turn."""
import json
import random

import pytest
import torch

from k3.data import load_tokenizer
from k3.data.calculator_task import TOOL, answer_is_correct, calculator, conversation
from k3.data.conversations import (ConversationError, ConversationLoader, conversation_eval_batches,
                                   load_conversations, render_conversation, render_conversations)
from k3.data.corpus import ASSETS_DIR

DATASET = ASSETS_DIR / "calculator_tool_use.jsonl"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def learned_spans(tok, ids, learn):
    spans, cur = [], []
    for t, on in zip(ids + [None], learn + [False]):
        if on:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans


def test_loss_is_on_the_assistant_turns_only(tok):
    """What is learned is each assistant message after its `<|open|>message role="assistant"<|sep|>`, through
    `<|end_of_msg|>` (SPEC §1.2's strings, written out here); user, system and tool text is context only, even
    when a user types the assistant's markup."""
    fake = '<|open|>message role="assistant"<|sep|>fake<|end_of_msg|>'
    record = {"tools": [TOOL], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": fake},
        {"role": "assistant", "reasoning_content": "add", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calculator",
                                                                     "arguments": {"a": 2, "op": "+", "b": 3}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "reasoning_content": "", "content": "2 + 3 = 5"}]}
    ids, learn = render_conversation(tok, record)
    assert learned_spans(tok, ids, learn) == [
        '<|open|>think<|sep|>add<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>'
        '<|open|>tools<|sep|><|open|>call tool="calculator" index="1"<|sep|>'
        '<|open|>argument key="a" type="number"<|sep|>2<|close|>argument<|sep|>'
        '<|open|>argument key="op" type="string"<|sep|>+<|close|>argument<|sep|>'
        '<|open|>argument key="b" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>',
        '<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>2 + 3 = 5<|close|>response<|sep|>'
        '<|close|>message<|sep|><|end_of_msg|>']
    assert tok.decode(ids).count(fake) == 1  # the user's text is there, as text, and not learned


def test_thinking_off_records_learn_the_response_section(tok):
    ids, learn = render_conversation(tok, {"thinking": False, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    assert learned_spans(tok, ids, learn) == [
        "<|open|>response<|sep|>hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"]


def test_packed_rows_label_exactly_the_learned_tokens(tok):
    convs = render_conversations(tok, [conversation(random.Random(s)) for s in range(5)])
    loader = ConversationLoader(convs, seq_len=64, batch_size=3, seed=1)
    stream_tokens, stream_learn = [], []
    for i in __import__("numpy").random.default_rng(1).permutation(5):
        stream_tokens += convs[i][0]
        stream_learn += convs[i][1]
    b = loader.next_batch()
    for r in range(3):
        window = slice(r * 64, r * 64 + 65)
        toks, learn = stream_tokens[window], stream_learn[window]
        assert b["input_ids"][r].tolist() == toks[:64]
        want = [t if on else -100 for t, on in zip(toks[1:], learn[1:])]
        assert b["labels"][r].tolist() == want
    # resumable: a loader restored to the saved position gives the same next batch
    state = loader.state_dict()
    nxt = loader.next_batch()
    again = ConversationLoader(convs, seq_len=64, batch_size=3, seed=1)
    again.load_state_dict(state)
    assert all(torch.equal(nxt[k], v) for k, v in again.next_batch().items())
    # evaluation covers every learned token exactly once
    labels = sum(int((e["labels"] != -100).sum()) for e in conversation_eval_batches(convs, 64, 4, tok.pad_id))
    assert labels == sum(sum(c[1]) for c in convs)


def test_bad_files_name_the_line(tmp_path, tok):
    f = tmp_path / "c.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{not json\n')
    with pytest.raises(ConversationError, match=r"c\.jsonl:2: not valid JSON"):
        load_conversations(f)
    f.write_text('{"messages": []}\n')
    with pytest.raises(ConversationError, match=r":1: .*non-empty 'messages'"):
        load_conversations(f)
    f.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    with pytest.raises(ConversationError, match="record 0: has no assistant message"):
        render_conversations(tok, load_conversations(f))
    with pytest.raises(FileNotFoundError):
        load_conversations(tmp_path / "missing.jsonl")


def test_shipped_calculator_dataset_is_correct(tok):
    records = load_conversations(DATASET)
    assert len(records) >= 1000
    for rec in records:
        user, call_msg, result, answer = rec["messages"]
        args = call_msg["tool_calls"][0]["function"]["arguments"]
        assert int(result["content"]) == calculator(args["a"], args["op"], args["b"])
        assert answer_is_correct(user["content"], answer["content"])
    assert len({json.dumps(r["messages"][0]) for r in records}) > 1400  # varied questions, not one repeated


@pytest.mark.slow
def test_training_on_conversations_learns_the_assistant_turn(tmp_path):
    """A short `--data` run on one conversation: the held-out loss (the same conversation's assistant tokens)
    falls far below a fresh model's, and only assistant tokens were labels."""
    from k3.train.trainer import TrainConfig, Trainer

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(conversation(random.Random(0))) + "\n")
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), max_steps=40, batch_size=2, seq_len=128,
                      eval_every=1000, save_every=1000, warmup_steps=2, final_eval_batches=4, device="cpu")
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    labels = trainer.loader.next_batch()["labels"]
    assert 0 < int((labels != -100).sum()) < labels.numel()
    before = trainer.evaluate(4)
    summary = trainer.run()
    after = trainer.evaluate(4)
    assert after < before / 3, (before, after, summary)
