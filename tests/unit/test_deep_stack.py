"""Grammars compile on a deep stack (app/engine/deep_stack.py): llguidance's compiler recurses once per link of a chain
of rules or references, and on a thread's default 8 MB stack a long chain killed the process (SIGSEGV)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.engine.deep_stack import on_a_deep_stack

ROOT = Path(__file__).resolve().parents[2]
_CHAIN = """
import sys, threading
import llguidance
from app.engine.deep_stack import on_a_deep_stack

links = int(sys.argv[1])
rules = "start: r0\\n" + "".join(f"r{i}: r{i + 1}\\n" for i in range(links)) + f'r{links}: "x"\\n'


def compile_():  # what the API and the engine do, on a thread as they do it
    grammar = llguidance.grammar_from("lark", rules)
    return llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]


worker = threading.Thread(target=lambda: print("error" if on_a_deep_stack(compile_) else "compiled"))
worker.start()
worker.join()
"""


def test_a_chain_of_4000_rules_compiles_on_the_deep_stack_in_a_worker_thread():
    """4,000 chained rules crashed a worker thread's compile on its default stack (2-core AVX2 EPYC, llguidance as
    pinned). In a child process, so that a crash fails the test, not the run."""
    done = subprocess.run([sys.executable, "-c", _CHAIN, "4000"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout.strip()) == (0, "compiled"), done.stderr[-1000:]


def test_the_result_or_the_exception_comes_back_to_the_caller():
    assert on_a_deep_stack(lambda: 41 + 1) == 42
    with pytest.raises(ValueError, match="bad grammar"):
        on_a_deep_stack(lambda: (_ for _ in ()).throw(ValueError("bad grammar")))
