"""The committed evaluation corpus: several long public-domain texts, each documented in
assets/corpus/README.md with the byte and token counts it really has."""

from __future__ import annotations

import re

from cachelib.models import gguf
from cachelib.profile.evaluate import CORPUS, corpus_texts


def test_the_corpus_has_several_texts_of_at_least_50k_tokens_in_all_and_the_readme_counts_are_exact():
    tok = gguf.load_tokenizer(str(gguf.bundled_path()))
    readme = (CORPUS / "README.md").read_text(encoding="utf-8")
    texts = corpus_texts()
    assert len(texts) >= 2
    total = 0
    for name, text in texts:
        tokens = tok.encode(text, add_special_tokens=False)
        total += len(tokens)
        row = re.search(rf"^\| `{re.escape(name)}\.txt` \|.*\| ([\d,]+) \| ([\d,]+) \|$", readme, re.M)
        assert row, f"{name}.txt is not in the README's table"
        assert (int(row[1].replace(",", "")), int(row[2].replace(",", ""))) == (len(text.encode("utf-8")), len(tokens))
        assert tok.decode(tokens) == text  # the tokenizer round-trips it: no odd characters
    assert total >= 50_000
    assert f"**{total:,}**" in readme
