"""Contestants imported from another family's model: the very function that family's contestant times, imported
into hf_alibi (SDPA, dense) by `convert`, after checking on one input that both give the same logits (a worker refuses
to start otherwise)."""


def imported_bloom(bloom, check_length: int = 64):
    """`bloom` imported into hf_alibi (SDPA), after checking that both give the same logits on one input."""
    import torch

    from hf_alibi import convert

    model = convert(bloom.eval())
    model.set_attn_implementation("sdpa")
    model.config.alibi_skip_eps = 0.0  # dense, as the source: skipping's gain depends on the (random) weights
    ids = torch.randint(3, bloom.config.vocab_size, (1, check_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = (model(ids).logits - bloom(ids).logits).abs().max().item()  # (1, L, V) each
    if not error < 1e-4:
        raise RuntimeError(f"imported BLOOM's logits differ from BloomForCausalLM's by {error:.2e}")
    return model


def imported_jais(jais, check_length: int = 64):
    """The `JaisEager` model `jais` imported into hf_alibi (SDPA), after checking both give the same logits."""
    import torch

    from hf_alibi.conversion import convert_cerebras
    from hf_alibi.conversion.remote_code import Checkpoint

    model = convert_cerebras(Checkpoint(jais.config, jais.state_dict()))
    model.set_attn_implementation("sdpa")
    model.config.alibi_skip_eps = 0.0  # dense, as the source: skipping's gain depends on the (random) weights
    length = min(check_length, jais.config["n_positions"])  # their code refuses longer inputs
    ids = torch.randint(3, jais.config["vocab_size"], (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = (model(ids).logits - jais.eval()(ids).logits).abs().max().item()  # (1, L, V) each
    if not error < 1e-4:
        raise RuntimeError(f"imported Jais's logits differ from their code's (jais-eager) by {error:.2e}")
    return model


def imported_baichuan(baichuan, check_length: int = 64):
    """The `BaichuanEager` model `baichuan` imported into hf_alibi (SDPA), after checking both give the same logits
    (imported before its first forward: their NormHead normalises its head in place then)."""
    import torch

    from hf_alibi.conversion import convert_baichuan
    from hf_alibi.conversion.remote_code import Checkpoint

    model = convert_baichuan(Checkpoint(baichuan.config, baichuan.state_dict()))
    model.set_attn_implementation("sdpa")
    model.config.alibi_skip_eps = 0.0  # dense, as the source: skipping's gain depends on the (random) weights
    ids = torch.randint(3, baichuan.config["vocab_size"], (1, check_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = (model(ids).logits - baichuan.eval()(ids).logits).abs().max().item()  # (1, L, V) each
    if not error < 1e-4:
        raise RuntimeError(f"imported Baichuan's logits differ from their code's (baichuan-eager) by {error:.2e}")
    return model
