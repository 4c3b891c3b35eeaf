"""Where a vLLM engine step's time goes, per KV-cache dtype: the wall time of every engine step of a burst
and the GPU kernels of a window of decode-only steps (torch.profiler), side by side in one run.

The burst's model and settings (``vllm_burst.py``), with all prompts added at once and the engine stepped
by hand (``LLMEngine.step``, engine core in-process) so that each step is timed and the profiler window
holds decode steps only. One subprocess per dtype, so that each engine gets the whole GPU.
Writes steps.json (per dtype: step seconds and batch sizes), kernels-DTYPE.txt and steps.md to --out.

    python benchmarks/vllm_step_profile.py --out DIR [--dtypes auto kvarn_k4v2_g128] [--prompts 256]
        [--output-len 256] [--max-num-seqs 256] [--profile-steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_burst import capacity, make_llm, random_prompts, save_config


def step_engine(args) -> dict:
    """Run the burst step by step in this process; profile ``--profile-steps`` decode steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    llm = make_llm(args.model, args.dtype, args)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = random_prompts([args.input_len] * args.prompts)
    # warm-up request, then the burst
    engine.add_request("warm", prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    steps, profiled, table = [], False, ""
    while engine.has_unfinished_requests():
        scheduler = engine.engine_core.engine_core.scheduler
        running, waiting = len(scheduler.running), len(scheduler.waiting)
        decode_only = waiting == 0 and len(steps) > 40  # past the prefills
        if decode_only and not profiled:
            gpu = torch.cuda.is_available()
            with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
                for _ in range(args.profile_steps):
                    engine.step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=25)
            profiled = True
            continue
        start = time.perf_counter()
        engine.step()
        steps.append({"seconds": time.perf_counter() - start, "running": running, "waiting": waiting})
    return {"dtype": args.dtype, "capacity": capacity(llm), "steps": steps, "kernels": table,
            "profile_steps": args.profile_steps}  # fmt: skip


def summary(run: dict) -> str:
    decode = [s["seconds"] for s in run["steps"] if s["waiting"] == 0 and s["running"] == max(
        r["running"] for r in run["steps"])][5:]  # fmt: skip
    batch = max(s["running"] for s in run["steps"])
    ms = 1e3 * statistics.median(decode) if decode else float("nan")
    return (f"| {run['dtype']} | {run['capacity']:,} | {len(run['steps'])} | {batch} | {len(decode)} | {ms:.2f} | "
            f"{batch / ms * 1e3:,.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one dtype, JSON to stdout's last line
    parser.add_argument("--model", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.dtype = args.one
        print("RESULT " + json.dumps(step_engine(args)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        save_config(pathlib.Path(tmp))
        for dtype in args.dtypes:
            cmd = [sys.executable, __file__, "--out", str(args.out), "--one", dtype, "--model", tmp]
            cmd += [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
                    ("prompts", "input-len", "output-len", "gpu-memory-utilization", "max-num-seqs", "profile-steps")]  # fmt: skip
            proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
            (args.out / f"engine-{dtype}.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
            line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{dtype}: engine failed (rc {proc.returncode}), see engine-{dtype}.log", flush=True)
                continue
            run = json.loads(line[len("RESULT ") :])
            (args.out / f"kernels-{dtype}.txt").write_text(run.pop("kernels"))
            runs.append(run)
            (args.out / "steps.json").write_text(json.dumps(runs, indent=1))
    table = ["| KV-cache dtype | capacity | steps | max batch | decode steps at max batch | median ms | tokens/s |",
             "|---|---|---|---|---|---|---|"] + [summary(r) for r in runs]  # fmt: skip
    (args.out / "steps.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
