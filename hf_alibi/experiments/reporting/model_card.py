"""Model cards for trained ALiBi checkpoints: metadata with a model-index of perplexity per evaluation length.

    card = render_card(evaluation, model_name="alibi-gpt2-tiny", repo_id="you/alibi-gpt2-tiny", training={...})
    save_card("runs/alibi/checkpoint", evaluation, plot_path="runs/eval/perplexity_vs_length.png", ...)

The card is rendered with `huggingface_hub.ModelCard.from_template` from the jinja template
`hf_alibi/experiments/reporting/templates/alibi_gpt2.md`, shipped as package data (or one passed as `template_path`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ...atomic_files import write_file_atomically, write_text_atomically
from ..length.length_eval import ModelEvaluation
from .results import perplexity_table

TEMPLATE_NAME = "alibi_gpt2.md"
DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "templates" / TEMPLATE_NAME  # package data: in wheels too
PLOT_FILE = "perplexity_vs_length.png"
CARD_TAGS = ["alibi", "gpt2", "causal-lm", "length-extrapolation", "hf_alibi"]


def find_template(template_path: str | os.PathLike | None = None) -> Path:
    """The card template: `template_path` if given, else the packaged `hf_alibi/experiments/reporting/templates/alibi_gpt2.md`."""
    path = Path(template_path) if template_path is not None else DEFAULT_TEMPLATE
    if not path.is_file():
        raise FileNotFoundError(
            f"model card template not found at {path}; pass template_path= pointing to a copy of "
            f"hf_alibi/experiments/reporting/templates/{TEMPLATE_NAME} from the hf_alibi repository"
        )
    return path


def card_eval_results(
    evaluation: ModelEvaluation, *, dataset_name: str, dataset_type: str, dataset_split: str = "validation"
) -> list[EvalResult]:
    """One `EvalResult` per measured (protocol, length): metric `perplexity`, config e.g. `nonoverlapping-512`."""
    results = []
    for r in evaluation.lengths:
        if r.unsupported:
            continue
        factor = f", {r.factor:g}x training length" if r.factor else ""
        for protocol, value in (("nonoverlapping", r.ppl_nonoverlapping), ("sliding", r.ppl_sliding)):
            if value is None:
                continue
            stride = f", stride {r.stride}" if protocol == "sliding" else ""
            results.append(
                EvalResult(
                    task_type="text-generation",
                    task_name="Causal language modeling",
                    dataset_type=dataset_type,
                    dataset_name=dataset_name,
                    dataset_split=dataset_split,
                    metric_type="perplexity",
                    metric_value=value,
                    metric_name=f"Perplexity ({protocol}, {r.length} tokens{factor}{stride})",
                    metric_config=f"{protocol}-{r.length}",
                )
            )
    return results


def render_card(
    evaluation: ModelEvaluation | dict,
    *,
    model_name: str,
    repo_id: str | None = None,
    model_summary: str | None = None,
    dataset_name: str = "held-out Python standard library files",
    dataset_type: str = "python-stdlib",
    datasets: list[str] | None = None,
    architecture: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
    compare_with: Mapping[str, ModelEvaluation | dict] | None = None,
    plot_file: str | None = PLOT_FILE,
    bias_plot_file: str | None = None,
    window_plot_file: str | None = None,
    window_table: str = "",
    license: str = "apache-2.0",
    base_model: str | None = None,
    source_license: Mapping[str, str] | None = None,
    template_path: str | os.PathLike | None = None,
) -> ModelCard:
    """Render the card of one ALiBi model from its length evaluation.

    Args:
        evaluation: this model's `ModelEvaluation` (or its dict); its perplexities fill the model-index.
        model_name: the name in the title and the model-index.
        repo_id: what the usage snippets load; defaults to `model_name`.
        model_summary: one paragraph under the title.
        dataset_name, dataset_type: the evaluation data as the model-index names it (`dataset_type` is a Hub id
            when the data is on the Hub).
        datasets: Hub dataset ids for the `datasets` metadata field (training data), if any.
        architecture, training: facts listed under "Training" (sizes; steps, batch, learning rate, seed, ...).
        compare_with: other models (e.g. the sinusoidal baseline) added as rows of the card's tables only.
        plot_file: the plot's file name, relative to the card (`save_card` copies it into the folder); None: none.
        bias_plot_file: the bias/slope figure (`hf_alibi.experiments.reporting.plots.plot_alibi_bias`), relative to the card.
        window_plot_file, window_table: the measured effective window per head (`attention_window`): its figure
            and markdown table; empty: the card has no such section.
        license: the licence of a model trained from scratch (this project's).
        base_model: the checkpoint it was fine-tuned from (a Hub id or a folder's name), if any; its card metadata
            `source_license` (`license`, `license_name`, `license_link`) becomes this card's licence, and when it
            has none the card says the licence is unknown (`license: other`, `license_name: unknown`).
        template_path: the jinja template; see `find_template`.
    """
    if not isinstance(evaluation, ModelEvaluation):
        evaluation = ModelEvaluation.from_dict(evaluation)
    rows = {model_name: evaluation}
    for name, other in (compare_with or {}).items():
        rows[name] = other if isinstance(other, ModelEvaluation) else ModelEvaluation.from_dict(other)
    if all(r.unsupported for r in evaluation.lengths):
        raise ValueError(f"{model_name}: the evaluation has no measured length (all unsupported): nothing to report")
    licence = _card_licence(license, base_model, source_license)
    card_data = ModelCardData(
        model_name=model_name,
        base_model=base_model,
        **licence,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(CARD_TAGS),
        datasets=datasets,
        metrics=["perplexity"],
        eval_results=card_eval_results(evaluation, dataset_name=dataset_name, dataset_type=dataset_type),
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(find_template(template_path)),
        model_name=model_name,
        repo_id=repo_id or model_name,
        model_summary=model_summary or f"`{model_name}`: an ALiBi GPT-2 model trained with `hf_alibi`.",
        dataset_name=dataset_name,
        **_evaluation_sections(evaluation, rows),
        plot_file=plot_file,
        bias_plot_file=bias_plot_file,
        window_plot_file=window_plot_file,
        window_table=window_table,
        architecture=dict(architecture or {}),
        training={key: _as_given(value) for key, value in (training or {}).items()},
        base_model=base_model,
        licence=licence.get("license_name") or licence["license"],
    )


def _card_licence(license: str, base_model: str | None, source_license: Mapping[str, str] | None) -> dict:
    """The card's licence metadata: `license` for a model trained from scratch; a fine-tuned model's is its base's
    (`source_license`), or `other`/`unknown` when the base's card names none."""
    if base_model is None:
        return {"license": license}
    return dict(source_license or {}) or {"license": "other", "license_name": "unknown"}


def _evaluation_sections(evaluation: ModelEvaluation, rows: dict[str, ModelEvaluation]) -> dict[str, str]:
    """The template's evaluation variables: the training length, the extrapolation factors, the documents scored,
    the perplexity tables of `rows` (the sliding one only when measured) and the sliding strides."""
    measured = [r for r in evaluation.lengths if not r.unsupported]
    factors = [r.factor for r in evaluation.lengths if r.factor]
    selection = evaluation.selection
    has_sliding = any(r.ppl_sliding is not None for r in measured)
    return dict(
        train_length=evaluation.train_length or "?",
        min_factor=f"{min(factors):g}" if factors else "?",
        max_factor=f"{max(factors):g}" if factors else "?",
        selection=(
            f"{selection.documents} documents, {selection.tokens_used:,} tokens, the same tokens scored at every "
            f"length (token ids fingerprint `{selection.fingerprint[:12]}`)."
        ),
        table_nonoverlapping=perplexity_table(rows, "ppl_nonoverlapping"),
        table_sliding=perplexity_table(rows, "ppl_sliding") if has_sliding else "",
        strides=", ".join(f"stride {r.stride} at {r.length}" for r in measured if r.stride),
    )


def _as_given(value):
    """A whole-number float as the integer it was given as (`warmup_steps: 0` comes back from argparse as 0.0)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def save_card(
    folder: str | os.PathLike,
    evaluation: ModelEvaluation | dict,
    *,
    plot_path: str | os.PathLike | None = None,
    bias_plot_path: str | os.PathLike | None = None,
    window_plot_path: str | os.PathLike | None = None,
    **card_kwargs: Any,
) -> Path:
    """Render the card into `folder/README.md` (atomically); copy the plots beside it. Returns the README path.

    `card_kwargs` go to `render_card` (`model_name` is required). The card links each plot by its file name.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    card = render_card(
        evaluation,
        plot_file=_copy_beside(plot_path, folder),
        bias_plot_file=_copy_beside(bias_plot_path, folder),
        window_plot_file=_copy_beside(window_plot_path, folder),
        **card_kwargs,
    )
    readme = folder / "README.md"
    write_text_atomically(readme, str(card))
    return readme


def _copy_beside(path: str | os.PathLike | None, folder: Path) -> str | None:
    """Copy `path` into `folder` (atomically, unless it is already there); its file name, or None without a path."""
    if path is None:
        return None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plot {path} does not exist")
    target = folder / path.name
    if path.resolve() != target.resolve():
        with open(path, "rb") as source:
            write_file_atomically(target, lambda handle: shutil.copyfileobj(source, handle))
    return path.name


__all__ = ["CARD_TAGS", "card_eval_results", "find_template", "render_card", "save_card"]
