"""Seeded fuzzing of the loaders (issue 33): mutated files get a ValueError, never another
exception and never a crash. Prompt caches below; profile CSVs (``read_meta`` and ``load_profile``)
at the end.

Valid prompt caches of several classes are written, then mutated ~1,000 ways (flipped bytes in
the header and in the data, truncations, extensions, header JSON edits: shapes, dtypes, offsets,
class names, leaf kinds, tensor names). A child process loads every mutant and reports what
each raised; a segmentation fault in a native loader ends the child, not pytest, and fails the
test with the mutant that did it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = 1000

CHILD = textwrap.dedent(
    r"""
    import json, random, struct, sys
    from pathlib import Path

    import mlx.core as mx

    import cachelib.mlx as ours
    from cachelib.mlx import load_prompt_cache, save_prompt_cache

    folder, seed, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)

    def filled(cache, tokens=5, heads=2, dim=8):
        k = mx.arange(tokens * heads * dim, dtype=mx.float32).reshape(1, heads, tokens, dim) / 100
        cache.update_and_fetch(k, k + 1)
        return cache

    seeds = {
        "kv": [filled(ours.KVCache()), filled(ours.KVCache())],
        "rotating": [filled(ours.RotatingKVCache(max_size=4, keep=1))],
        "quantized": [filled(ours.QuantizedKVCache(group_size=32, bits=4), dim=32)],
        "chunked": [filled(ours.ChunkedKVCache(8))],
        "concat": [filled(ours.ConcatenateKVCache())],
    }
    b = ours.BatchKVCache([1, 0])  # two batch rows, one left_padding entry each
    k = mx.zeros((2, 2, 3, 8))
    b.update_and_fetch(k, k)
    seeds["batch"] = [b]
    originals = {}
    for name, cache in seeds.items():
        path = folder / f"{name}.safetensors"
        save_prompt_cache(path, cache, {"model": "fuzz"})
        load_prompt_cache(path)  # each seed loads as written
        originals[name] = path.read_bytes()

    def split(data):
        n = struct.unpack("<Q", data[:8])[0]
        return json.loads(data[8:8 + n]), data[8 + n:]

    def join(header, body):
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + body

    def edit_header(data):
        header, body = split(data)
        names = [k for k in header if k != "__metadata__"]
        meta = header.get("__metadata__", {})
        choice = rng.randrange(9)
        name = rng.choice(names)
        entry = header[name]
        if choice == 0:
            entry["shape"] = [rng.choice([0, 1, 2, 3, 7, 2**31, -1]) for _ in range(rng.randrange(0, 6))]
        elif choice == 1:
            entry["dtype"] = rng.choice(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "C64", 5, None])
        elif choice == 2:
            a, b = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[b, a], [a, b + 4], [a - 4, b - 4], [0, 2**62], [a], "x"])
        elif choice == 3:
            header[rng.choice(["0", "0.9", "9.0", "0.0.0.0.0.0.0.0.0.0", "0.99999999", "x.y", "0.01"])] = entry
            del header[name]
        elif choice == 4 and meta:
            key = rng.choice(list(meta))
            meta[key] = rng.choice(["KVCache", "RotatingKVCache", "QuantizedKVCache", "BatchKVCache", "CacheList",
                                    "Nope", "scalar", "string", "none", "", "0.0", "9.9", str(2**40)])
        elif choice == 5 and meta:
            key = rng.choice(["1.7", "2.99.0", "2.1.5", "3", "1.x", "2.1.1"])
            meta[key] = rng.choice(["string", "scalar", "KVCache"])
        elif choice == 6:
            entry["shape"] = entry["shape"][::-1] or [1]
        elif choice == 7:
            header["__metadata__"] = rng.choice([{}, [], "x", {"1.0": 5}, None])
        else:
            del header[name]
        return join(header, body)

    def edit_bytes(data):
        data = bytearray(data)
        if len(data) < 16:  # what is left of a cut-short mutant: grow it back with noise
            data += bytes(rng.randrange(256) for _ in range(16))
        how = rng.randrange(5)
        if how == 0:  # flip bytes anywhere
            for _ in range(rng.randrange(1, 8)):
                i = rng.randrange(len(data))
                data[i] = rng.randrange(256)
        elif how == 1:  # cut it short
            del data[rng.randrange(len(data)):]
        elif how == 2:  # the header size says something else
            struct.pack_into("<Q", data, 0, rng.choice([0, 1, 7, len(data), len(data) - 7, 2**63, 2**64 - 1]))
        elif how == 3:  # flip bytes inside the header text
            n = min(struct.unpack("<Q", bytes(data[:8]))[0], len(data) - 8)
            for _ in range(rng.randrange(1, 4)):
                data[8 + rng.randrange(max(1, n))] = rng.choice(b'{}[]",:0123456789-ex\x00\xff')
        else:  # bytes added at the end, or leaf values replaced
            data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        return bytes(data)

    def string_leaf(data):  # a leaf of another kind than the file says: 2^40, inf, 2-D
        header, body = split(data)
        meta = header["__metadata__"]
        kinds = [k for k in meta if k.startswith("2.") and k.endswith(".1")]
        if kinds:
            meta[rng.choice(kinds)] = rng.choice(["string", "scalar", "none"])
        return join(header, body)

    found = {}
    for i in range(count):
        base = rng.choice(sorted(originals))
        data = originals[base]
        for _ in range(rng.randrange(1, 3)):
            mutate = rng.choice([edit_header, edit_header, edit_bytes, edit_bytes, string_leaf])
            try:
                data = mutate(data)
            except Exception:  # a mutation of a mutant whose header no longer parses: bytes only
                data = edit_bytes(data)
        path = folder / rng.choice(["m.safetensors", "m.gguf", "m.npz", "m.npy", "m"])
        path.write_bytes(data)
        print(json.dumps({"i": i, "base": base, "file": path.name}), flush=True)  # the last line names a crash
        try:
            load_prompt_cache(path)
            outcome = "loaded"
        except ValueError as e:
            outcome = "ValueError" if path.name in str(e) else "ValueError without the file's name: " + str(e)[:200]
        except BaseException as e:  # noqa: BLE001 - what the test is looking for
            outcome = f"{type(e).__name__}: {str(e)[:200]}"
        key = outcome if outcome in ("loaded", "ValueError") else "other"
        found[key] = found.get(key, 0) + 1
        if key == "other":
            print(json.dumps({"bad": outcome, "i": i, "base": base}), flush=True)
    print(json.dumps({"summary": found}), flush=True)
    """
)


def test_1000_mutated_prompt_cache_files_get_only_value_errors(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), "33", str(MUTANTS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0:  # a crash: the last mutant announced did it
        last = next((line for line in reversed(lines) if "i" in line and "file" in line), None)
        pytest.fail(f"the loader process ended with {run.returncode} at mutant {last}: {run.stderr[-2000:]}")
    bad = [line for line in lines if "bad" in line]
    summary = lines[-1]["summary"]
    assert not bad, bad[:10]
    assert sum(summary.values()) == MUTANTS
    assert summary.get("ValueError", 0) > MUTANTS // 2, summary  # most mutants are refused, each naming the file


# --- profiles: 1,000 mutated CSVs to load_profile ------------------------------------------------------

PROFILE_SEED = ROOT / "profiles" / "examples" / "smollm2-mlx-256t.csv"
CELLS = [
    "",
    "nan",
    "inf",
    "-inf",
    "1e400",
    "-1",
    "2",
    "0.5",
    "99999999999999999999999",
    "x",
    "=cmd|' /C calc'!A0",
    "\x00",
    "True",
    "'",
    '"',
    "[]",
    '["a"]',
    "{}",
    "complete",
    "running",
    "é",
    "1" * 300,
    "-0",
    "+3",
]


def _small_profile() -> bytes:
    """The example profile cut to its metadata and its first two steps and layers (a valid profile of ~130 rows)."""
    import pandas as pd

    full = pd.read_csv(PROFILE_SEED, dtype=str, keep_default_na=False)
    step, layer = (pd.to_numeric(full[c], errors="coerce") for c in ("step", "layer"))
    return full[(full["table"] == "meta") | ((step < 2) & (layer.isna() | (layer < 2)))].to_csv(index=False).encode()


def _mutant(rng, data: bytes) -> bytes:
    import csv
    import io

    how = rng.randrange(9)
    if how == 0:  # flip bytes anywhere
        raw = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    if how == 1:  # cut short
        return data[: rng.randrange(len(data))]
    rows = list(csv.reader(io.StringIO(data.decode("utf-8", errors="replace"), newline="")))
    if not rows:
        return data
    header, body = rows[0], rows[1:] or [[]]
    if how == 2:  # one cell replaced, in any row (the header included)
        row = rng.choice(rows)
        if row:
            row[rng.randrange(len(row))] = rng.choice(CELLS)
    elif how == 3:  # a column dropped, everywhere
        k = rng.randrange(len(header))
        rows = [r[:k] + r[k + 1 :] for r in rows]
    elif how == 4:  # a row dropped, repeated, or its table renamed
        i = rng.randrange(len(body))
        choice = rng.randrange(3)
        if choice == 0:
            del body[i]
        elif choice == 1:
            body.insert(i, list(body[i]))
        elif body[i]:
            body[i][0] = rng.choice(["meta", "steps", "layers", "slots", "masks", "bogus", ""])
        rows = [header] + body
    elif how == 5:  # a metadata value replaced
        metas = [r for r in body if r and r[0] == "meta"]
        if metas:
            r = rng.choice(metas)
            r[-1 if len(r) < 3 else header.index("value") if "value" in header else -1] = rng.choice(
                CELLS + ['["standard", "standard"]', "2", "99", "incomplete", '{"memory": "x"}']
            )
    elif how == 6:  # a row of another length
        r = rng.choice(body)
        if rng.randrange(2) and r:
            del r[rng.randrange(len(r)) :]
        else:
            r.extend(rng.choice(CELLS) for _ in range(rng.randrange(1, 4)))
    elif how == 7:  # a number column's cells all replaced
        k = rng.randrange(len(header))
        value = rng.choice(CELLS)
        for r in body:
            if len(r) > k and r[k] != "":
                r[k] = value
    else:  # the header shuffled or renamed
        if rng.randrange(2):
            rng.shuffle(header)
        else:
            header[rng.randrange(len(header))] = rng.choice(["table", "bogus", "step", ""])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue().encode("utf-8", errors="replace")


@pytest.mark.slow  # ~45 s: load_profile's fixed cost per file (~20 ms of column checks) x 2 readers x 1,000
def test_1000_mutated_profile_csvs_get_only_value_errors(tmp_path):
    import random

    from cachelib.profile import load_profile, read_meta

    seed = _small_profile()
    assert load_profile(seed).complete  # the seed itself loads
    rng = random.Random(33)
    found: dict[str, int] = {}
    bad = []
    for i in range(MUTANTS):
        data = seed
        for _ in range(rng.randrange(1, 3)):
            data = _mutant(rng, data)
        path = tmp_path / "m.csv"
        path.write_bytes(data)
        for load in (read_meta, load_profile):
            try:
                load(path)
                outcome = "loaded"
            except ValueError as e:
                outcome = "ValueError" if "m.csv" in str(e) else f"ValueError without the file's name: {e}"[:300]
            except Exception as e:  # noqa: BLE001 - what the test is looking for
                outcome = f"{type(e).__name__}: {e}"[:300]
            if outcome not in ("loaded", "ValueError"):
                bad.append((i, load.__name__, outcome))
            found[outcome if outcome in ("loaded", "ValueError") else "other"] = found.get(outcome, 0) + 1
    assert not bad, bad[:10]
    assert found.get("ValueError", 0) > MUTANTS // 2, found
