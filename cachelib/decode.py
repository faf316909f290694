"""Prompt -> chat template -> prefill -> token-by-token decode, on either backend.

The cache is always passed in explicitly: the caller decides what the model remembers.
:class:`Runner` is the one place that knows how to run a forward step on MLX and on PyTorch;
the profiler builds on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .models import LoadedModel


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``, wrapped in the model's chat template when it has one."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty; give some text to decode from")
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt)]


def eos_ids(tokenizer) -> set[int]:
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class Runner:
    """Runs forward steps of a loaded model with a given cache; logits come back as numpy."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.backend = loaded.info.backend
        if self.backend == "mlx":
            import mlx.core as mx

            self._mx = mx
        else:
            import torch

            self._torch = torch
            self._device = loaded.info.device

    def default_cache(self):
        """The model's own default cache (mlx-lm's make_prompt_cache / transformers' DynamicCache)."""
        model = self.loaded.model
        if self.backend == "mlx":
            from mlx_lm.models.cache import make_prompt_cache

            return make_prompt_cache(model)
        from transformers import DynamicCache

        return DynamicCache(config=model.config)

    def logits(self, cache, ids: list[int], extra: Callable[[], list] | None = None) -> Any:
        """Forward ``ids`` (one sequence) through the model with ``cache``; logits of every
        position as a backend array of shape (len(ids), vocab), already computed. ``extra``: on
        MLX, called after the forward is built, the further lazy arrays to compute in the same
        evaluation (a probe's, see ``BackendProbe.pending``); torch computes as it goes, and
        calls it once the forward is done, before the logits are handed on (:meth:`step_rows`
        calls it sooner, as the last layer's rows have updated)."""
        if self.backend == "mlx":
            mx = self._mx
            out = self.loaded.model(mx.array([ids]), cache=cache)[0]
            mx.eval(out, extra() if extra else [])
            return out
        torch = self._torch
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=self._device)
            out = self.loaded.model(input_ids=x, cache=cache, use_cache=True).logits[0]
        if extra:
            extra()
        return out

    def step(self, cache, ids: list[int], extra: Callable[[], list] | None = None) -> np.ndarray:
        """Forward ``ids`` and return the float32 logits of the last position (``extra`` as in
        :meth:`logits`)."""
        out = self.logits(cache, ids, extra)[-1]
        if self.backend == "mlx":
            return np.array(out.astype(self._mx.float32), copy=False)
        return out.float().cpu().numpy()

    # --- a strategy batch: k whole-model caches, one per batch row, one forward per step ----

    def batch_problem(self, cache) -> str | None:
        """Why ``cache`` (a whole-model cache of this model) cannot be a row of a strategy
        batch, or None when it can."""
        if self.backend == "mlx":
            from .mlx.rows import batch_problem

            return batch_problem(cache)
        from .torch.rows import batch_problem

        return batch_problem(cache, self.loaded.model.config.get_text_config(decoder=True))

    def rows_cache(self, caches: list) -> Any:
        """The cache of a forward whose row ``i`` advances ``caches[i]`` (each must pass
        :meth:`batch_problem`); give it to :meth:`step_rows`."""
        if self.backend == "mlx":
            from .mlx.rows import make_rows_cache

            return make_rows_cache(caches)
        from .torch.rows import RowsCache

        return RowsCache(caches, self.loaded.model.config.get_text_config(decoder=True))

    def step_rows(self, rows, ids: list[list[int]], extra: Callable[[], list] | None = None) -> np.ndarray:
        """Forward ``ids[i]`` through row ``i`` (every row the same number of tokens) and return
        the float32 logits of each row's last position, shape (rows, vocab); ``extra`` as in
        :meth:`logits`."""
        if len({len(r) for r in ids}) != 1:
            raise ValueError(f"step_rows: every row takes the same number of tokens, got {[len(r) for r in ids]}")
        if self.backend == "mlx":
            mx = self._mx
            from .mlx.rows import row_states

            out = self.loaded.model(mx.array(ids), cache=rows)[:, -1, :]
            mx.eval(out, extra() if extra else [], row_states(rows))
            return np.array(out.astype(mx.float32), copy=False)
        torch = self._torch
        called = []
        if extra:
            # as soon as the last layer's rows have updated: before the final norm and the LM head,
            # whose weights (113 MB at SmolLM2's vocabulary, float32) stream through the CPU's caches
            # and leave the small ops' code and data cold (bench/bench_cold_ops.py: 2.6x their time
            # after one decoder layer's weights; 1.2-1.3x in a run, bench/README.md)
            rows.after_last_update = lambda: called.append(extra())
        try:
            with torch.inference_mode():
                x = torch.tensor(ids, dtype=torch.long, device=self._device)
                mask = rows.attention_mask(x.shape[1], x.device)
                out = self.loaded.model(
                    input_ids=x, cache=rows, attention_mask=mask, use_cache=True, logits_to_keep=1
                ).logits[:, -1]
        finally:
            rows.after_last_update = None
        if extra and not called:  # a forward whose last layer did not reach the batch's cache
            extra()
        return out.float().cpu().numpy()

    def advance_rows(self, rows, ids: list[list[int]]) -> None:
        """Forward ``ids[i]`` through row ``i`` computing no logits (a prefill chunk, as mlx-lm's
        prefill: the caches are evaluated, the logits never are)."""
        if len({len(r) for r in ids}) != 1:
            raise ValueError(f"advance_rows: every row takes the same number of tokens, got {[len(r) for r in ids]}")
        if self.backend == "mlx":
            mx = self._mx
            from .mlx.rows import row_states

            self.loaded.model(mx.array(ids), cache=rows)
            mx.eval(row_states(rows))
            mx.clear_cache()
            return
        torch = self._torch
        with torch.inference_mode():
            x = torch.tensor(ids, dtype=torch.long, device=self._device)
            mask = rows.attention_mask(x.shape[1], x.device)
            self.loaded.model(input_ids=x, cache=rows, attention_mask=mask, use_cache=True, logits_to_keep=1)

    def synchronize(self) -> None:
        if self.backend == "mlx":
            self._mx.synchronize()
        elif self._device.startswith("cuda"):
            self._torch.cuda.synchronize()
        elif self._device.startswith("mps"):
            self._torch.mps.synchronize()


