"""Profiles: list saved runs, upload CSVs, compare several with the same charts, save, and download
any of them as CSV, Parquet or an HTML report."""

from __future__ import annotations

import streamlit as st

from app import exports, panels, profile_folder, shelf, state, streams
from app.keys import Keys, kept
from app.plain import md
from cachelib.profile import list_profiles
from cachelib.sweep import load_index

st.title("Profiles")
st.caption(f"Profiles in {md(profile_folder.profiles_dir())} (and its sweep folders), or uploaded CSV files.")


def downloads(name: str, source, views: dict, key: str) -> None:
    """Download buttons for one profile: CSV, Parquet, and the HTML report of ``views``. Each
    file is made when its button is pressed (a Parquet file or a report takes seconds)."""
    a, b, c = st.columns(3)
    for col, fmt in ((a, "csv"), (b, "parquet")):
        col.download_button(
            f"Download {'CSV' if fmt == 'csv' else 'Parquet'}",
            data=lambda fmt=fmt: exports.export_bytes(source, fmt, name),
            file_name=f"{name.replace('/', '-')}.{fmt}",
            mime=exports.EXPORT_FORMATS[fmt],
            key=f"{key}_{fmt}",
            width="stretch",
        )
    c.download_button(
        "HTML report",
        data=lambda: exports.report_bytes(views),
        file_name=f"{name.replace('/', '-')}-report.html",
        mime="text/html",
        key=f"{key}_report",
        width="stretch",
        help="the summary table and the figures in one file that opens offline (plotly.js inlined)",
    )


# --- the current run ---------------------------------------------------------------------------

if (cur := state.current()) is not None:
    profile, view = cur
    st.subheader("Current run")
    st.markdown(panels.describe(view))
    panels.status(view)
    path = profile.path
    left, right = st.columns([3, 2], vertical_alignment="bottom")
    with left:
        if path:
            downloads(view.name, path, {view.name: view}, Keys.DOWNLOAD_CURRENT)
    with right:
        with st.form("save_as", border=False):
            a, b = st.columns([3, 1], vertical_alignment="bottom")
            new_name = a.text_input("Save as", **kept(Keys.SAVE_NAME), placeholder="a name, e.g. smollm2-ring-vs-4bit")
            if b.form_submit_button("Save"):
                try:
                    saved = profile_folder.save_as(profile, new_name)
                except ValueError as e:
                    st.error(md(e))
                else:
                    st.success(f"saved as {md(saved)}")

# --- saved and uploaded profiles ---------------------------------------------------------------

st.subheader("Saved profiles")
files = list_profiles(profile_folder.profiles_dir())
by_name = {f.name: f for f in files}
if files:
    st.dataframe(profile_folder.listing(files), hide_index=True, width="stretch")
    for folder in sorted({f.folder for f in files if f.folder}):
        if (profile_folder.profiles_dir() / folder / "index.csv").exists():
            with st.expander(f"Sweep {md(folder)}: every grid point, with or without a profile"):
                try:
                    index = load_index(profile_folder.profiles_dir() / folder)
                except ValueError as e:
                    st.error(md(e))
                else:
                    st.dataframe(index.drop(columns=["path"]), hide_index=True, width="stretch")
else:
    st.caption("No profiles saved yet.")

uploads = st.file_uploader("Upload profile CSVs", type=["csv"], accept_multiple_files=True, key=Keys.UPLOAD)
uploaded: dict = st.session_state.setdefault(Keys.UPLOADED, {})  # "upload: NAME" -> (file id, RunView, bytes)
fresh = []
for upload in uploads or []:
    label = f"upload: {upload.name}"
    if label in uploaded and uploaded[label][0] == upload.file_id:
        continue  # parsed already: keep the same view (and the figures drawn from it)
    try:
        view = profile_folder.view_of_upload(upload.getvalue(), upload.name)
    except ValueError as e:  # not a profile, another schema version: one line; the page goes on
        st.error(md(e))
        continue
    if label not in uploaded:
        fresh.append(label)
    uploaded[label] = (upload.file_id, view, upload.getvalue())

# Widget state is dropped on other pages: restore the selection from a plain key.
options = [*by_name, *uploaded]
if Keys.COMPARE not in st.session_state:
    st.session_state[Keys.COMPARE] = [n for n in st.session_state.get(Keys.COMPARE_KEPT, []) if n in options]
st.session_state[Keys.COMPARE] = [n for n in st.session_state[Keys.COMPARE] if n in options] + fresh
chosen = st.multiselect("Compare", options, **kept(Keys.COMPARE), placeholder="choose profiles to load")
st.session_state[Keys.COMPARE_KEPT] = chosen

views, sources = {}, {}
for name in chosen:
    if name in uploaded:
        label = name.removeprefix("upload: ").removesuffix(".csv")
        views[label], sources[label] = uploaded[name][1], uploaded[name][2]
        continue
    try:
        views[by_name[name].label] = profile_folder.view_of_file(by_name[name])
        sources[by_name[name].label] = by_name[name].path
    except ValueError as e:  # a malformed profile: one line naming the file, line and column; the page goes on
        st.error(md(e))
    except OSError as e:
        st.error(md(f"{name}: cannot read the file ({e.strerror})"))
st.session_state[Keys.LOADED] = views

if views:
    st.subheader("Comparison" if len(views) > 1 else next(iter(views)))
    for i, (name, v) in enumerate(views.items()):
        st.markdown(panels.describe(v))
        downloads(name, sources[name], {name: v}, f"download_{i}")
    if len(views) > 1:
        st.download_button(
            "HTML report of the comparison",
            data=lambda: exports.report_bytes(views),
            file_name="comparison-report.html",
            mime="text/html",
            key=Keys.DOWNLOAD_REPORT,
            help="every loaded profile's summary and the figures in one file that opens offline",
        )
    panels.charts_grid(state.combined(views), key="compare")
    for name, v in views.items():
        with st.expander(f"Generated text · {md(name)}"):
            streams.generated_text(v, shelf.decoder_of(v.meta))
