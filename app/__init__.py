"""The Streamlit app: pages (``app/pages``), figure builders (``charts``), shaped data (``data``),
session state and the live run (``state``), form widgets (``widgets``), shared sections (``panels``)."""
