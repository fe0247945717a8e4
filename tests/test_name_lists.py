"""One source for every family, layout and encoder name: conversion's records.

`hf-alibi`'s choices, its help and its description, and the help of `--init_from`, name exactly what
`hf_alibi.conversion` records (`dispatch.FAMILIES` and the remote-code records in `dispatch.REMOTE_CODE`, the
encoders' layouts in `encoders`, `encoder_files.ENCODER_SOURCES`): adding a family is its record and nothing else.
No module outside `hf_alibi/conversion/` keeps a list of them by hand (`models/`, which ships with checkpoints and
imports nothing of ours, excepted).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from hf_alibi import cli
from hf_alibi.conversion import dispatch, encoder_files, encoders

PACKAGE = Path(cli.__file__).resolve().parent


def subcommands(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    """{name: its parser}, {name: its one-line help}."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices, {choice.dest: choice.help for choice in action._choices_actions}


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def test_the_records_derive_every_list():
    remote = [model_type for family in dispatch.REMOTE_CODE for model_type in family.names]
    assert (
        tuple(
            unique(
                [f.name for f in dispatch.FAMILIES.values()]
                + [n for f in dispatch.REMOTE_CODE for n in f.names.values()]
            )
        )
        == dispatch.FAMILY_NAMES
    )
    assert list(dispatch.NAMES) == [*dispatch.FAMILIES, *remote]
    assert tuple(dispatch.EXPORTABLE) == dispatch.GPT2_LAYOUTS and set(remote) <= set(dispatch.GPT2_LAYOUTS)
    assert (*encoders.LAYOUTS, encoder_files.GGUF_LAYOUT) == encoder_files.ENCODER_LAYOUTS
    assert tuple(unique([*dispatch.GPT2_LAYOUTS, *encoder_files.ENCODER_LAYOUTS])) == dispatch.LAYOUTS
    assert set(dispatch.LAYOUT_NAMES) == set(dispatch.LAYOUTS)
    assert tuple(unique(encoders.SHORT_NAMES.values())) == dispatch.ENCODER_NAMES
    assert set(remote) <= set(dispatch.MAX_SEQ_LEN) <= set(dispatch.GPT2_LAYOUTS)


def test_export_offers_exactly_the_layouts():
    parsers, _ = subcommands(cli.build_parser())
    assert tuple(option(parsers["export"], "--to").choices) == dispatch.LAYOUTS


def test_convert_and_export_help_name_exactly_the_records():
    _, helps = subcommands(cli.build_parser())
    families, encoder_names = re.fullmatch(
        r"import a (.+) checkpoint, or an ALiBi encoder \((.+)\)", helps["convert"]
    ).groups()
    assert families.split(", ") == list(dispatch.FAMILY_NAMES)
    assert encoder_names.split(", ") == list(dispatch.ENCODER_NAMES)
    gpt2, bert = re.fullmatch(r"export an ALiBi GPT-2 folder \((.+)\) or ALiBi BERT \((.+)\)", helps["export"]).groups()
    assert gpt2.split(", ") == unique(dispatch.LAYOUT_NAMES[layout] for layout in dispatch.GPT2_LAYOUTS)
    assert bert.split(", ") == unique(dispatch.LAYOUT_NAMES[layout] for layout in encoder_files.ENCODER_LAYOUTS)


def test_max_seq_len_help_names_exactly_the_layouts_that_take_it():
    parsers, _ = subcommands(cli.build_parser())
    text = option(parsers["export"], "--max-seq-len").help.removesuffix(" (default: the model's n_positions)")
    named = {}
    for group in text.split("; "):
        layouts, meaning = group.split(": ", 1)
        named.update(dict.fromkeys(layouts.split(", "), meaning))
    assert named == dispatch.MAX_SEQ_LEN


def test_the_description_names_the_records():
    text = cli.description()
    assert f"# {', '.join(dispatch.FAMILY_NAMES)} -> ALiBi GPT-2" in text
    assert f"# {', '.join(encoder_files.ENCODER_SOURCES)} -> ALiBi BERT" in text
    remote = [model_type for family in dispatch.REMOTE_CODE for model_type in family.names]
    assert f"--to {remote[0]} " in text and f"(also {', '.join(f'--to {t}' for t in remote[1:])})" in text
    assert f"--to {encoders.LAYOUTS[0]} " in text
    assert f"(also {', '.join(f'--to {t}' for t in encoders.LAYOUTS[1:])})" in text
    assert f"({dispatch.spoken(dispatch.GGUF_ARCHITECTURES)})" in text
    assert "{" not in text  # every placeholder filled


def test_init_from_help_names_the_exact_families():
    from hf_alibi.experiments.setup.arguments import ExperimentArguments

    field = ExperimentArguments.__dataclass_fields__["init_from"]
    exact = dispatch.spoken(dispatch.NAMES[family] for family in dispatch.EXACT_FAMILIES)
    assert f"{exact} (imported exactly by hf_alibi.convert) or {dispatch.NAMES['gpt2']}" in field.metadata["help"]


