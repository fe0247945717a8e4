"""What a finished run publishes: a model card (with its figures) in every ALiBi model's final folder, and the
upload of that folder to the Hub.

`write_cards` renders each card with `model_card.save_card` from the run's evaluations, metadata and measured
windows; `push_alibi_model` uploads the ALiBi model's final folder exactly as it lies on disk (weights, config with
`auto_map`, code, tokenizer, card, plots). `runner.run_experiment` calls both after every model is evaluated.
"""

from pathlib import Path

from transformers import AutoConfig

from ..length.attention_window import window_table
from ..setup.launch import final_dir
from .model_card import save_card
from .plots import plot_alibi_bias, plot_effective_window
from .results import run_caveat


def write_cards(experiment, training, evaluations, metadata, windows=None) -> None:
    """A model card in the final folder of every ALiBi model: extrapolation table and plot, the bias figure
    (`alibi_bias.png`) and, when measured, the effective window per head (`effective_window.png`)."""
    output_dir = Path(training.output_dir)
    windows = windows or {}
    caveat = run_caveat(metadata)
    for name, (encoding, length) in experiment.model_specs().items():
        if encoding != "alibi" or name not in evaluations:  # the template describes ALiBi slopes; NoPE gets none
            continue
        final = final_dir(output_dir, name)
        config = AutoConfig.from_pretrained(final)
        bias_plot = plot_alibi_bias(config, final / "alibi_bias.png", eps=experiment.window_eps)
        window_plot = None
        if name in windows:
            window_plot = plot_effective_window({name: windows[name]}, final / "effective_window.png", caveat=caveat)
        others = {other: ev for other, ev in evaluations.items() if other != name}
        model_name = training.hub_model_id or f"alibi-gpt2-{encoding}-{length}"
        save_card(
            final,
            evaluations[name],
            plot_path=output_dir / "perplexity_vs_length.png",
            bias_plot_path=bias_plot,
            window_plot_path=window_plot,
            window_table=window_table(windows[name]) if name in windows else "",
            model_name=model_name,
            model_summary=f"**{caveat}.** `{model_name}`: a smoke run of `hf_alibi`'s recipe." if caveat else None,
            repo_id=training.hub_model_id,
            architecture={k: getattr(config, k) for k in ("n_embd", "n_layer", "n_head", "vocab_size")},
            **fine_tuned_from(experiment.init_from),
            training={
                **metadata["training"],
                **metadata.get(f"{name}_training", {}),
                "corpus_fingerprint": metadata["corpus_fingerprint"],
            },
            compare_with=others,
        )


def fine_tuned_from(init_from: str | None) -> dict:
    """`render_card`'s `base_model` and `source_license` for a model fine-tuned from `init_from` ({} if none): the
    Hub id or folder name, and the licence fields of the source's own model card."""
    if init_from is None:
        return {}
    from ...conversion.common import LICENSE_FIELDS, checkpoint_name, source_card_metadata

    card = source_card_metadata(init_from)
    base_model = card.get("base_model") if Path(init_from).exists() else None  # a local import names its source
    base_model = base_model if isinstance(base_model, str) else checkpoint_name(init_from)
    return {"base_model": base_model, "source_license": {k: card[k] for k in LICENSE_FIELDS if k in card}}


def push_alibi_model(experiment, training) -> str:
    """Upload the ALiBi model's final folder (weights, config with auto_map, code, tokenizer, card, plot) as is."""
    from huggingface_hub import HfApi

    if not training.hub_model_id:
        raise ValueError("push_to_hub needs --hub_model_id")
    alibi = [name for name, (encoding, _) in experiment.model_specs().items() if encoding == "alibi"]
    if not alibi:
        raise ValueError(f"push_to_hub uploads the ALiBi model, but models {experiment.models} has none")
    folder = final_dir(Path(training.output_dir), alibi[0])
    api = HfApi(token=training.hub_token)
    api.create_repo(training.hub_model_id, private=training.hub_private_repo, exist_ok=True)
    api.upload_folder(
        repo_id=training.hub_model_id, folder_path=str(folder), commit_message="hf_alibi train-short-test-long"
    )
    return training.hub_model_id


__all__ = ["fine_tuned_from", "push_alibi_model", "write_cards"]
