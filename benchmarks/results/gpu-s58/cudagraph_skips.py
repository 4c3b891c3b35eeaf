"""Whether Inductor's CUDA-graph trees run the kvarn graphs whose rewritten form keeps writing the fp16 buffers
(session 57), for the three ways a model holds its cache buffers: transformers' StaticCache (static addresses,
session 57's probe), gpt-fast's module buffers, and buffers passed as plain inputs to a compiled function
(reasoned in session 57 to make the trees skip: "mutated inputs"). Prints torch._dynamo's cudagraph counters
after each case's prefill and decode steps, and each case's largest difference from the same steps run eagerly
without kvarn (the quantization's own error)."""

import logging
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, "tests")
import test_backend as tb  # noqa: E402
from gpt_fast_model import GPTFast  # noqa: E402

messages = []


class Keep(logging.Handler):
    def emit(self, record):
        if "cudagraph" in record.getMessage().lower() or "skipping" in record.getMessage().lower():
            messages.append(record.getMessage()[:300])


for name in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.compile_fx"):
    logging.getLogger(name).addHandler(Keep())
torch._logging.set_logs(perf_hints=True)
OPTIONS = {"keep_first_tile": False, "cudagraphs": True}


def report(case, got, want):
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    print(f"{case}: counters {skips}; max |kvarn - plain| {(got.float() - want.float()).abs().max():.4f}; "
          f"messages {messages}", flush=True)
    counters.clear()
    messages.clear()
    torch._dynamo.reset()


def static_cache():
    model = tb.tiny_model("llama", torch.float16).cuda()
    fn = torch.compile(model, backend=tb.backend.backend_with(**OPTIONS), fullgraph=True)
    ids = torch.randint(0, 512, (tb.ROWS, 140)).cuda()
    chunks = [130] + [1] * 10
    got = tb.run_chunks(fn, ids, chunks, tb.static_cache(model))
    want = tb.run_chunks(model, ids, chunks, tb.static_cache(model))
    report("transformers StaticCache", got, want)


def gpt_fast():
    torch.manual_seed(0)
    model = GPTFast(dtype=torch.float16).cuda().half().eval()
    torch.manual_seed(0)
    plain = GPTFast(dtype=torch.float16).cuda().half().eval()
    fn = torch.compile(model, backend=tb.backend.backend_with(**OPTIONS), fullgraph=True)
    ids = torch.randint(0, 512, (tb.ROWS, 140)).cuda()
    calls = [torch.arange(0, 130)] + [torch.arange(t, t + 1) for t in range(130, 140)]
    got, want = [], []
    with torch.no_grad():
        for pos in calls:
            pos = pos.cuda()
            got.append(fn(ids[:, pos], pos).clone())
            want.append(plain(ids[:, pos], pos))
    report("gpt-fast module buffers", torch.cat(got, 1), torch.cat(want, 1))


def plain_inputs():
    inputs = tb.attention_inputs(7, "cuda")
    q = inputs[0][0][0]
    fn = torch.compile(tb.attend_and_store, backend=tb.backend.backend_with(inner="inductor", **OPTIONS))
    got = tb.run_attention({0: (fn, inputs, tb.empty_buffers(q))})[0]
    want = tb.run_attention({0: (tb.attend_and_store, inputs, tb.empty_buffers(q))})[0]
    report("plain-input buffers", got, want)


for case in (static_cache, gpt_fast, plain_inputs):
    try:
        case()
    except Exception as e:  # one case's failure must not hide the others'
        print(f"{case.__name__}: {type(e).__name__}: {str(e)[:500]}", flush=True)
