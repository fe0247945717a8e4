"""Tiny random Baichuan-13B and Baichuan2-13B checkpoints in their own layout, files and config keys, their
SentencePiece tokenizer, and the float64 forward of their architecture, written here from their modeling code's
description (independently of hf_alibi): what their code computes.

Shapes: Baichuan-13B's 40 heads (the paper's slopes interleaved past 32), head_dim 4, its MLP ratio (13696 / 5120),
2 layers, a tiny vocabulary, `model_max_length` 16 (the inputs run past it).
"""

import io
import json
import math

import torch

from hf_alibi.conversion.remote_code import Checkpoint

VOCAB, HIDDEN, HEADS, LAYERS, MAX_LENGTH = 96, 160, 40, 2, 16
INTERMEDIATE = HIDDEN * 13696 // 5120  # 428
GENERATIONS = {
    "baichuan_13b": {"architectures": ["BaichuanForCausalLM"]},
    "baichuan2_13b": {"architectures": ["BaichuanForCausalLM"], "z_loss_weight": 0},  # NormHead
}


def their_config(generation: str, **overrides) -> dict:
    """Their config.json at the tiny sizes, the keys their config class writes; an override of `...` removes a key."""
    config = {
        "model_type": "baichuan",
        "auto_map": {
            "AutoConfig": "configuration_baichuan.BaichuanConfig",
            "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM",
        },
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "hidden_act": "silu",
        "model_max_length": MAX_LENGTH,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.29.2",
    }
    return {key: value for key, value in (config | GENERATIONS[generation] | overrides).items() if value is not ...}


def tiny_checkpoint(generation: str, seed: int = 0, dtype=torch.float32, **overrides) -> Checkpoint:
    """Random weights in their names and `nn.Linear` layout, scaled like a trained model's (norm weights off 1); a
    Baichuan2 head whose rows are far from unit norm (its NormHead divides them by it)."""
    config = their_config(generation, **overrides)
    generator = torch.Generator().manual_seed(seed)
    width, inner = config["hidden_size"], config["intermediate_size"]

    def rand(*shape, std=0.1, mean=0.0):
        return (mean + std * torch.randn(*shape, generator=generator)).to(dtype)

    state = {"model.embed_tokens.weight": rand(config["vocab_size"], width, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        state[layer + "self_attn.W_pack.weight"] = rand(3 * width, width, std=0.15)  # rows: q, then k, then v
        state[layer + "self_attn.o_proj.weight"] = rand(width, width, std=0.08)
        state[layer + "mlp.gate_proj.weight"] = rand(inner, width, std=0.1)
        state[layer + "mlp.up_proj.weight"] = rand(inner, width, std=0.1)
        state[layer + "mlp.down_proj.weight"] = rand(width, inner, std=0.08)
        state[layer + "input_layernorm.weight"] = rand(width, mean=1.0)
        state[layer + "post_attention_layernorm.weight"] = rand(width, mean=1.0)
    state["model.norm.weight"] = rand(width, mean=1.0)
    head_std = 0.05 if "z_loss_weight" in config else 0.3  # NormHead's rows: norms ~0.6, not 1
    state["lm_head.weight"] = rand(config["vocab_size"], width, std=head_std)
    return Checkpoint(config, state)


def save_source(checkpoint: Checkpoint, folder, shards: int = 3) -> None:
    """Their folder as published: config.json and `pytorch_model-0000N-of-0000M.bin` pickles with their index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(checkpoint.config, indent=2))
    names = sorted(checkpoint.state_dict)
    weight_map = {}
    for shard in range(shards):
        file = f"pytorch_model-{shard + 1:05d}-of-{shards:05d}.bin"
        part = {name: checkpoint.state_dict[name].contiguous() for name in names[shard::shards]}
        torch.save(part, folder / file)
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def their_slopes(n: int) -> list[float]:
    """Their `_get_interleave(n)`: the paper's slopes, interleaved for a head count not a power of two."""

    def power_of_two(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + their_slopes(2 * closest)[0::2][: n - closest]


def _rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # their variance is fp32: exact here


def their_logits(checkpoint: Checkpoint, input_ids, attention_mask=None) -> torch.Tensor:
    """Float64 logits `(B, L, V)` of their forward: embeddings; per layer x + o_proj(attention(RMSNorm x)) with q, k,
    v the three row blocks of W_pack, scores q.k / sqrt(head_dim) + slope * j (key index), keys after the query or
    padding masked; then x + down(silu(gate(RMSNorm x)) * up(RMSNorm x)); RMSNorm; the head, its rows divided by
    their L2 norms where the config carries z_loss_weight (Baichuan2's NormHead). Padded query rows are undefined."""
    config, w = checkpoint.config, {name: tensor.double() for name, tensor in checkpoint.state_dict.items()}
    eps, heads = config["rms_norm_eps"], config["num_attention_heads"]
    hidden = w["model.embed_tokens.weight"][input_ids]  # (B, L, C)
    batch, length, width = hidden.shape
    head_dim = width // heads
    slopes = torch.tensor(their_slopes(heads), dtype=torch.float64)[:, None, None]  # (H, 1, 1)
    j = torch.arange(length, dtype=torch.float64)
    bias = slopes * j  # (H, 1, L): their `slope * j`, the same for every query row
    hidden_keys = torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    visible = torch.ones(length, length).tril().bool()[None, None] & hidden_keys[:, None, None, :]  # (B, 1, L, L)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms_norm(hidden, w[p + "input_layernorm.weight"], eps)
        q, k, v = (
            t.view(batch, length, heads, head_dim).transpose(1, 2)
            for t in (x @ w[p + "self_attn.W_pack.weight"].T).split(width, dim=-1)
        )  # 3 x (B, H, L, D)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias  # (B, H, L, L)
        weights = torch.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1).nan_to_num(0.0)
        out = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        hidden = hidden + out @ w[p + "self_attn.o_proj.weight"].T
        x = _rms_norm(hidden, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        hidden = hidden + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    hidden = _rms_norm(hidden, w["model.norm.weight"], eps)
    head = w["lm_head.weight"]
    if "z_loss_weight" in config:
        head = head / head.norm(dim=-1, keepdim=True)
    return hidden @ head.T  # (B, L, V)


def their_greedy(checkpoint: Checkpoint, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding of one unpadded prompt with `their_logits`."""
    ids = list(ids)
    for _ in range(new_tokens):
        ids.append(int(their_logits(checkpoint, torch.tensor([ids]))[0, -1].argmax()))
    return ids


TOKENIZER_TEXT = [
    "百川大模型 Baichuan is a large language model trained on Chinese and English text.",
    "The year 2023 had 365 days and 12 months; prices rose 4.5%.",
    "  two  spaces,\ttabs\nand newlines between lines",
    "中文和English混合的句子，还有数字12345。",
    "hello world, hello there, general kenobi",
]


def train_sentencepiece(folder, add_bos_token: bool = False) -> bytes:
    """A SentencePiece BPE model trained here with Baichuan's settings (byte fallback, digits split, no dummy prefix,
    whitespace kept as it is, identity normalisation), written as `tokenizer.model` with their tokenizer_config.json
    (their remote class, special tokens as AddedToken dicts); the model's bytes."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT * 20),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())

    def added(content):
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False}

    tokenizer_config = {
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]},
        "bos_token": added("<s>"),
        "eos_token": added("</s>"),
        "unk_token": added("<unk>"),
        "pad_token": added("<unk>"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LENGTH,
        "sp_model_kwargs": {},
        "tokenizer_class": "BaichuanTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return model.getvalue()
