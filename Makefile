# ferry: the two set-up commands.
#   make demo   installs dependencies, builds, and serves a small MoE model disaggregated over shm
#   make test   installs dependencies, builds, and runs every test
#   make sanitize  the same tests built with AddressSanitizer and UBSan (not part of make test)
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

.PHONY: all deps configure build test demo sanitize clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 900

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

clean:
	rm -rf $(BUILD) build-asan
