"""Reference check of our importance scores against NVIDIA's kvpress 0.5.5 (issue 14).

kvpress pins transformers < 5.3, so it runs in its own environment, ``.venv-kvpress``
(``scripts/kvpress_env.sh`` creates and caches it). The check has two halves, one per
environment, joined by an ``.npz`` file:

1. ``--reference OUT.npz``, run by the side environment's python: random keys, values and
   queries (fixed seed, GQA shapes), kvpress's own presses (``KnormPress``, ``SnapKVPress``,
   ``TOVAPress``) score them through their ``score`` method, and their ``compress`` method prunes
   them; the inputs, the scores and the positions ``compress`` kept are saved.
2. the default, run by cachelib's environment: ``cachelib.torch.importance.score_keys`` scores the
   same inputs; printed per case and method: the max abs difference of the scores over the
   positions kvpress scores by attention, and whether the top-k positions we keep are the ones
   kvpress's ``compress`` kept. Exit code 1 if any differ.

kvpress's presses are handed a stand-in attention module whose ``q_proj`` is the identity, so
the "hidden states" are the queries themselves, and an identity rotation (cos 1, sin 0), so
the queries are used as given (post-RoPE, as the attention layer has them); that way kvpress
computes the observation-window attention itself (``attentions=None``, its path under SDPA).
Where kvpress gives the observation window (SnapKV) or the last token (TOVA) a score of
``max + 1`` so it is always kept, only the kept positions are compared there.

    python bench/check_kvpress.py                  # both halves: creates .venv-kvpress if missing
    .venv-kvpress/bin/python bench/check_kvpress.py --reference ref.npz   # the kvpress half alone
    python bench/check_kvpress.py --npz ref.npz    # the comparison alone, from a saved reference
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIDE_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
SEED = 0
# (name, batch, kv heads, query heads, tokens, head dim, snapkv window, snapkv kernel, compression ratio)
CASES = [
    ("gqa-b2-h2x3-t257", 2, 2, 6, 257, 64, 64, 5, 0.5),
    ("smollm2-b1-h3x3-t1000", 1, 3, 9, 1000, 64, 64, 5, 0.75),
    ("gqa-b2-h4x2-t300-w32k7", 2, 4, 8, 300, 32, 32, 7, 0.8),
]
METHODS = ("knorm", "snapkv", "tova")
# float32 scores (softmax probabilities, norms): agreement to rounding, relative to the largest score
RTOL = 1e-5


def _inputs(batch: int, kv_heads: int, heads: int, tokens: int, dim: int, rng: np.random.Generator):
    keys = rng.standard_normal((batch, kv_heads, tokens, dim), dtype=np.float32)
    # some keys with a large norm and some queries aligned with them, so attention is not flat
    keys *= rng.uniform(0.5, 2.0, size=(batch, kv_heads, tokens, 1)).astype(np.float32)
    queries = rng.standard_normal((batch, heads, tokens, dim), dtype=np.float32)
    values = rng.standard_normal((batch, kv_heads, tokens, dim), dtype=np.float32)
    values[..., 0] = np.arange(tokens, dtype=np.float32)  # channel 0 carries the position: what compress kept
    return keys, values, queries


def reference(out: Path) -> None:
    """The kvpress half: runs where kvpress is installed (the side environment)."""
    from importlib.metadata import version
    from types import SimpleNamespace

    import torch
    import transformers
    from kvpress import KnormPress, SnapKVPress, TOVAPress
    from torch import nn

    class Attention(nn.Module):  # what kvpress reads of an attention layer: its config, head_dim, q_proj
        def __init__(self, heads: int, kv_heads: int, dim: int):
            super().__init__()
            self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
            self.head_dim = dim
            self.q_proj = nn.Identity()

    rng = np.random.default_rng(SEED)
    arrays: dict[str, np.ndarray] = {}
    for name, batch, kv_heads, heads, tokens, dim, window, kernel, ratio in CASES:
        keys, values, queries = _inputs(batch, kv_heads, heads, tokens, dim, rng)
        arrays |= {f"{name}/keys": keys, f"{name}/values": values, f"{name}/queries": queries}
        module = Attention(heads, kv_heads, dim)
        hidden = torch.from_numpy(queries).transpose(1, 2).reshape(batch, tokens, heads * dim)
        rotation = (torch.ones(batch, tokens, dim), torch.zeros(batch, tokens, dim))
        k, v = torch.from_numpy(keys), torch.from_numpy(values)
        presses = {
            "knorm": KnormPress(compression_ratio=ratio),
            "snapkv": SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel),
            "tova": TOVAPress(compression_ratio=ratio),
        }
        for method, press in presses.items():
            kwargs = {"position_embeddings": rotation}
            with torch.no_grad():
                scores = press.score(module, hidden, k, v, None, kwargs)
                _, kept_values = press.compress(module, hidden, k, v, None, kwargs)
            arrays[f"{name}/{method}/scores"] = scores.float().numpy()
            arrays[f"{name}/{method}/kept"] = np.sort(kept_values[..., 0].round().to(torch.int64).numpy(), axis=-1)
    meta = {
        "kvpress": version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": SEED,
        "cases": [
            dict(zip(("name", "batch", "kv_heads", "heads", "tokens", "dim", "window", "kernel", "ratio"), c))
            for c in CASES
        ],
    }
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(out, **arrays)
    print(
        f"kvpress {meta['kvpress']} (transformers {meta['transformers']}, torch {meta['torch']}): "
        f"{len(CASES)} cases x {len(METHODS)} presses -> {out}"
    )


def _ours(method: str, keys, queries, window: int, kernel: int):
    """Our scores of one case: the queries the method looks at (the last ``window`` for SnapKV,
    the last one for TOVA, none for knorm), as the attention layer would hand them over."""
    from cachelib.torch.importance import score_keys

    if method == "knorm":
        return score_keys("knorm", keys, None)
    if method == "snapkv":
        return score_keys("snapkv", keys, queries[:, :, -window:], window=window, kernel=kernel, pooling="avg")
    return score_keys("tova", keys, queries[:, :, -1:])


def compare(npz: Path) -> list[dict]:
    """The comparison half, in cachelib's environment: one row per case x method."""
    import torch

    data = np.load(npz)
    meta = json.loads(str(data["meta"]))
    rows = []
    for case in meta["cases"]:
        name, window, kernel, ratio = case["name"], case["window"], case["kernel"], case["ratio"]
        keys = torch.from_numpy(data[f"{name}/keys"])
        queries = torch.from_numpy(data[f"{name}/queries"])
        tokens = keys.shape[2]
        n_kept = max(1, int(tokens * (1 - ratio)))  # kvpress's compute_n_kept
        for method in METHODS:
            ref = data[f"{name}/{method}/scores"]
            ours = _ours(method, keys, queries, window, kernel).float().numpy()
            if ours.shape != ref.shape:
                raise ValueError(f"{name}/{method}: our scores have shape {ours.shape}, kvpress's {ref.shape}")
            # the positions kvpress scores by attention (the rest it pins to max + 1)
            scored = {"knorm": tokens, "snapkv": tokens - window, "tova": tokens - 1}[method]
            diff = float(np.abs(ours[..., :scored] - ref[..., :scored]).max())
            kept = np.sort(torch.from_numpy(ours).topk(n_kept, dim=-1).indices.numpy(), axis=-1)
            ref_kept = data[f"{name}/{method}/kept"]
            same = (kept == ref_kept).all(axis=-1)
            overlap = np.mean(
                [
                    len(np.intersect1d(a, b)) / n_kept
                    for a, b in zip(kept.reshape(-1, n_kept), ref_kept.reshape(-1, n_kept))
                ]
            )
            rows.append(
                {
                    "case": name,
                    "method": method,
                    "tokens": tokens,
                    "kept": n_kept,
                    "max_abs_diff": diff,
                    "scale": float(np.abs(ref[..., :scored]).max()),
                    "rows_identical": int(same.sum()),
                    "rows": int(same.size),
                    "overlap": float(overlap),
                    "ok": diff <= RTOL * float(np.abs(ref[..., :scored]).max()) and bool(same.all()),
                }
            )
    return rows


