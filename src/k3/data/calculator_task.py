"""A tool-use task that a `tiny` model learns in minutes on a CPU: arithmetic through a calculator tool.

Each exchange: the user asks for `a op b`; the assistant thinks, calls `calculator` with typed arguments; the tool
answers; the assistant thinks again and states the result. A conversation holds 1 to 3 exchanges. The skill to learn
is copying: numbers from the question into the arguments, and from the tool's result into the answer. `write_dataset` makes the OpenAI-format JSONL that
`k3 train --data` takes; `run_agent` is the client side of the same loop against a live `k3 serve`, through the
official openai SDK: it executes the calls the model makes and feeds the results back.
Run: python -m k3.data.calculator_task write FILE.jsonl [--count 3000]
     python -m k3.data.calculator_task ask --base-url http://127.0.0.1:8000/v1 --model NAME "What is 12 + 7?"
"""
from __future__ import annotations

import argparse
import json
import random
import re

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Compute a op b.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "op": {"enum": ["+", "-", "*"]},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "op", "b"]}}}
QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Please calculate {a} {op} {b}.",
             "What's {a} {op} {b}?", "Work out {a} {op} {b}.", "{a} {op} {b} = ?")
MAX_DIGITS = 3  # operands have 1 to 3 digits (equally often): longer numbers give the copying more to learn from


def calculator(a: int, op: str, b: int) -> int:
    if op not in ("+", "-", "*"):
        raise ValueError(f"op must be +, - or *, got {op!r}")
    return a + b if op == "+" else a - b if op == "-" else a * b


def operand(rng: random.Random) -> int:
    digits = rng.randint(1, MAX_DIGITS)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def problem(rng: random.Random) -> tuple[int, str, int]:
    return operand(rng), rng.choice("+-*"), operand(rng)


def exchange(rng: random.Random, a: int, op: str, b: int) -> list[dict]:
    """One question and its tool round trip: user, assistant call, tool result, assistant answer."""
    result = calculator(a, op, b)
    call_id = f"call_{rng.randrange(16**8):08x}"
    return [
        {"role": "user", "content": rng.choice(QUESTIONS).format(a=a, op=op, b=b)},
        {"role": "assistant", "reasoning_content": f"I use the calculator for {a} {op} {b}.", "content": "",
         "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": "calculator", "arguments": {"a": a, "op": op, "b": b}}}]},
        {"role": "tool", "tool_call_id": call_id, "content": str(result)},
        {"role": "assistant", "reasoning_content": f"The calculator says {result}.",
         "content": f"{a} {op} {b} = {result}"},
    ]


def conversation(rng: random.Random, questions: int = 1) -> dict:
    """A conversation of `questions` exchanges (later ones see the earlier ones: the model must copy from the
    newest question, not any number in sight)."""
    messages = []
    for _ in range(questions):
        messages += exchange(rng, *problem(rng))
    return {"tools": [TOOL], "messages": messages}


def write_dataset(path, count: int = 3000, seed: int = 0) -> None:
    """`count` conversations of 1 to 3 questions each (equally often): the tool declaration, the same in every
    conversation, is paid once for several questions."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(count):
            fh.write(json.dumps(conversation(rng, rng.randint(1, 3))) + "\n")


def run_agent(client, model: str, question: str, max_rounds: int = 3, **create) -> list[dict]:
    """Ask `question` with the calculator offered; execute every call the model makes and send the results back
    until it answers without calling. → the whole transcript (OpenAI messages)."""
    messages = [{"role": "user", "content": question}]
    for _ in range(max_rounds):
        r = client.chat.completions.create(model=model, messages=messages, tools=[TOOL], **create)
        msg = r.choices[0].message
        messages.append({k: v for k, v in msg.model_dump().items() if v is not None and k in (
            "role", "content", "reasoning_content", "tool_calls")})
        if not msg.tool_calls:
            return messages
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                content = str(calculator(int(args["a"]), args["op"], int(args["b"])))
            except (ValueError, KeyError, TypeError) as e:
                content = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return messages


def answer_is_correct(question: str, answer: str | None) -> bool:
    """The last integer in `answer` is the result of the question's `a op b`."""
    a, op, b = re.search(r"(\d+) ([-+*]) (\d+)", question).groups()
    numbers = re.findall(r"-?\d+", answer or "")
    return bool(numbers) and int(numbers[-1]) == calculator(int(a), op, int(b))


def score(question: str, transcript: list[dict]) -> dict[str, bool]:
    """How one played question went (`transcript` as run_agent returns it, with at most two rounds):
    format_ok: the first reply calls `calculator` once with a, op, b of the declared types, the second reads the
      result and answers in `content` without calling again, both after a closed think section;
    arguments_ok: the call's arguments are the question's a, op, b;
    answer_ok: the answer's last integer is the true result;
    answer_is_tool_result: the answer's last integer is what the tool returned (copied right, whatever was asked)."""
    a, op, b = re.search(r"(\d+) ([-+*]) (\d+)", question).groups()
    first = transcript[1] if len(transcript) > 1 else {}
    calls = first.get("tool_calls") or []
    args = None
    if len(calls) == 1 and calls[0]["function"]["name"] == "calculator":
        try:
            args = json.loads(calls[0]["function"]["arguments"])
        except json.JSONDecodeError:
            pass
    typed = (isinstance(args, dict) and set(args) == {"a", "op", "b"} and type(args["a"]) is int
             and type(args["b"]) is int and args["op"] in ("+", "-", "*"))
    final = transcript[3] if len(transcript) == 4 and transcript[2].get("role") == "tool" else {}
    answer = final.get("content") or ""
    numbers = re.findall(r"-?\d+", answer)
    return {
        "format_ok": bool(typed and first.get("reasoning_content") and final.get("reasoning_content")
                          and answer and not final.get("tool_calls")),
        "arguments_ok": bool(typed and (args["a"], args["op"], args["b"]) == (int(a), op, int(b))),
        "answer_ok": bool(final) and answer_is_correct(question, answer),
        "answer_is_tool_result": bool(numbers) and bool(final) and numbers[-1] == transcript[2]["content"],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("path")
    w.add_argument("--count", type=int, default=3000)
    w.add_argument("--seed", type=int, default=0)
    q = sub.add_parser("ask")
    q.add_argument("question", nargs="+")
    q.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    q.add_argument("--model", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "write":
        write_dataset(a.path, a.count, a.seed)
        return
    import openai
    client = openai.OpenAI(base_url=a.base_url, api_key="none")
    for question in a.question:
        transcript = run_agent(client, a.model, question, temperature=0, max_tokens=256)
        for m in transcript:
            print(json.dumps(m, ensure_ascii=False))
        print("correct:", answer_is_correct(question, transcript[-1].get("content")))


if __name__ == "__main__":
    main()
