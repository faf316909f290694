"""Entry point of the app (``streamlit run app/main.py``): page set-up and routes, nothing else."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `streamlit run` puts app/ on the path, not the repository
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

st.set_page_config(page_title="cachelib", page_icon=":material/memory:", layout="wide")

# Narrow windows (800 px): a narrower sidebar; columns too narrow for their widgets wrap onto the
# next line instead of cutting them (a button reading "D…", a clipped select box), and a column
# holding a chart takes the whole width, so charts stack instead of squeezing side by side.
NARROW_CSS = """
<style>
@media (max-width: 1100px) {
  section[data-testid="stSidebar"] { width: 240px !important; min-width: 240px !important; }
  [data-testid="stHorizontalBlock"] { flex-wrap: wrap; }
  [data-testid="stColumn"] { min-width: min(100%, 7.5rem); }
  [data-testid="stColumn"]:has(.stPlotlyChart) { min-width: 100%; }
}
</style>
"""
st.html(NARROW_CSS)

PAGES = [
    st.Page("views/live.py", title="Live comparison", icon=":material/monitoring:", default=True),
    st.Page("views/inspector.py", title="Inspector", icon=":material/search:"),
    st.Page("views/profiles.py", title="Profiles", icon=":material/folder_open:"),
    st.Page("views/planner.py", title="Planner", icon=":material/calculate:"),
]
st.navigation(PAGES).run()
