# One command sets up and runs each job on a fresh machine (Python >= 3.10 with pip).
PY ?= python3
# torch/torchvision are pinned to the last releases that import together on CPU-only machines here.
INSTALL = $(PY) -m pip install -q "torch==2.14.1" "torchvision==0.29.1" -e ".[dev,seg,ood]"

.PHONY: install demo test lint bench

# pip compiles what it installs, not an editable checkout: where PYTHONDONTWRITEBYTECODE is set, every process
# would compile hf_sms from source again (0.2 s each, over a hundred processes in the tests)
install:
	$(INSTALL)
	$(PY) -m compileall -q hf_sms

demo: install
	$(PY) -m hf_sms.cli demo --output-dir demo-output

test: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q

lint:
	ruff check . && ruff format --check .
