"""What every family's import and export share: refusals as tables, exact state-dict transfers, checkpoint files."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel

from .._transformers_compat import auto_tokenizer, special_token_ids
from ..atomic_files import check_destination, write_folder_atomically  # noqa: F401  (importable here: dispatch, cli)

# The tanh GELU's names (BLOOM's, GPT-2's, llama.cpp's function): the model's own table, the one that runs it fused
from ..models.alibi.activations import TANH_GELUS  # noqa: F401  (importable here: bloom, gguf_export)
from ..models.alibi.alibi_bias import slopes_from_config


def shared_fields(config) -> dict:
    """The config fields every family names as GPT-2 does: norm epsilon, init range, special tokens, tied head."""
    names = ("layer_norm_epsilon", "initializer_range", "tie_word_embeddings")
    return {**{name: getattr(config, name) for name in names}, **special_token_ids(config)}


IMPORT_REFUSAL = (
    "{family} config has {field}={value!r}; hf_alibi holds only {field}={accepted!r} exactly, so this checkpoint "
    "cannot be imported"
)
EXPORT_REFUSAL = "{family} needs {field}={accepted!r}, the model has {field}={value!r}"


_ABSENT = object()  # a field the config lacks: nothing to refuse


class Requirement(NamedTuple):
    """One thing a conversion needs of a config field; `require` refuses a config that does not meet it."""

    field: str  # dotted into nested dicts (MPT's "attn_config.alibi"); the name the refusal gives
    accepted: object  # the one value held exactly; a frozenset: any of its values; a function: of the config, giving it
    message: str | None = None  # `str.format`ted with family, field, value, accepted and config; None: the default
    read: Callable | None = None  # the value checked, when derived from the config (the slopes); None: the field


# A slope scale that changes with the key length (`alibi_scaling.train_seq_len`): only Jais's and BTLM's code has one
LENGTH_DEPENDENT_SCALING = Requirement(
    "alibi_scaling.train_seq_len",
    None,
    "{family} has no slope scale that changes with the key length; {field}="
    "{value!r} (the length-dependent alibi_scaling) divides the slopes by K / {value} past {value} keys",
)
# Every layout's norm but Baichuan's: LayerNorm. An RMSNorm model (an imported Baichuan) is refused by name first.
LAYER_NORM = Requirement(
    "norm_type",
    "layer_norm",
    "{family} normalises with LayerNorm; {field}={value!r} (an RMSNorm model, such as an imported Baichuan, exports "
    "--to baichuan)",
)
# The Jais/BTLM switches at their defaults: what a layout without a gated MLP, a 1/d attention scale or muP
# multipliers (BLOOM, MPT, llama.cpp's mpt graph) needs. A static slope scale shows in the slopes those layouts
# compare; the length-dependent one is refused by name.
NO_MUP_SWITCHES = (
    Requirement("gated_mlp", False),
    Requirement("attn_scale_power", 0.5),
    Requirement("embedding_scale", 1.0),
    Requirement("logit_scale", 1.0),
    LENGTH_DEPENDENT_SCALING,
)


def export_requirements(
    *specific: Requirement, mlp: str, slopes: Callable[[int], torch.Tensor], rule: str
) -> tuple[Requirement, ...]:
    """What an export to a family with a 4 * n_embd MLP, its own slopes and none of the muP switches needs, in the
    order checked: `LAYER_NORM`, `NO_MUP_SWITCHES`, the family's `specific` fields, the MLP's width (`mlp` says whose, e.g. "BLOOM's
    MLP"), the slopes `slopes(n_head)` (`rule` says the family's rule, with `{config.n_head}` for the head count)."""
    mlp_width = Requirement(
        "n_inner",
        lambda config: 4 * config.n_embd,
        mlp + " is 4 * n_embd = {accepted} wide; n_inner={config.n_inner}",
        read=lambda config: config.n_inner or 4 * config.n_embd,
    )
    own_slopes = Requirement(
        "alibi_slopes",
        lambda config: slopes(config.n_head).tolist(),
        rule + "; this model's alibi_slopes/alibi_max_bias give {value}",
        read=lambda config: slopes_from_config(config).tolist(),
    )
    return (LAYER_NORM, *NO_MUP_SWITCHES, *specific, mlp_width, own_slopes)


def require(config, requirements: tuple[Requirement, ...], family: str, message: str) -> None:
    """Raise a `ValueError` for the first of `requirements` that `config` (a config or a dict) does not meet, with
    its message or else `message` (`IMPORT_REFUSAL`, `EXPORT_REFUSAL`). A field a config object lacks is accepted; a
    key a dict lacks reads as None."""
    for requirement in requirements:
        if requirement.read is not None:
            value = requirement.read(config)
        else:
            value = config
            for part in requirement.field.split("."):
                value = value.get(part) if isinstance(value, dict) else getattr(value, part, _ABSENT)
        if value is _ABSENT:
            continue
        accepted = requirement.accepted(config) if callable(requirement.accepted) else requirement.accepted
        if (value not in accepted) if isinstance(accepted, frozenset) else (value != accepted):
            text = requirement.message or message
            raise ValueError(
                text.format(family=family, field=requirement.field, value=value, accepted=accepted, config=config)
            )


def load_exactly(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> nn.Module:
    """Load `state` into `model` (every key, strict) and check tensor by tensor that it arrived bit for bit."""
    target = model.state_dict()
    missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
    if missing or unexpected:
        raise ValueError(f"{what}: weights do not line up: missing {missing}, unexpected {unexpected}")
    for key, tensor in state.items():
        if tensor.shape != target[key].shape:
            raise ValueError(f"{what}: shape mismatch for {key}: {tuple(tensor.shape)} vs {tuple(target[key].shape)}")
    with torch.no_grad():  # in place, one tensor at a time: no second copy of the weights (a 13B import is 26 GB)
        for key, tensor in state.items():
            target[key].copy_(tensor)
    differing = [key for key, tensor in state.items() if not torch.equal(target[key], tensor)]
    if differing:
        raise ValueError(f"{what}: weights did not copy over exactly: {differing}")
    return model.eval()


def build_exactly(model_class, config, state: dict[str, torch.Tensor], source: PreTrainedModel) -> PreTrainedModel:
    """A `model_class(config)` holding `state` exactly, in `source`'s dtype and with its generation config."""
    model = model_class(config).to(source.dtype)
    load_exactly(model, state, f"{source.config.model_type} -> {config.model_type}")
    model.generation_config = source.generation_config
    return model


def load_config(source: str | os.PathLike, **config_kwargs):
    """The config of the checkpoint at `source`, a local folder or a Hub id; `ValueError` naming `source` when it
    holds none (no such folder, no config.json, unreadable safetensors, a Hub id unavailable or, offline, not cached).
    `config_kwargs` go to `AutoConfig.from_pretrained` (e.g. `trust_remote_code`).
    """
    from transformers import AutoConfig

    return _read_config(source, lambda where: AutoConfig.from_pretrained(where, **config_kwargs))


def source_config(source: str | os.PathLike) -> dict:
    """The config.json at `source` (folder or Hub id), read as a dict: families whose code ships with the checkpoint
    (Jais, BTLM, Baichuan) have no config class here. Only that file is read (or downloaded). `ValueError`s as
    `load_config`'s."""
    from transformers import PretrainedConfig

    return _read_config(source, lambda where: PretrainedConfig.get_config_dict(where)[0])


def source_model_type(source: str | os.PathLike) -> str | None:
    """The `model_type` in the config.json at `source` (folder or Hub id); `ValueError`s as `load_config`'s."""
    return source_config(source).get("model_type")


def _read_config(source: str | os.PathLike, read: Callable):
    """`read(source)` after checking that `source` is a checkpoint folder or a Hub id worth asking for
    (`check_hub_id`); its failures as `ValueError`s naming `source`."""
    from huggingface_hub import constants

    path = Path(source)
    if path.exists():
        check_checkpoint_folder(path)
        try:
            return read(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path / 'config.json'}: not a readable transformers config ({exc})") from exc
    check_hub_id(source)
    try:
        return read(source)
    except OSError as exc:
        where = "in the local Hub cache (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "on the Hub"
        raise ValueError(f"{str(source)!r}: no such folder, and no model of that id {where}") from exc


def check_hub_id(source: str | os.PathLike) -> None:
    """`ValueError` at once, naming `source` (which is no local folder), where asking the Hub for it could only fail:
    it is no valid Hub repo id (`huggingface_hub`'s own check: a path of three parts, `./x`, ...), or the Hub cannot be
    reached and the id is not in the local Hub cache. Without this, a mistyped folder cost ~40 s of the Hub client's
    retries and a dozen lines of them before the error."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(source))
    except HFValidationError:
        raise ValueError(f"{str(source)!r}: no such folder") from None
    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(str(source), "config.json"), str):
        return
    if not hub_reachable():
        raise ValueError(
            f"{str(source)!r}: no such folder, and the Hub ({constants.ENDPOINT}) cannot be reached to "
            "look for a model of that id"
        )


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub's endpoint opens within `timeout_s` (one try). True behind a proxy, which
    may reach what a direct connection cannot: the Hub's own client is left to try."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def check_checkpoint_folder(path: Path) -> None:
    """`ValueError` naming `path` (or the file at fault) unless it is a folder with a config.json whose safetensors
    files all open (a truncated or corrupt file fails here, not deep inside the loader)."""
    from safetensors import safe_open

    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file, not a checkpoint folder")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json: not a saved checkpoint folder")
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except Exception as exc:  # noqa: BLE001  (safetensors raises its own SafetensorError for every defect)
            raise ValueError(f"{file}: not a readable safetensors file, truncated or corrupt ({exc})") from exc


LICENSE_FIELDS = ("license", "license_name", "license_link")


def source_card_metadata(source: str | os.PathLike) -> dict:
    """The licence and `base_model` fields of the model card at `source` (a local folder's README.md, or a Hub id's
    from the local Hub cache: no network); `{}` when there is no card or it names neither."""
    from huggingface_hub import ModelCard, try_to_load_from_cache

    readme = Path(source) / "README.md"
    if not readme.is_file():
        try:
            cached = None if Path(source).exists() else try_to_load_from_cache(str(source), "README.md")
        except ValueError:  # not a valid Hub id either
            cached = None
        if not isinstance(cached, str):
            return {}
        readme = Path(cached)
    try:
        data = ModelCard.load(readme).data.to_dict()
    except (OSError, ValueError):
        return {}
    return {key: data[key] for key in (*LICENSE_FIELDS, "base_model") if data.get(key)}


def checkpoint_name(source: str | os.PathLike) -> str:
    """What a checkpoint is called in metadata: a Hub id as is, a local folder by its own name (never its path)."""
    path = Path(source)
    return path.resolve().name if path.exists() else str(source)


def load_tokenizer(source):
    """The tokenizer saved at `source` (folder or Hub id), or None when there is no real vocabulary there."""
    try:
        tokenizer = auto_tokenizer(source)
    except (OSError, ValueError):
        return None
    # transformers 5 builds an empty tokenizer from a bare config: only a real vocabulary is worth shipping
    return tokenizer if len(tokenizer) > len(tokenizer.all_special_tokens) else None