@dataclass
class Decoded:
    prompt_ids: list[int]
    ids: list[int]  # generated token ids (the EOS included when it ended the decode)
    text: str
    prefill_seconds: float
    decode_seconds: float
    step_seconds: list[float] = field(default_factory=list)

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        n = len(self.ids) - 1  # the first token comes out of the prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


def greedy_decode(
    loaded: LoadedModel,
    prompt: str | list[int],
    cache=None,
    max_tokens: int = 32,
    chat: bool = True,
    stop_at_eos: bool = True,
    on_token: Callable[[int, int], None] | None = None,
) -> Decoded:
    """Greedy decode. ``prompt`` is text (chat-templated) or token ids; ``cache`` defaults to the
    model's own. ``on_token(step, token_id)`` is called for every generated token."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    runner = Runner(loaded)
    tok = loaded.tokenizer
    prompt_ids = encode_prompt(tok, prompt, chat) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    cache = runner.default_cache() if cache is None else cache
    stops = eos_ids(tok) if stop_at_eos else set()

    t0 = time.perf_counter()
    token = int(np.argmax(runner.step(cache, prompt_ids)))
    prefill = time.perf_counter() - t0
    ids, steps = [token], []
    if on_token:
        on_token(0, token)
    t1 = time.perf_counter()
    while len(ids) < max_tokens and token not in stops:
        s = time.perf_counter()
        token = int(np.argmax(runner.step(cache, [token])))
        steps.append(time.perf_counter() - s)
        ids.append(token)
        if on_token:
            on_token(len(ids) - 1, token)
    decode = time.perf_counter() - t1
    text = tok.decode(ids, skip_special_tokens=True)
    return Decoded(prompt_ids, ids, text, prefill, decode, steps)
