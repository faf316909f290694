"""The models this app's server process holds, shared by every session and page, and what it can
run on this machine (backends, devices, a profile's tokenizer)."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Callable

import streamlit as st

from cachelib.models import LoadedModel, available_devices, load
from cachelib.profile.report import decoder_for


class ModelShelf:
    """The loaded models of this server process, one per (name, backend, device), shared by every
    session and page, the most recently used ``max_entries`` kept. A model is loaded once even
    when two sessions ask at the same moment (the second waits for the first)."""

    def __init__(self, max_entries: int = 4):
        self.max_entries = max_entries
        self._models: OrderedDict[tuple, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple, threading.Lock] = {}
        self.loads = 0  # how many times a model was actually loaded (not taken from the shelf)

    def has(self, key: tuple) -> bool:
        return key in self._models

    def get(self, key: tuple, progress: Callable[[str, float], None] | None = None) -> LoadedModel:
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                if key in self._models:
                    return self._models[key]
            try:
                model = load(*key, progress=progress)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            with self._lock:
                self.loads += 1
                self._models[key] = model
                while len(self._models) > self.max_entries:
                    self._models.popitem(last=False)
            return model


@st.cache_resource(show_spinner=False)
def model_shelf() -> ModelShelf:
    return ModelShelf()


def loaded_model(
    name: str, backend: str, device: str | None, progress: Callable[[str, float], None] | None = None
) -> LoadedModel:
    """One model object per (name, backend, device), shared by every session and page, loaded
    on first use (``progress(stage, fraction)`` hears how the load goes; :func:`cachelib.models.load`)."""
    return model_shelf().get((name, backend, device), progress)


def model_is_loaded(name: str, backend: str, device: str | None) -> bool:
    return model_shelf().has((name, backend, device))


@st.cache_resource(show_spinner=False)
def backends_here() -> dict[str, str]:
    """Backend -> "" when it imports here, else why not."""
    out = {}
    for backend, module in (("mlx", "mlx.core"), ("torch", "torch")):
        try:
            __import__(module)
            out[backend] = ""
        except Exception as e:  # a missing or broken install: offer the other backend
            out[backend] = f"{type(e).__name__}: {e}"
    return out


@st.cache_resource(show_spinner=False)
def devices_of(backend: str) -> list[str]:
    return available_devices(backend)


def decoder_of(meta: dict):
    """``ids -> text`` with the profile's own tokenizer (kept per model source), or None."""
    return _decoder(str(meta.get("model_source", "") or ""))


@functools.lru_cache(maxsize=8)
def _decoder(source: str):
    return decoder_for({"model_source": source}) if source else None
