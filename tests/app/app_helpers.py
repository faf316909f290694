"""Helpers of the app tests: plotly JSON as plain lists, and waiting for the app's background run."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from app.keys import Keys

MAIN = Path(__file__).resolve().parents[2] / "app" / "main.py"
TINY_STRATEGIES = ["standard", "rotating:max_size=16,keep=2", "quantized:bits=4,group_size=32"]


def plain(obj):
    """Plotly JSON with its typed arrays ({"dtype", "bdata"}, base64) decoded to lists."""
    if isinstance(obj, dict):
        if "bdata" in obj and "dtype" in obj:
            values = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=np.dtype(obj["dtype"]))
            shape = obj.get("shape")
            if shape:
                dims = [int(d) for d in str(shape).split(",")] if isinstance(shape, str) else list(shape)
                values = values.reshape(dims)
            return values.tolist()
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def figure_json(fig) -> dict:
    """A plotly figure as plain JSON data (what the browser receives)."""
    return plain(fig.to_plotly_json())


def plotly_figures(at) -> list[dict]:
    """The figures an AppTest run drew, as plain plotly JSON."""
    return [plain(json.loads(e.proto.spec)) for e in at.get("plotly_chart")]


def finish_run(at, timeout: float = 240) -> None:
    """Wait for the app's background run to end, then rerun the page once (what the polling
    fragment does in a browser)."""
    run = at.session_state[Keys.LIVE]
    assert run.done.wait(timeout), "the run did not end in time"
    at.run()
