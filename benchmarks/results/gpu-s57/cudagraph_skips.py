"""Whether Inductor's CUDA-graph trees still run the kvarn graphs of a transformers StaticCache model now that the
rewritten graphs keep writing the fp16 buffers (session 57): torch._dynamo's counters of cudagraph skips, after
a prefill and 10 decode steps of the tests' tiny Llama in fp16 (cudagraphs=True)."""
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, "tests")
import test_backend as tb  # noqa: E402

model = tb.tiny_model("llama", torch.float16).cuda()
fn = torch.compile(model, backend=tb.backend.kvarn_backend, fullgraph=True,
                   options={"keep_first_tile": False, "cudagraphs": True})  # fmt: skip
ids = torch.randint(0, 512, (tb.ROWS, 140)).cuda()
tb.run_chunks(fn, ids, [130] + [1] * 10, tb.static_cache(model))
print("cudagraph skips:", dict(counters["inductor"].get("cudagraph_skips", {}) or {}),
      {k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
