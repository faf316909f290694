"""The sweep file: a TOML grid of profiling runs, read, checked and expanded into points.

A grid names axes (models, backends, devices, prompts or texts, max_tokens) and the strategies
to compare. A **point** is one profiling run: one model on one backend and device, one prompt
or text, one token count, and one *knob setting*. Knob ranges in the strategies are lists; the
k-th value of every list goes into setting k (lists pair up, they do not multiply), so every
run holds the baseline plus every strategy at that setting, and all of them are fed the same
tokens (the teacher-forced comparison holds inside each profile). The points of a grid are the
product of the axes and the settings.

A grid with ``contexts`` is an **evaluation grid**: each point (an :class:`EvaluationPoint`) is
one model x backend x device x context x knob setting, run with ``cachelib.profile.evaluate``
over all its texts (default: the corpus in ``assets/corpus/``), writing one evaluation CSV.

Everything is checked before anything runs: an unknown key, an empty axis, a bad spec, a knob
list of the wrong length, a missing text file. Errors name the grid file and the line. This
module knows the file format and the strategy grammar; it does not know Dask, devices present
on any machine, or how a run is done.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..core.reader import MAX_CONFIG_BYTES, parse_toml, read_text
from ..core.units import check_backend, clip_input
from ..models import model_names
from ..profile import Probes, parse_memory_limit
from ..profile.evaluate import CORPUS, DEFAULT_PREFILL_CHUNK, DEFAULT_SCORE_TOKENS, DEFAULT_WINDOWS
from ..spec import STRATEGIES, Spec, SpecError, make_spec, parse_spec, split_spec, strategy
from .lines import Locator

GRID_KEYS = {
    "name": "the sweep's name; the default output folder is profiles/NAME/ (default: the file's stem)",
    "models": "model names (smollm2, presets) or model folders (relative to the grid file)",
    "backends": "mlx and/or torch (default: mlx)",
    "devices": "cpu, cuda, metal (MLX), mps (torch); a list for every backend or a table per backend "
    "(default: each backend's best device on the machine that submits the sweep)",
    "baseline": "the spec every run starts with and compares against (default: standard)",
    "strategies": "specs compared with the baseline; a list as a knob value is a knob range",
    "prompts": "chat prompts (one of prompts / texts)",
    "texts": "evaluation text files, relative to the grid file (profile grids: one of prompts / texts; "
    "evaluation grids: default every assets/corpus/*.txt)",
    "max_tokens": "steps per run, one number or a list (default: 64)",
    "free_running": "each strategy feeds its own greedy tokens (default: false)",
    "probes": "probe periods, e.g. 'memory=1,masks=0' or a table {masks = 0} (default: the profiler's)",
    "memory_limit": "stop a run before its caches pass this size, e.g. '2GB' (default: none)",
    "chat": "wrap prompts in the model's chat template (default: true)",
    "prompt_tokens": "texts: tokens prefilled before the first step (default: 32)",
    "contexts": "context lengths in tokens; a grid with contexts is an evaluation grid: each point runs "
    "`evaluate` (long-context quality against the full cache) and writes one evaluation CSV",
    "score_tokens": "evaluation grids: tokens scored after each prefill (default: 128)",
    "windows": "evaluation grids: windows per text (default: 4)",
    "prefill_chunk": "evaluation grids: tokens per prefill forward pass (default: 2048, mlx-lm's)",
}
PROFILE_ONLY = ("prompts", "max_tokens", "free_running", "probes", "memory_limit", "chat", "prompt_tokens")
EVALUATION_ONLY = ("score_tokens", "windows", "prefill_chunk")

# Devices a grid may name per backend, and the Dask resource a run on each asks for.
DEVICES = {"mlx": ("cpu", "metal", "cuda"), "torch": ("cpu", "cuda", "mps")}
DEVICE_RESOURCES = {"cpu": {}, "cuda": {"GPU": 1}, "metal": {"MLX": 1}, "mps": {"MLX": 1}}

DEFAULT_MAX_TOKENS = 64
DEFAULT_PROMPT_TOKENS = 32


class GridError(ValueError):
    """A grid file the sweep refuses; ``line`` is where the fault is (None: the whole file)."""

    def __init__(self, path: str, line: int | None, reason: str):
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}" if line else f"{path}: {reason}")


@dataclass(frozen=True)
class Input:
    """A prompt or an evaluation text. ``source`` is the prompt itself or the text's path as written."""

    kind: str  # "prompt" | "text"
    source: str
    content: str

    @property
    def label(self) -> str:
        if self.kind == "text":
            return _slug(Path(self.source).stem, 24)
        return _slug("-".join(self.content.split()[:4]), 24) or "prompt"


