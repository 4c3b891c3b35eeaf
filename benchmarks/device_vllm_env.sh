# Source on the device tool's GPU machine (no package index) after the vLLM 0.23 bundle's install.sh
# (../shared/device/vllm023/make-bundle.sh): puts vLLM and this checkout on PYTHONPATH and registers the
# package's entry points (the vLLM plugin, the torch.compile backend) without pip, through a dist-info
# folder that importlib.metadata finds on the path.
ep=/tmp/kvarn-entry-points/kvarn_compile-0.1.0.dist-info
mkdir -p "$ep"
printf 'Metadata-Version: 2.1\nName: kvarn-compile\nVersion: 0.1.0\n' > "$ep/METADATA"
printf '[vllm.general_plugins]\nkvarn = kvarn_compile.integrations.vllm:register\n\n[torch_dynamo_backends]\nkvarn = kvarn_compile.backend:kvarn_backend\n' > "$ep/entry_points.txt"
export PYTHONPATH="/tmp/vllm023-site:$PWD:/tmp/kvarn-entry-points${PYTHONPATH:+:$PYTHONPATH}"
