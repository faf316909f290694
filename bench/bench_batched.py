"""Steps/s of a teacher-forced profile of k strategies: a strategy batch (one forward per step,
one row per strategy) against one by one (k forwards per step), on the bundled model, both
backends; beside it, in the same run, what the runtime's own batching reaches on this machine and
what the probes cost.

Targets (issue #15): at least 2.5x for 4 strategies, at least 4x for 8. Per backend and k, six
decodes of ``--tokens`` steps run side by side, one step of each in turn (a round robin in
threads, one running at a time), so drift and other jobs on the machine hit them alike:

- ``strategy batch`` and ``one by one``: ``run_profile`` with the default probes;
- the same two with every per-step probe off (``Probes.none()``): the difference is the probe cost;
- ``runtime, batch of k`` and ``runtime, batch 1``: the reference runtime's plain cache (mlx-lm's
  ``make_prompt_cache``, transformers' ``DynamicCache``) decoding the same model with k identical
  rows and with one, fed the same token stream (the runtime's own greedy tokens at batch 1, taken
  before the timing), no probes. ``k x batch 1 / batch of k`` is the runtime's batching ceiling on
  this machine: a strategy batch, whose rows are k different caches, should not beat it.

A step's time runs from the moment its decode gets its turn to its step callback (decode steps
only: the prefill, step 0, is left out); the wall time and the CPU time of the process
(``time.process_time``, the steadier figure on a shared machine) are both quoted, as medians over
``--rounds`` repeats. Speed-ups are against ``one by one`` (default probes) for the strategy
batch, ``one by one, probes off`` for the probe-free batch, and k x ``runtime, batch 1`` for the
runtime's batch.

    python bench/bench_batched.py [--backend mlx torch] [--tokens 256] [--rounds 2] [--strategies 4 8]

With ``--context N`` (torch; issue #34) it measures instead what the strategy batch costs per
decode step at ``N`` tokens of context, beyond the runtime's own batch of identical rows: for k
strategies incl. quantized and KIVI rows, decode steps of three caches run one after another in
turn, step by step (``--steps`` each, medians): the strategy batch writing only the slots each row
changed (``RowsCache``'s per-layer buffers), the same batch copying every row whole at every
layer (``buffer_bytes=0``, the path before them), and transformers' ``DynamicCache`` with k
identical rows. Each cache's ``N`` tokens are written by the layers' own updates from seeded
random keys and values (the states of a prefill of ``N`` tokens, without its minutes of
forwards); the decode steps are real forwards of the bundled model. Then (``--evaluate-context``)
a 2-row batch as ``evaluate`` runs it (prefill chunks of 2048 by ``advance_rows``, then one token a
step by ``step_rows``) against transformers' own batch of two standard rows fed the same tokens,
prefill and decode timed separately (wall and process CPU time), one forward of each in turn, over
``--rounds``:

    python bench/bench_batched.py --backend torch --context 4000 --steps 12 --strategies 4 8

``--evaluate-only`` runs just that 2-row comparison (``--evaluate-context``, ``--steps``, ``--rounds``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from typing import Callable

import numpy as np

from cachelib.core.threads import release_thread_streams
from cachelib.decode import Runner, encode_prompt
from cachelib.models import load
from cachelib.profile import Probes, run_profile

STRATEGIES = [
    "standard",
    "rotating:max_size=128,keep=4",
    "quantized:bits=8",
    "quantized:bits=4",
    "kivi:bits=4,residual=32",
    "static:max_len=512",
    "rotating:max_size=64,keep=0",
    "concat",
]
PROMPT = "Explain what a KV cache is, and why it matters for serving language models."


class RoundRobin:
    """Runs decodes in threads, one step of each in turn, and times each step: from the moment its
    decode gets the turn to the moment it calls ``done`` (wall and process CPU seconds).

    ``seed``: every round takes the decodes in a fresh random order (drawn with this seed), so no
    decode always runs first, or always right after the same other one. With a fixed order, where
    a decode ran in the round moved its steps' times by up to ~3% on the 2-core CI machine, the
    same way every round, and that was in every comparison (bench/README.md, issue #34's A/A
    control). None: the order given, every round."""

    def __init__(self, names: list[str], seed: int | None = None):
        self.names = names
        self.finished: set[str] = set()
        self.cv = threading.Condition()
        self.steps: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        self._start: dict[str, tuple[float, float]] = {}
        self._rng = None if seed is None else random.Random(seed)
        self._round: list[str] = []  # the rest of this round, in order
        self.current = self._next()

    def _next(self) -> str:
        """The decode whose turn comes next: the rest of this round's order, then a new round's."""
        if not self._round:
            self._round = [n for n in self.names if n not in self.finished]
            if self._rng is not None:
                self._rng.shuffle(self._round)
        return self._round.pop(0)

    def _wait(self, name: str) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.current == name)
        self._start[name] = (time.perf_counter(), time.process_time())

    def _pass(self, name: str, finished: bool = False) -> None:
        with self.cv:
            if finished:
                self.finished.add(name)
                self._round = [n for n in self._round if n != name]
            if len(self.finished) < len(self.names):
                self.current = self._next()
            self.cv.notify_all()

    def done(self, name: str) -> None:
        """End of one step of ``name``: record it, hand the turn on, wait for the next."""
        wall, cpu = time.perf_counter(), time.process_time()
        start = self._start[name]
        self.steps[name].append((wall - start[0], cpu - start[1]))
        self._pass(name)
        self._wait(name)

    def run(self, decodes: dict[str, Callable[[Callable[[], None]], None]]) -> dict[str, list[tuple[float, float]]]:
        """``decodes``: name -> a function that decodes, calling its argument after every step."""
        errors: list[BaseException] = []

        def body(name, decode):
            try:
                self._wait(name)
                decode(lambda: self.done(name))
            except BaseException as e:  # re-raised below, once every thread has ended
                errors.append(e)
            finally:
                self._pass(name, finished=True)
                release_thread_streams()  # MLX asks it of a thread before it ends

        threads = [threading.Thread(target=body, args=(n, decodes[n])) for n in self.names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return self.steps


class RuntimeDecode:
    """The reference runtime's plain cache (``Runner.default_cache``: mlx-lm's
    ``make_prompt_cache``, transformers' ``DynamicCache``) decoding ``rows`` identical rows, no
    probes; the logits of the last position come back to the host as numpy, as the profiler's do."""

    def __init__(self, loaded, rows: int):
        self.loaded, self.rows = loaded, rows
        self.runner = Runner(loaded)
        self.cache = self.runner.default_cache()

    def step(self, ids: list[int]) -> np.ndarray:
        model = self.loaded.model
        if self.loaded.info.backend == "mlx":
            import mlx.core as mx

            out = model(mx.array([ids] * self.rows), cache=self.cache)[:, -1, :]
            mx.eval(out)
            return np.array(out.astype(mx.float32), copy=False)
        import torch

        with torch.inference_mode():
            x = torch.tensor([ids] * self.rows, dtype=torch.long, device=self.loaded.info.device)
            out = model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return out.float().cpu().numpy()


