# The two commands of the README. Each does all set-up on a fresh machine first.
.PHONY: app test setup
SHELL := /bin/bash

setup:
	@bash scripts/bootstrap.sh

app: setup
	@source scripts/env.sh && .venv/bin/python -m streamlit run app/main.py $(ARGS)

test: setup
	@source scripts/env.sh && .venv/bin/python -m pytest $(ARGS)
