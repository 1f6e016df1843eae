# nsa -- build, test and demo. `make demo` and `make test` are all a new machine needs.
# Outputs: build/libnsa.a, build/libnsa.so, build/nsa (CLI), build/nsa_tests, build/nsa_fuzz_replay
# (the fuzz inputs replayed on either backend); the test kit
# (tests/kit: harness, float64 reference, sweep, backend memory) is build/libnsa_testkit.a,
# linked by build/nsa_tests, build/nsa_gpu_tests and build/nsa.
# B: the build folder (every output goes under it); one per configuration is the tidy way
# to keep several (the recorded flags below make a changed configuration rebuild either way).
B ?= build
comma := ,
empty :=
space := $(empty) $(empty)
# A parallel build by default, one job per core, unless the command line chose its own -j.
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif
CC ?= cc
NATIVE ?= 1
OPT ?= -O3
ARCH := $(if $(filter 1,$(NATIVE)),-march=native,)
CFLAGS_BASE := -std=c11 -Wall -Wextra -Werror -fPIC -fopenmp -ffp-contract=fast -fno-math-errno -Wno-psabi -g $(OPT) $(ARCH) -Iinclude -Isrc
LDLIBS := -fopenmp -lm

# The CUDA planners are plain C: built in every configuration, so the CPU suite tests them.
LIB_SRC := src/api.c src/flex_route.c src/validate.c $(sort $(wildcard src/mod/*.c)) $(sort $(wildcard src/cpu/*.c)) src/cuda/plan.c $(sort $(wildcard src/cuda/*/plan.c))
LIB_OBJ := $(LIB_SRC:%.c=$(B)/obj/%.o)
KIT_SRC := $(sort $(wildcard tests/kit/*.c))
KIT_OBJ := $(KIT_SRC:%.c=$(B)/obj/%.o)
KIT_H := $(wildcard tests/kit/*.h)
KIT_LIB := $(B)/libnsa_testkit.a
TEST_SRC := tests/main.c $(filter-out tests/main.c tests/gpu_main.c tests/gpu_cp.c,$(sort $(wildcard tests/*.c)))

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
# CUDA_ARCHS: the GPUs this machine has (nvidia-smi's compute capabilities; 9.0 is built as
# sm_90a, whose wgmma / TMA kernels need it), else sm_80 and sm_90a, the two the kernels are
# tuned for (sm_80 code also runs on sm_86 / sm_89). Give CUDA_ARCHS="80 90a" to choose.
CUDA_ARCHS ?= $(or $(sort $(foreach c,$(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d . | grep -E '^[0-9]+$$'),$(if $(filter 90,$(c)),90a,$(c)))),80 90a)
NVCCFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC -Xcompiler -fvisibility=hidden $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a))
ifeq ($(filter clean install uninstall,$(MAKECMDGOALS)),)
$(info nsa: CUDA kernels for sm_$(subst $(space),$(comma) sm_,$(CUDA_ARCHS)) ($(if $(shell nvidia-smi -L 2>/dev/null),the GPUs found here,no GPU found: the default pair)); the first build compiles about 45 CUDA units, a few minutes on 2 cores (NSA_CUDA=0: CPU only))
endif
CUDA_SRC := $(sort $(wildcard src/cuda/*.cu src/cuda/*/*.cu))
CUDA_HDR := $(wildcard src/cuda/*.h src/cuda/*/*.h src/cuda/*/*.cuh src/*.h include/*.h)
CUDA_OBJ := $(CUDA_SRC:%.cu=$(B)/obj/%.o)
CUDA_CFLAGS := -DNSA_WITH_CUDA -I$(CUDA_HOME)/include
LIB_OBJ += $(CUDA_OBJ)
LDLIBS += -L$(CUDA_HOME)/lib64 -lcudart_static -lstdc++ -ldl -lrt -lpthread
GPU_TEST_SRC := tests/gpu_main.c tests/test_attention.c tests/test_step.c tests/test_flex.c
all: $(B)/nsa_gpu_tests $(B)/nsa_wgmma_test $(B)/nsa_cp_tests

# ptxas's report of each unit is kept beside its object ($@.ptxas: registers, spills, and whether
# it serialised a tile's wgmma products, which tests/run_all.sh checks); shown are its other
# lines (warnings, errors) and its performance-loss notes
$(B)/obj/src/cuda/%.o: src/cuda/%.cu $(CUDA_HDR) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(if $(filter 1,$(EXPERIMENTAL)),-DNSA_CUDA_EXPERIMENTAL=1,) -Iinclude -Isrc -Xptxas -v -c $< -o $@ 2> $@.ptxas; \
	rc=$$?; grep -E -v '^ptxas info|^    [0-9]+ bytes stack frame' $@.ptxas >&2; grep 'Performance Loss' $@.ptxas >&2; exit $$rc

$(B)/obj/src/api.o $(B)/nsa $(B)/nsa_gpu_tests $(B)/nsa_cp_tests $(B)/nsa_fuzz_replay $(KIT_OBJ): CFLAGS_BASE += $(CUDA_CFLAGS)

$(B)/nsa_gpu_tests: $(GPU_TEST_SRC) $(KIT_H) $(KIT_LIB) $(B)/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ $(GPU_TEST_SRC) $(KIT_LIB) $(B)/libnsa.a $(LDLIBS)

# context parallelism over NCCL on every GPU of the machine (NCCL loaded at run time)
$(B)/nsa_cp_tests: tests/gpu_cp.c $(B)/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -o $@ tests/gpu_cp.c $(B)/libnsa.a $(LDLIBS)

# the Hopper primitives alone (tile loaders, descriptors, wgmma wrappers) against a host product
$(B)/nsa_wgmma_test: tests/gpu_wgmma.cu $(CUDA_HDR)
	@mkdir -p $(B)
	$(NVCC) $(NVCCFLAGS) -Iinclude -Isrc -o $@ tests/gpu_wgmma.cu
endif
# ---- end of the CUDA section --------------------------------------------------------------------

# ---- version and configuration -------------------------------------------------------------------
VERSION_MAJOR := $(shell sed -n 's/^\#define NSA_VERSION_MAJOR \([0-9]*\).*/\1/p' include/nsa.h)
VERSION_MINOR := $(shell sed -n 's/^\#define NSA_VERSION_MINOR \([0-9]*\).*/\1/p' include/nsa.h)
VERSION_PATCH := $(shell sed -n 's/^\#define NSA_VERSION_PATCH \([0-9]*\).*/\1/p' include/nsa.h)
VERSION := $(VERSION_MAJOR).$(VERSION_MINOR).$(VERSION_PATCH)
SONAME := libnsa.so.$(VERSION_MAJOR)
# One build folder, several configurations: the flags of the last build are recorded in
# build/config.stamp (rewritten only when they change) and every object depends on it, so
# `make NSA_CUDA=0` after a CUDA build (or NATIVE=0 after NATIVE=1) rebuilds what it must.
CONFIG_STAMP := $(B)/config.stamp
CONFIG_LINE := cc=$(CC) cflags=$(CFLAGS_BASE) $(CFLAGS) cuda=$(NSA_CUDA) nvcc=$(NVCC) $(NVCCFLAGS) experimental=$(EXPERIMENTAL)
$(shell mkdir -p $(B) && { test -f $(CONFIG_STAMP) && echo '$(CONFIG_LINE)' | cmp -s - $(CONFIG_STAMP); } || echo '$(CONFIG_LINE)' > $(CONFIG_STAMP))

.PHONY: all lib test test-sanitize test-valgrind demo clean check fuzz fuzz-ci install uninstall
all: $(B)/libnsa.a $(B)/libnsa.so $(B)/nsa $(B)/nsa_tests $(B)/nsa_fuzz_replay

lib: $(B)/libnsa.a $(B)/libnsa.so

$(B)/obj/%.o: %.c $(wildcard include/*.h src/*.h src/mod/*.h src/cpu/*.h src/cuda/*.h src/cuda/*/plan.h) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -c $< -o $@

$(B)/libnsa.a: $(LIB_OBJ)
	@mkdir -p $(B)
	ar rcs $@ $^

# The shared library exports nsa.h's functions and nothing else (a version script made from the
# header's NSA_API declarations: no internal symbol, none of cudart's), under the SONAME
# libnsa.so.<major>.
$(B)/libnsa.map: include/nsa.h
	@mkdir -p $(B)
	{ echo '{ global:'; sed -n 's/^NSA_API.*[ *]\(nsa_[a-z0-9_]*\)(.*/    \1;/p' include/nsa.h; echo '  local: *; };'; } > $@

$(B)/libnsa.so: $(LIB_OBJ) $(B)/libnsa.map
	$(CC) -shared -Wl,-soname,$(SONAME) -Wl,--version-script=$(B)/libnsa.map -o $@ $(LIB_OBJ) $(LDLIBS)

# The test kit, compiled once; its objects also depend on its own headers.
$(KIT_OBJ): $(KIT_H)

$(KIT_LIB): $(KIT_OBJ)
	@mkdir -p $(B)
	rm -f $@ && ar rcs $@ $^

$(B)/nsa_tests: $(TEST_SRC) $(KIT_H) $(KIT_LIB) $(B)/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ $(TEST_SRC) $(KIT_LIB) $(B)/libnsa.a $(LDLIBS) -ldl

# The fuzz inputs without libFuzzer, on the backend --backend names (tests/fuzz/replay.c): the
# device memory check of scripts/device-check.sh, and the sanitized build's replay.
FUZZ_DECODE_H := tests/fuzz/decode.h tests/kit/op_calls.h
$(B)/nsa_fuzz_replay: tests/fuzz/replay.c tests/fuzz/decode.c $(FUZZ_DECODE_H) $(KIT_H) $(KIT_LIB) $(B)/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ tests/fuzz/replay.c tests/fuzz/decode.c $(KIT_LIB) $(B)/libnsa.a $(LDLIBS)

$(B)/nsa: tools/nsa_cli.c $(KIT_H) $(KIT_LIB) $(B)/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests/kit -o $@ tools/nsa_cli.c $(KIT_LIB) $(B)/libnsa.a $(LDLIBS)

# The README's C example is compiled from the README itself, so the two cannot drift.
$(B)/readme_example.c: README.md
	@mkdir -p $(B)
	awk '/^```c$$/{on=1;next} /^```$$/{if(on){exit}} on' README.md > $@

$(B)/readme_example: $(B)/readme_example.c $(B)/libnsa.a
	$(CC) -std=c11 -Wall -Wextra -Werror -Iinclude -o $@ $< $(B)/libnsa.a $(LDLIBS)

test: $(B)/nsa_tests $(B)/readme_example $(B)/libnsa.so $(B)/nsa
	B=$(B) ./tests/run_all.sh

# libFuzzer over the public C API (CPU backend), library and harness built with ASan + UBSan
# into build/fuzz/; `make fuzz` fuzzes FUZZ_SECONDS on the corpus, `make fuzz-ci`
# (scripts/fuzz-check.sh, run by CI) first replays every file of tests/fuzz/regressions and the
# corpus, then fuzzes FUZZ_CI_SECONDS; any crash or violation fails.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 600
FUZZ_CI_SECONDS ?= 180
FUZZ_FLAGS := -std=c11 -g -O1 -Wno-pass-failed -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fopenmp -Iinclude -Isrc -Itests/kit
FUZZ_OBJ := $(LIB_SRC:%.c=$(B)/fuzz/%.o)

$(B)/fuzz/%.o: %.c $(wildcard include/*.h src/*.h src/mod/*.h src/cpu/*.h src/cuda/*.h src/cuda/*/plan.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(subst fuzzer$(comma),fuzzer-no-link$(comma),$(FUZZ_FLAGS)) -c $< -o $@

$(B)/fuzz/tests/fuzz/decode.o: $(FUZZ_DECODE_H)

$(B)/nsa_fuzz: tests/fuzz/fuzz_api.c $(B)/fuzz/tests/fuzz/decode.o $(FUZZ_OBJ) $(FUZZ_DECODE_H)
	$(FUZZ_CC) $(FUZZ_FLAGS) -o $@ tests/fuzz/fuzz_api.c $(B)/fuzz/tests/fuzz/decode.o $(FUZZ_OBJ) -lm

fuzz: $(B)/nsa_fuzz
	@mkdir -p $(B)/fuzz/corpus
	$(B)/nsa_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=512 -timeout=10 -print_final_stats=1 \
		-artifact_prefix=$(B)/fuzz/ $(B)/fuzz/corpus tests/fuzz/corpus

fuzz-ci: $(B)/nsa_fuzz
	FUZZ_SECONDS=$(FUZZ_CI_SECONDS) bash scripts/fuzz-check.sh

# the CPU suite, the CLI's check and the fuzz replay under ASan + UBSan + LSan, in
# build-sanitize/ (CI runs it)
test-sanitize:
	bash scripts/sanitize-check.sh

# small runs of the CLI, the README example and the fuzz replay under valgrind memcheck, in
# build-valgrind/ (CI runs it)
test-valgrind:
	bash scripts/valgrind-check.sh

demo: $(B)/nsa
	$(B)/nsa demo

check: $(B)/nsa
	$(B)/nsa check --minutes 1

clean:
	rm -rf build build-sanitize build-valgrind

# ---- install: the header, both libraries, the CLI, pkg-config and CMake files, the license ------
# make install PREFIX=/usr/local DESTDIR=<staging root>. Consumers: `pkg-config --cflags --libs
# nsa` (add --static for libnsa.a), or CMake's find_package(nsa) -> nsa::nsa (shared) and
# nsa::nsa_static (static, with OpenMP and, in a CUDA build, cudart's link flags).
PREFIX ?= /usr/local
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
BINDIR ?= $(PREFIX)/bin
DATADIR ?= $(PREFIX)/share
# what a static link of libnsa.a needs besides it (pkg-config's Libs.private, CMake's static target)
STATIC_LIBS := $(LDLIBS)
INSTALL_LIB := $(DESTDIR)$(LIBDIR)

install: $(B)/libnsa.a $(B)/libnsa.so $(B)/nsa
	install -d $(DESTDIR)$(INCLUDEDIR) $(INSTALL_LIB)/pkgconfig $(INSTALL_LIB)/cmake/nsa $(DESTDIR)$(BINDIR) \
		$(DESTDIR)$(DATADIR)/licenses/nsa
	install -m 644 include/nsa.h $(DESTDIR)$(INCLUDEDIR)/nsa.h
	install -m 644 $(B)/libnsa.a $(INSTALL_LIB)/libnsa.a
	install -m 755 $(B)/libnsa.so $(INSTALL_LIB)/libnsa.so.$(VERSION)
	ln -sf libnsa.so.$(VERSION) $(INSTALL_LIB)/$(SONAME)
	ln -sf $(SONAME) $(INSTALL_LIB)/libnsa.so
	install -m 755 $(B)/nsa $(DESTDIR)$(BINDIR)/nsa
	install -m 644 LICENSE $(DESTDIR)$(DATADIR)/licenses/nsa/LICENSE
	printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$(LIBDIR)' 'includedir=$(INCLUDEDIR)' '' 'Name: nsa' \
		'Description: Native Sparse Attention and flash attention kernels for the CPU and NVIDIA GPUs' \
		'Version: $(VERSION)' 'Libs: -L$${libdir} -lnsa' 'Libs.private: $(STATIC_LIBS)' 'Cflags: -I$${includedir}' \
		> $(INSTALL_LIB)/pkgconfig/nsa.pc
	printf '%s\n' '# nsa $(VERSION): find_package(nsa) gives nsa::nsa (shared) and nsa::nsa_static.' \
		'get_filename_component(_nsa_root "$${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)' \
		'set(nsa_VERSION $(VERSION))' 'set(nsa_CUDA $(NSA_CUDA))' \
		'if(NOT TARGET nsa::nsa)' \
		'  add_library(nsa::nsa SHARED IMPORTED)' \
		'  set_target_properties(nsa::nsa PROPERTIES IMPORTED_LOCATION "$${_nsa_root}/$(notdir $(LIBDIR))/libnsa.so.$(VERSION)"' \
		'    IMPORTED_SONAME $(SONAME) INTERFACE_INCLUDE_DIRECTORIES "$${_nsa_root}/$(notdir $(INCLUDEDIR))")' \
		'  add_library(nsa::nsa_static STATIC IMPORTED)' \
		'  set_target_properties(nsa::nsa_static PROPERTIES IMPORTED_LOCATION "$${_nsa_root}/$(notdir $(LIBDIR))/libnsa.a"' \
		'    INTERFACE_INCLUDE_DIRECTORIES "$${_nsa_root}/$(notdir $(INCLUDEDIR))" INTERFACE_LINK_LIBRARIES "$(subst $(space),;,$(strip $(STATIC_LIBS)))")' \
		'endif()' > $(INSTALL_LIB)/cmake/nsa/nsaConfig.cmake
	printf '%s\n' 'set(PACKAGE_VERSION $(VERSION))' \
		'if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION OR NOT PACKAGE_FIND_VERSION_MAJOR STREQUAL "$(VERSION_MAJOR)")' \
		'  set(PACKAGE_VERSION_COMPATIBLE FALSE)' 'else()' '  set(PACKAGE_VERSION_COMPATIBLE TRUE)' \
		'  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)' '    set(PACKAGE_VERSION_EXACT TRUE)' '  endif()' 'endif()' \
		> $(INSTALL_LIB)/cmake/nsa/nsaConfigVersion.cmake

uninstall:
	rm -f $(DESTDIR)$(INCLUDEDIR)/nsa.h $(INSTALL_LIB)/libnsa.a $(INSTALL_LIB)/libnsa.so $(INSTALL_LIB)/$(SONAME) \
		$(INSTALL_LIB)/libnsa.so.$(VERSION) $(INSTALL_LIB)/pkgconfig/nsa.pc $(DESTDIR)$(BINDIR)/nsa
	rm -rf $(INSTALL_LIB)/cmake/nsa $(DESTDIR)$(DATADIR)/licenses/nsa

