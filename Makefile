# nsa -- build, test and demo. `make demo` and `make test` are all a new machine needs.
# Outputs: build/libnsa.a, build/libnsa.so, build/nsa (CLI), build/nsa_tests.
CC ?= cc
NATIVE ?= 1
OPT ?= -O3
ARCH := $(if $(filter 1,$(NATIVE)),-march=native,)
CFLAGS_BASE := -std=c11 -Wall -Wextra -Werror -fPIC -fopenmp -ffp-contract=fast -fno-math-errno -g $(OPT) $(ARCH) -Iinclude -Isrc
LDLIBS := -fopenmp -lm

LIB_SRC := src/api.c src/validate.c $(sort $(wildcard src/cpu/*.c))
LIB_OBJ := $(LIB_SRC:%.c=build/obj/%.o)
TEST_SUPPORT := tests/harness.c tests/ref.c tests/sweep.c
TEST_SRC := $(TEST_SUPPORT) tests/main.c $(filter-out $(TEST_SUPPORT) tests/main.c,$(sort $(wildcard tests/*.c)))
CLI_SRC := tools/nsa_cli.c tests/harness.c tests/ref.c tests/sweep.c

.PHONY: all lib test demo clean check
all: build/libnsa.a build/libnsa.so build/nsa build/nsa_tests

lib: build/libnsa.a build/libnsa.so

build/obj/%.o: %.c $(wildcard include/*.h src/*.h src/cpu/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -c $< -o $@

build/libnsa.a: $(LIB_OBJ)
	@mkdir -p build
	ar rcs $@ $^

build/libnsa.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS)

build/nsa_tests: $(TEST_SRC) $(wildcard tests/*.h) build/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests -o $@ $(TEST_SRC) build/libnsa.a $(LDLIBS)

build/nsa: $(CLI_SRC) $(wildcard tests/*.h) build/libnsa.a
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -Itests -o $@ $(CLI_SRC) build/libnsa.a $(LDLIBS)

# The README's C example is compiled from the README itself, so the two cannot drift.
build/readme_example.c: README.md
	@mkdir -p build
	awk '/^```c$$/{on=1;next} /^```$$/{if(on){exit}} on' README.md > $@

build/readme_example: build/readme_example.c build/libnsa.a
	$(CC) -std=c11 -Wall -Wextra -Werror -Iinclude -o $@ $< build/libnsa.a $(LDLIBS)

test: build/nsa_tests build/readme_example
	./build/nsa_tests

demo: build/nsa
	./build/nsa demo

check: build/nsa
	./build/nsa check --minutes 1

clean:
	rm -rf build