def token_stream(loaded, prompt_ids: list[int], tokens: int) -> list[list[int]]:
    """The ids fed at each step: the prompt, then the runtime's greedy tokens at batch 1."""
    decode = RuntimeDecode(loaded, 1)
    feed, out = prompt_ids, []
    for _ in range(tokens):
        out.append(feed)
        feed = [int(np.argmax(decode.step(feed)[0]))]
    return out


def decodes(loaded, strategies: list[str], feeds: list[list[int]]) -> dict[str, Callable]:
    k, tokens = len(strategies), len(feeds)

    def profile(one_by_one: bool, probes: Probes | None):
        def decode(done):
            run_profile(
                loaded,
                strategies,
                prompt=PROMPT,
                max_tokens=tokens,
                one_by_one=one_by_one,
                probes=probes,
                on_step=lambda e: done(),
            )

        return decode

    def runtime(rows: int):
        def decode(done):
            d = RuntimeDecode(loaded, rows)
            for ids in feeds:
                d.step(ids)
                done()

        return decode

    return {
        "strategy batch": profile(False, None),
        "one by one": profile(True, None),
        "strategy batch, probes off": profile(False, Probes.none()),
        "one by one, probes off": profile(True, Probes.none()),
        f"runtime, batch of {k}": runtime(k),
        "runtime, batch 1": runtime(1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--strategies", type=int, nargs="+", default=[4, 8], choices=range(2, len(STRATEGIES) + 1), metavar="K"
    )
    ap.add_argument("--context", type=int, default=0, help="torch: the per-step batch overhead at this context")
    ap.add_argument("--steps", type=int, default=12, help="with --context: decode steps timed per cache")
    ap.add_argument("--evaluate-context", type=int, default=512, help="with --context: the 2-row evaluate batch's")
    ap.add_argument(
        "--buffer-bytes", type=int, default=None, help="with --context: RowsCache's limit (default its own)"
    )
    ap.add_argument(
        "--evaluate-only", action="store_true", help="with --context: only the 2-row evaluate batch (no k-row steps)"
    )
    args = ap.parse_args()
    if args.context:
        context_bench(args)
        return
    for backend in args.backend:
        loaded = load("smollm2", backend)
        prompt_ids = encode_prompt(loaded.tokenizer, PROMPT)
        feeds = token_stream(loaded, prompt_ids, args.tokens)
        load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"\n{backend} ({loaded.info.device}, {loaded.info.dtype}), {args.tokens} tokens x {args.rounds} rounds, "
            f"teacher-forced, load average at start {load_avg}"
        )
        for k in args.strategies:
            strategies = STRATEGIES[:k]
            names = list(decodes(loaded, strategies, feeds))
            RoundRobin(names).run(decodes(loaded, strategies, feeds[:4]))  # warm-up
            wall: dict[str, list[float]] = {n: [] for n in names}
            cpu: dict[str, list[float]] = {n: [] for n in names}
            for _ in range(args.rounds):
                for name, steps in RoundRobin(names).run(decodes(loaded, strategies, feeds)).items():
                    wall[name] += [w for w, _ in steps[1:]]  # decode steps: step 0 is the prefill
                    cpu[name] += [c for _, c in steps[1:]]
            report(k, wall, cpu)


