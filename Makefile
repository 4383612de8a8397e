# ferry: the two set-up commands.
#   make demo   installs dependencies, builds, and runs the main job on libfabric's shm provider
#   make test   installs dependencies, builds, and runs every test
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=
# CUDA is optional: use nvcc where the machine has it.
NVCC := $(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
ifneq ($(NVCC),)
CMAKE_FLAGS += -DCMAKE_CUDA_COMPILER=$(NVCC)
endif

.PHONY: all deps configure build test demo clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 900

demo: build
	$(BUILD)/ferry-bench demo

clean:
	rm -rf $(BUILD)
