"""``python -m cachelib``: the command line over the same API the app uses.

Subcommands: ``profile`` (record a run), ``report`` (profiles as one HTML file), ``evaluate``
(long-context quality against the full cache), ``plan`` (capacity planner), ``sweep`` (grids of runs
on Dask), ``strategies`` and ``models`` (what is available), ``profiles`` (a folder's profiles,
incomplete ones and unclosed partial files included). Bad input — a bad value, a path that cannot be
read or written — exits with code 2 and one line that says what is wrong. Ctrl-C and SIGTERM stop a
profiling run cleanly (exit 130 and 143): its profile is closed, marked incomplete, and the line
says where it is."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from ..core.units import clip_message

# Each subcommand's module is imported only when that subcommand is chosen (``plan`` never pays for
# pandas' profile readers, models or Dask): (name, help, module with add_arguments/run; None = here).
SUBCOMMANDS = (
    ("profile", "run a model with several cache strategies and record a profile", None),
    ("profiles", "list the profiles in a folder, incomplete ones and unclosed partial files included", None),
    ("plan", "exact KV bytes, what fits in a budget, and the quality price", "cachelib.cli.plan"),
    (
        "evaluate",
        "long-context quality (KL, top-1, perplexity) of strategies vs the full cache",
        "cachelib.cli.evaluate",
    ),
    ("retrieval", "needle-in-a-haystack accuracy of strategies over contexts x depths", "cachelib.cli.retrieval"),
    ("report", "a comparison of profiles as one self-contained HTML file (opens offline)", "cachelib.cli.report"),
    ("sweep", "run a grid of profiles (TOML) locally or on a Dask cluster", "cachelib.cli.sweep"),
    ("strategies", "list cache strategies and their knobs", None),
    ("models", "list the models and devices available here", None),
)


class CliError(Exception):
    """A one-line user error: printed without a traceback, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the whole usage otherwise)
        raise CliError(f"{self.prog}: {message}")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {clip_message(str(message))}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the top level has no options but -h: the first word that is not an option names the subcommand
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    shown, warnings.showwarning = warnings.showwarning, _one_line_warning  # a warning is one line, as an error is
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except CliError as e:  # every error line quotes at most ~100 characters of an input (clip_message)
        print(f"error: {clip_message(str(e))}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {clip_message(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be read or written: the input is at fault
        print(f"error: {clip_message(os_error_text(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"interrupted ({e})" if str(e) else "interrupted", file=sys.stderr)
        return 143 if str(e) == "SIGTERM" else 130
    finally:
        warnings.showwarning = shown


def os_error_text(e: OSError) -> str:
    """One line for an ``OSError``: "PATH: what went wrong"."""
    if e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    return e.strerror or str(e)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` only that subcommand's flags are declared (the
    others keep their help line), so only its module is imported."""
    parser = _Parser(prog="cachelib", description="See inside KV caches: profile, compare and plan cache strategies.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    here = {
        "profile": (_add_profile_arguments, _profile),
        "profiles": (_add_profiles_arguments, _profiles),
        "strategies": (None, _strategies),
        "models": (None, _models),
    }
    for name, help, module in SUBCOMMANDS:
        p = sub.add_parser(name, help=help)
        if command is not None and command != name:
            continue  # declared by name only: its flags and module are not needed for this command line
        if module is None:
            add, run = here[name]
        else:
            found = importlib.import_module(module)
            add, run = found.add_arguments, found.run
        if add is not None:
            add(p)
        p.set_defaults(func=run)
    return parser


def _add_profiles_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", type=Path, default=Path("profiles"), help="the folder (default: profiles/)")


def _add_profile_arguments(p: argparse.ArgumentParser) -> None:
    from ..core.units import INDEX_MAX
    from ..spec import GROUP_SIZES, QUANT_BITS
    from .args import SIZE_HELP, add_model_arguments, int_range, positive_int, positive_memory_size

    add_model_arguments(p)
    p.add_argument(
        "--strategy",
        action="append",
        default=[],
        metavar="SPEC",
        help="a cache strategy, e.g. rotating:max_size=512,keep=4 (repeat; the first is the baseline)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a chat prompt; the baseline decodes greedily from it")
    src.add_argument("--text-file", type=Path, help="an evaluation text; every strategy is fed its tokens")
    p.add_argument(
        "--max-tokens", type=int_range(1, INDEX_MAX), default=64, help="steps to run (the prefill is step 0)"
    )
    p.add_argument("--free-running", action="store_true", help="each strategy feeds its own greedy tokens")
    p.add_argument(
        "--one-by-one",
        action="store_true",
        help="advance every strategy by its own forward pass (default: the strategies are the rows of one batch)",
    )
    p.add_argument(
        "--sample-every", type=positive_int, default=None, help="sample masks and quantization error every K steps"
    )
    p.add_argument("--probes", default="", help="probe periods, e.g. memory=1,masks=0 ('none' for all off)")
    p.add_argument(
        "--memory-limit",
        type=positive_memory_size,
        default=None,
        metavar="SIZE",
        help="stop before the caches pass this size (default: 90%% of the memory available at the start; "
        f"without it a run predicted to need more is refused); {SIZE_HELP}",
    )
    p.add_argument("--out", type=Path, default=None, help="profile CSV to write (default: profiles/<time>-<model>.csv)")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt raw, without the chat template")
    mlx = p.add_argument_group("mlx-lm shorthands (add one strategy after the baseline)")
    mlx.add_argument("--max-kv-size", type=int_range(1, INDEX_MAX), default=None, help="= rotating:max_size=N,keep=4")
    mlx.add_argument(
        "--kv-bits",
        type=int,
        choices=QUANT_BITS,
        default=None,
        help="= quantized:bits=B (with --max-kv-size: a quantized ring)",
    )
    mlx.add_argument("--kv-group-size", type=int, choices=GROUP_SIZES, default=64, help="group size for --kv-bits")
    mlx.add_argument(
        "--quantized-kv-start", type=int_range(0, INDEX_MAX), default=0, help="quantize after this many tokens"
    )


def _profile(args) -> int:
    from ..profile import Probes, default_profile_name, run_profile, summarize
    from ..profile.run import RunInterrupted
    from ..profile.text import read_text_file
    from ..spec import parse_spec, spec_from_mlx_flags

    strategies = [parse_spec(s) for s in args.strategy]
    if args.max_kv_size is not None or args.kv_bits is not None:
        shorthand = spec_from_mlx_flags(args.max_kv_size, args.kv_bits, args.kv_group_size, args.quantized_kv_start)
        strategies = (strategies or [parse_spec("standard")]) + [shorthand]
    strategies = strategies or [parse_spec("standard")]
    probes = Probes()
    if args.sample_every:
        probes = probes.sampled(args.sample_every)
    probes = Probes.parse(args.probes, probes)
    text = read_text_file(args.text_file, "--text-file") if args.text_file is not None else None
    out = args.out or Path("profiles") / f"{default_profile_name(args.model, strategies)}.csv"
    limit = args.memory_limit

    bar = _Progress(args.max_tokens) if sys.stderr.isatty() else None
    try:
        with _sigterm_stops_the_run():
            profile = run_profile(
                args.model,
                strategies,
                backend=args.backend,
                device=args.device,
                prompt=args.prompt,
                text=text,
                max_tokens=args.max_tokens,
                free_running=args.free_running,
                one_by_one=args.one_by_one,
                probes=probes,
                memory_limit=limit,
                out=out,
                chat=not args.no_chat,
                on_step=bar.update if bar else None,
            )
    except RunInterrupted as e:
        if bar:
            bar.done()
        print(f"interrupted ({e.how}): {_where_written(e.profile, out)}", file=sys.stderr)
        return 143 if e.how == "SIGTERM" else 130
    if bar:
        bar.done()
    print(format_summary(summarize(profile)))
    for label, why in (json.loads(profile.meta["batch_notes"]) if profile.meta.get("batch_notes") else {}).items():
        print(f"ran on its own: {label}: {why}")
    print(_where_written(profile, out))
    return 0


def _where_written(profile, out: Path) -> str:
    """Where the profile went and how it ended; why it is not at ``out`` when it is not."""
    status = profile.status if profile.complete else f"{profile.status}: {profile.meta.get('reason', '')}"
    line = f"profile: {profile.path} ({status})"
    if profile.path is not None and Path(profile.path) != Path(out):
        why = (
            "another run wrote it while this one ran"
            if profile.complete
            else "an incomplete run never replaces a profile"
        )
        line += f"; {out} was kept as it is ({why})"
    return line


@contextmanager
def _sigterm_stops_the_run() -> Iterator[None]:
    """While a run goes, SIGTERM stops it as Ctrl-C does (the profile is closed, marked incomplete)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _profiles(args) -> int:
    """``cachelib profiles [FOLDER]``: one line per profile, with its status and why it is not complete."""
    from ..profile import list_profiles, load_profile, read_meta
    from ..profile.store import meta_list

    folder = args.folder
    if not folder.is_dir():
        raise CliError(f"no folder {str(folder)!r}")
    files = list_profiles(folder)
    if not files:
        print(f"no profiles in {folder}")
        return 0
    rows = []
    for f in files:
        try:
            m = read_meta(f.path, name=f.name)
            if m.get("status") == "complete":  # "complete" only for what load_profile opens: every table checked
                load_profile(f.path, name=f.name)
        except (ValueError, OSError) as e:
            rows.append((f.name, "not a profile", "", "", str(e)))
            continue
        rows.append(
            (
                f.name,
                m.get("status", ""),
                m.get("model", ""),
                ", ".join(meta_list(m.get("strategies", ""))),
                m.get("reason", ""),
            )
        )
    width = max(len(r[0]) for r in rows)
    for name, status, model, strategies, reason in rows:
        line = f"{name:<{width}}  {status:<13} {model} {strategies}".rstrip()
        print(line + (f"  ({reason})" if reason else ""))
    return 0


class _Progress:
    def __init__(self, total: int):
        self.total = total

    def update(self, event) -> None:
        done = event.step + 1
        width = 30
        fill = int(width * done / self.total)
        rates = [r.get("tokens_per_second") for r in event.rows.values() if r.get("tokens_per_second")]
        rate = f"  {sum(rates) / len(rates):6.1f} tok/s" if rates else ""
        sys.stderr.write(f"\r[{'#' * fill}{' ' * (width - fill)}] {done}/{self.total} steps{rate}")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")


def format_summary(summary) -> str:
    """One line per strategy: peak cache bytes allocated, bytes per token held, memory saved
    against the full cache in the run's dtype (:mod:`cachelib.profile.summary`), mean KL,
    top-1 agreement, tokens/s; then what "saved" was measured against."""
    lines = [
        f"{'strategy':<44} {'peak alloc':>12} {'B/token':>8} {'saved':>6} {'mean KL':>10} {'top-1':>7} {'tok/s':>8}"
    ]
    for _, r in summary.iterrows():
        peak = f"{r['peak_bytes_allocated'] / 2**20:,.2f} MiB" if r["peak_bytes_allocated"] is not None else "-"
        per_token = f"{r['bytes_per_token']:,.0f}" if r["bytes_per_token"] is not None else "-"
        saved = (
            f"{r['memory_saved']:.0%}"
            if r["memory_saved"] is not None and r["memory_saved"] == r["memory_saved"]
            else "-"
        )
        kl = f"{r['mean_kl']:.4g}" if r["mean_kl"] is not None else "-"
        agree = f"{r['top1_agreement']:.1%}" if r["top1_agreement"] is not None else "-"
        tps = f"{r['decode_tokens_per_second']:.1f}" if r["decode_tokens_per_second"] is not None else "-"
        lines.append(f"{r['strategy']:<44} {peak:>12} {per_token:>8} {saved:>6} {kl:>10} {agree:>7} {tps:>8}")
    against = sorted({str(a) for a in summary["saved_against"] if isinstance(a, str) and a})
    tokens = sorted({int(n) for n in summary["tokens"] if n is not None and n == n})
    if against:
        at = f" at {', '.join(f'{n:,}' for n in tokens)} tokens" if tokens else ""
        what = " or ".join("the baseline" if a == "baseline" else f"a {a}" for a in against)
        lines.append(f"B/token = bytes used / tokens held; saved = 1 - bytes used / bytes used by {what}{at}")
    return "\n".join(lines)


def _strategies(args) -> int:
    from ..spec import STRATEGIES

    for s in STRATEGIES.values():
        print(f"{s.name:<10} {s.summary}  [backends: {', '.join(s.backends)}]")
        for k in s.knobs:
            default = "required" if k.required else ("off" if k.default is None else f"default {k.default}")
            print(f"    {k.name:<12} {k.range_text:<28} {default:<12} {k.help}")
    return 0


def _models(args) -> int:
    from ..models import BACKENDS, available_devices, model_names

    print("models: " + ", ".join(model_names()) + ", or a path to a model folder")
    for b in BACKENDS:
        print(f"{b} devices: {', '.join(available_devices(b))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
