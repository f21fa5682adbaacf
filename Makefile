# Every target bootstraps .venv from requirements.lock: exact versions of torch (the CPU
# build), the project's dependencies, the dev tools and the build backend, so every machine
# tests against the same packages. `make lock` refreshes the lock file (docs/development.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UNROLL := $(VENV)/bin/unroll
STAMP  := $(VENV)/.installed-stamp
LOCK   := requirements.lock
# pytest worker processes (pytest-xdist): the suite is mostly single-threaded Python
WORKERS ?= 2

.PHONY: venv lock test test-slow test-all bench bench-precision accuracy generate check lint format clean

venv: $(STAMP)

# The locked packages first, then the project itself without resolving anything more
# (--no-deps) and built by the locked hatchling (--no-build-isolation); `pip check` fails
# the setup when the lock no longer satisfies pyproject.toml. (Not --no-compile: it saves
# a third of the setup but the tests then spend more than that compiling in every
# interpreter they start with PYTHONDONTWRITEBYTECODE.)
$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "requirements.lock holds versions for Python 3.11: make PYTHON=python3.11 ... (or make lock to re-resolve for this Python)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $(STAMP)

# Re-resolve the newest versions pyproject.toml allows in a scratch venv and write them,
# exactly, to requirements.lock. Review the diff, run `make test`, commit both.
LOCK_VENV := build/lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q torch==2.13.0 hatchling editables -e '.[dev]'
	$(LOCK_VENV)/bin/python -m pip freeze --exclude-editable --all \
		| grep -v -E '^(pip|setuptools|wheel)==' | sed -E 's/^(torch==[^+]*)\+.*/\1/' > $(LOCK).new
	{ printf '%s\n' "# Exact versions \`make\` installs into .venv (Python 3.11, Linux x86-64)." \
		"# Regenerate with \`make lock\`; torch is the CPU build of the version named."; \
		cat $(LOCK).new; } > $(LOCK)
	rm -f $(LOCK).new
	rm -rf $(LOCK_VENV)

# The tests' cache of native kernel builds (tests/conftest.py takes the same folder); the
# kernels are built into it on the second core while check and lint run on the first, so
# no test waits ~40 s of compiling for them on a fresh machine (a failed build here is
# only reported: the test that needs the kernels builds them, or fails, itself).
export UNROLLER_TEST_CACHE_DIR ?= $(shell $(PYTHON) -c 'import os, tempfile; print(os.path.join(tempfile.gettempdir(), f"unroller-tests-{os.getuid()}"))')

test: $(STAMP)
	@UNROLLER_CACHE_DIR=$(UNROLLER_TEST_CACHE_DIR) $(UNROLL) cache build-native > /dev/null & \
	build=$$!; \
	$(UNROLL) check generated && $(UNROLL) lint generated/ipu generated/multiipu --platform ipu; \
	status=$$?; wait $$build || echo "make test: the native kernels did not build ahead"; \
	exit $$status
	$(PY) -m pytest -q -n $(WORKERS)

# Everything `make test` runs, plus the slow tests (benchmark scripts end to end, the
# make accuracy commands) and the fuzz tests at thousands of mutants.
test-all: test-slow
test-slow: $(STAMP)
	$(UNROLL) check generated
	$(UNROLL) lint generated/ipu generated/multiipu --platform ipu
	SLOW=1 $(PY) -m pytest -q -n $(WORKERS)

# The benchmark suite (unroller.bench, as `unroll bench`): its quick preset, or with FULL=1
# the published sizes, with PRECISION=bf16-mixed (or any --precision) in that precision (the
# peers under torch.autocast); writes benchmarks/results/bench.*. The two other reports of
# the same harness: `unroll bench core` (python -m benchmarks.core_bench) and `unroll bench
# compress` (python -m benchmarks.compress_bench).
bench: $(STAMP)
	$(PY) -m benchmarks.run $(if $(FULL),--full,) $(if $(PRECISION),--precision $(PRECISION),)

# Mixed precision (docs/benchmarks.md, "Mixed precision"): the four transformers in
# bf16-mixed against autograd and checkpointing under torch.autocast (quick sizes, bytes per
# sample between batch 4 and 8, and 16 and 32), and the lora_llama preset (a peft LoRA Llama
# through unroller.unroll against autocast, per-layer checkpointing and Hugging Face gradient
# checkpointing) at sequence 512 and 2048 (the max batch under 1 GiB there); then their
# tables and the headline. Hours on a 2-core CPU, most of it the 2048-token steps.
PRECISION_RUNS := benchmarks/results/precision
PRECISION_SUITE := --benchmark vit_tiny,gpt_tiny,gpt_small,bert_encoder --precision bf16-mixed \
	--scheme nocompress,dct-dense,quant,auto --threads 1 --memory-budget none --no-recompute \
	--no-progress