def _digest(ident: dict) -> str:
    """A point's id: what decides its run, hashed."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]


class _Run:
    """What every kind of point derives from its id and device: its file and its Dask resources."""

    @property
    def file(self) -> str:
        return f"{self.id}.csv"

    @property
    def resources(self) -> dict[str, int]:
        """The Dask resource this run holds while it runs (none for CPU runs)."""
        return dict(DEVICE_RESOURCES[self.device])


@dataclass(frozen=True)
class Point(_Run):
    """One profiling run of a sweep: what ``run_profile`` is called with."""

    model: str
    backend: str
    device: str
    input: Input
    max_tokens: int
    strategies: tuple[Spec, ...]  # the baseline first
    setting: int  # index of the knob setting
    free_running: bool = False
    chat: bool = True
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    probes: Probes = field(default_factory=Probes)
    memory_limit: int | None = None

    @property
    def id(self) -> str:
        """Stable name: readable parts plus a hash of everything that defines the run."""
        model = _slug(Path(self.model).name if "/" in self.model else self.model, 24)
        stem = f"{model}-{self.backend}-{self.device}-{self.input.label}-{self.max_tokens}t"
        return f"{stem}-{self.digest}"

    @property
    def digest(self) -> str:
        ident = {
            "model": self.model,
            "backend": self.backend,
            "device": self.device,
            "input": [self.input.kind, self.input.content],
            "max_tokens": self.max_tokens,
            "strategies": [str(s) for s in self.strategies],
            "free_running": self.free_running,
            "chat": self.chat,
            "prompt_tokens": self.prompt_tokens if self.input.kind == "text" else None,
            "probes": self.probes.to_dict(),
            "memory_limit": self.memory_limit,
        }
        return _digest(ident)

    @property
    def mode(self) -> str:
        return "free-running" if self.free_running else "teacher-forced"

    def run_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``run_profile`` for this point (without ``out``)."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "strategies": [str(s) for s in self.strategies],
            "backend": self.backend,
            "device": self.device,
            "max_tokens": self.max_tokens,
            "free_running": self.free_running,
            "probes": self.probes,
            "memory_limit": self.memory_limit,
            "name": self.id,
            "chat": self.chat,
            "prompt_tokens": self.prompt_tokens,
        }
        kwargs["prompt" if self.input.kind == "prompt" else "text"] = self.input.content
        return kwargs


@dataclass(frozen=True)
class EvaluationPoint(_Run):
    """One evaluation of an evaluation grid: what ``evaluate`` is called with, at one context."""

    model: str
    backend: str
    device: str
    context: int
    texts: tuple[Input, ...]
    strategies: tuple[Spec, ...]  # the reference first
    setting: int
    score_tokens: int = DEFAULT_SCORE_TOKENS
    windows: int = DEFAULT_WINDOWS
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    mode = "evaluation"  # the index's mode column

    @property
    def id(self) -> str:
        model = _slug(Path(self.model).name if "/" in self.model else self.model, 24)
        return f"{model}-{self.backend}-{self.device}-eval-{self.context}c-{self.digest}"

    @property
    def digest(self) -> str:
        ident = {
            "model": self.model,
            "backend": self.backend,
            "device": self.device,
            "context": self.context,
            "texts": [[_text_name(t), hashlib.sha256(t.content.encode()).hexdigest()] for t in self.texts],
            "strategies": [str(s) for s in self.strategies],
            "score_tokens": self.score_tokens,
            "windows": self.windows,
            "prefill_chunk": self.prefill_chunk,
        }
        return _digest(ident)

    @property
    def input(self) -> Input:
        """The texts, as the index lists a point's input."""
        sources = " ".join(t.source for t in self.texts)
        return Input("text", sources, "")

    @property
    def max_tokens(self) -> int:
        """The index's max_tokens column: tokens scored per window."""
        return self.score_tokens

    def run_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``evaluate`` for this point (without ``out``)."""
        return {
            "model": self.model,
            "strategies": [str(s) for s in self.strategies],
            "texts": [(_text_name(t), t.content) for t in self.texts],
            "context": self.context,
            "score_tokens": self.score_tokens,
            "windows": self.windows,
            "prefill_chunk": self.prefill_chunk,
            "backend": self.backend,
            "device": self.device,
        }


def _text_name(text: Input) -> str:
    return Path(text.source).stem


@dataclass(frozen=True)
class Grid:
    path: Path
    text: str  # the file as read
    name: str
    models: tuple[str, ...]
    backends: tuple[str, ...]
    devices: Mapping[str, tuple[str, ...]]  # backend -> devices; a backend missing: its default
    baseline: Spec
    settings: tuple[tuple[Spec, ...], ...]  # knob setting -> strategies (without the baseline)
    inputs: tuple[Input, ...]
    max_tokens: tuple[int, ...]
    free_running: bool = False
    chat: bool = True
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    probes: Probes = field(default_factory=Probes)
    memory_limit: int | None = None
    contexts: tuple[int, ...] = ()  # non-empty: an evaluation grid
    score_tokens: int = DEFAULT_SCORE_TOKENS
    windows: int = DEFAULT_WINDOWS
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    @property
    def kind(self) -> str:
        return "evaluation" if self.contexts else "profile"

    def backends_without_devices(self) -> list[str]:
        return [b for b in self.backends if b not in self.devices]

    def points(self, default_devices: Mapping[str, str] | None = None) -> list[Point] | list[EvaluationPoint]:
        """Every run of the grid, in order model > backend > device > input > max_tokens > setting
        (an evaluation grid: model > backend > device > context > setting, all texts in each).
        ``default_devices`` gives the device of each backend the grid names none for."""
        default_devices = default_devices or {}
        out = []
        if self.contexts:
            for model, backend, device in self._runs(default_devices):
                for context in self.contexts:
                    for k, strategies in enumerate(self.settings):
                        out.append(
                            EvaluationPoint(
                                model=model,
                                backend=backend,
                                device=device,
                                context=context,
                                texts=self.inputs,
                                strategies=(self.baseline, *strategies),
                                setting=k,
                                score_tokens=self.score_tokens,
                                windows=self.windows,
                                prefill_chunk=self.prefill_chunk,
                            )
                        )
        else:
            for model, backend, device in self._runs(default_devices):
                for inp in self.inputs:
                    for tokens in self.max_tokens:
                        for k, strategies in enumerate(self.settings):
                            out.append(
                                Point(
                                    model=model,
                                    backend=backend,
                                    device=device,
                                    input=inp,
                                    max_tokens=tokens,
                                    strategies=(self.baseline, *strategies),
                                    setting=k,
                                    free_running=self.free_running,
                                    chat=self.chat,
                                    prompt_tokens=self.prompt_tokens,
                                    probes=self.probes,
                                    memory_limit=self.memory_limit,
                                )
                            )
        seen: set[str] = set()
        for p in out:
            if p.id in seen:
                raise ValueError(f"{self.path}: two points of the grid are the same run ({p.id}); remove the repeat")
            seen.add(p.id)
        return out

    def _runs(self, default_devices: Mapping[str, str]):
        """(model, backend, device) of every run, in grid order."""
        for model in self.models:
            for backend in self.backends:
                if backend in self.devices:
                    devices = self.devices[backend]
                elif backend in default_devices:
                    devices = (default_devices[backend],)
                else:
                    raise ValueError(f"no device for backend {backend!r}: the grid names none and no default was given")
                for device in devices:
                    yield model, backend, device


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file; a fault raises :class:`GridError` naming the line."""
    path = Path(path)
    label = str(path)
    try:
        text = read_text(path, "grid file", MAX_CONFIG_BYTES)  # bounded: no device, pipe or socket
    except FileNotFoundError:
        raise GridError(label, None, "no such grid file") from None
    except (OSError, ValueError) as e:
        raise GridError(label, None, f"cannot read the grid file ({e})") from None
    return parse_grid(text, path)


