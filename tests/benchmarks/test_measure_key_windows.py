"""`measure_key_windows`' figures from key ranges: each head's kept share of causal key work, its keys read back over
the settled blocks, and the kept work's growth by length (the band's edge: a fixed window doubles faster than 2x)."""

import pytest
import torch

from benchmarks.measure_key_windows import layer_windows, markdown


def brute_kept_share(first_key, rows, length):
    shares = []
    for head in first_key.tolist():
        kept = sum(i - head[i // rows] + 1 for i in range(length))
        shares.append(kept / (length * (length + 1) / 2))
    return shares


def test_the_kept_share_counts_each_rows_keys_from_its_blocks_first_key():
    rows, length = 4, 14  # four blocks, the last one short
    first_key = torch.tensor([[0, 0, 0, 0], [0, 2, 5, 9], [0, 4, 8, 12]])  # dense; a window; the diagonal blocks alone
    kept = [head["kept"] for head in layer_windows(first_key, rows, length, settled=0)]
    assert kept == pytest.approx(brute_kept_share(first_key, rows, length))
    assert kept[0] == pytest.approx(1.0)


def test_windows_average_over_the_settled_blocks_and_a_fixed_window_doubles_its_work_faster_than_2x():
    rows, window = 256, 1024
    cells = []

    def first_key(length):  # one head, the same window at every length
        return (torch.arange(length // rows) * rows - window).clamp(min=0)[None]

    for length in (4096, 8192, 16384):
        heads = layer_windows(first_key(length), rows, length, settled=2048)
        assert heads[0]["mean_back"] == heads[0]["max_back"] == window
        cells.append({"length": length, "rows": rows, "layers": [heads]})
    text = markdown(cells, "python -m x", slopes=[1 / 256])
    # key work about L w - w^2 / 2, w the window plus half a block's diagonal: x2.16, then x2.07, towards 2
    growth = [float(line.rsplit("| x", 1)[1].rstrip(" |")) for line in text.splitlines() if "| x" in line]
    work = [brute_kept_share(first_key(n), rows, n)[0] * n**2 for n in (4096, 8192, 16384)]
    assert growth == [pytest.approx(work[1] / work[0], abs=1e-3), pytest.approx(work[2] / work[1], abs=1e-3)]
    assert 2.0 < growth[1] < growth[0]
    assert "| 4,096 | 0 | 0 (1/256) | 1,024 | 1,024 |" in text
