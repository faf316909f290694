"""The planner's llama.cpp KV bytes against llama.cpp's own log line (issue 28, item 2).

llama.cpp itself, built from source by ``bash scripts/llamacpp_env.sh`` (build b10605, CPU only,
under ``.llamacpp/``), creates a context for each case of a grid and logs what it allocated::

    llama_kv_cache: size = 90.00 MiB (  8192 cells,  30 layers,  1/1 seqs), K (f16): 45.00 MiB, V (f16): ...

(one line per cache: an iSWA model logs its full-attention cache, then its SWA cache). The
planner sizes the same deployment (``Deployment.make("llama.cpp", max_model_len=n_ctx, ...)``)
and each line is compared at the log's own precision (MiB with two decimals, from a float32, as
``llama_kv_cache``'s constructor prints it), cells x streams and layers exactly.

Models: the bundled SmolLM2-135M GGUF (llama, 30 full layers) and a tiny random-weights Gemma-2
GGUF written here with the ``gguf`` package (6 layers, 4 KV heads of 256 as Gemma-2-2B has,
sliding window 128: llama.cpp's gemma2 pattern makes layers 0, 2 and 4 SWA), whose Hugging Face
config the planner reads.

Grid: n_ctx x ``-ctk/-ctv`` (f16, q8_0, q4_0) x ``--parallel`` (1; 4 per-slot; 4 unified) x
``--swa-full`` (Gemma-2) x ``-fa`` (auto; off, where llama.cpp refuses a quantized V cache and
the planner refuses it too).

    python bench/bench_llama_cpp.py            # the whole grid, one line per cache
    python bench/bench_llama_cpp.py --quick    # the test's subset
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's cachelib, not an installed one
    sys.path.insert(0, str(ROOT))
TOOL = ROOT / ".llamacpp" / "bin" / "llamacpp-kv"
BUILD = "b10605"

# llama-kv-cache.cpp (b10605):
# "%s: size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB"
LOG_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\), "
    r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)

# the tiny Gemma-2: its Hugging Face config (what the planner reads) and the GGUF written from it
TINY_GEMMA2 = {
    "model_type": "gemma2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "vocab_size": 49152,
}


@dataclass(frozen=True)
class Case:
    model: str  # "smollm2" | "gemma2-tiny"
    n_ctx: int
    kv: str  # -ctk and -ctv
    slots: int = 1
    unified: bool = False
    swa_full: bool = False
    fa: str = "auto"
    ubatch: int = 512

    def flags(self) -> str:
        text = f"-c {self.n_ctx} -ctk {self.kv} -ctv {self.kv} -np {self.slots}"
        text += " --kv-unified" * self.unified + " --swa-full" * self.swa_full
        return text + f" -fa {self.fa}" + (f" -ub {self.ubatch}" if self.ubatch != 512 else "")


@dataclass(frozen=True)
class KvLine:
    """One ``llama_kv_cache: size = ...`` line."""

    size_mib: str
    cells: int
    layers: int
    seqs: int
    streams: int
    k_mib: str
    v_mib: str


def available() -> bool:
    return TOOL.exists()


def bundled_gguf() -> Path:
    from cachelib.models.gguf import bundled_path

    return bundled_path()


def write_tiny_gemma2(path: Path, seed: int = 0) -> Path:
    """A Gemma-2 GGUF with random weights and TINY_GEMMA2's shapes, the bundled model's tokenizer."""
    import gguf

    c = TINY_GEMMA2
    src = gguf.GGUFReader(str(bundled_gguf()))

    def field(key):
        return src.fields[key].contents()

    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_name("tiny-random-gemma2")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_sliding_window(c["sliding_window"])
    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(field("tokenizer.ggml.tokens"))
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    rng = np.random.default_rng(seed)
    d, hd, ff = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def t(name: str, *shape: int) -> None:  # numpy shape = ggml's ne reversed
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    t("token_embd.weight", c["vocab_size"], d)
    t("output_norm.weight", d)
    for i in range(c["num_hidden_layers"]):
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t(f"blk.{i}.{name}.weight", d)
        t(f"blk.{i}.attn_q.weight", q, d)
        t(f"blk.{i}.attn_k.weight", kv, d)
        t(f"blk.{i}.attn_v.weight", kv, d)
        t(f"blk.{i}.attn_output.weight", d, q)
        t(f"blk.{i}.ffn_gate.weight", ff, d)
        t(f"blk.{i}.ffn_up.weight", ff, d)
        t(f"blk.{i}.ffn_down.weight", d, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_path(model: str, workdir: Path) -> Path:
    if model == "smollm2":
        return bundled_gguf()
    path = workdir / "tiny-gemma2.gguf"
    return path if path.exists() else write_tiny_gemma2(path)


def run_llama_cpp(case: Case, workdir: Path) -> tuple[list[KvLine], str]:
    """llama.cpp's KV lines for ``case`` (empty when it refused the context) and its log."""
    args = [
        str(TOOL),
        str(model_path(case.model, workdir)),
        str(case.n_ctx),
        case.kv,
        case.kv,
        str(case.slots),
        case.fa,
        str(int(case.swa_full)),
        str(int(case.unified)),
        str(case.ubatch),
        "2048",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    lines = [KvLine(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[7], m[9]) for m in LOG_LINE.finditer(log)]
    if out.returncode != 0 and lines:
        raise RuntimeError(f"llama.cpp failed after logging its KV cache:\n{log[-2000:]}")
    return lines, log


def planner_arch(model: str):
    from cachelib.plan import arch_from_config, preset

    return preset("smollm2") if model == "smollm2" else arch_from_config(dict(TINY_GEMMA2))


def mib(n: int) -> str:
    """Bytes as llama_kv_cache prints them: a float32 quotient, two decimals."""
    return f"{float(np.float32(n) / np.float32(1024 * 1024)):.2f}"


def planner_lines(case: Case) -> list[KvLine]:
    """The planner's caches for ``case`` as llama.cpp's log lines would state them (full
    layers first, then SWA layers); ValueError where the planner refuses the deployment."""
    from cachelib.core.rules import KV_FORMATS, format_bytes
    from cachelib.plan import Deployment, account
    from cachelib.plan.runtimes import device_arch

    arch = planner_arch(case.model)
    d = Deployment.make(
        "llama.cpp",
        max_model_len=case.n_ctx,
        kv_format=None if case.kv == "f16" else case.kv,
        slots=case.slots,
        kv_unified=case.unified,
        swa_full=case.swa_full,
        flash_attn=case.fa,
        ubatch=case.ubatch,
    )
    acc = account(arch, "standard", context=1, deployment=d)
    dev = device_arch(arch, d)
    streams = 1 if case.unified else case.slots

    def row(dim: int) -> int:  # one K (or V) row of one cell, as -ctk/-ctv stores it
        n = dev.kv_heads * dim
        return n * 2 if case.kv == "f16" else format_bytes(n, case.kv)

    assert case.kv == "f16" or case.kv in KV_FORMATS
    out = []
    for kind in ("full", "sliding"):
        layers = [a for a in acc.layers if a.layer_type == kind]
        if not layers:
            continue
        cells = {a.capacity for a in layers}
        assert len(cells) == 1, cells
        total = sum(a.bytes_allocated for a in layers)
        cap = cells.pop()
        k, v = cap * len(layers) * row(dev.key_dim), cap * len(layers) * row(dev.value_dim)
        assert k + v == total, (k, v, total)  # the planner's bytes are the K and V rows, nothing else
        out.append(KvLine(mib(total), cap // streams, len(layers), case.slots, streams, mib(k), mib(v)))
    return out


def grid(quick: bool = False) -> list[Case]:
    kvs = ("f16", "q8_0", "q4_0")
    slot_sets = ((1, False), (4, False), (4, True))
    cases = []
    for n_ctx in (1000, 8192) if quick else (300, 1000, 4096, 8192):
        for kv in kvs:
            for slots, unified in slot_sets:
                cases.append(Case("smollm2", n_ctx, kv, slots, unified))
    for n_ctx in (1000, 4096) if quick else (300, 1000, 4096, 8192):
        for kv in kvs:
            for slots, unified in slot_sets:
                for swa_full in (False, True):
                    cases.append(Case("gemma2-tiny", n_ctx, kv, slots, unified, swa_full))
    cases += [
        Case("gemma2-tiny", 4096, "q8_0", 4, True, fa="off"),
        Case("smollm2", 4096, "f16", 2, fa="off"),
        Case("gemma2-tiny", 2048, "f16", 4, True, ubatch=256),
    ]
    if quick:  # the test keeps one of each kind of case
        keep = [c for c in cases if c.model == "smollm2" and c.n_ctx == 1000 and c.kv == "f16"]
        keep += [
            Case("smollm2", 8192, "q8_0", 1),
            Case("gemma2-tiny", 4096, "q4_0", 4, True),
            Case("gemma2-tiny", 1000, "q4_0", 4),
            Case("gemma2-tiny", 1000, "f16", 1, swa_full=True),
        ]
        keep += [c for c in cases if c.fa == "off" or c.ubatch != 512]
        cases = keep
    return cases


def compare(case: Case, workdir: Path) -> dict:
    """One case: llama.cpp's lines, the planner's, and whether both refused or both agree."""
    llama, log = run_llama_cpp(case, workdir)
    try:
        planned, refusal = planner_lines(case), None
    except ValueError as e:
        planned, refusal = [], str(e)
    llama_refused = not llama
    if llama_refused and "requires" not in log and "refus" not in log:
        raise RuntimeError(f"llama.cpp made no KV cache for {case.flags()}:\n{log[-2000:]}")
    return {
        "case": case,
        "llama": llama,
        "planned": planned,
        "refusal": refusal,
        "equal": llama == planned and (refusal is None) == (not llama_refused),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test's subset of the grid")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".llamacpp" / "models")
    args = parser.parse_args(argv)
    if not available():
        print(f"no llama.cpp build at {TOOL}: run `bash scripts/llamacpp_env.sh`", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = [compare(c, args.workdir) for c in grid(args.quick)]
    print(f"llama.cpp {BUILD} (CPU) vs the planner; MiB as llama_kv_cache logs them")
    print(f"{'model':<12} {'flags':<58} {'llama.cpp size / cells / layers':<34} {'planner':<34} equal")
    for r in rows:
        c = r["case"]
        for i in range(max(len(r["llama"]), len(r["planned"]), 1)):
            ll = r["llama"][i] if i < len(r["llama"]) else None
            pl = r["planned"][i] if i < len(r["planned"]) else None
            lt = f"{ll.size_mib} / {ll.cells}x{ll.streams} / {ll.layers}" if ll else "refused"
            pt = f"{pl.size_mib} / {pl.cells}x{pl.streams} / {pl.layers}" if pl else "refused"
            print(f"{c.model:<12} {c.flags() if i == 0 else '':<58} {lt:<34} {pt:<34} {'yes' if r['equal'] else 'NO'}")
    bad = [r for r in rows if not r["equal"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