def parse_grid(text: str, path: str | Path = "grid.toml") -> Grid:
    """Check and expand the TOML ``text`` of a grid; relative paths resolve against ``path``'s folder."""
    path = Path(path)
    return _Reader(text, path).grid()


class _Reader:
    def __init__(self, text: str, path: Path):
        self.text = text
        self.path = path
        self.label = str(path)
        self.where = Locator(text)
        try:
            self.data = parse_toml(text, f"grid file {clip_input(self.label)!r}")  # nesting capped before parsing
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"\(at line (\d+), column \d+\)", str(e))
            reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
            raise GridError(self.label, int(m.group(1)) if m else None, f"not valid TOML: {reason}") from None
        except ValueError as e:  # nested too deep
            raise GridError(self.label, None, str(e)) from None

    def fail(self, key: str | None, reason: str, line: int | None = None) -> GridError:
        if line is None and key is not None:
            line = self.where.key_line(key)
        return GridError(self.label, line, reason)

    # --- generic shapes ---------------------------------------------------------------------

    def axis(self, key: str, kind: type, default: Sequence | None = None, required: bool = False) -> tuple:
        """A key that takes one value or a non-empty list of values of ``kind``."""
        if key not in self.data:
            if required:
                raise self.fail(None, f"the grid needs {key!r} ({GRID_KEYS[key]})")
            return tuple(default or ())
        return self.values(key, self.data[key], kind)

    def values(self, key: str, value: Any, kind: type) -> tuple:
        values = value if isinstance(value, list) else [value]
        if not values:
            raise self.fail(key, f"{key!r} is an empty list; give at least one value ({GRID_KEYS[key.split('.')[0]]})")
        for v in values:
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise self.fail(key, f"{key!r}: expected {_kind_name(kind)} values, got {v!r}")
        for i, v in enumerate(values):
            if v in values[:i]:
                raise self.fail(key, f"{key!r}: {v!r} is listed twice")
        return tuple(values)

    def scalar(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        if key not in self.data:
            return default
        v = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(v, kinds) or (bool not in kinds and isinstance(v, bool)):
            names = " or ".join(_kind_name(k) for k in kinds)
            raise self.fail(key, f"{key!r}: expected {names}, got {v!r}")
        return v

    # --- the grid ---------------------------------------------------------------------------

    def grid(self) -> Grid:
        for key in self.data:
            if key not in GRID_KEYS:
                raise self.fail(key, f"unknown key {key!r}; keys: {', '.join(GRID_KEYS)}")
        name = self.scalar("name", str, self.path.stem)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise self.fail("name", f"'name' {name!r} must be a folder name: letters, digits, '.', '_', '-'")
        models = tuple(self.model(m) for m in self.axis("models", str, required=True))
        backends = self.axis("backends", str, default=("mlx",))
        for b in backends:
            try:
                check_backend(b)
            except ValueError as e:
                raise self.fail("backends", str(e)) from None
        devices = self.devices(backends)
        if "contexts" in self.data:
            return self.evaluation_grid(name, models, backends, devices)
        for key in EVALUATION_ONLY:
            if key in self.data:
                raise self.fail(key, f"{key!r} is for evaluation grids; add 'contexts' (context lengths) to make one")
        baseline = self.baseline(backends)
        settings = self.strategies(backends, baseline)
        inputs = self.inputs()
        max_tokens = self.axis("max_tokens", int, default=(DEFAULT_MAX_TOKENS,))
        for t in max_tokens:
            if t < 1:
                raise self.fail("max_tokens", f"'max_tokens' must be >= 1, got {t}")
        free_running = self.scalar("free_running", bool, False)
        if free_running and inputs[0].kind == "text":
            raise self.fail("free_running", "free_running decodes from prompts; evaluation texts are teacher-forced")
        chat = self.scalar("chat", bool, True)
        prompt_tokens = self.scalar("prompt_tokens", int, DEFAULT_PROMPT_TOKENS)
        if prompt_tokens < 1:
            raise self.fail("prompt_tokens", f"'prompt_tokens' must be >= 1, got {prompt_tokens}")
        return Grid(
            path=self.path,
            text=self.text,
            name=name,
            models=models,
            backends=backends,
            devices=devices,
            baseline=baseline,
            settings=settings,
            inputs=inputs,
            max_tokens=max_tokens,
            free_running=free_running,
            chat=chat,
            prompt_tokens=prompt_tokens,
            probes=self.probes(),
            memory_limit=self.memory_limit(),
        )

    def evaluation_grid(self, name: str, models: tuple[str, ...], backends: tuple[str, ...], devices) -> Grid:
        """A grid with 'contexts': each point is one ``evaluate`` run at one context."""
        for key in PROFILE_ONLY:
            if key in self.data:
                raise self.fail(
                    key,
                    f"{key!r} is for profile grids; an evaluation grid (it has 'contexts') scores texts "
                    "(see 'texts', 'score_tokens', 'windows', 'prefill_chunk')",
                )
        baseline = self.baseline(backends)
        if not baseline.lossless:
            raise self.fail(
                "baseline",
                f"'baseline': {baseline} is not a full cache; an evaluation measures against a lossless "
                "one (standard, concat, static, offloaded)",
            )
        settings = self.strategies(backends, baseline)
        contexts = self.axis("contexts", int)
        for c in contexts:
            if c < 1:
                raise self.fail("contexts", f"'contexts' must be >= 1, got {c}")
        counts = {}
        for key, default in (
            ("score_tokens", DEFAULT_SCORE_TOKENS),
            ("windows", DEFAULT_WINDOWS),
            ("prefill_chunk", DEFAULT_PREFILL_CHUNK),
        ):
            counts[key] = self.scalar(key, int, default)
            if counts[key] < 1:
                raise self.fail(key, f"{key!r} must be >= 1, got {counts[key]}")
        need = max(contexts) + counts["score_tokens"] - 1
        for spec in (baseline, *(s for setting in settings for s in setting)):
            if spec.max_context is not None and spec.max_context < need:
                key = "baseline" if spec == baseline else "strategies"
                raise self.fail(
                    key, f"{spec} holds at most {spec.max_context} tokens; the longest context needs {need}"
                )
        return Grid(
            path=self.path,
            text=self.text,
            name=name,
            models=models,
            backends=backends,
            devices=devices,
            baseline=baseline,
            settings=settings,
            inputs=self.inputs() if "texts" in self.data else self.corpus(),
            max_tokens=(),
            contexts=contexts,
            **counts,
        )

    def corpus(self) -> tuple[Input, ...]:
        files = sorted(CORPUS.glob("*.txt")) if CORPUS.is_dir() else []
        if not files:
            raise self.fail(
                None, f"the grid names no 'texts' and there is no evaluation corpus at {CORPUS}; add texts = [...]"
            )
        where = f"{CORPUS.parent.name}/{CORPUS.name}"  # as the index shows it: assets/corpus/NAME.txt
        return tuple(Input("text", f"{where}/{p.name}", p.read_text(encoding="utf-8")) for p in files)

    def model(self, name: str) -> str:
        if name in model_names():
            return name
        folder = Path(name).expanduser()
        if not folder.is_absolute():
            folder = self.path.parent / folder
        if folder.is_dir():
            return str(folder.resolve())
        raise self.fail(
            "models", f"unknown model {name!r}: not one of {', '.join(model_names())} and no folder {str(folder)!r}"
        )

    def devices(self, backends: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
        if "devices" not in self.data:
            return {}
        value = self.data["devices"]
        if isinstance(value, dict):
            for b in value:
                if b not in backends:
                    raise self.fail("devices", f"'devices' names backend {b!r}, which 'backends' does not list")
            per_backend = {b: self.values(f"devices.{b}", v, str) for b, v in value.items()}
        else:
            listed = self.axis("devices", str)
            per_backend = {b: listed for b in backends}
        for b, devices in per_backend.items():
            for d in devices:
                if d not in DEVICES[b]:
                    raise self.fail(
                        "devices", f"device {d!r} is not a {b} device; {b} runs on: {', '.join(DEVICES[b])}"
                    )
        return per_backend

    def baseline(self, backends: tuple[str, ...]) -> Spec:
        text = self.scalar("baseline", str, "standard")
        try:
            spec = parse_spec(text)
            for b in backends:
                spec.check_backend(b)
        except ValueError as e:
            raise self.fail("baseline", f"'baseline': {e}") from None
        return spec

    def strategies(self, backends: tuple[str, ...], baseline: Spec) -> tuple[tuple[Spec, ...], ...]:
        if "strategies" not in self.data:
            raise self.fail(None, f"the grid needs 'strategies' ({GRID_KEYS['strategies']})")
        entries = self.data["strategies"]
        if not isinstance(entries, list):
            raise self.fail("strategies", f"'strategies' must be a list of specs, got {entries!r}")
        if not entries:
            raise self.fail("strategies", "'strategies' is an empty list; give at least one spec to compare")
        lines = self.where.entry_lines("strategies", entries)

        def entry_fail(i: int, error: ValueError | str) -> GridError:
            knob = getattr(error, "knob", None)  # SpecError names the knob at fault
            end = next((x for x in lines[i + 1 :] if x), None)
            line = self.where.line_within(knob, lines[i], end) if knob else lines[i]
            return self.fail(None, f"strategies[{i}]: {error}", line=line)

        ranged = []  # per entry: (name, knobs with lists kept as lists)
        for i, entry in enumerate(entries):
            try:
                ranged.append(_entry_knobs(entry))
            except ValueError as e:
                raise entry_fail(i, e) from None
        lengths = {}
        for i, (name, knobs) in enumerate(ranged):
            for knob, v in knobs.items():
                if isinstance(v, list):
                    if not v:
                        raise entry_fail(i, SpecError(f"{name}: knob {knob!r} has an empty range", knob))
                    lengths[(i, knob)] = len(v)
        # The first range sets the number of settings; a range of another length is the fault.
        (first, n) = next(iter(lengths.items()), ((None, None), 1))
        for (i, knob), length in lengths.items():
            if length != n:
                raise entry_fail(
                    i,
                    SpecError(
                        f"knob {knob!r} lists {length} values but strategies[{first[0]}] {first[1]} lists {n}; "
                        "knob ranges pair up setting by setting, so every range needs the same length",
                        knob,
                    ),
                )
        settings = []
        for k in range(n):
            specs = []
            for i, (name, knobs) in enumerate(ranged):
                values = {key: (v[k] if isinstance(v, list) else v) for key, v in knobs.items()}
                try:
                    spec = make_spec(name, values)
                    for b in backends:
                        spec.check_backend(b)
                except ValueError as e:
                    raise entry_fail(i, e) from None
                if spec == baseline:
                    raise self.fail(None, f"strategies[{i}]: {spec} is the baseline already", line=lines[i])
                if spec in specs:
                    raise self.fail(None, f"strategies[{i}]: {spec} is listed twice in knob setting {k}", line=lines[i])
                specs.append(spec)
            settings.append(tuple(specs))
        return tuple(settings)

    def inputs(self) -> tuple[Input, ...]:
        has_prompts, has_texts = "prompts" in self.data, "texts" in self.data
        if has_prompts == has_texts:
            if has_prompts:
                raise self.fail("texts", "give 'prompts' or 'texts', not both")
            raise self.fail(None, "the grid needs 'prompts' (chat prompts) or 'texts' (evaluation text files)")
        if has_prompts:
            prompts = self.axis("prompts", str)
            for p in prompts:
                if not p.strip():
                    raise self.fail("prompts", "'prompts' holds an empty prompt")
            return tuple(Input("prompt", p, p) for p in prompts)
        out = []
        for rel in self.axis("texts", str):
            file = Path(rel).expanduser()
            if not file.is_absolute():
                file = self.path.parent / file
            try:
                content = read_text(file, "text file")  # bounded: no device, pipe or socket
            except FileNotFoundError:
                raise self.fail(
                    "texts", f"text file {clip_input(rel)!r} not found (looked at {clip_input(str(file))!r})"
                ) from None
            except (OSError, ValueError) as e:
                raise self.fail("texts", f"cannot read text file {clip_input(rel)!r} ({e})") from None
            if not content.strip():
                raise self.fail("texts", f"text file {rel!r} is empty")
            out.append(Input("text", rel, content))
        return tuple(out)

    def probes(self) -> Probes:
        if "probes" not in self.data:
            return Probes()
        value = self.data["probes"]
        if isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        elif not isinstance(value, str):
            raise self.fail("probes", f"'probes': expected a string like 'memory=1,masks=0' or a table, got {value!r}")
        try:
            return Probes.parse(value)
        except ValueError as e:
            raise self.fail("probes", f"'probes': {e}") from None

    def memory_limit(self) -> int | None:
        if "memory_limit" not in self.data:
            return None
        value = self.data["memory_limit"]
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise self.fail("memory_limit", f"'memory_limit': expected a size like '2GB' or bytes, got {value!r}")
        try:
            return parse_memory_limit(value)
        except ValueError as e:
            raise self.fail("memory_limit", f"'memory_limit': {e}") from None


def _entry_knobs(entry: Any) -> tuple[str, dict[str, Any]]:
    """A strategies entry -> (strategy name, knob -> value or list of values)."""
    if isinstance(entry, str):
        name, knobs = split_spec(entry, ranges=True)  # spec.py's grammar, with knob ranges
        _check_knob_names(name, knobs)
        return name, knobs
    if isinstance(entry, dict):
        if "name" not in entry:
            raise SpecError(f"a strategy table needs name = one of {', '.join(STRATEGIES)}")
        name = entry["name"]
        if not isinstance(name, str):
            raise SpecError(f"'name' must be a strategy name, got {name!r}")
        knobs = {k: v for k, v in entry.items() if k != "name"}
        _check_knob_names(name, {})
        stray = [k for k in knobs if k in GRID_KEYS and k not in {kn.name for kn in STRATEGIES[name].knobs}]
        if stray:
            raise SpecError(
                f"{name}: {stray[0]!r} is a grid key, not a knob; a key written after a [[strategies]] "
                "header belongs to that table, so move it above the first header",
                stray[0],
            )
        _check_knob_names(name, knobs)
        for key, v in knobs.items():
            if isinstance(v, list):
                bad = [x for x in v if not isinstance(x, int) or isinstance(x, bool)]
                if bad:
                    raise SpecError(f"{name}: knob {key!r} range holds {bad[0]!r}; knob values are integers", key)
            elif not isinstance(v, int) or isinstance(v, bool):
                raise SpecError(f"{name}: knob {key!r} must be an integer or a list of integers, got {v!r}", key)
        return name, knobs
    raise SpecError(f"expected a spec string or a table {{name = ..., knob = ...}}, got {entry!r}")


def _check_knob_names(name: str, knobs: Mapping[str, Any]) -> None:
    entry = strategy(name)  # raises, naming the strategies
    for key in knobs:
        entry.knob(key)  # raises, naming the allowed knobs


def _kind_name(kind: type) -> str:
    return {str: "string", int: "integer", bool: "true/false", float: "number"}.get(kind, kind.__name__)


def _slug(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:limit].strip("-")
