# pipedream_ext developer entry points. `make test` and `make run` install
# everything they need themselves (see .ci/bootstrap.sh).
PY ?= python3
BUILD_DIR ?= build/cmake
SAN_BUILD_DIR ?= build/cmake-asan
FUZZ_SECONDS ?= 60

.PHONY: setup build docs lint test test-all cpp-test cpp-test-sanitized fuzz py-test gpu-test gpu-check run bench bench-network soak clean

setup:
	PYTHON=$(PY) bash .ci/bootstrap.sh

# Incremental rebuild of pipedream_ext._C in place (after editing csrc/).
build:
	MAX_JOBS=2 $(PY) setup.py -q build_ext --inplace

cpp-test:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD_DIR) -j 2
	cd $(BUILD_DIR) && ctest --output-on-failure -j 2

# The same GoogleTest suite built with g++ under AddressSanitizer (leaks
# included) and UndefinedBehaviorSanitizer; it also replays tests/fuzz's
# corpora and saved findings. -O1 -g1 (line tables for the reports) halves the
# build time of -O2 -g.
cpp-test-sanitized:
	cmake -S . -B $(SAN_BUILD_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DPIPEDREAM_SANITIZE=ON >/dev/null
	cmake --build $(SAN_BUILD_DIR) -j 2
	cd $(SAN_BUILD_DIR) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
		ctest --output-on-failure -j 2

# libFuzzer/atheris targets for the profile, schedule and plan JSON parsers,
# FUZZ_SECONDS each (installs clang if missing; see docs/fuzzing.md).
fuzz: setup
	bash tests/fuzz/run_fuzzers.sh $(FUZZ_SECONDS)

py-test:
	$(PY) -m pytest tests -q --durations=25

# On a GPU machine with its own torch (no network, no pin): build against the
# installed torch and run the CUDA tests (tests/test_gpu.py skips without a GPU).
gpu-test:
	MAX_JOBS=8 $(PY) setup.py -q build_ext --inplace
	$(PY) -m pytest tests/test_gpu.py tests/test_units.py -v

# The one prepared run for a lent GPU machine (benchmarks/README.md, "GPU runs"): build,
# gpu-test, the main job on CUDA, the GPT against torch.distributed.pipelining (1 NCCL rank
# with chunks; 2 Gloo ranks with CUDA tensors), host syncs per transfer; one summary,
# $(OUT)/gpu_check.md (OUT defaults to out/gpu-check). About 6 minutes on an H100.
gpu-check:
	bash benchmarks/gpu_check.sh

# ruff (pyproject.toml's rules: noqa comments name rules that run) and the import-linter
# contract (each package folder imports only the layers below it: docs/architecture.md).
lint:
	$(PY) -m ruff check .
	lint-imports

# The documentation site (Sphinx + MyST, API reference by autodoc) into build/docs;
# any warning fails it. -E: every page re-read (a warning is never hidden by a cache).
docs:
	$(PY) -m sphinx -b html -E -q -W --keep-going docs build/docs

# The README's test command: the linters, the docs, GoogleTest (under the sanitizers:
# the same suite as cpp-test, which test-all also builds plain), pytest.
test: setup
	$(MAKE) lint
	$(MAKE) docs
	$(MAKE) cpp-test-sanitized
	$(MAKE) py-test

# Everything `make test` runs, plus the tests marked slow (the whole transformers zoo of
# tests/test_zoo.py, other world sizes, the Gloo twins of the nccl_rules launches): each
# repeats in kind something `make test` runs (docs/testing.md, "What only `make test-all`
# runs"; the mark: tests/conftest.py).
test-all: setup
	$(MAKE) lint
	$(MAKE) cpp-test
	$(MAKE) cpp-test-sanitized
	PIPEDREAM_TEST_ALL=1 $(MAKE) py-test

# The README's main job: 4-stage pipeline training of a CNN on digits (CPU).
run: setup
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc-per-node 4 examples/train_digits.py

# Every benchmark (tables and plots under benchmarks/results/; see benchmarks/README.md).
bench: setup
	$(PY) benchmarks/schedules_sweep.py
	$(PY) benchmarks/schedule_bubbles.py
	$(PY) benchmarks/schedule_build.py
	$(PY) benchmarks/planner_speed.py --clusters 4,16,4x4,64 > benchmarks/results/planner_speed.md
	$(PY) benchmarks/comm_volume.py
	$(PY) benchmarks/plan_accuracy.py --repeats 3
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/split_backward.py
	$(PY) benchmarks/zero_bubble.py
	$(PY) benchmarks/vs_torch.py
	$(PY) benchmarks/shape_change.py
	$(PY) benchmarks/message_load.py
	$(PY) benchmarks/deferred_init.py
	$(PY) benchmarks/meta_init.py
	$(PY) benchmarks/traced.py
	$(PY) benchmarks/agreement.py
	$(PY) benchmarks/p2p_engine.py
	$(PY) benchmarks/fsdp_2d.py
	$(PY) benchmarks/vs_torch_tp.py
	$(PY) benchmarks/vs_torch_ep.py
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/ep_prediction.py > benchmarks/results/ep_prediction.md
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/ep_overlap.py > benchmarks/results/ep_overlap.md
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/ep_overlap.py >> benchmarks/results/ep_overlap.md
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/ep_tp_layouts.py > benchmarks/results/ep_tp_layouts.md
	$(PY) benchmarks/update_readme.py

# Time to accuracy on an emulated 4-host cluster (network namespaces, tc-limited
# links at 100 Mbit/s and 1 Gbit/s): DDP vs 1f1b / pipedream / pipedream-2bw.
# Needs root and iproute2 (sudo make bench-network); 8-13 minutes on 2 cores.
bench-network: setup
	$(PY) benchmarks/slow_network.py --command "sudo make bench-network"

# Soak run (not CI): 4 ranks, every schedule, 20 000 steps of a tiny model each;
# exits non-zero if a rank's RSS grows more than 5 MiB after warm-up, throughput
# drops more than 30% or a queue grows (benchmarks/README.md, "Soak"). About 20
# minutes on an idle 2-core machine; `$(PY) benchmarks/soak.py --steps 2000` is quicker.
soak: setup
	$(PY) benchmarks/soak.py

clean:
	rm -rf build pipedream_ext/_C*.so *.egg-info