def report(k: int, wall: dict[str, list[float]], cpu: dict[str, list[float]]) -> None:
    med = {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in wall}
    base = {  # what each mode's speed-up is taken against: (name, times it)
        "strategy batch": ("one by one", 1),
        "strategy batch, probes off": ("one by one, probes off", 1),
        f"runtime, batch of {k}": ("runtime, batch 1", k),
    }
    print(
        f"{'k':>3} {'mode':<28} {'median step ms':>15} {'steps/s':>8} {'speed-up':>9} {'CPU ms/step':>12} "
        f"{'CPU speed-up':>13}"
    )
    speedup: dict[str, tuple[float, float]] = {}
    for name, (w, c) in med.items():
        ref, times = base.get(name, (name, 1))
        speedup[name] = (times * med[ref][0] / w, times * med[ref][1] / c if c else float("nan"))
        print(
            f"{k:>3} {name:<28} {w * 1e3:15.2f} {1 / w:8.2f} {speedup[name][0]:8.2f}x {c * 1e3:12.2f} "
            f"{speedup[name][1]:12.2f}x"
        )
    ceiling = speedup[f"runtime, batch of {k}"]
    for name in ("strategy batch", "strategy batch, probes off"):
        ours = speedup[name]
        print(
            f"    {name}: {ours[0]:.2f}x wall, {ours[1]:.2f}x CPU against the runtime's own batching ceiling "
            f"{ceiling[0]:.2f}x wall, {ceiling[1]:.2f}x CPU: {ours[0] / ceiling[0]:.0%} / "
            f"{ours[1] / ceiling[1]:.0%} of it"
        )
    runtime = med[f"runtime, batch of {k}"]
    for name in ("strategy batch, probes off", "strategy batch"):
        print(
            f"    {name}: a step takes {med[name][0] / runtime[0]:.2f}x the wall, "
            f"{med[name][1] / runtime[1]:.2f}x the CPU "
            f"of a step of the runtime's own batch of {k}"
        )
    for mode, off in (("strategy batch", "strategy batch, probes off"), ("one by one", "one by one, probes off")):
        print(
            f"    probe cost, {mode}: {(med[mode][0] - med[off][0]) * 1e3:+.1f} ms wall, "
            f"{(med[mode][1] - med[off][1]) * 1e3:+.1f} ms CPU per step (default probes against all off)"
        )