def run_reference(out: Path, python: Path = SIDE_PYTHON) -> None:
    """The kvpress half in the side environment (created first when missing)."""
    if not python.exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "kvpress_env.sh")], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([str(python), str(Path(__file__).resolve()), "--reference", str(out)], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, metavar="OUT.npz", help="the kvpress half: save its scores here")
    ap.add_argument("--npz", type=Path, help="compare with this saved reference instead of computing one")
    args = ap.parse_args()
    if args.reference:
        reference(args.reference)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        npz = args.npz
        if npz is None:
            npz = Path(tmp) / "kvpress.npz"
            start = time.perf_counter()
            run_reference(npz)
            print(f"kvpress half: {time.perf_counter() - start:.1f} s")
        meta = json.loads(str(np.load(npz)["meta"]))
        rows = compare(npz)
    print(
        f"\nours (cachelib.torch.importance.score_keys) vs kvpress {meta['kvpress']} "
        f"(transformers {meta['transformers']}), seed {meta['seed']}, float32"
    )
    print(
        f"{'case':<24} {'method':<7} {'kept':>9} {'max |diff|':>11} {'max |score|':>12} {'top-k same':>11} "
        f"{'overlap':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:<24} {r['method']:<7} {r['kept']:>4}/{r['tokens']:<4} {r['max_abs_diff']:11.2e} "
            f"{r['scale']:12.3e} {r['rows_identical']:>5}/{r['rows']:<5} {r['overlap']:8.3f}"
        )
    bad = [f"{r['case']}/{r['method']}" for r in rows if not r["ok"]]
    print("\nall agree" if not bad else f"\ndiffer: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
