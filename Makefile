# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
.PHONY: run test

run:
	pip install torch==2.13.0 -e .
	k3 train
	k3 generate --model runs/tiny/model --prompt "ROMEO:"

test:
	sh scripts/install-system-deps.sh
	pip install torch==2.13.0 -e '.[dev]'
	python -m pytest -q
