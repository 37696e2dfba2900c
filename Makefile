# cfsdp build targets.  `make build`: editable install with warnings as
# errors.  `make sanitize`: build the C core with ASan + UBSan into a separate
# tree (build/sanitize/lib, put first on PYTHONPATH) and run tests/unit
# against it (every test that calls into cfsdp._C; the no_core ones, which call
# nothing of the core, are left out, see `test`); the normal in-place extension of
# the editable install is never touched, so it keeps working during and after the
# run.  pytest runs with
# --capture=sys so a sanitizer report (written to fd 2) reaches the log, and Python
# allocates with malloc (PYTHONMALLOC=malloc), so C reading a freed Python object (a
# plan, a list slot) or past a bytearray is an ASan report, not a read of pymalloc's
# arena.  tests/unit/test_fuzz_c.py runs its fuzz of every C entry point in this pass,
# in child processes that inherit this environment.

# Every target sets up what it needs on a fresh machine: a virtual environment
# in .venv with torch==2.13.0 (always pinned: an unpinned torch pulls a CUDA
# build of several GB) and the test/benchmark tools, then the C build.
VENV ?= .venv
PY ?= $(VENV)/bin/python
PYTHON3 ?= python3
TORCH_PIN := torch==2.13.0
DEPS := $(TORCH_PIN) pytest pytest-timeout pytest-xdist==3.6.1 hypothesis numpy matplotlib
STAMP := $(VENV)/.cfsdp-deps
# 2 ranks on 2 cores: one thread per rank.
export OMP_NUM_THREADS ?= 1
SAN_DIR := build/sanitize
SAN_LIB := $(abspath $(SAN_DIR)/lib)
SAN_ENV = LD_PRELOAD="$$(gcc -print-file-name=libasan.so):$$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	PYTHONPATH=$(SAN_LIB)$${PYTHONPATH:+:$$PYTHONPATH}

.PHONY: venv build sanitize test test-unit test-dist demo bench test-torch torch-venv torchtitan-check

# Other torch versions (issue 23): cfsdp supports torch 2.11.x to 2.15.x and mirrors the
# installed one.  `make test-torch TORCH=2.11.0` runs TORCH_TESTS (the unit tests and the
# distributed parity launches of both faces, ZeRO, state dicts and tensor parallelism, at world size 2) against
# that torch, in a virtual environment of its own, .venv-torch/<version>, made once and reused
# (gitignored): torch==<version> pinned and the test tools in one pip command, then cfsdp
# installed into it in editable mode (no dependencies: torch is already there).  The C
# extension is built in place against CPython only, so the one build serves every torch;
# each run rebuilds it if a C source changed (setup.py build_ext, a no-op otherwise).  The unit
# tests run with fewer hypothesis examples there (profile `versions`: what differs is torch, not
# the C core the full pass searched).  Only 2.13.0 has a CPU wheel here; the others are the
# registry's default (CUDA) builds, which run on a CPU-only machine: ~3 GB of downloads each
# for 2.11.0 and 2.15.0 (2.14.1 lies on this machine's disk).  Another subset: TORCH_TESTS="tests/...".
# `make demo TORCH=...` and `make bench TORCH=...` run on that venv the same way.
TORCH ?=
TORCH_TESTS ?= tests/unit tests/distributed/test_parity.py tests/distributed/test_fully_shard.py \
	tests/distributed/test_zero.py tests/distributed/test_state_dict.py \
	tests/distributed/test_tp.py::test_tensor_parallel
# the versions `make test` runs TORCH_TESTS against, besides the full suite on 2.13.0
TORCH_OTHERS := 2.11.0 2.15.0
TVENV = .venv-torch/$(TORCH)
TDEPS := pytest pytest-timeout pytest-xdist==3.6.1 hypothesis numpy matplotlib 'setuptools>=70.1'

$(STAMP): Makefile
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(DEPS)
	touch $@

venv: $(STAMP)

# .venv-torch/<version>/.cfsdp-deps: that torch, the test tools and cfsdp (editable)
.venv-torch/%/.cfsdp-deps: Makefile
	test -x .venv-torch/$*/bin/python || $(PYTHON3) -m venv .venv-torch/$*
	.venv-torch/$*/bin/python -m pip install -q --disable-pip-version-check torch==$* $(TDEPS)
	CFSDP_WERROR=1 .venv-torch/$*/bin/python -m pip install -q --disable-pip-version-check \
		--no-build-isolation --no-deps -e .
	touch $@

