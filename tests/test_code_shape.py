"""The code keeps the shape docs/contributing.md promises: no function in the package, the benchmarks or the recipes
holds more than 60 lines of code (its docstring, comments and blank lines not counted), and no module more than 400
lines, the modeling files excepted (one model, one file, as transformers' own)."""

import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("hf_alibi", "benchmarks", "recipes")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def code_lines(source: str) -> set[int]:
    """The numbers of the lines of `source` that hold code: not blank, not only a comment (a string spanning lines
    counts on every line it spans)."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def function_lengths(source: str) -> dict[str, int]:
    """Each function's (methods and nested functions too) lines of code, from its `def` to its last line, less its
    docstring: {"name:line": count}."""
    code, lengths = code_lines(source), {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        span = set(range(node.lineno, node.end_lineno + 1))
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            span -= set(range(first.lineno, first.end_lineno + 1))  # the docstring
        lengths[f"{node.name}:{node.lineno}"] = len(span & code)
    return lengths


def checked_modules() -> list[Path]:
    return sorted(path for folder in CHECKED for path in (REPO / folder).rglob("*.py"))


def test_function_length_counts_code_not_docstrings_comments_or_blank_lines():
    source = '''
def f(
    a,
):
    """A docstring
    over two lines."""
    # a comment

    text = """a string
    # that looks like a comment"""
    return a  # trailing comment
'''
    assert function_lengths(source) == {"f:2": 6}  # def, a, ):, the string's two lines, return


def test_no_function_holds_more_than_60_lines_of_code():
    long = [
        f"{path.relative_to(REPO)}::{name} ({count} lines)"
        for path in checked_modules()
        for name, count in function_lengths(path.read_text()).items()
        if count > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code (split them): {long}"


def test_no_module_holds_more_than_400_lines_but_the_modeling_files():
    long = [
        f"{path.relative_to(REPO)} ({count} lines)"
        for path in checked_modules()
        if not path.name.startswith("modeling_") and (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them at a natural seam): {long}"
