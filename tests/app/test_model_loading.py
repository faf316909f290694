"""The Live page loads a model once: later runs, other strategies and other pages reuse it."""

from __future__ import annotations

import threading

from app_helpers import MAIN, finish_run
from streamlit.testing.v1 import AppTest

from app import shelf
from app.keys import Keys

TIMEOUT = 180


def test_the_model_is_loaded_once_across_runs_strategy_changes_and_pages(profiles_dir):
    shelf.model_shelf.clear()
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.selectbox(key="model").set_value("tiny-llama").run()
    at.slider(key="max_tokens").set_value(2)
    at.button(key="run").click().run()
    finish_run(at)
    first = at.session_state[Keys.LIVE].loaded
    assert not at.exception and shelf.model_shelf().loads == 1

    at.button(key="strategy_2_del").click().run()  # other strategies, same model
    at.button(key="run").click().run()
    finish_run(at)
    assert at.session_state[Keys.LIVE].loaded is first and len(at.session_state[Keys.LIVE].strategies) == 2

    at.switch_page("views/profiles.py").run()
    at.switch_page("views/live.py").run()
    at.selectbox(key="model").set_value("tiny-llama").run()  # the page's settings start afresh
    at.slider(key="max_tokens").set_value(2)
    at.button(key="run").click().run()
    finish_run(at)
    assert not at.exception
    assert at.session_state[Keys.LIVE].loaded is first
    assert shelf.model_shelf().loads == 1


def test_two_sessions_asking_at_once_load_the_model_once():
    models = shelf.ModelShelf()
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.get(("tiny-llama", "mlx", None)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert models.loads == 1 and len(got) == 3 and all(g is got[0] for g in got)


def test_the_shelf_keeps_the_most_recently_used_models():
    models = shelf.ModelShelf(max_entries=1)
    a = models.get(("tiny-llama", "mlx", None))
    models.get(("tiny-llama", "torch", None))
    assert not models.has(("tiny-llama", "mlx", None)) and models.has(("tiny-llama", "torch", None))
    assert models.get(("tiny-llama", "mlx", None)) is not a and models.loads == 3
