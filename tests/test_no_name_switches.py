"""No code outside the strategy table switches on a strategy's name: every fact about a strategy
is a fact of its entry in ``cachelib/strategies.py`` (docs/adding-a-strategy.md), so a strategy added to
the table alone is one that the rest of cachelib already handles.

Every .py file of cachelib/ and app/ except cachelib/strategies.py is read with ``ast``; a comparison
(``==``, ``!=``, ``in``, ``not in``, a ``match`` case) of an expression with a string constant, or
a tuple/list/set of them, that is a registered strategy name fails, unless the expression is one
of :data:`OTHER_VOCABULARIES`: words that other vocabularies share with strategy names. The KV
formats (fp8, q8_0, q4_0: strategies too) are asked of their own table, ``cachelib.core.formats``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from cachelib.spec import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("cachelib", "app")
TABLE = Path("cachelib/strategies.py")

# (words of the compared expression, its constants that are another vocabulary's, why)
OTHER_VOCABULARIES = [
    (
        {"layer_kinds", "kinds", "stage_kinds", "layer_type", "counts"},
        {"sliding"},
        "a layer's attention type (full / sliding / recurrent), not the sliding strategy",
    ),
    ({"weights_dtype", "quant_method"}, {"fp8"}, "a checkpoint's weight format"),
    ({"weights"}, {"quantized"}, "how a model's weights load (auto / full / quantized)"),
]


def _strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` is: one, or the elements of a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e) if isinstance(e, ast.Constant)]
    return []


def _words(node: ast.AST | None) -> set[str]:
    """The names, attributes and string keys an expression is made of (``arch.layer_kinds`` ->
    {arch, layer_kinds})."""
    out: set[str] = set()
    for sub in ast.walk(node) if node is not None else ():
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.add(sub.value)
    return out


def _other_vocabulary(subject: ast.AST | None, names: set[str]) -> bool:
    words = _words(subject)
    return any(words & subjects and names <= constants for subjects, constants, _ in OTHER_VOCABULARIES)


def name_switches(source: str, where: str, names: set[str]) -> list[str]:
    """Every comparison of ``source`` with a strategy name among ``names``, as ``where:line: code``."""
    found = []
    tree = ast.parse(source, where)
    subjects = {id(case): node.subject for node in ast.walk(tree) if isinstance(node, ast.Match) for case in node.cases}
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST | None, ast.AST]] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            pairs = [(a, b) for a, b in zip(operands, operands[1:])] + [(b, a) for a, b in zip(operands, operands[1:])]
        elif isinstance(node, ast.match_case):
            values = [p.value for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue)]
            pairs = [(subjects.get(id(node)), v) for v in values]
        for subject, constant in pairs:
            hit = {s for s in _strings(constant) if s in names}
            if hit and not _other_vocabulary(subject, hit):
                line = getattr(node, "lineno", getattr(getattr(node, "pattern", None), "lineno", 0))
                found.append(f"{where}:{line}: {ast.unparse(node).splitlines()[0][:100]}")
                break
    return found


def scanned_files() -> list[Path]:
    return [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py")) if p.relative_to(ROOT) != TABLE]


def test_no_code_outside_the_table_compares_a_strategy_name():
    names = set(STRATEGIES)
    found = [
        hit
        for p in scanned_files()
        for hit in name_switches(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)), names)
    ]
    assert not found, "strategy names compared outside cachelib/strategies.py (ask the table instead):\n" + "\n".join(
        found
    )


def test_the_scan_sees_every_form_of_a_name_switch():
    names = set(STRATEGIES)
    planted = {
        "spec.name == 'pyramidkv'": 1,
        "'standard' != name": 1,
        "method in ('tova', 'h2o')": 1,
        "kind not in ['knorm', 'other']": 1,
        "kind in {'snapkv'}": 1,
        "a < b == 'static'": 1,
        "match spec.name:\n    case 'rotating':\n        pass\n    case 'x' | 'kivi':\n        pass": 2,
        "weights == 'standard'": 1,  # another vocabulary's subject, but a word it does not have
        "layer_kinds == 'rotating'": 1,
        # not strategy names, or another vocabulary's own word
        "name == 'nope'": 0,
        "spec.name == other_name": 0,
        "'sliding' in arch.layer_kinds": 0,
        "kv_format in ('q8_0', 'q4_0')": 1,  # a KV format is asked of its table (cachelib.core.formats)
        "x = 'standard'": 0,
        "f('standard')": 0,
    }
    for code, count in planted.items():
        assert len(name_switches(code, "planted.py", names)) == count, code
    # a planted switch in a real module is found, at its line
    source = (ROOT / "cachelib/plan/quality.py").read_text(encoding="utf-8")
    lines = len(source.splitlines())
    hits = name_switches(source + "\nif spec.name == 'pyramidkv':\n    pass\n", "quality.py", names)
    assert hits == [f"quality.py:{lines + 2}: spec.name == 'pyramidkv'"]
