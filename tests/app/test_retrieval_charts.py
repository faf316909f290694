"""The needle-in-a-haystack heatmap on hand-made retrieval samples: the info holds the mean exact
match per strategy x depth x context (NaN where nothing was measured), the figure draws one panel
per strategy on one 0..1 colour scale."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from app_helpers import figure_json

from app.retrieval_charts import retrieval_heatmap, retrieval_heatmap_info

COLUMNS = ["model", "backend", "task", "strategy", "context", "depth", "trial", "exact_match", "kept_fraction"]


def samples(rows):
    return pd.DataFrame(rows, columns=COLUMNS)


RING = "rotating:max_size=256,keep=4"
ROWS = [
    # model, backend, task, strategy, context, depth, trial, exact_match, kept_fraction
    ("SmolLM2", "mlx", "passkey", "standard", 2048, 0.1, 0, 1, 1.0),
    ("SmolLM2", "mlx", "passkey", "standard", 2048, 0.1, 1, 1, 1.0),
    ("SmolLM2", "mlx", "passkey", "standard", 1024, 0.9, 0, 1, 1.0),
    ("SmolLM2", "mlx", "passkey", RING, 2048, 0.1, 0, 0, 0.125),
    ("SmolLM2", "mlx", "passkey", RING, 2048, 0.1, 1, 1, 0.125),
    ("SmolLM2", "mlx", "passkey", RING, 1024, 0.9, 0, 1, 0.25),
    ("SmolLM2", "mlx", "passkey", RING, 2048, 0.9, 0, 0, 0.125),
]


def test_info_averages_exact_match_over_trials_per_strategy_depth_and_context():
    info = retrieval_heatmap_info(samples(ROWS))
    assert info.strategies == ["standard", RING]  # the samples' order
    assert info.contexts == [1024, 2048] and info.depths == [0.1, 0.9]
    ring = info.accuracy[RING]
    assert ring.shape == (2, 2)  # (depths, contexts)
    assert ring[0, 1] == 0.5 and info.trials[RING][0, 1] == 2  # depth 0.1, 2048: one of two trials
    assert ring[1, 0] == 1.0 and ring[1, 1] == 0.0
    assert info.kept_fraction[RING][1, 0] == 0.25
    assert "SmolLM2" in info.title and "passkey" in info.title and "mlx" in info.title


def test_cells_a_strategy_did_not_measure_are_nan_with_zero_trials_not_zero_accuracy():
    info = retrieval_heatmap_info(samples(ROWS))
    std = info.accuracy["standard"]
    assert np.isnan(std[0, 0]) and info.trials["standard"][0, 0] == 0  # depth 0.1 at 1024: never run
    assert np.isnan(std[1, 1])
    assert std[0, 1] == 1.0


def test_info_refuses_samples_without_the_retrieval_columns():
    with pytest.raises(ValueError, match="exact_match"):
        retrieval_heatmap_info(pd.DataFrame({"strategy": ["standard"], "context": [1024], "depth": [0.5]}))


def test_figure_has_one_heatmap_per_strategy_on_one_shared_0_to_1_colour_scale():
    fig = figure_json(retrieval_heatmap(retrieval_heatmap_info(samples(ROWS))))
    heatmaps = [t for t in fig["data"] if t["type"] == "heatmap"]
    assert len(heatmaps) == 2
    assert {t["coloraxis"] for t in heatmaps} == {"coloraxis"}
    axis = fig["layout"]["coloraxis"]
    assert (axis["cmin"], axis["cmax"]) == (0.0, 1.0)
    assert heatmaps[1]["x"] == ["1,024", "2,048"] and heatmaps[1]["y"] == ["0.1", "0.9"]
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles == ["standard", RING]


def test_figure_without_samples_says_so():
    fig = figure_json(retrieval_heatmap(retrieval_heatmap_info(samples([]))))
    assert fig["layout"]["annotations"][0]["text"] == "no retrieval samples"


def test_more_than_four_strategies_wrap_onto_a_second_row_of_panels():
    rows = [("m", "mlx", "passkey", f"rotating:max_size={64 * (i + 1)},keep=4", 1024, 0.5, 0, 1, 0.1) for i in range(6)]
    fig = figure_json(retrieval_heatmap(retrieval_heatmap_info(samples(rows))))
    assert len([t for t in fig["data"] if t["type"] == "heatmap"]) == 6
    assert (
        fig["data"][4]["xaxis"] == "x5" and fig["layout"]["yaxis5"]["domain"][1] < fig["layout"]["yaxis"]["domain"][0]
    )
