"""Tiny random Jais and BTLM checkpoints in their own layout and config keys, and the float64 reference of what their
code computes, read from those keys here (independently of hf_alibi's import)."""

import json
import math

import torch
from safetensors.torch import save_file
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from alibi_reference import cached_row_slopes, reference_logits
from hf_alibi.conversion.remote_code import Checkpoint

VOCAB, N_EMBD, N_HEAD, N_LAYER, N_INNER, N_POSITIONS = 96, 48, 6, 2, 100, 32  # 6 heads: the interleaved slopes
# The muP keys of each generation, at the shapes of the released configs (jais-13b: 14.6, 0.111; BTLM-3B-8K: 14.6,
# 2.22 * 0.1): jais-13b's code, the Jais-family code and BTLM's code
GENERATIONS = {
    "jais_13b": {
        "model_type": "jais",
        "architectures": ["JAISLMHeadModel"],
        "embeddings_scale": 14.6,
        "width_scale": 0.111,
        "scale_qk_dot_by_d": True,
    },
    "jais_family": {
        "model_type": "jais",
        "architectures": ["JAISLMHeadModel"],
        "mup_embeddings_scale": 9.17,
        "mup_output_alpha": 1.1,
        "mup_width_scale": 0.25,
        "mup_scale_qk_dot_by_d": True,
        "alibi_scaling": None,
    },
    "btlm": {
        "model_type": "btlm",
        "architectures": ["BTLMLMHeadModel"],
        "mup_embeddings_scale": 14.6,
        "mup_output_alpha": 2.22,
        "mup_width_scale": 0.1,
        "mup_scale_qk_dot_by_d": True,
        "alibi_scaling": None,
    },
}


def paper_slopes(n: int) -> list[float]:
    """The ALiBi paper's code, as their `_get_alibi_slopes` has it: interleaved for a head count not a power of 2."""

    def power_of_two(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


def their_config(generation: str, **overrides) -> dict:
    """A config.json of `generation` at the tiny sizes; an override of `...` removes that key."""
    config = {
        "vocab_size": VOCAB,
        "n_embd": N_EMBD,
        "n_head": N_HEAD,
        "n_layer": N_LAYER,
        "n_inner": N_INNER,
        "n_positions": N_POSITIONS,
        "activation_function": "swiglu",
        "position_embedding_type": "alibi",
        "scale_attn_weights": True,
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    return {key: value for key, value in (config | GENERATIONS[generation] | overrides).items() if value is not ...}


def tiny_checkpoint(generation: str, seed: int = 0, mask_buffers: bool = True, **overrides) -> Checkpoint:
    """Random weights (scaled like a trained model's: unit LayerNorms off 1, biases off 0) in GPT-2's names and
    Conv1D layout, their slopes parameter and, as older saves have them, the causal-mask buffers."""
    config = their_config(generation, **overrides)
    generator = torch.Generator().manual_seed(seed)
    width, inner = config["n_embd"], config["n_inner"]

    def rand(*shape, std=0.1, mean=0.0):
        return mean + std * torch.randn(*shape, generator=generator)

    state = {"transformer.wte.weight": rand(config["vocab_size"], width, std=1.0)}  # logits of order 1
    gated = config["activation_function"] == "swiglu"
    n_positions = config["n_positions"]
    for i in range(config["n_layer"]):
        block = f"transformer.h.{i}."
        shapes = {
            "attn.c_attn": (width, 3 * width),
            "attn.c_proj": (width, width),
            "mlp.c_fc": (width, inner),
            "mlp.c_proj": (inner, width),
        } | ({"mlp.c_fc2": (width, inner)} if gated else {})
        for name, shape in shapes.items():
            state[block + name + ".weight"] = rand(*shape, std=0.15)
            state[block + name + ".bias"] = rand(shape[1], std=0.05)
        for norm in ("ln_1", "ln_2"):
            state[block + norm + ".weight"], state[block + norm + ".bias"] = rand(width, mean=1.0), rand(width)
        if mask_buffers:
            state[block + "attn.bias"] = torch.tril(torch.ones(n_positions, n_positions, dtype=torch.bool))[None, None]
            state[block + "attn.masked_bias"] = torch.tensor(-1e4)
    state["transformer.ln_f.weight"], state["transformer.ln_f.bias"] = rand(width, mean=1.0), rand(width)
    state["transformer.relative_pe.slopes"] = torch.tensor(paper_slopes(config["n_head"]))[:, None]  # (H, 1)
    return Checkpoint(config, state)


def save_source(checkpoint: Checkpoint, folder, shards: int = 1) -> None:
    """Their folder: config.json and the weights, as safetensors or (shards > 1) pytorch_model-*.bin with an index,
    as jais-13b ships them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(checkpoint.config))
    state = {name: tensor.contiguous() for name, tensor in checkpoint.state_dict.items()}
    if shards == 1:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    for shard in range(shards):
        file = f"pytorch_model-{shard + 1:05d}-of-{shards:05d}.bin"
        part = {name: state[name] for name in names[shard::shards]}
        torch.save(part, folder / file)
        weight_map |= dict.fromkeys(part, file)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def their_logits(checkpoint: Checkpoint, input_ids, attention_mask=None, forward_lengths=None) -> torch.Tensor:
    """Float64 logits of what their code computes: their config keys read as their code reads them (jais-13b's code:
    `width_scale`, `embeddings_scale`, `scale_qk_dot_by_d`; the Jais-family and BTLM code: `mup_output_alpha *
    mup_width_scale`, `mup_embeddings_scale`, `mup_scale_qk_dot_by_d`, and `alibi_scaling`: a static `factor` dividing
    the slopes parameter, else `train_seq_len` dividing it by K / train_seq_len in a forward over K > train_seq_len
    keys), the rest of the architecture as written in `alibi_reference.reference_logits`. `forward_lengths`: the new
    tokens of each forward of a cached run (their code's K is the cached plus new tokens); None: one forward."""
    config, state = checkpoint.config, checkpoint.state_dict
    scaling = {}
    if "width_scale" in config:
        embedding_scale, logit_scale = config["embeddings_scale"], config["width_scale"]
        by_d = config["scale_qk_dot_by_d"]
    else:
        embedding_scale, by_d = config.get("mup_embeddings_scale", 1.0), config.get("mup_scale_qk_dot_by_d", False)
        logit_scale = config.get("mup_output_alpha", 1.0) * config.get("mup_width_scale", 1.0)
        scaling = {key: value for key, value in (config.get("alibi_scaling") or {}).items() if key != "type"}
    head_dim = config["n_embd"] // config["n_head"]
    forward_lengths = [input_ids.shape[1]] if forward_lengths is None else forward_lengths
    slopes = cached_row_slopes(state["transformer.relative_pe.slopes"].flatten(), forward_lengths, **scaling)
    gated = config["activation_function"] == "swiglu"
    return reference_logits(
        state,
        input_ids,
        n_layer=config["n_layer"],
        n_head=config["n_head"],
        slopes=slopes,
        attn_scale=1 / head_dim if by_d else head_dim**-0.5,
        gated=gated,
        activation="silu" if gated else config["activation_function"],
        embedding_scale=embedding_scale,
        logit_scale=logit_scale,
        eps=config["layer_norm_epsilon"],
        attention_mask=attention_mask,
    )


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (Jais's and BTLM's kind) trained on a little Arabic and English: ~290 ids."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["مرحبا بالعالم hello world"] * 20,
        vocab_size=VOCAB + 200,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
