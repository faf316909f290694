"""User text inside the app's markdown, shown as the text it is.

Streamlit renders ``st.markdown``, ``st.caption``, ``st.error`` and the rest as markdown, so a
prompt, a profile or folder name, or an error message quoting one could otherwise bring links,
images (fetched by the browser), emphasis or Streamlit's ``:color[...]`` directives onto the
page. :func:`md` backslash-escapes what would start any of them; the page shows the characters
themselves. Text shown with ``st.text``, ``st.code`` or in a dataframe needs none of this.
"""

from __future__ import annotations

import re

# Links and images ([ ] !), autolinks and HTML (< >), emphasis and strike (* _ ~), code (`),
# headings (#), tables (|), math ($), Streamlit directives (:name[...] needs the [) and the escape itself.
_SPECIAL = re.compile(r"([\\`*_\[\]<>#|$~!])")
_BARE_LINK = re.compile(r"(?i)(https?|ftp|mailto)(:)|(www)(\.)")  # GFM links bare URLs too
_LIST_START = re.compile(r"^(\s*)([-+=]|\d+[.)])(?=\s|$)")  # a list item or setext underline


def md(text: object) -> str:
    """``text`` escaped for markdown: it renders as exactly these characters."""
    out = _SPECIAL.sub(r"\\\1", str(text))
    out = _BARE_LINK.sub(lambda m: f"{m[1]}\\{m[2]}" if m[1] else f"{m[3]}\\{m[4]}", out)
    out = " ".join(out.splitlines())  # one paragraph: no headings, quotes or lists from later lines
    return _LIST_START.sub(lambda m: m[1] + m[2][:-1] + "\\" + m[2][-1], out)  # nor from the first