# --- per-step overhead at a long context (torch, issue #34) -----------------------------------

CONTEXT_STRATEGIES = [
    "standard",
    "quantized:bits=4",
    "kivi:bits=4",
    "quantized:bits=8",
    "rotating:max_size=1024,keep=4",
    "q8_0",
    "kivi:bits=2,residual=64",
    "quantized:bits=4,start=1024",
]


def filled(loaded, specs: list[str], context: int, seed: int = 0) -> list:
    """One whole-model cache per spec, each holding ``context`` tokens written by its layers' own
    update from seeded random keys/values (what a prefill leaves, shapes and all)."""
    import torch

    from cachelib.profile.backends import probe_for
    from cachelib.spec import parse_spec

    probe, cfg = probe_for(loaded), loaded.model.config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    caches = [probe.make_cache(parse_spec(s)) if s != "runtime" else Runner(loaded).default_cache() for s in specs]
    with torch.inference_mode():
        for layer in range(cfg.num_hidden_layers):  # one layer's keys and values alive at a time
            k, v = torch.randn(2, 1, heads, context, dim, generator=gen)
            for cache in caches:
                cache.update(k, v, layer)
    return caches


def runtime_batch(loaded, k: int, context: int):
    """transformers' ``DynamicCache`` of ``k`` identical rows holding ``context`` tokens."""
    import torch

    one = filled(loaded, ["runtime"], context)[0]
    cache = Runner(loaded).default_cache()
    with torch.inference_mode():
        for layer, dl in enumerate(one.layers):
            cache.update(dl.keys.expand(k, -1, -1, -1).clone(), dl.values.expand(k, -1, -1, -1).clone(), layer)
    return cache


def context_bench(args) -> None:
    loaded = load("smollm2", "torch")
    load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"torch ({loaded.info.device}, {loaded.info.dtype}), {args.context} tokens of context, {args.steps} decode "
        f"steps per cache, interleaved step by step; load average at start {load_avg} (a shared, busy machine)"
    )
    for k in [] if args.evaluate_only else args.strategies:
        overhead(loaded, k, args)
    evaluate_batch(loaded, args.evaluate_context, args.steps, args.rounds)


def overhead(loaded, k: int, args) -> None:
    """Decode steps of k strategies at ``args.context`` tokens: written slots, whole copy and the
    runtime's batch of k, interleaved step by step; prints medians."""
    from cachelib.torch.rows import RowsCache

    runner, specs = Runner(loaded), CONTEXT_STRATEGIES[:k]
    config = loaded.model.config.get_text_config(decoder=True)
    limit = {} if args.buffer_bytes is None else {"buffer_bytes": args.buffer_bytes}
    new = RowsCache(filled(loaded, specs, args.context), config, **limit)
    old = RowsCache(filled(loaded, specs, args.context), config, buffer_bytes=0)
    ref = RuntimeDecode(loaded, k)
    ref.cache = runtime_batch(loaded, k, args.context)
    runtime = f"runtime, batch of {k}"
    times: dict[str, list[float]] = {"written slots": [], "whole copy": [], runtime: []}
    for step in range(args.steps + 1):  # step 0 (each cache's first, buffers made) is not counted
        token = 100 + step
        for name in times:
            start = time.perf_counter()
            if name == runtime:
                ref.step([token])
            else:
                runner.step_rows(new if name == "written slots" else old, [[token]] * k)
            if step:
                times[name].append(time.perf_counter() - start)
    buffered = "per-layer buffers" if new._layers else "no buffers (past the byte limit: whole copy)"
    limit = "its floor (never measured)" if new.buffer_limit is None else f"{new.buffer_limit / 2**20:.0f} MiB"
    print(f"\nk={k}: {', '.join(specs)}; the batch kept {buffered}, {new._buffered / 2**20:.0f} MiB (limit {limit})")
    med = {n: statistics.median(t) for n, t in times.items()}
    base = med[runtime]
    print(f"{'cache':<24} {'median step ms':>15} {'beyond runtime ms':>18} {'x runtime':>10}")
    for name, t in med.items():
        print(f"{name:<24} {t * 1e3:15.1f} {(t - base) * 1e3:18.1f} {t / base:9.3f}x")
    over_new, over_old = med["written slots"] - base, med["whole copy"] - base
    print(
        f"batch overhead per step: {over_old * 1e3:.1f} ms whole copy -> {over_new * 1e3:.1f} ms written slots "
        f"({over_new / base:+.1%} of the runtime's step; target <= +10%)"
    )


