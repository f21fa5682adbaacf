# Every target bootstraps .venv: torch (CPU build) first, then the project with [dev].
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UNROLL := $(VENV)/bin/unroll
STAMP  := $(VENV)/.installed-stamp
# pytest worker processes (pytest-xdist): the suite is mostly single-threaded Python
WORKERS ?= 2

.PHONY: venv test test-slow test-all bench accuracy generate check lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(UNROLL) check generated
	$(UNROLL) lint generated/ipu generated/multiipu --platform ipu
	$(PY) -m pytest -q -n $(WORKERS)

# Everything `make test` runs, plus the slow tests (benchmark scripts end to end, the
# make accuracy commands) and the fuzz tests at thousands of mutants.
test-all: test-slow
test-slow: $(STAMP)
	$(UNROLL) check generated
	$(UNROLL) lint generated/ipu generated/multiipu --platform ipu
	SLOW=1 $(PY) -m pytest -q -n $(WORKERS)

# The benchmark suite (unroller.bench, as `unroll bench`): its quick preset, or with FULL=1
# the published sizes; writes benchmarks/results/bench.*. The two other reports of the same
# harness: `unroll bench core` (python -m benchmarks.core_bench) and `unroll bench compress`
# (python -m benchmarks.compress_bench).
bench: $(STAMP)
	$(PY) -m benchmarks.run $(if $(FULL),--full,)

# Accuracy by scheme (README "Training and accuracy analysis"): about 40 minutes on an idle
# 2-core CPU (25 for the first three). Finished runs under each --out are reused, so an
# interrupted `make accuracy` resumes.
ACCURACY := $(UNROLL) accuracy --schemes all --seeds 3 --quiet
# Transformers (vit_digits, gpt_tiny): every saved tensor is a token tensor, attention map or
# feature vector, which dct leaves raw, so dct-first/dct-dense would repeat nocompress; one seed.
ACCURACY_V2 := $(UNROLL) accuracy --schemes nocompress,quant-8bit,quant-4bit,quant-2bit --seeds 1 --quiet
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
