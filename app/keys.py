"""Every ``st.session_state`` key of the app, in one namespace.

A browser session has one state for all pages, so a key means the same thing on every page.
Widget keys are state keys too (a widget's value lives under its key), and the tests address
widgets by them. Chart element keys, which hold no state, stay with their charts.
"""

from __future__ import annotations

from typing import Any

# How long an input widget's value lives when a run does not draw it: for the browser session.
# Streamlit drops the state of a widget that a run leaves out (every widget of the other pages);
# "session" keeps it, so a page change keeps what was set and a page reload starts afresh.
PERSIST = "session"


def kept(key: str) -> dict[str, Any]:
    """The keyword arguments that key an input widget and keep its value through page changes:
    ``st.selectbox(..., **kept(Keys.MODEL))``. Every page's input widgets take them (buttons and
    file uploaders hold no value to keep and take a plain ``key``)."""
    return {"key": key, "persist_state": PERSIST}


class Keys:
    # What the pages hand to each other
    LIVE = "live_run"  # the LiveRun in progress or last started
    CURRENT = "current_run"  # (Profile, RunView) of the last run that recorded at least one step
    LOADED = "loaded_profiles"  # name -> RunView of the profiles loaded on the Profiles page
    FILE_VIEWS = "_file_views"  # (path, mtime, size, label) -> RunView of a profile file
    COMBINED = "_combined"  # (the loaded views, their combined RunView)

    # Live comparison: the run form
    BACKEND = "backend"
    MODEL = "model"
    MODEL_FOLDER = "model_folder"
    INPUT_KIND = "input_kind"
    PROMPT = "prompt"
    EVAL_TEXT = "eval_text"
    MAX_TOKENS = "max_tokens"
    FREE_RUNNING = "free_running"
    ONE_BY_ONE = "one_by_one"
    MEMORY_LIMIT = "memory_limit"
    STRATEGY_ROWS = "strategy_rows"  # row ids, in order; row 0 is the baseline
    STRATEGY_NEXT = "_strategy_next"  # the id the next row gets
    STRATEGY_ADD = "strategy_add"
    RUN = "run"
    STOP = "stop"

    # Profiles
    DOWNLOAD_CURRENT = "download_current"  # prefix of the current run's CSV, Parquet and report buttons
    DOWNLOAD_REPORT = "download_report"  # the HTML report of the loaded comparison
    SAVE_NAME = "save_name"
    UPLOAD = "upload"
    UPLOADED = "_uploaded"  # "upload: NAME" -> (file id, RunView)
    COMPARE = "compare"  # the Compare multiselect
    COMPARE_KEPT = "_compare"  # its choice, kept while other pages drop the widget's state

    # Inspector
    INSP_SOURCE = "insp_source"
    INSP_STRATEGY = "insp_strategy"
    INSP_LAYER = "insp_layer"
    INSP_PLAY = "insp_play"  # the Play/Pause button
    INSP_PLAYING = "insp_playing"  # whether it plays
    INSP_STEP = "insp_step"
    INSP_ERROR = "insp_error"
    INSP_SPAN = "insp_span"  # decode steps in the run-matrix block

    # Planner (its input widgets are keyed "plan_*", by app.views.planner.DEFAULTS)
    PLANNER_LAST = "planner_last"  # the last valid plan, shown again under an error
    PLANNER_INPUTS = "_planner_inputs"  # widget values, restored after a visit to another page

    @staticmethod
    def device(backend: str) -> str:
        """The Device select box of ``backend`` (one per backend, so each keeps its choice)."""
        return f"device_{backend}"

    @staticmethod
    def probe(name: str) -> str:
        return f"probe_{name}"

    @staticmethod
    def strategy(row: int, what: str = "") -> str:
        """A widget of strategy row ``row``: ``what`` is ``name``, ``dup``, ``del``,
        ``STRATEGY.KNOB`` or ``STRATEGY.given``; "" gives the prefix of all of them."""
        return f"strategy_{row}_{what}"

    @staticmethod
    def layer_strategy(grid: str) -> str:
        """The per-layer chart's strategy choice in the chart grid ``grid`` (live, current, compare)."""
        return f"{grid}_layer_strategy"

    @staticmethod
    def layer_value(grid: str) -> str:
        return f"{grid}_layer_value"

    @staticmethod
    def shown(grid: str) -> str:
        """The strategy picker of the chart grid ``grid``: which strategies its charts draw."""
        return f"{grid}_shown"

    @staticmethod
    def layout(grid: str) -> str:
        """The memory chart's layout choice (one chart, or one panel per strategy) in ``grid``."""
        return f"{grid}_layout"

    @staticmethod
    def read_table(grid: str, table: str) -> str:
        """The toggle that reads ``table`` of a large profile for the chart grid ``grid``."""
        return f"{grid}_read_{table}"
