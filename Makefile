# The two set-up commands of the README: `make demo` and `make test`.
# Everything the project needs is installed from here, on a fresh machine.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# The build of HBONE's hot path (setup.py, docs/compiled.md): `compiled` (mypyc; fails without a C
# compiler and the Python headers, which `build-deps` installs), `pure`, or `auto`.
ZTUNNEL_BUILD ?= compiled
# The compiled modules' sources (hbone/build.py's HOT_PATH): an edit rebuilds the editable install.
HOT_SOURCES := $(shell sed -n 's/^    "\(hbone[a-z0-9_.]*\)",$$/\1/p' hbone/build.py | tr . / | sed 's/$$/.py/')
# The second venv: the pure Python build, for the tests of the compiled modules (`test-pure`).
PURE_VENV := .venv-pure
PURE_STAMP := $(PURE_VENV)/.installed-test
PURE_TESTS := tests/test_build.py tests/test_hbone_frames.py tests/test_hbone_h2.py tests/test_hbone_h2_streams.py \
  tests/test_hbone_hpack.py tests/test_h2core_transcripts.py tests/test_h2core_oracle.py tests/test_hbone_abuse.py \
  tests/fuzz/test_fuzz_h2core.py tests/test_hbone_pool.py tests/test_e2e.py
# The compiler and headers of the compiled build (Debian's python3 keeps Python.h in python3-dev; a
# pyenv or python.org Python has its own).
BUILD_DEBS := gcc libc6-dev python3-dev
DEBIAN_PACKAGES := iptables iproute2 nghttp2-proxy tinyproxy stunnel4 openssl curl containernetworking-plugins util-linux bind9-dnsutils dnsmasq-base dnsperf buildah debootstrap iperf3 strace $(BUILD_DEBS) prometheus

.PHONY: demo test lint typecheck unit test-pure fuzz debs build-deps proto clean image

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# setuptools tells at every editable install that a folder named like a package shadows it: here that
# is the point (the tree is the package), so that one notice is filtered by its text.
$(STAMP): pyproject.toml setup.py $(HOT_SOURCES) | $(PY) build-deps
	@[ "$(ZTUNNEL_BUILD)" = pure ] || echo "make: installing the project; mypyc compiles HBONE's hot path (about a minute)"
	ZTUNNEL_BUILD=$(ZTUNNEL_BUILD) PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e .
	@build=$$($(PY) -c 'import hbone.build as b; print(b.summary())'); echo "make: hot path build: $$build"; \
	  case "$(ZTUNNEL_BUILD):$$build" in compiled:compiled*|pure:pure*|auto:*) ;; \
	  *) echo "make: ZTUNNEL_BUILD=$(ZTUNNEL_BUILD) but the build is $$build" >&2; exit 1;; esac
	touch $@

# The test extra's packages alone: the project itself is not rebuilt.
$(TEST_STAMP): pyproject.toml $(STAMP)
	$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test']))" > $(VENV)/requirements-test.txt
	$(PY) -m pip install --quiet -r $(VENV)/requirements-test.txt
	touch $@

# The pure venv borrows the dependencies of $(VENV) (a .pth line: the same list, not installed twice)
# and gets the project built without a compiler, not editable: its own copy, no extension module.
$(PURE_STAMP): pyproject.toml setup.py $(shell find ztunnel hbone xds mesh policy controlplane cni benches -name "*.py") $(TEST_STAMP)
	rm -rf $(PURE_VENV) && $(PYTHON) -m venv --without-pip $(PURE_VENV)
	$(PY) -c 'import site; print(site.getsitepackages()[0])' > \
	  "$$($(PURE_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/ztunnel-deps.pth"
	ZTUNNEL_BUILD=pure $(PY) -m pip --python $(PURE_VENV)/bin/python install --quiet --no-deps --no-build-isolation .
	touch $@

# A C compiler and the Python headers, for the compiled build; installed (root) or named when missing.
build-deps:
	@if [ "$(ZTUNNEL_BUILD)" = pure ]; then exit 0; fi; \
	if command -v gcc >/dev/null 2>&1 && $(PYTHON) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then exit 0; fi; \
	if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing the compiled build's Debian packages: $(BUILD_DEBS)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BUILD_DEBS) >/dev/null; \
	elif [ "$(ZTUNNEL_BUILD)" = compiled ]; then \
	  echo "make: the compiled build needs a C compiler and the Python headers (Debian: apt-get install $(BUILD_DEBS)); or run make with ZTUNNEL_BUILD=pure" >&2; exit 1; \
	fi

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

# The pure Python build (its own venv, installed without a compiler) runs the compiled modules' tests
# and a few end-to-end ones, from a copy of the tree without its extension modules (the proxies the
# tests start import from their working directory).
PURE_TREE := build/pure-tree
test-pure: $(PURE_STAMP) debs
	rm -rf $(PURE_TREE) && mkdir -p $(PURE_TREE)
	tar -c --exclude=./.git --exclude='./.venv*' --exclude=./build --exclude=./results --exclude='*.so' \
	  --exclude=./hbone/_compiled.json --exclude=__pycache__ --exclude=./.mypy_cache --exclude=./.hypothesis . \
	  | tar -x -C $(PURE_TREE)
	cd $(PURE_TREE) && $(CURDIR)/$(PURE_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider $(PURE_TESTS)

test: lint typecheck unit test-pure

# The node image (Containerfile), with buildah; without registry access on a debootstrap base.
# IMAGE, BASE_IMAGE and IMAGE_CACHE (default /var/cache/ztunnel-image) are passed through.
image:
	sh deploy/build-image.sh

# The fuzz targets (tests/fuzz/, the HTTP/2 session, the h2 oracle of our HTTP/2 core) with a long budget; `make test` runs
# them bounded.
fuzz: $(TEST_STAMP)
	FUZZ_PROFILE=long FUZZ_EXAMPLES=10000 $(PY) -m pytest -q -p no:cacheprovider --timeout 3600 tests/fuzz tests/test_hbone_frames.py tests/test_h2core_oracle.py

clean:
	rm -rf $(VENV) $(PURE_VENV) .pytest_cache .mypy_cache .ruff_cache build hbone__mypyc.*.so hbone/_compiled.json
	find hbone -name '*.so' -delete
