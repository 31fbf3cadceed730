# make test: a fresh virtual environment with the package and its test extras, then the CPU suite.
# make gpu-test: the GPU suite (on a machine with an NVIDIA GPU, nvcc and PyTorch).
# make test-vllm: the tests against the real vLLM classes, in a CPU-only environment of its own
#   (tests/vllm_env.sh: torch 2.13.0 CPU, vLLM 0.25.1 --no-deps and the packages its imports need).
# make test-vllm-latest: the same tests against vLLM 0.34.0 (tests/vllm_latest_cpu_requirements.txt).
# make test-sglang: the same for SGLang 0.5.23 (tests/sglang_env.sh, tests/integration/test_sglang_*.py).
# make test-sanitized: the CPU suite against the native library built with UBSan, then the tests of the native
#   library (in-process and preloaded, with the mock driver) with ASan and with TSan; a finding fails the process
#   under test, so its test fails. CENSUS_TEST_SANITIZER puts the runtime first in every process a test starts.
PYTHON ?= python3
VENV   ?= .venv

# the package is installed as a copy (not editable): reinstall when its Python sources change too
$(VENV)/.installed: pyproject.toml setup.py $(shell find native/src native/include -type f) $(shell find src -name "*.py")
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q '.[test]'
	touch $@

install: $(VENV)/.installed

test: install
	$(VENV)/bin/python -m pytest -q

# pytest's exit 5 (no tests collected) is not a failure: the vLLM tests are added file by file.
test-vllm:
	tests/vllm_env.sh .venv-vllm
	.venv-vllm/bin/python -m pytest -q tests/integration/test_vllm_*.py; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

test-vllm-latest:
	tests/vllm_env.sh .venv-vllm-latest tests/vllm_latest_cpu_requirements.txt
	.venv-vllm-latest/bin/python -m pytest -q tests/integration/test_vllm_*.py

test-sglang:
	tests/sglang_env.sh .venv-sglang
	.venv-sglang/bin/python -m pytest -q tests/integration/test_sglang_*.py tests/unit/test_sglang_engine.py

SANITIZE := -fno-omit-frame-pointer -fno-sanitize-recover=all
SAN_BUILD := $(abspath build-sanitized)
NATIVE_TESTS := tests/unit/test_reader.py tests/unit/test_reader_layout.py tests/unit/test_reader_mutations.py \
	tests/integration/test_injector.py tests/integration/test_interpose.py tests/integration/test_events.py \
	tests/integration/test_interpose_coverage.py tests/integration/test_segment_consistency.py \
	tests/integration/test_engine_faults.py
test-sanitized: install
	$(MAKE) -s -C native BUILD=$(SAN_BUILD)/ubsan PYTHON=$(abspath $(VENV))/bin/python CC="$(CC) $(SANITIZE) -fsanitize=undefined"
	$(MAKE) -s -C native BUILD=$(SAN_BUILD)/asan PYTHON=$(abspath $(VENV))/bin/python CC="$(CC) $(SANITIZE) -fsanitize=address,undefined"
	@# TSan does not model the seqlock's fences (-Wtsan): it found no false race there
	$(MAKE) -s -C native BUILD=$(SAN_BUILD)/tsan PYTHON=$(abspath $(VENV))/bin/python CC="$(CC) $(SANITIZE) -fsanitize=thread -Wno-tsan"
	OTEL_GPU_CENSUS_LIB=$(SAN_BUILD)/ubsan/libotel_gpu_census.so UBSAN_OPTIONS=print_stacktrace=1 $(VENV)/bin/python -m pytest -q
	rt=$$($(CC) -print-file-name=libasan.so) && OTEL_GPU_CENSUS_LIB=$(SAN_BUILD)/asan/libotel_gpu_census.so \
	  ASAN_OPTIONS=detect_leaks=0 CENSUS_TEST_SANITIZER=$$rt LD_PRELOAD=$$rt $(VENV)/bin/python -m pytest -q $(NATIVE_TESTS)
	rt=$$($(CC) -print-file-name=libtsan.so) && OTEL_GPU_CENSUS_LIB=$(SAN_BUILD)/tsan/libotel_gpu_census.so \
	  TSAN_OPTIONS=die_after_fork=0 CENSUS_TEST_SANITIZER=$$rt LD_PRELOAD=$$rt $(VENV)/bin/python -m pytest -q $(NATIVE_TESTS)

gpu-test:
	$(PYTHON) -m pytest -q -m gpu tests/gpu tests/integration/test_metrics_nvml.py

.PHONY: install test test-vllm test-vllm-latest test-sglang test-sanitized gpu-test
