"""Diagnose full vs piecewise CUDA graphs: engines on the same prompts, per-step tokens/logprobs.
usage: graph_modes.py run DTYPE:MODE:SIZES OUT.json  |  graph_modes.py compare A.json B.json ..."""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
for k, v in (
    ("TORCHINDUCTOR_DETERMINISTIC", "1"),
    ("VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE", "0"),
    ("VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING", "0"),
):
    os.environ[k] = v


def run(spec, out):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests import test_vllm_plugin as t

    t0 = time.time()
    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    LlamaForCausalLM(LlamaConfig(**t.TINY_LLAMA)).to(torch.float16).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in t.PROMPT_LENGTHS]
    dtype, mode, sizes, *flags = spec.split(":")
    comp = {
        "cudagraph_capture_sizes": [int(s) for s in sizes.split(",")],
        "cudagraph_mode": mode,
        "cache_dir": tempfile.mkdtemp(),
        "inductor_compile_config": {"combo_kernels": False, "benchmark_combo_kernel": False},
    }
    kw = {"block_size": 128} if dtype == "auto" else {}
    if "noasync" in flags:
        kw["async_scheduling"] = False
    with t.engine(
        path,
        kv_cache_dtype=dtype,
        enforce_eager=(mode == "EAGER"),
        compilation_config=None if mode == "EAGER" else comp,
        gpu_memory_utilization=0.1,
        **kw,
    ) as llm:
        if "seq" in flags:
            runs = [t.generate(llm, p, n) for p, n in zip(prompts[:4], (24, 5, 16, 9))]
        else:
            runs = t.concurrent_runs(llm, prompts[:4])
    with open(out, "w") as f:
        json.dump({"spec": spec, "runs": runs, "seconds": time.time() - t0}, f)


def compare(files):
    res = []
    for name in files:
        with open(name) as f:
            res.append(json.load(f))
    for r in res:
        print(r["spec"], f"{r['seconds']:.0f}s", [x[0][:10] for x in r["runs"]])
    for i in range(len(res)):
        for j in range(i + 1, len(res)):
            rep = []
            for r, ((ta, la, _), (tb, lb, _)) in enumerate(zip(res[i]["runs"], res[j]["runs"])):
                first = next((s for s, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
                upto = len(ta) if first is None else first + 1
                d = [abs(x - y) for x, y in zip(la[:upto], lb[:upto])]
                rep.append(
                    f"req{r}: first token diff {first}, max logprob diff before it {max(d[:-1] or [0]):.2e}, at it {d[-1]:.2e}"
                )
            print(res[i]["spec"], "vs", res[j]["spec"], "\n   ", "\n    ".join(rep))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        compare(sys.argv[2:])
