"""Packed rows (several documents in one row, positions restarting at 0) attend only within each document.

This is what transformers' `DataCollatorWithFlattening` and TRL's padding-free batches send: `position_ids` that
restart per document (and `cu_seq_lens_*` for flash attention). Reference: each document run alone.
"""

import logging

import pytest
import torch
from transformers import DataCollatorWithFlattening

DOC_LENGTHS = (5, 23, 1, 11)  # a one-token document, and lengths that straddle the 16-row SDPA chunks below
BACKENDS = ["eager", "sdpa", "sdpa_chunked", "flex_attention"]


def build(make_model, backend):
    if backend == "sdpa_chunked":  # the bias bank over several chunks, documents across them
        return make_model("sdpa", alibi_sdpa_split=False, alibi_sdpa_query_chunk=16)
    return make_model(backend)


def packed_row(documents):
    ids = torch.cat(documents, dim=1)  # (1, total)
    positions = torch.cat([torch.arange(d.shape[1]) for d in documents])[None]  # (1, total), restarting at 0
    return ids, positions


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_row_gives_each_document_its_own_logits(backend, make_model, random_ids):
    model = build(make_model, backend)
    documents = [random_ids(1, n) for n in DOC_LENGTHS]
    ids, positions = packed_row(documents)
    with torch.no_grad():
        packed = model(ids, position_ids=positions).logits[0]  # (total, V)
        alone = torch.cat([model(d).logits[0] for d in documents])  # (total, V)
    difference = (packed - alone).abs().max().item()
    assert difference <= 1e-5, f"largest difference from the documents run alone: {difference:.3g}"


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sdpa_chunked"])  # FlexAttention has no CPU backward
def test_packed_row_gives_the_gradients_of_the_documents_alone(backend, make_model, random_ids):
    documents = [random_ids(1, n) for n in DOC_LENGTHS]
    ids, positions = packed_row(documents)
    packed_model, alone_model = build(make_model, backend), build(make_model, backend)
    packed_model(ids, position_ids=positions).logits.square().mean(-1).sum().backward()
    sum(alone_model(d).logits.square().mean(-1).sum() for d in documents).backward()
    for (name, packed), (_, alone) in zip(packed_model.named_parameters(), alone_model.named_parameters()):
        difference = (packed.grad - alone.grad).abs().max().item()
        assert difference <= 1e-5, f"{name}: largest gradient difference {difference:.3g}"


def test_cu_seq_lens_mark_documents_like_restarting_positions(tiny_model, random_ids):
    documents = [random_ids(1, n) for n in DOC_LENGTHS]
    ids, positions = packed_row(documents)
    cu_seq_lens = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        by_positions = tiny_model(ids, position_ids=positions).logits
        by_cu_seq_lens = tiny_model(ids, cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens).logits
    assert torch.equal(by_positions, by_cu_seq_lens)


def test_cu_seq_lens_that_do_not_cover_the_row_are_refused(tiny_model, random_ids):
    with pytest.raises(ValueError, match="cu_seq_lens"):
        tiny_model(random_ids(1, 10), cu_seq_lens_q=torch.tensor([0, 4, 8], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_plain_and_left_padded_position_ids_change_nothing_and_log_nothing(backend, make_model, random_ids, caplog):
    model = make_model(backend)
    ids = random_ids(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    left_padded_positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() sends with left padding
    with torch.no_grad(), caplog.at_level(logging.INFO):
        plain = model(ids).logits
        with_positions = model(ids, position_ids=torch.arange(9)[None]).logits
        padded = model(ids, attention_mask=mask).logits
        padded_with_positions = model(ids, attention_mask=mask, position_ids=left_padded_positions).logits
    assert torch.equal(plain, with_positions)
    assert torch.equal(padded, padded_with_positions)
    assert not [r for r in caplog.records if "position" in r.getMessage()], "position_ids should log nothing"


def test_padding_free_collator_batch_trains_to_the_loss_of_the_padded_batch(make_model, random_ids):
    """transformers' DataCollatorWithFlattening (TRL's padding-free strategy) against a right-padded batch."""
    documents = [random_ids(1, n)[0] for n in (12, 7, 9)]
    flat = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in documents])
    length = max(len(d) for d in documents)
    padded_ids = torch.zeros(len(documents), length, dtype=torch.long)
    mask = torch.zeros_like(padded_ids)
    for row, document in enumerate(documents):
        padded_ids[row, : len(document)], mask[row, : len(document)] = document, 1
    padded_labels = padded_ids.masked_fill(mask == 0, -100)

    losses = {}
    for name in ("packed", "padded"):
        model = make_model("sdpa").train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(3):
            if name == "packed":
                out = model(flat["input_ids"], position_ids=flat["position_ids"], labels=flat["labels"])
            else:
                out = model(padded_ids, attention_mask=mask, labels=padded_labels)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(out.loss.item())
    assert losses["packed"] == pytest.approx(losses["padded"], abs=1e-5), losses
    assert losses["packed"][-1] < losses["packed"][0], f"the model did not learn: {losses['packed']}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attention_packed_row_gives_each_document_its_own_logits(make_model, random_ids):
    pytest.importorskip("flash_attn", reason="needs the flash-attn package")
    model = make_model("flash_attention_2").cuda().half()
    documents = [random_ids(1, n).cuda() for n in DOC_LENGTHS]
    ids, positions = packed_row(documents)
    with torch.no_grad():
        packed = model(ids, position_ids=positions.cuda()).logits[0].float()
        alone = torch.cat([model(d).logits[0] for d in documents]).float()
    difference = (packed - alone).abs().max().item()
    assert difference <= 2e-2, f"largest difference from the documents run alone: {difference:.3g}"