def evaluate_batch(loaded, context: int, steps: int, rounds: int) -> None:
    """A 2-row batch as ``evaluate`` runs it against transformers' own batch of two standard rows:
    prefill (chunks of 2048) and decode timed apart, one forward of each in turn; two standard-like
    rows (``concat`` is transformers' own layer), then a standard and a 4-bit quantized row."""
    ids = [int(i) for i in np.random.default_rng(0).integers(100, 40000, context + steps)]
    chunk = 2048
    for specs in (["standard", "concat"], ["standard", "quantized:bits=4"]):
        evaluate_pair(loaded, specs, ids, context, chunk, steps, rounds)


def evaluate_pair(loaded, specs: list[str], ids: list[int], context: int, chunk: int, steps: int, rounds: int):
    import torch

    from cachelib.profile.backends import probe_for
    from cachelib.spec import parse_spec

    runner, probe, model = Runner(loaded), probe_for(loaded), loaded.model

    def forward(which: str, cache, tokens: list[int], logits: bool) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        if which == "ours":
            (runner.step_rows if logits else runner.advance_rows)(cache, [tokens] * 2)
        else:
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([tokens] * 2), cache=cache, use_cache=True, logits_to_keep=1)
                if logits:
                    out.logits[:, -1].float().cpu().numpy()
        return time.perf_counter() - start, time.process_time() - cpu

    names = {"ours": "evaluate batch (2 rows)", "theirs": "transformers batch of 2"}
    prefill: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    decode: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):  # one forward of each in turn, the first to go alternating by round
        order = ["ours", "theirs"] if r % 2 == 0 else ["theirs", "ours"]
        caches = {"ours": runner.rows_cache([probe.make_cache(parse_spec(s)) for s in specs])}
        caches["theirs"] = runner.default_cache()
        took = {n: (0.0, 0.0) for n in names}
        for s in range(0, context, chunk):
            for n in order:
                wall, cpu = forward(n, caches[n], ids[s : min(s + chunk, context)], False)
                took[n] = (took[n][0] + wall, took[n][1] + cpu)
        for n in names:
            prefill[n].append(took[n])
        for t in ids[context:]:
            for n in order:
                decode[n].append(forward(n, caches[n], [t], True))
    print(f"\n2-row evaluate batch ({', '.join(specs)}) at {context} tokens, {steps} decode steps, {rounds} rounds")
    print(
        f"{'batch':<26} {'prefill s':>10} {'x ref':>7} {'decode ms/step':>15} {'x ref':>7} "
        f"{'CPU: prefill x ref':>19} {'decode x ref':>13}"
    )

    def med(times: dict, n: str, i: int) -> float:  # i: 0 wall, 1 process CPU
        return statistics.median(t[i] for t in times[n])

    for n, label in names.items():
        p, d = med(prefill, n, 0), med(decode, n, 0)
        p_ref, d_ref = med(prefill, "theirs", 0), med(decode, "theirs", 0)
        p_cpu, d_cpu = med(prefill, n, 1) / med(prefill, "theirs", 1), med(decode, n, 1) / med(decode, "theirs", 1)
        print(
            f"{label:<26} {p:10.2f} {p / p_ref:6.3f}x {d * 1e3:15.1f} {d / d_ref:6.3f}x {p_cpu:18.3f}x {d_cpu:12.3f}x"
        )


if __name__ == "__main__":
    main()
