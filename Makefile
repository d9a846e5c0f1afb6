# The two commands of the README: `make run` (the main job) and `make test` (the test suite). Both install from
# the committed lock (requirements-lock.txt, resolved by pip-tools for CPython 3.11 on Linux with the CPU torch
# wheel), so every day's fresh machine gets the same versions; pyproject.toml keeps the loose ranges for library
# users. `make lock` adds new dependencies to the lock, `make lock UPGRADE=1` moves every pin to the newest release
# the ranges allow (on purpose, never by accident); `make test-latest` runs the suite against those newest releases
# in a separate environment, to see drift before a refresh (it is not part of CI).
.PHONY: run test test-latest lock

LOCK := requirements-lock.txt

# `make test` runs the suite on two processes (pytest-xdist, a module's tests kept together), then, alone, the tests
# that cannot share the machine (marked serial in tests/conftest.py: they time the host or read its load).
# Both passes run; the target fails if either does.
PYTEST = python -m pytest -q -n 2 --dist loadgroup -m "not serial"; parallel=$$?; \
	python -m pytest -q -m serial && exit $$parallel

# `make run` replaces its own run in runs/tiny each time (--overwrite); `k3 train` alone refuses a used directory.
run:
	pip install -c $(LOCK) torch==2.13.0 -e .
	k3 train --overwrite
	k3 generate --model runs/tiny/model --prompt "ROMEO:"

test:
	sh scripts/install-system-deps.sh
	pip install -c $(LOCK) torch==2.13.0 -e '.[dev]'
	$(PYTEST)

test-latest:
	python -m venv .venv-latest
	.venv-latest/bin/pip install --upgrade --upgrade-strategy eager torch==2.13.0 -e '.[dev]'
	. .venv-latest/bin/activate && $(PYTEST)

lock:
	pip install pip-tools
	pip-compile $(if $(UPGRADE),--upgrade) --extra dev --extra serve --strip-extras --no-emit-index-url \
		--no-emit-find-links --output-file $(LOCK) pyproject.toml
	# the CPU wheel's local label (+cpu) would tie the lock to that wheel: the README's commands ask for torch==2.13.0
	sed -i 's/^torch==\([0-9.]*\)+[a-z0-9]*$$/torch==\1/' $(LOCK)