torch-venv:
	@test -n "$(TORCH)" || { echo "name a torch version: make $(MAKECMDGOALS) TORCH=2.11.0"; exit 2; }
	$(MAKE) --no-print-directory $(TVENV)/.cfsdp-deps
	CFSDP_WERROR=1 $(TVENV)/bin/python setup.py -q build_ext --inplace

test-torch: torch-venv
	$(TIMED) torch-$(TORCH) env CFSDP_IMPL=c CFSDP_TEST_WORLD_SIZES=2 CFSDP_HYPOTHESIS_PROFILE=versions \
		XDIST="$(XDIST)" tools/pytest_split $(TVENV)/bin/python -q -p no:cacheprovider --durations=5 -- $(TORCH_TESTS)

build: $(STAMP)
	CFSDP_WERROR=1 $(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e .

# The whole suite (torch 2.13.0, .venv): unit tests, the C core under ASan/UBSan, the distributed
# tests with the C core (world sizes 2 and 4), then the unit tests and the
# training-parity launches again on the pure-Python twins, at world size 2
# only (the unit tests already compare every twin with C for every world
# size; TWIN_DIST are the launches that call every C entry point in training:
# layout, shard fill, cast/reduce, norm, chunk copy-in/out, the fused optimizer
# steps; the checkpoint launches call the same ones and would add minutes, not
# coverage).  Under the twins the collectives take the process group (its
# twin): test_shm.py forces the C core and shared memory in its own launches.
# Unit tests marked no_core (pytest.ini; the marker is checked, see tests/unit/conftest.py)
# call nothing of the core (e.g. atomic_save, the backend choice in fresh interpreters that set
# their own CFSDP_IMPL): they run once, in the first pass, not again under the sanitizer or on
# the twins, where they would repeat the same work (they spawn interpreters: about a minute
# in each pass).
TWIN_DIST := tests/distributed/test_parity.py tests/distributed/test_mixed_precision.py \
	tests/distributed/test_strategies.py tests/distributed/test_clip.py \
	tests/distributed/test_fully_shard.py tests/distributed/test_optim.py
# Last, test-torch on each of TORCH_OTHERS (2.11.0, 2.15.0: the unit tests and the parity
# launches of both faces, ZeRO, state dicts and tensor parallelism at world size 2; see test-torch above).
# Each pass runs through tools/timed, which prints "=== pass NAME: M:SS (exit RC)".
TIMED := tools/timed
# Unit tests run in one process each but on 1 core of 2: pytest-xdist runs them on two
# processes, a test file per process at a time (--dist loadfile: a module's fixtures, e.g. its
# one-rank group, stay in one process).  The distributed launches already use both cores (and
# 4 ranks oversubscribe them), so they stay one at a time: tools/pytest_split runs the
# tests/unit paths of a pass with $(XDIST) and the rest after them without.
XDIST := -n 2 --dist loadfile
test: build
	@date +%s > .test-start
	$(TIMED) unit env CFSDP_IMPL=c $(PY) -m pytest -q $(XDIST) tests/unit
	$(TIMED) sanitize $(MAKE) --no-print-directory sanitize
	$(TIMED) distributed env CFSDP_IMPL=c $(PY) -m pytest -q --durations=12 tests/distributed
	$(TIMED) twins env CFSDP_IMPL=python CFSDP_TEST_WORLD_SIZES=2 XDIST="$(XDIST)" tools/pytest_split $(PY) -q --durations=8 \
		-m "not no_core" -- tests/unit $(TWIN_DIST)
	for v in $(TORCH_OTHERS); do $(MAKE) --no-print-directory test-torch TORCH=$$v || exit 1; done
	@secs=$$(( $$(date +%s) - $$(cat .test-start) )); rm -f .test-start; \
		printf '=== make test: %d:%02d in all\n' $$((secs / 60)) $$((secs % 60))

# torchtitan 0.3.0's debugmodel recipe on torch's FSDP2 and under cfsdp.run (2 CPU ranks),
# compared bit for bit; its own venv .venv-titan (~2.5 GB), so not part of make test
torchtitan-check: build
	tools/torchtitan_cpu/check.sh

test-unit: build
	$(PY) -m pytest -q tests/unit

test-dist: build
	$(PY) -m pytest -q tests/distributed

# The main job: cfsdp against torch's FSDP on 2 CPU ranks (TORCH=<version>: on that torch).
ifeq ($(TORCH),)
RUN_VENV := $(VENV)
RUN_SETUP := build
else
RUN_VENV := $(TVENV)
RUN_SETUP := torch-venv
endif
demo: $(RUN_SETUP)
	$(RUN_VENV)/bin/torchrun --standalone --nproc_per_node 2 demo/train_demo.py

# Every benchmark of benchmarks/RESULTS.md, in one go (about an hour on 2 cores):
# step time and memory (fp32, bf16, 4 ranks, a size sweep and its plot), collectives,
# optimizer step, wrap time, state dicts, ZeRO, Muon on shards, emulated hosts.
TORCHRUN2 = $(RUN_VENV)/bin/torchrun --standalone --nproc_per_node 2
BENCH_GPT2_BF16 = --set n_layer=2 --set d_model=256 --set n_head=4 --set vocab_size=2048
bench: $(RUN_SETUP)
	mkdir -p benchmarks/out
	$(TORCHRUN2) benchmarks/bench_fsdp.py --model all --out benchmarks/out/bench.json
	$(RUN_VENV)/bin/python benchmarks/plot.py benchmarks/out/bench.json --out benchmarks/results.png
	$(TORCHRUN2) benchmarks/bench_fsdp.py --model small --mp bf16 \
		--out benchmarks/out/bench_bf16_small.json
	$(TORCHRUN2) benchmarks/bench_fsdp.py --model gpt2 --mp bf16 $(BENCH_GPT2_BF16) \
		--warmup 2 --iters 6 --out benchmarks/out/bench_bf16_gpt2s.json
	$(RUN_VENV)/bin/torchrun --standalone --nproc_per_node 4 benchmarks/bench_fsdp.py --model all \
		--set n_layer=4 --warmup 2 --iters 6 --out benchmarks/out/bench_ws4.json
	for d in 128 256 384 512 768; do \
		$(TORCHRUN2) benchmarks/bench_fsdp.py --model gpt2 --set d_model=$$d --set n_layer=4 \
			--warmup 2 --iters 5 --out benchmarks/out/sweep_d$$d.json || exit 1; done
	$(RUN_VENV)/bin/python benchmarks/plot.py benchmarks/out/sweep_d*.json --vs-size --out benchmarks/results_sweep.png
	$(TORCHRUN2) benchmarks/bench_collectives.py --out benchmarks/out/collectives.json
	$(TORCHRUN2) benchmarks/bench_optim.py --out benchmarks/out/optim.json
	$(TORCHRUN2) benchmarks/bench_wrap.py --repeats 3 --out benchmarks/out/wrap.json
	$(TORCHRUN2) benchmarks/bench_state_dict.py --repeats 7 --out benchmarks/out/state_dict.json
	$(TORCHRUN2) benchmarks/bench_zero.py --out benchmarks/out/zero.json
	$(TORCHRUN2) benchmarks/bench_muon.py --out benchmarks/out/muon_w2.json
	$(RUN_VENV)/bin/torchrun --standalone --nproc_per_node 4 benchmarks/bench_muon.py \
		--out benchmarks/out/muon_w4.json
	$(RUN_VENV)/bin/python benchmarks/plot.py benchmarks/out/muon_w*.json --muon \
		--out benchmarks/results_muon.png
	$(RUN_VENV)/bin/python benchmarks/bench_hosts.py --out benchmarks/out/hosts.json  # root: emulated hosts

sanitize: $(STAMP)
	rm -rf $(SAN_DIR)
	CFSDP_SANITIZE=1 CFSDP_WERROR=1 $(PY) setup.py -q build \
		--build-base $(SAN_DIR)/tmp --build-lib $(SAN_LIB) --force
	$(SAN_ENV) $(PY) -c "import cfsdp._C as m; \
		assert m.__file__.startswith('$(SAN_LIB)'), m.__file__; \
		print('sanitized extension:', m.__file__)"
	$(SAN_ENV) CFSDP_HYPOTHESIS_PROFILE=sanitize $(PY) -m pytest -q -p no:cacheprovider \
		--capture=sys -m "not no_core" $(XDIST) tests/unit
