"""The Streamlit app: pages (``app/views``), figure builders (``charts``, ``plan_charts``), shaped
data (``data``), session state and the live run (``state``), form widgets (``widgets``), shared
sections (``panels``). The pages are not in ``pages/``: Streamlit would serve a folder of that name
on its own too, so a page's URL opened directly would run without ``main.py``."""
