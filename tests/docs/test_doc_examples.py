"""Every example of README.md and docs/*.md runs as written (tests/docs/doc_examples.py says how: one temporary
directory and one Python process per page, bash under `-euo pipefail`, markers for skips and tiny sizes), and the
markers themselves are well-formed. The parser and the runner are checked on tiny inline pages first."""

import os
from pathlib import Path

import pytest

from doc_examples import ExampleError, PageRun, page_examples, pages, parse_examples, run_page
from hf_alibi._transformers_compat import MINIMUM_TRANSFORMERS

# Pages whose examples take more than ~10 s on 2 cores (the whole suite's examples: ~3 minutes).
SLOW_PAGES = {
    "README.md",
    "docs/checkpoints.md",
    "docs/serving.md",
    "docs/train-short-test-long.md",
    "docs/scale-out.md",
    "docs/cli.md",
}
# Reference pages: no runnable block is expected there.
REFERENCE_PAGES = {"docs/benchmarks.md", "docs/api.md"}


def _page_param(page: str):
    return pytest.param(page, id=page, marks=[pytest.mark.slow] if page in SLOW_PAGES else [])


@pytest.mark.parametrize("page", [_page_param(page) for page in pages()])
def test_examples_on_page_run(page):
    ran, failure = run_page(page)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    if not ran:
        pytest.skip(f"{page} has no block that runs")


def test_every_marker_is_well_formed_and_every_page_but_the_references_has_examples_that_run():
    errors, without_examples = [], []
    for page in pages():
        try:
            examples = page_examples(page)
        except ExampleError as error:
            errors.append(str(error))
            continue
        if page not in REFERENCE_PAGES and not any(example.skip is None for example in examples):
            without_examples.append(page)
    assert not errors, "\n".join(errors)
    assert not without_examples, f"pages with no example that runs: {without_examples}"


# The parser, on inline pages.

PAGE = """# A page

Some prose.

```python
x = 1
```

<!-- example: replace "8000" "$PORT"; replace "big" "tiny" -->
```bash
serve big --port 8000
```

```yaml
not: run
```

- In a list:

    ```bash
    echo indented
    ```

<!-- example: skip, needs a GPU -->
```python
model.cuda()
```
"""


def test_parser_finds_python_and_bash_blocks_with_their_lines_and_replacements_and_skips():
    examples = parse_examples(PAGE, "page.md")
    assert [(e.line, e.language, e.code, e.skip) for e in examples] == [
        (5, "python", "x = 1\n", None),
        (10, "bash", "serve tiny --port $PORT\n", None),
        (20, "bash", "echo indented\n", None),
        (25, "python", "model.cuda()\n", "needs a GPU"),
    ]


@pytest.mark.parametrize(
    "marker, message",
    [
        ("<!-- example: skip, too slow -->", "skip reason 'too slow' is not one of"),
        ("<!-- example: skip, needs transformers 5.24 -->", "skip reason 'needs transformers 5.24' is not one of"),
        ('<!-- example: replace "absent" "x" -->', "replace 'absent': that text is not in the block"),
        ('<!-- example: replace "a" -->', "cannot read the marker"),
        ("<!-- example: run twice -->", "cannot read the marker"),
        ("<!-- example: skip, needs a GPU", "a marker is one line"),
    ],
)
def test_parser_refuses_a_marker_it_cannot_honour(marker, message):
    with pytest.raises(ExampleError, match=message) as error:
        parse_examples(f"text\n{marker}\n```python\na = 1\n```\n", "page.md")
    assert str(error.value).startswith("page.md:"), error.value


def test_a_block_that_needs_a_newer_transformers_is_skipped_only_on_an_older_one():
    page = "<!-- example: skip, needs transformers>={} -->\n```python\na = 1\n```\n"
    assert parse_examples(page.format(MINIMUM_TRANSFORMERS), "page.md")[0].skip is None  # every supported release
    assert parse_examples(page.format("99.0"), "page.md")[0].skip == "needs transformers>=99.0"


@pytest.mark.parametrize(
    "text",
    [
        "<!-- example: skip, needs a GPU -->\n\n```python\na = 1\n```\n",  # a blank line between
        "<!-- example: skip, needs a GPU -->\n```yaml\na: 1\n```\n",  # above a display block
        "<!-- example: skip, needs a GPU -->\nprose\n",  # above prose
        "<!-- example: skip, needs a GPU -->\n",  # above the page's end
    ],
)
def test_parser_refuses_a_marker_that_is_not_directly_above_a_runnable_block(text):
    with pytest.raises(ExampleError, match="page.md:1: marker"):
        parse_examples(text, "page.md")


def test_parser_refuses_a_block_that_is_never_closed():
    with pytest.raises(ExampleError, match="page.md:2: the block opened here is never closed"):
        parse_examples("text\n```python\na = 1\n", "page.md")


# The runner, on inline pages.


def _run(text: str) -> tuple[list[str | None], dict]:
    run = PageRun("inline.md")
    try:
        failures = [run.run(example) for example in parse_examples(text, "inline.md")]
        return failures, {"directory": run.directory, "environment": run.environment}
    finally:
        run.close()


def test_python_blocks_of_a_page_share_one_namespace_and_bash_sees_the_repository_and_the_port():
    failures, facts = _run(
        "```python\nvalue = 41\n```\n\n```python\nassert value + 1 == 42\nopen('made.txt', 'w').write('x')\n```\n\n"
        "```bash\ntest -f made.txt && test -f pyproject.toml && test -d hf_alibi && test ! -e runs\n"
        'test "$HF_HUB_OFFLINE" = 1 && test -n "$HF_ALIBI_EXAMPLE_PORT" && command -v python\n```\n'
    )
    assert failures == [None, None, None], failures
    assert not Path(facts["directory"]).exists(), "the page's temporary directory outlives it"


def test_a_failing_block_names_its_page_line_and_output_tail():
    failures, _ = _run(
        "```python\nprint('before')\nraise RuntimeError('boom')\n```\n\n"
        "```bash\necho 'on stdout'\nfalse\necho never\n```\n"
    )
    python_failure, bash_failure = failures
    assert python_failure.startswith("inline.md:1: the python block raised"), python_failure
    assert "before" in python_failure and "RuntimeError: boom" in python_failure, python_failure
    assert bash_failure.startswith("inline.md:6: the bash block exited with status 1"), bash_failure
    assert "on stdout" in bash_failure and "never" not in bash_failure, bash_failure


def test_background_jobs_of_a_page_are_killed_when_it_ends(tmp_path):
    pid_file = tmp_path / "pid"
    failures, _ = _run(f"```bash\nsleep 300 &\necho $! > {pid_file}\n```\n")
    assert failures == [None], failures
    pid = int(pid_file.read_text())
    status = Path(f"/proc/{pid}/status")
    alive = status.exists() and "\nState:\tZ" not in status.read_text()  # a zombie has ended; init reaps it
    if alive:
        os.kill(pid, 9)
    assert not alive, f"background job {pid} still runs after its page ended"