def test_a_new_record_reaches_the_cli_alone(monkeypatch):
    """What adding a family changes: the records; the parser picks it up with no edit of its own."""
    monkeypatch.setattr(dispatch, "FAMILY_NAMES", (*dispatch.FAMILY_NAMES, "NewFamily"))
    monkeypatch.setattr(dispatch, "LAYOUTS", (*dispatch.LAYOUTS, "newfamily"))
    monkeypatch.setattr(dispatch, "GPT2_LAYOUTS", (*dispatch.GPT2_LAYOUTS, "newfamily"))
    monkeypatch.setattr(dispatch, "LAYOUT_NAMES", {**dispatch.LAYOUT_NAMES, "newfamily": "NewFamily"})
    monkeypatch.setattr(dispatch, "MAX_SEQ_LEN", {**dispatch.MAX_SEQ_LEN, "newfamily": "its own limit"})
    parser = cli.build_parser()
    parsers, helps = subcommands(parser)
    assert "NewFamily" in helps["convert"] and "NewFamily" in helps["export"]
    assert parser.parse_args(["export", "a", "b", "--to", "newfamily"]).to == "newfamily"
    assert "newfamily: its own limit" in option(parsers["export"], "--max-seq-len").help
    assert "NewFamily" in cli.description()


# ---- no second list kept by hand -----------------------------------------------------------------------------------


def known_names() -> set[str]:
    """Every name the records hold: display names, model types, layouts, encoder sources."""
    return {
        *dispatch.FAMILY_NAMES,
        *dispatch.ENCODER_NAMES,
        *dispatch.NAMES,
        *dispatch.LAYOUTS,
        *encoder_files.ENCODER_SOURCES,
        dispatch.GGUF_NAME,
    }


def hand_kept_lists(source: str, label: str, names: set[str]) -> list[str]:
    """Literal collections of two or more record names, and strings that run two or more of them together as a list
    (`BLOOM, MPT`, `jais or btlm`), in the Python `source` (reported as `label:line`)."""
    tree = ast.parse(source)
    found = []
    alternation = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    run = re.compile(
        rf"(?<![\w-])({alternation}),? (?:(?:or|and) )?({alternation})(?![\w-])|"
        rf"(?<![\w-])({alternation}), ({alternation})(?![\w-])"
    )
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        elif isinstance(node, ast.Dict):
            items = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        else:
            items = []
        if sum(item in names for item in items) >= 2:
            found.append(f"{label}:{node.lineno}: {items}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and run.search(node.value):
            found.append(f"{label}:{node.lineno}: {run.search(node.value).group(0)!r}")
    return found


# Where names may be written out: conversion (the records), and models/, which ships inside every checkpoint and
# imports nothing outside its folder (its docstrings and the encoder config's variants name the families they serve).
OWN_LISTS = {"conversion", "models"}


def test_no_module_outside_conversion_keeps_a_name_list():
    names = known_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in OWN_LISTS:
            continue
        found += hand_kept_lists(path.read_text(), str(path.relative_to(PACKAGE.parent)), names)
    assert found == [], "name lists kept outside hf_alibi/conversion/ (derive them from its records):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "source, hits",
    [
        ('FAMILIES = ("bloom", "mpt")\n', 1),
        ('HELP = "import a BLOOM, MPT or Jais checkpoint"\n', 1),
        ('HELP = "--to jais or btlm"\n', 1),
        ('HELP = "export to BLOOM"\n', 0),
    ],
)
def test_the_check_finds_a_hand_kept_list(source, hits):
    found = hand_kept_lists(source, "probe.py", known_names())
    assert len(found) == hits, found


# ---- the docs: prose, so checked against the records rather than derived ------------------------------------------

REPO = PACKAGE.parent


def table_row(page: str, start: str) -> str:
    return next(line for line in (REPO / page).read_text().splitlines() if line.startswith(start))


def test_the_cli_reference_names_every_family_and_layout():
    convert, export = table_row("docs/cli.md", "| `convert` |"), table_row("docs/cli.md", "| `export` |")
    for name in (*dispatch.FAMILY_NAMES, *encoder_files.ENCODER_SOURCES):
        assert name in convert, f"docs/cli.md's convert row does not name {name}"
    for name in dispatch.LAYOUT_NAMES.values():
        assert name in export, f"docs/cli.md's export row does not name {name}"


def test_the_readme_offers_exactly_the_layouts():
    row = table_row("README.md", "| `hf-alibi export SRC DST --to ")
    gpt2, bert = re.match(r"\| `hf-alibi export SRC DST --to ([\w\\|]+)`.*`--to ([\w\\|]+)`", row).groups()
    assert gpt2.split("\\|") == list(dispatch.GPT2_LAYOUTS)
    assert bert.split("\\|") == list(encoder_files.ENCODER_LAYOUTS)
