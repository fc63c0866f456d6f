# Thin wrappers. `make demo` and `make test` work on a fresh machine (they set up first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The glyph set's fonts (imgret/training/data/glyphs.py FACES): about 44 MB of .debs.
GLYPH_FONTS := fonts-ipaexfont-gothic fonts-ipaexfont-mincho fonts-arphic-ukai \
  fonts-arphic-uming fonts-motoya-l-maruberi fonts-seto fonts-kiloji fonts-wqy-microhei
DEBS := dataset-fashion-mnist chromium chromium-driver $(GLYPH_FONTS)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-deps postgres demo test test-fast lint bench clean

setup: $(VENV)/.installed

# Re-installs only when pyproject.toml changes; pip's cache keeps the large torch wheels.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[dev,postgres,ray,pretrained,milvus]'
	touch $@

system-deps:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; \
	fi

postgres:
	@pg_isready -q -h 127.0.0.1 -p 5432 || { \
	  $(SUDO) pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start; \
	  for i in $$(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done; }

demo: setup system-deps
	$(BIN)/imgret demo

# pytest exits 5 when it collects no test; make treats that as a failure, as CI must.
# Pytest workers (xdist): one per core, each test file on one worker (its module fixtures,
# servers among them, are built once). The integration tests mostly wait on servers and
# subprocesses: serially the suite takes about 18 minutes.
# Plain `pytest PATH` stays serial, for debugging.
test: setup system-deps postgres
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n auto --dist loadfile

# The inner loop: unit and API tests on SQLite only (no PostgreSQL, no live servers, no
# browser); `make test` runs everything, as CI does.
test-fast: setup
	$(BIN)/python -m pytest tests/unit tests/api -m "not postgres and not slow" -n auto --dist loadfile

lint: setup
	$(BIN)/ruff check .

# wrk drives benchmarks/load_bench.py (service_bench.py falls back to httpx without it).
bench: setup
	@dpkg -s wrk >/dev/null 2>&1 || { $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q wrk; }
	$(BIN)/python benchmarks/metrics_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
