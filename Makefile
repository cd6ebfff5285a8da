# The two set-up commands of the README: `make demo` and `make test`.
# Everything the project needs is installed from here, on a fresh machine.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DEBIAN_PACKAGES := iptables iproute2 nghttp2-proxy tinyproxy stunnel4 openssl curl containernetworking-plugins util-linux bind9-dnsutils dnsmasq-base dnsperf buildah debootstrap iperf3 gcc libc6-dev prometheus

.PHONY: demo test lint typecheck unit fuzz debs proto clean image

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(TEST_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/ztunnel demo

# Debian packages the root-only and interop tests need. Skipped, with a message, when not root.
debs:
	@if [ "$$(id -u)" != "0" ]; then \
	  echo "make: not root: skipping the Debian packages ($(DEBIAN_PACKAGES)); root-only tests will be skipped"; \
	else \
	  missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  command -v node >/dev/null 2>&1 || missing="$$missing nodejs"; \
	  if [ -n "$$missing" ]; then \
	    echo "make: installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	fi

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(TEST_STAMP)
	$(VENV)/bin/mypy

unit: $(TEST_STAMP) debs
	$(PY) -m pytest -q -rs

test: lint typecheck unit

# The node image (Containerfile), with buildah; without registry access on a debootstrap base.
# IMAGE, BASE_IMAGE and IMAGE_CACHE (default /var/cache/ztunnel-image) are passed through.
image:
	sh deploy/build-image.sh

# The fuzz targets (tests/fuzz/, the HTTP/2 session, the h2 oracle of our HTTP/2 core) with a long budget; `make test` runs
# them bounded.
fuzz: $(TEST_STAMP)
	FUZZ_PROFILE=long FUZZ_EXAMPLES=10000 $(PY) -m pytest -q -p no:cacheprovider --timeout 3600 tests/fuzz tests/test_hbone_frames.py tests/test_h2core_oracle.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
