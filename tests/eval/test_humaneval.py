"""Prompts, code extraction and program assembly for HumanEval."""
from __future__ import annotations

from specee_eval import humaneval
from specee_eval.sandbox import Limits, run_python

P = humaneval.Problem("HumanEval/x", 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum."""\n',
                      "add", "def check(candidate):\n    assert candidate([1, 2]) == 3\n", "    return sum(xs)\n")


def test_chat_extraction_takes_the_first_fenced_block():
    text = "Here it is:\n```python\ndef add(xs):\n    return sum(xs)\n```\n\nThen\n```python\nbad\n```"
    assert humaneval.extract_code(text, chat=True) == "def add(xs):\n    return sum(xs)"
    # cut by the stop string before the closing fence
    assert humaneval.extract_code("```py\ndef add(xs):\n    return sum(xs)", chat=True) == "def add(xs):\n    return sum(xs)"
    assert humaneval.extract_code("def add(xs): return 3", chat=True) == "def add(xs): return 3"


def test_plain_extraction_cuts_at_the_next_top_level_statement():
    assert humaneval.extract_code("    return sum(xs)\n\n\ndef other():\n    pass", chat=False) == "    return sum(xs)"
    assert humaneval.extract_code("    return sum(xs)\nprint(add([1]))", chat=False) == "    return sum(xs)"


def test_program_keeps_the_prompts_imports_and_takes_bodies_or_whole_functions():
    fast = Limits(timeout_s=5)
    whole = humaneval.program(P, "def add(xs: List[int]) -> int:\n    return sum(xs)")  # List from the prompt
    body = humaneval.program(P, "    return sum(xs)")
    wrong = humaneval.program(P, "def add(xs):\n    return 0")
    assert run_python(whole, fast).passed and run_python(body, fast).passed
    assert not run_python(wrong, fast).passed
    assert whole.rstrip().endswith("check(add)")


def test_chat_prompt_holds_the_problem_and_the_stops_spare_the_opening_fence():
    prompt = humaneval.engine_prompt(P, chat_prompt=lambda msgs: "<user>" + msgs[0]["content"] + "<assistant>")
    assert P.prompt in prompt and prompt.endswith("<assistant>")
    assert humaneval.engine_prompt(P) == P.prompt
    opening = "```python\ndef add(xs):\n"
    assert not any(s in opening for s in humaneval.stop_strings(chat=True))
    assert any(s in opening + "    return 1\n```\n" for s in humaneval.stop_strings(chat=True))
