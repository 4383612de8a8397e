# ferry: the two set-up commands.
#   make demo   installs dependencies, builds, and serves a small MoE model disaggregated over shm
#   make test   installs dependencies, builds, and runs every test
#   make sanitize  the same tests built with AddressSanitizer and UBSan (not part of make test)
#   make fuzz-short  each libFuzzer harness for 30 s (part of make test where clang is)
#   make fuzz      each harness for FUZZ_SECONDS (600); make tsan: the tests under ThreadSanitizer
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=
# CUDA is optional: use nvcc where the machine has it.
NVCC := $(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
ifneq ($(NVCC),)
CMAKE_FLAGS += -DCMAKE_CUDA_COMPILER=$(NVCC)
endif
# The bindings are built for Debian's interpreter, which Debian's python3-torch serves (the
# python3 first on PATH may be another).
PYTHON := $(firstword $(wildcard /usr/bin/python3) $(shell command -v python3 2>/dev/null))
ifneq ($(PYTHON),)
CMAKE_FLAGS += -DPython_EXECUTABLE=$(PYTHON)
endif

.PHONY: all deps configure build test demo sanitize tsan fuzz-build fuzz-short fuzz clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 900
	@if command -v clang++ >/dev/null 2>&1; then $(MAKE) --no-print-directory fuzz-short; \
	else echo "make test: no clang++, so no fuzzing (make fuzz-short needs it)"; fi

# The main job: a small MoE model served disaggregated (prefill TP 2, decode EP 2, a router) on
# shm, every prompt's tokens checked against the model run colocated (examples/serve). The
# fabric / moe / kv benchmark demo is `build/ferry-bench demo`.
demo: build
	PYTHONPATH=$(BUILD)/python $$(cat $(BUILD)/python/interpreter) examples/serve/demo.py

# Every CPU test under ASan + UBSan in build-asan (about twice make test's build and test time
# on 2 cores). What ferry leaks on purpose is marked (src/common/leak.h). The install consumer
# and the Python bindings are left out: both would load the instrumented library into an
# uninstrumented program (the consumer, python3).
SAN_FLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
sanitize: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) -DFERRY_BUILD_PYTHON=OFF \
	  -DCMAKE_CXX_FLAGS="$(SAN_FLAGS)" -DCMAKE_EXE_LINKER_FLAGS="$(SAN_FLAGS)" \
	  -DCMAKE_SHARED_LINKER_FLAGS="$(SAN_FLAGS)"
	cmake --build build-asan -j $(JOBS)
	cd build-asan && UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure --timeout 900 -E install_consumer

# Every CPU test under ThreadSanitizer in build-tsan (the Python bindings and the install
# consumer left out, as for sanitize; netns_moe too: it times ferry-bench processes against a
# link taken down after a fixed delay, which TSan's slowdown outlasts before the world forms;
# and soak_short, whose flat-memory check would measure TSan's own growing bookkeeping; and
# moe_scale_model, 24 ranks of the same host-device code soak_short's ranks run). libfabric is not built with TSan, so what its own threads
# do is invisible to it: the suppressions (tests/tsan.supp) name only libraries outside ferry,
# each with its reason.
TSAN_FLAGS := -fsanitize=thread -fno-omit-frame-pointer
tsan: deps
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_ENABLE_CUDA=OFF \
	  -DFERRY_BUILD_PYTHON=OFF -DCMAKE_CXX_FLAGS="$(TSAN_FLAGS)" \
	  -DCMAKE_EXE_LINKER_FLAGS="$(TSAN_FLAGS)" -DCMAKE_SHARED_LINKER_FLAGS="$(TSAN_FLAGS)"
	cmake --build build-tsan -j $(JOBS)
	cd build-tsan && FERRY_TEST_TIME_SCALE=5 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 \
	  suppressions=$(CURDIR)/tests/tsan.supp" ctest --output-on-failure --timeout 900 \
	  -E "install_consumer|netns_moe|soak_short|moe_scale_model"

# libFuzzer harnesses (tests/fuzz): every decoder of bytes from a peer or a user. Built with clang
# in build-fuzz (the library CPU-only, under ASan + UBSan). Each run starts from the seed corpus
# in the tree and keeps what it finds in build-fuzz/corpus/<harness>; a crashing input is left
# in build-fuzz/ as crash-* and fails the target.
FUZZ_SECONDS ?= 600
FUZZ_FLAGS := -fsanitize=address,undefined -fsanitize=fuzzer-no-link -fno-omit-frame-pointer \
  -fno-sanitize-recover=undefined
fuzz-build: deps
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DFERRY_ENABLE_CUDA=OFF -DFERRY_BUILD_TESTS=OFF -DFERRY_BUILD_TOOLS=OFF \
	  -DFERRY_BUILD_PYTHON=OFF -DBUILD_SHARED_LIBS=OFF -DFERRY_BUILD_FUZZERS=ON \
	  -DCMAKE_CXX_FLAGS="$(FUZZ_FLAGS)" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
	cmake --build build-fuzz -j $(JOBS)
fuzz-short: fuzz-build
	./scripts/run-fuzzers.sh build-fuzz 30
fuzz: fuzz-build
	./scripts/run-fuzzers.sh build-fuzz $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD) build-asan build-fuzz build-tsan