bench-precision: $(STAMP)
	$(PY) -m benchmarks.run $(PRECISION_SUITE) --out-dir $(PRECISION_RUNS)/bf16_mixed
	$(PY) -m benchmarks.run $(PRECISION_SUITE) --per-sample-batches 16,32 \
		--out-dir $(PRECISION_RUNS)/bf16_mixed_16_32
	$(PY) -m benchmarks.run lora_llama --sequence 512 --threads 1 \
		--out-dir $(PRECISION_RUNS)/lora_llama_512
	$(PY) -m benchmarks.run lora_llama --sequence 2048 --threads 1 \
		--out-dir $(PRECISION_RUNS)/lora_llama_2048
	$(PY) -m benchmarks.summary_tables $(PRECISION_RUNS)/bf16_mixed \
		$(PRECISION_RUNS)/bf16_mixed_16_32 $(PRECISION_RUNS)/lora_llama_512 \
		$(PRECISION_RUNS)/lora_llama_2048
	$(PY) -m benchmarks.headline benchmarks/results/per_sample $(PRECISION_RUNS)/bf16_mixed \
		$(PRECISION_RUNS)/lora_llama_512 $(PRECISION_RUNS)/lora_llama_2048

# Accuracy by scheme (docs/accuracy.md): about 40 minutes on an idle
# 2-core CPU (25 for the first three). Finished runs under each --out are reused, so an
# interrupted `make accuracy` resumes. Then the summaries docs/accuracy.md includes
# (goals.md: each scheme against nocompress and the goals; stash_per_token.md).
ACCURACY := $(UNROLL) accuracy --schemes all --seeds 3 --quiet
# Transformers (vit_digits, gpt_tiny): every saved tensor is a token tensor, attention map or
# feature vector, which dct leaves raw, so dct-first/dct-dense would repeat nocompress; one seed.
ACCURACY_V2 := $(UNROLL) accuracy --schemes nocompress,quant-8bit,quant-4bit,quant-2bit --seeds 1 --quiet
# What --scheme auto chooses at its default --max-time-ratio, beside nocompress, one seed.
ACCURACY_AUTO := $(UNROLL) accuracy --schemes nocompress,auto --seeds 1 --quiet
accuracy: $(STAMP)
	$(ACCURACY) benchmarks/models/quick.txt --dataset digits --epochs 15 \
		--out benchmarks/results/accuracy/digits
	$(ACCURACY) benchmarks/models/emdenoise.txt --dataset denoise --resolution 64 --epochs 8 \
		--optimizer adam --lr 0.002 --batch-size 16 --out benchmarks/results/accuracy/denoise
	$(ACCURACY) benchmarks/models/slstrcloud.txt --dataset clouds --resolution 32 --epochs 8 \
		--optimizer adam --lr 0.001 --batch-size 16 --out benchmarks/results/accuracy/clouds
	$(ACCURACY_V2) benchmarks/models/vit_digits.txt --dataset digits --epochs 12 \
		--optimizer adam --lr 0.003 --batch-size 32 --out benchmarks/results/accuracy/vit_digits
	$(ACCURACY_V2) benchmarks/models/gpt_tiny.txt --dataset pysource --epochs 2 --train-size 2048 \
		--test-size 512 --optimizer adam --lr 0.003 --batch-size 32 --out benchmarks/results/accuracy/gpt_pysource
	$(ACCURACY_AUTO) benchmarks/models/quick.txt --dataset digits --epochs 15 \
		--out benchmarks/results/accuracy/digits_auto
	$(ACCURACY_AUTO) benchmarks/models/vit_digits.txt --dataset digits --epochs 12 \
		--optimizer adam --lr 0.003 --batch-size 32 --out benchmarks/results/accuracy/vit_digits_auto
	$(ACCURACY_AUTO) benchmarks/models/gpt_tiny.txt --dataset pysource --epochs 2 --train-size 2048 \
		--test-size 512 --optimizer adam --lr 0.003 --batch-size 32 \
		--out benchmarks/results/accuracy/gpt_pysource_auto
	$(PY) -m benchmarks.accuracy_goals
	$(PY) -m benchmarks.stash_per_token

# The golden files under generated/; `make generate ALL=1` also writes every benchmark
# module (each platform, scheme, pipeline) under build/generated/.
generate: $(STAMP)
	$(PY) -m benchmarks.generate_all $(if $(ALL),--all,)

check: $(STAMP)
	$(UNROLL) check generated

lint: $(STAMP)
	$(VENV)/bin/ruff check unroller tests benchmarks
	$(VENV)/bin/black --check unroller tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix unroller tests benchmarks
	$(VENV)/bin/black unroller tests benchmarks

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
