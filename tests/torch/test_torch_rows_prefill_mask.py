"""A strategy batch's first prefill chunk, seen plainly causally by every row, goes to the model
without a mask, so transformers' SDPA runs ``is_causal`` as in its own prefill (an explicit 4-D
mask made that attention ~3x slower). The logits are those of the same batch given the explicit
causal mask, bit for bit, through the later chunks and steps (which keep their masks); a row whose
first chunk is not plainly causal (static slots past the queries) keeps its mask."""

from __future__ import annotations

import pytest
import torch

from cachelib.core.masks import visible
from cachelib.decode import Runner
from cachelib.profile.backends import probe_for
from cachelib.spec import parse_spec

STRATEGIES = ["standard", "rotating:max_size=12,keep=2", "quantized:bits=8,group_size=32", "kivi:bits=4,residual=4"]


@pytest.fixture(scope="module")
def tiny(load_model):
    return load_model("tiny-llama", "torch")


def _logits(loaded, rows, chunks, explicit_first: bool) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for i, chunk in enumerate(chunks):
            x = torch.tensor([chunk] * len(rows.rows))
            mask = rows.attention_mask(x.shape[1], x.device)
            if i == 0:
                assert mask is None  # the first chunk of every row here is plainly causal
                if explicit_first:
                    n = x.shape[1]
                    causal = visible(torch.arange(n)[:, None], torch.arange(n)[None, :])
                    mask = causal.expand(len(rows.rows), 1, n, n)
            else:
                assert mask is not None or x.shape[1] == 1
            out.append(loaded.model(input_ids=x, cache=rows, attention_mask=mask, use_cache=True).logits)
    return out


def test_the_first_chunk_goes_without_a_mask_and_gives_the_masked_logits_bit_for_bit(tiny):
    probe, runner = probe_for(tiny), Runner(tiny)
    ids = [int(i) for i in torch.randint(5, 200, (40,), generator=torch.Generator().manual_seed(0))]
    chunks = [ids[:16], ids[16:30]] + [[t] for t in ids[30:]]
    got, want = (
        _logits(tiny, runner.rows_cache([probe.make_cache(parse_spec(s)) for s in STRATEGIES]), chunks, explicit)
        for explicit in (False, True)
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_row_whose_first_chunk_shows_more_slots_keeps_its_mask(tiny):
    probe, runner = probe_for(tiny), Runner(tiny)
    rows = runner.rows_cache([probe.make_cache(parse_spec(s)) for s in ("standard", "static:max_len=64")])
    mask = rows.attention_mask(16, torch.device("cpu"))
    assert mask is not None and mask.shape == (2, 1, 16, 16)
