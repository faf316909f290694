"""Entry point of the app (``streamlit run app/main.py``): page set-up and routes, nothing else."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `streamlit run` puts app/ on the path, not the repository
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

st.set_page_config(page_title="cachelib", page_icon=":material/memory:", layout="wide")

PAGES = [
    st.Page("views/live.py", title="Live comparison", icon=":material/monitoring:", default=True),
    st.Page("views/inspector.py", title="Inspector", icon=":material/search:"),
    st.Page("views/profiles.py", title="Profiles", icon=":material/folder_open:"),
    st.Page("views/planner.py", title="Planner", icon=":material/calculate:"),
]
st.navigation(PAGES).run()
