"""On torch the runner calls a probe's ``pending`` once a forward has updated every layer's
cache, before it hands the logits on (in a strategy batch as soon as the last layer's rows have
updated, before the final norm and the LM head; one by one as the forward ends): the torch probe
computes the step's quantization error there, and ``views_of`` then reads figures already made,
the same as those it computes itself when ``pending`` was not called."""

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


def _batch_order(loaded, hook: bool):
    """Three steps of a batch on ``loaded`` whose ``extra`` and final norm log themselves in order
    (``hook=False``: the batch's cache never calls the runner back, as for a forward whose last
    layer does not reach it); per step the log, then the figures ``views_of`` reads."""
    runner, probe = Runner(loaded), probe_for(loaded)
    caches = [probe.make_cache(parse_spec(s)) for s in ["standard", *SPECS]]
    for cache in caches:
        probe.set_track_error(cache, True)
    rows = runner.rows_cache(caches)
    if not hook:
        update = rows.update

        def update_without_hook(*args, **kwargs):
            hook_fn, rows.after_last_update = rows.after_last_update, None
            try:
                return update(*args, **kwargs)
            finally:
                rows.after_last_update = hook_fn

        rows.update = update_without_hook
    log: list[str] = []

    def extra():
        # every row of every layer holds this step's tokens already
        lengths = {c.get_seq_length(layer) for c in caches for layer in range(len(c.layers))}
        log.append(f"extra at {sorted(lengths)}")
        return probe.pending(caches)

    norm = loaded.model.model.norm.register_forward_pre_hook(lambda *_: log.append("norm"))
    out = []
    try:
        for ids in ([1, 2, 3, 4, 5], [6], [7]):
            log.clear()
            runner.step_rows(rows, [ids] * len(caches), extra=extra)
            assert rows.after_last_update is None  # the runner's hook does not outlive its forward
            out.append((list(log), [[v.quant_error for v in views] for views in probe.views_of(caches)]))
    finally:
        norm.remove()
    return out


def test_a_batch_computes_the_error_before_the_final_norm_and_the_lm_head(load_model):
    loaded = load_model("tiny-llama", "torch")
    early, late = _batch_order(loaded, hook=True), _batch_order(loaded, hook=False)
    assert [log for log, _ in early] == [["extra at [5]", "norm"], ["extra at [6]", "norm"], ["extra at [7]", "norm"]]
    assert [log for log, _ in late] == [["norm", "extra at [5]"], ["norm", "extra at [6]"], ["norm", "extra at [7]"]]
    assert [f for _, f in early] == [f for _, f in late]  # the same figures, bit for bit
    assert any(e is not None and e.key_rel_rms > 0 for _, f in early for row in f for e in row)
