# nsa -- build, test and demo. `make demo` and `make test` are all a new machine needs.
# Outputs: build/libnsa.a, build/libnsa.so, build/nsa (CLI), build/nsa_tests, build/nsa_fuzz_replay
# (the fuzz inputs replayed on either backend); the test kit
# (tests/kit: harness, float64 reference, sweep, backend memory) is build/libnsa_testkit.a,
# linked by build/nsa_tests, build/nsa_gpu_tests and build/nsa.
CC ?= cc
NATIVE ?= 1
OPT ?= -O3
ARCH := $(if $(filter 1,$(NATIVE)),-march=native,)
CFLAGS_BASE := -std=c11 -Wall -Wextra -Werror -fPIC -fopenmp -ffp-contract=fast -fno-math-errno -Wno-psabi -g $(OPT) $(ARCH) -Iinclude -Isrc
LDLIBS := -fopenmp -lm

# The CUDA planners are plain C: built in every configuration, so the CPU suite tests them.
LIB_SRC := src/api.c src/validate.c $(sort $(wildcard src/cpu/*.c)) src/cuda/plan.c $(sort $(wildcard src/cuda/*/plan.c))
LIB_OBJ := $(LIB_SRC:%.c=build/obj/%.o)
KIT_SRC := $(sort $(wildcard tests/kit/*.c))
KIT_OBJ := $(KIT_SRC:%.c=build/obj/%.o)
KIT_H := $(wildcard tests/kit/*.h)
KIT_LIB := build/libnsa_testkit.a
TEST_SRC := tests/main.c $(filter-out tests/main.c tests/gpu_main.c,$(sort $(wildcard tests/*.c)))

# ---- CUDA backend (src/cuda/**/*.cu) ----------------------------------------------------------
# NSA_CUDA=auto (default) builds it when nvcc is on PATH; NSA_CUDA=1 forces it, NSA_CUDA=0 keeps
# the build CPU-only. Enabled, it compiles src/cuda/**/*.cu for sm_80 and sm_90a into libnsa,
# defines NSA_WITH_CUDA for api.c, the test kit and the CLI, links cudart statically into every
# program and libnsa.so, and adds build/nsa_gpu_tests (the sweep on the GPU).
NSA_CUDA ?= auto
# EXPERIMENTAL=1 also compiles the kernel variants kept only for comparisons (bench/NOTES.md).
EXPERIMENTAL ?= 0
ifeq ($(EXPERIMENTAL),1)
CFLAGS_BASE += -DNSA_CUDA_EXPERIMENTAL=1
endif
NVCC ?= nvcc
ifeq ($(NSA_CUDA),auto)
override NSA_CUDA := $(if $(shell command -v $(NVCC) 2>/dev/null),1,0)
endif
ifeq ($(NSA_CUDA),1)
CUDA_HOME ?= $(patsubst %/bin/,%,$(dir $(shell command -v $(NVCC) 2>/dev/null)))
NVCCFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a
CUDA_SRC := $(sort $(wildcard src/cuda/*.cu src/cuda/*/*.cu))
CUDA_HDR := $(wildcard src/cuda/*.h src/cuda/*/*.h src/cuda/*/*.cuh src/*.h include/*.h)
CUDA_OBJ := $(CUDA_SRC:%.cu=build/obj/%.o)
CUDA_CFLAGS := -DNSA_WITH_CUDA -I$(CUDA_HOME)/include
LIB_OBJ += $(CUDA_OBJ)
LDLIBS += -L$(CUDA_HOME)/lib64 -lcudart_static -lstdc++ -ldl -lrt -lpthread
GPU_TEST_SRC := tests/gpu_main.c tests/test_attention.c tests/test_step.c
all: build/nsa_gpu_tests build/nsa_wgmma_test

build/obj/src/cuda/%.o: src/cuda/%.cu $(CUDA_HDR)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(if $(filter 1,$(EXPERIMENTAL)),-DNSA_CUDA_EXPERIMENTAL=1,) -Iinclude -Isrc -c $< -o $@

build/obj/src/api.o build/nsa build/nsa_gpu_tests build/nsa_fuzz_replay $(KIT_OBJ): CFLAGS_BASE += $(CUDA_CFLAGS)

build/nsa_gpu_tests: $(GPU_TEST_SRC) $(KIT_H) $(KIT_LIB) build/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ $(GPU_TEST_SRC) $(KIT_LIB) build/libnsa.a $(LDLIBS)

# the Hopper primitives alone (tile loaders, descriptors, wgmma wrappers) against a host product
build/nsa_wgmma_test: tests/gpu_wgmma.cu $(CUDA_HDR)
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) -Iinclude -Isrc -o $@ tests/gpu_wgmma.cu
endif
# ---- end of the CUDA section --------------------------------------------------------------------

.PHONY: all lib test test-sanitize test-valgrind demo clean check fuzz fuzz-ci
comma := ,
all: build/libnsa.a build/libnsa.so build/nsa build/nsa_tests build/nsa_fuzz_replay

lib: build/libnsa.a build/libnsa.so

build/obj/%.o: %.c $(wildcard include/*.h src/*.h src/cpu/*.h src/cuda/*.h src/cuda/*/plan.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -c $< -o $@

build/libnsa.a: $(LIB_OBJ)
	@mkdir -p build
	ar rcs $@ $^

build/libnsa.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS)

# The test kit, compiled once; its objects also depend on its own headers.
$(KIT_OBJ): $(KIT_H)

$(KIT_LIB): $(KIT_OBJ)
	@mkdir -p build
	rm -f $@ && ar rcs $@ $^

build/nsa_tests: $(TEST_SRC) $(KIT_H) $(KIT_LIB) build/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ $(TEST_SRC) $(KIT_LIB) build/libnsa.a $(LDLIBS)

# The fuzz inputs without libFuzzer, on the backend --backend names (tests/fuzz/replay.c): the
# device memory check of scripts/device-check.sh, and the sanitized build's replay.
FUZZ_DECODE_H := tests/fuzz/decode.h tests/kit/op_calls.h
build/nsa_fuzz_replay: tests/fuzz/replay.c tests/fuzz/decode.c $(FUZZ_DECODE_H) $(KIT_H) $(KIT_LIB) build/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ tests/fuzz/replay.c tests/fuzz/decode.c $(KIT_LIB) build/libnsa.a $(LDLIBS)

build/nsa: tools/nsa_cli.c $(KIT_H) $(KIT_LIB) build/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ tools/nsa_cli.c $(KIT_LIB) build/libnsa.a $(LDLIBS)

# The README's C example is compiled from the README itself, so the two cannot drift.
build/readme_example.c: README.md
	@mkdir -p build
	awk '/^```c$$/{on=1;next} /^```$$/{if(on){exit}} on' README.md > $@

build/readme_example: build/readme_example.c build/libnsa.a
	$(CC) -std=c11 -Wall -Wextra -Werror -Iinclude -o $@ $< build/libnsa.a $(LDLIBS)

test: build/nsa_tests build/readme_example build/libnsa.so build/nsa
	./tests/run_all.sh

# libFuzzer over the public C API (CPU backend), library and harness built with ASan + UBSan
# into build/fuzz/; `make fuzz` fuzzes FUZZ_SECONDS on the corpus, `make fuzz-ci`
# (scripts/fuzz-check.sh, run by CI) first replays every file of tests/fuzz/regressions and the
# corpus, then fuzzes FUZZ_CI_SECONDS; any crash or violation fails.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 600
FUZZ_CI_SECONDS ?= 180
FUZZ_FLAGS := -std=c11 -g -O1 -Wno-pass-failed -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fopenmp -Iinclude -Isrc -Itests/kit
FUZZ_OBJ := $(LIB_SRC:%.c=build/fuzz/%.o)

build/fuzz/%.o: %.c $(wildcard include/*.h src/*.h src/cpu/*.h src/cuda/*.h src/cuda/*/plan.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(subst fuzzer$(comma),fuzzer-no-link$(comma),$(FUZZ_FLAGS)) -c $< -o $@

build/fuzz/tests/fuzz/decode.o: $(FUZZ_DECODE_H)

build/nsa_fuzz: tests/fuzz/fuzz_api.c build/fuzz/tests/fuzz/decode.o $(FUZZ_OBJ) $(FUZZ_DECODE_H)
	$(FUZZ_CC) $(FUZZ_FLAGS) -o $@ tests/fuzz/fuzz_api.c build/fuzz/tests/fuzz/decode.o $(FUZZ_OBJ) -lm

fuzz: build/nsa_fuzz
	@mkdir -p build/fuzz/corpus
	./build/nsa_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=512 -timeout=10 -print_final_stats=1 \
		-artifact_prefix=build/fuzz/ build/fuzz/corpus tests/fuzz/corpus

fuzz-ci: build/nsa_fuzz
	FUZZ_SECONDS=$(FUZZ_CI_SECONDS) bash scripts/fuzz-check.sh

# the CPU suite, the CLI's check and the fuzz replay under ASan + UBSan + LSan, in
# build-sanitize/ (CI runs it)
test-sanitize:
	bash scripts/sanitize-check.sh

# small runs of the CLI, the README example and the fuzz replay under valgrind memcheck, in
# build-valgrind/ (CI runs it)
test-valgrind:
	bash scripts/valgrind-check.sh

demo: build/nsa
	./build/nsa demo

check: build/nsa
	./build/nsa check --minutes 1

clean:
	rm -rf build build-sanitize build-valgrind
