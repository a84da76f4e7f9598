"""Answers that a scorer would run as code never reach it as code.

Some reasoning-gym scorers hand the answer text to Python's `eval` (a list or board written as Python) or to
sympy's `parse_expr`, which evaluates Python too. A peer's completion reaches our scorer when we recompute its
rewards, so without a guard any peer could run code on every node that verifies its batch (`binary_matrix`,
in the paper's mix, evals its answers). So:

- the `eval` scorers' `eval` is `literal_eval` (node/learn/gym.py puts it in their modules): a Python literal
  gives the value `eval` would, anything else an error, which the scorer scores 0;
- the sympy scorers see only arithmetic: numbers, + - * / and parentheses, and for algebra single-letter
  symbols, a few functions and constants, and small powers (`admits`); anything else scores 0;
- every dataset's answer is capped in length: scorers are not written for adversarial input
  (`propositional_logic`'s parser takes time quadratic in the answer), and a receiver scores a batch's worth
  of completions per record.

Publisher and receiver run the same rule, so an honest peer is never charged for it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from typing import Any

MAX_ANSWER_CHARS = 1024  # far above any dataset's real answer; bounds every scorer's work

# reasoning-gym 0.1.x modules whose scorer `eval`s the answer (tests/learn/test_answer_guard.py feeds every
# dataset's scorer answers that would run code, so a scorer that starts to eval elsewhere fails it)
EVAL_SCORER_MODULES = (
    "reasoning_gym.algorithmic.binary_matrix",
    "reasoning_gym.algorithmic.spiral_matrix",
    "reasoning_gym.algorithmic.string_insertion",
    "reasoning_gym.games.n_queens",
)
# scorers that `parse_expr` the answer: numbers, + - * / and parentheses
ARITHMETIC_DATASETS = frozenset({"countdown", "puzzle24"})
# ... and symbols: single letters, a few functions and constants, small powers
ALGEBRA_DATASETS = frozenset({"polynomial_multiplication", "simple_integration", "intermediate_integration"})
ALGEBRA_NAMES = frozenset(
    "sin cos tan cot sec csc asin acos atan sinh cosh tanh asinh acosh atanh exp log ln sqrt pi oo Abs Integral".split()
) | frozenset(c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMPRTUVWXYZ")  # not N, O, Q, S: sympy callables
ARITHMETIC_OPS = frozenset({"+", "-", "*", "/", "(", ")"})
ALGEBRA_OPS = ARITHMETIC_OPS | {"**", "^", ","}
POWER_OPS = frozenset({"**", "^"})
MAX_NUMBER_CHARS = 16
MAX_POWER = 64  # the largest exponent, nested powers multiplied: (x**8)**8 is x**64
MAX_POWERS = 16  # power operators in one answer
IGNORED_TOKENS = frozenset({tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT})


def admits(dataset: str, answer: str) -> bool:
    """May this answer be given to the dataset's scorer? False: it scores 0 without being looked at."""
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    if dataset in ARITHMETIC_DATASETS:
        return is_expression(answer, names=frozenset(), ops=ARITHMETIC_OPS)
    if dataset in ALGEBRA_DATASETS:
        return is_expression(answer, names=ALGEBRA_NAMES, ops=ALGEBRA_OPS)
    return True


def scorer_dataset(dataset: str, entry: dict[str, Any]) -> str:
    """The dataset whose scorer scores an entry: a composite dataset hands it to the one it came from."""
    metadata = entry.get("metadata")
    source = metadata.get("source_dataset") if isinstance(metadata, dict) else None
    return source if dataset == "composite" and isinstance(source, str) else dataset


def literal_eval(text: str, *_: Any) -> Any:
    """`eval` for the scorers that eval an answer: the value of a Python literal (numbers, strings, lists,
    tuples, sets, dicts, booleans, None), with no name looked up and no call made; ValueError or SyntaxError
    for anything else. Leading blanks are skipped, as `eval` skips them."""
    return ast.literal_eval(text.lstrip(" \t"))


def _tokens(text: str) -> list[tokenize.TokenInfo] | None:
    try:
        return [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in IGNORED_TOKENS]
    except (tokenize.TokenError, SyntaxError):
        return None


def is_expression(text: str, names: frozenset[str], ops: frozenset[str]) -> bool:
    """Arithmetic that sympy can parse without running anything and evaluate in little time: plain decimal
    numbers, the allowed names and operators, balanced parentheses, and powers whose exponent is a small number
    (or a single letter), at most MAX_POWER when nested powers are multiplied out."""
    tokens = _tokens(text.strip())
    if tokens is None:
        return False
    depth_power = [1]  # per open parenthesis: the largest power applied inside it so far
    powers = 0
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == tokenize.NUMBER:
            if len(tok.string) > MAX_NUMBER_CHARS or not tok.string.replace(".", "", 1).isdigit():
                return False
        elif tok.type == tokenize.NAME:
            if tok.string not in names:
                return False
        elif tok.type == tokenize.OP and tok.string in ops:
            if tok.string == "(":
                depth_power.append(1)
            elif tok.string == ")":
                if len(depth_power) == 1:
                    return False
                inner = depth_power.pop()
                if i + 1 < len(tokens) and tokens[i + 1].string in POWER_OPS:
                    exponent = _exponent(tokens, i + 2)
                    if exponent is None or inner * exponent > MAX_POWER:
                        return False
                    inner *= exponent
                depth_power[-1] = max(depth_power[-1], inner)
            elif tok.string in POWER_OPS:
                powers += 1
                exponent = _exponent(tokens, i + 1)
                if powers > MAX_POWERS or exponent is None:
                    return False
                depth_power[-1] = max(depth_power[-1], exponent)
        elif tok.type == tokenize.ERRORTOKEN and not tok.string.strip():
            pass  # stray whitespace
        else:
            return False
        i += 1
    return len(depth_power) == 1


def _exponent(tokens: list[tokenize.TokenInfo], at: int) -> int | None:
    """The size of the exponent that starts at tokens[at]: a signed number up to MAX_POWER (a decimal counts as
    its integer part plus one), a single letter (counts as 1: a symbol), or one of those in parentheses, or a
    fraction of two numbers in parentheses; None for anything else, or when another power follows."""
    end = at
    if end < len(tokens) and tokens[end].string == "(":
        end += 1
        inner_open = True
    else:
        inner_open = False
    if end < len(tokens) and tokens[end].string in ("+", "-"):
        end += 1
    if end >= len(tokens):
        return None
    tok = tokens[end]
    if tok.type == tokenize.NUMBER:
        size = int(float(tok.string)) + 1 if "." in tok.string else int(tok.string) if tok.string.isdigit() else None
        if size is None or size > MAX_POWER:
            return None
    elif tok.type == tokenize.NAME and len(tok.string) == 1:
        size = 1
    else:
        return None
    end += 1
    if inner_open:
        if end + 1 < len(tokens) and tokens[end].string == "/" and tokens[end + 1].type == tokenize.NUMBER:
            end += 2  # (3/2): at most its numerator
        if end >= len(tokens) or tokens[end].string != ")":
            return None
        end += 1
    if end < len(tokens) and tokens[end].string in POWER_OPS:
        return None  # a tower: x**2**9 is x**512
    return max(size, 1)
