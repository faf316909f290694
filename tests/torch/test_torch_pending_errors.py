"""On torch the runner calls a probe's ``pending`` as each forward ends, before it hands the
logits on: the torch probe computes the step's quantization error there (the error's small ops
run before the quality probe's thread starts on those logits), and ``views_of`` then reads
figures already made, the same as those it computes itself when ``pending`` was not called."""

from __future__ import annotations

import pytest

from cachelib.decode import Runner
from cachelib.profile.backends import probe_for
from cachelib.spec import parse_spec

SPECS = ["quantized:bits=4", "quantized:bits=8", "kivi:bits=2,residual=1"]


@pytest.fixture(scope="module")
def loaded(load_model):
    return load_model("smollm2", "torch")


def _pending_layers(caches):
    return sum(getattr(layer, "_pending_error", None) is not None for c in caches for layer in c.layers)


def _decode(loaded, batched: bool, call_pending: bool):
    """Three steps of SPECS (a batch, or one forward each): per forward the pending errors
    ``extra`` found, and per step each row's figures as ``views_of`` reads them."""
    runner, probe = Runner(loaded), probe_for(loaded)
    caches = [probe.make_cache(parse_spec(s)) for s in SPECS]
    for cache in caches:
        probe.set_track_error(cache, True)
    seen, figures = [], []

    def extra_for(of):
        def extra():
            seen.append(_pending_layers(of))
            return probe.pending(of) if call_pending else []

        return extra

    rows = runner.rows_cache(caches) if batched else None
    for ids in ([1, 2, 3, 4, 5], [6], [7]):
        if batched:
            runner.step_rows(rows, [ids] * len(caches), extra=extra_for(caches))
        else:
            for cache in caches:
                runner.step(cache, ids, extra=extra_for([cache]))
        assert _pending_layers(caches) == (0 if call_pending else seen[-1] if batched else sum(seen[-3:]))
        figures.append([[v.quant_error for v in views] for views in probe.views_of(caches)])
    return seen, figures


@pytest.mark.parametrize("batched", [True, False])
def test_the_runner_has_the_probe_compute_the_error_as_the_forward_ends(loaded, batched):
    seen, figures = _decode(loaded, batched, call_pending=True)
    assert seen and max(seen) > 0  # extra ran once a forward had recorded the errors
    _, unresolved = _decode(loaded, batched, call_pending=False)
    assert figures == unresolved  # views_of computes the same figures itself
    assert any(e is not None and e.key_rel_rms > 0 for step in figures for row in step for e in row)
