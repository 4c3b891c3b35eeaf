"""The CLI: plan (arithmetic), the stdlib corpus, eval on SmolLM2 (the ordering the method promises), and
demo / eval end to end on a tiny random model saved with its own tokenizer."""

import json

import pytest
import torch

from kvarn_compile.cli.capacity import KVGeometry, parse_bytes, plan
from kvarn_compile.cli.corpus import load_corpus, stdlib_text
from kvarn_compile.cli.evaluate import Settings, evaluate, tokenize
from kvarn_compile.cli.main import main
from kvarn_compile.cli.models import load_model

QWEN3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36,
            "head_dim": 128}  # fmt: skip


def test_plan_dense():
    g = KVGeometry.from_config(QWEN3_8B)
    assert g.bytes_per_token("fp16") == 36 * 8 * 512
    assert g.bytes_per_token("kvarn_k4v2_g128") == 36 * 8 * 108
    rows = {r["method"]: r for r in plan(g, parse_bytes("40GB"), 32768)}
    assert rows["kvarn_k4v2_g128"]["tokens"] == 40_000_000_000 // (36 * 8 * 108)
    # a sequence: 255 quantized tiles + the current and first tiles exact in fp16
    per_seq = 36 * 8 * (255 * 128 * 108 + 2 * 128 * 512)
    assert rows["kvarn_k4v2_g128"]["sequences"] == 40_000_000_000 // per_seq
    assert rows["fp16"]["sequences"] == 40_000_000_000 // (36 * 8 * 512 * 32768)
    assert rows["kvarn_k4v2_g128"]["compression"] == pytest.approx(512 / 108)


def test_plan_hybrid_sliding_mla_and_unsupported():
    hybrid = {**QWEN3_8B, "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    assert KVGeometry.from_config(hybrid).bytes_per_token("fp16") == 8 * 512  # only the attention layer
    jamba = {**QWEN3_8B, "num_hidden_layers": 16, "attn_layer_period": 8, "attn_layer_offset": 4}
    assert len(KVGeometry.from_config(jamba).layers) == 2  # layers 4 and 12
    bamba = {**QWEN3_8B, "num_hidden_layers": 8, "attn_layer_indices": [3, 7]}
    assert len(KVGeometry.from_config(bamba).layers) == 2
    gemma = {**QWEN3_8B, "num_hidden_layers": 2, "sliding_window": 1024,
             "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    g = KVGeometry.from_config(gemma)
    assert g.bytes_per_sequence("fp16", 32768) == 8 * 512 * (1024 + 32768)  # a sliding layer holds its window
    mla = {"hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 2, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}  # fmt: skip
    g = KVGeometry.from_config(mla)
    assert g.layers[0] == g.layers[1]
    # MLA caches one latent and one rope key per token (transformers 5, vLLM): 1,152 B per layer in fp16
    assert g.bytes_per_token("fp16") == 2 * (512 + 64) * 2
    assert g.bytes_per_token("kvarn_k4v2_g128") == 2 * 402  # the latent tile: 51,456 B per 128 tokens
    # a sequence: all its tiles quantized (no exact first tile for latents), and the current tile's buffer
    assert g.bytes_per_sequence("kvarn_k4v2_g128", 1024) == 2 * (8 * 51_456 + 128 * 576 * 2)
    assert g.supported("kvarn_k4v4_g64") and not g.supported("fp8") and not g.supported("rtn_k4v2_g128")
    assert not KVGeometry.from_config({**mla, "kv_lora_rank": 576}).supported("kvarn_k4v2_g128")
    odd = {**QWEN3_8B, "head_dim": 96}
    rows = {r["method"]: r for r in plan(KVGeometry.from_config(odd), 10**9, 4096)}
    assert rows["fp8"]["supported"] and not rows["kvarn_k4v2_g128"]["supported"]
    g = KVGeometry.from_config(odd)
    assert g.supported("kivi2") and not g.supported("rtn_k4v2_g128")  # rtn stores the KVarN tile format


def plan_of_file(tmp_path, config: dict) -> KVGeometry:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return KVGeometry.from_file(path)


def test_plan_reads_configs_as_transformers_does(tmp_path):
    """A config.json holds only what differs from its class's defaults, and some classes derive the layers' kinds:
    ``plan`` reads it through transformers. Each count below is what the model's attention caches."""
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 256, "hidden_size": 3584, "sliding_window": 4096}  # fmt: skip
    layers = plan_of_file(tmp_path, gemma2).layers  # Gemma2 alternates sliding and full layers
    assert [layer.window for layer in layers[:4]] == [4096, 0, 4096, 0] and len(layers) == 42
    gemma3 = {"model_type": "gemma3", "text_config": {"num_hidden_layers": 34, "hidden_size": 2560,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 1024}}  # fmt: skip
    layers = plan_of_file(tmp_path, gemma3).layers  # defaults filled in; five sliding layers per global one
    assert [layer.window for layer in layers[:6]] == [1024] * 5 + [0] and len(layers) == 34
    mistral = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "sliding_window": 4096}  # fmt: skip
    assert {layer.window for layer in plan_of_file(tmp_path, mistral).layers} == {4096}  # every layer slides
    qwen3 = {"model_type": "qwen3", **QWEN3_8B, "sliding_window": 4096, "use_sliding_window": False}
    assert {layer.window for layer in plan_of_file(tmp_path, qwen3).layers} == {0}


def test_plan_reads_what_transformers_saved(tmp_path):
    """Configs as transformers writes them (Bamba's holds an infinite float, ``{"__float__": "Infinity"}``), GPT-2's
    names for heads and layers (``n_head``, ``n_layer``), and layer kinds beyond full and sliding (DeepSeek-V3.2's
    ``indexed_attention``) are read; a folder holding a config.json stands for it."""
    transformers = pytest.importorskip("transformers")
    transformers.BambaConfig(num_hidden_layers=8, attn_layer_indices=[3, 7]).save_pretrained(tmp_path / "bamba")
    assert len(KVGeometry.from_file(tmp_path / "bamba" / "config.json").layers) == 2
    transformers.GPT2Config(n_layer=3, n_head=4, n_embd=256).save_pretrained(tmp_path / "gpt2")
    gpt2 = KVGeometry.from_file(tmp_path / "gpt2" / "config.json")
    assert len(gpt2.layers) == 3 and gpt2.bytes_per_token("fp16") == 3 * 4 * 2 * 64 * 2
    dsa = {**QWEN3_8B, "num_hidden_layers": 3, "layer_types": ["full_attention", "indexed_attention", "mamba"]}
    assert len(KVGeometry.from_config(dsa).layers) == 2
    main(["plan", "--hf-config", str(tmp_path / "gpt2"), "--kv-memory", "1GB", "--json"])


def test_plan_counts_the_attention_layers_of_hybrid_models():
    zamba2 = {"num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 2560,
              "attention_head_dim": 160, "layers_block_type": ["mamba", "mamba", "hybrid"] * 2}  # fmt: skip
    assert KVGeometry.from_config(zamba2).bytes_per_token("fp16") == 2 * 32 * 2 * 160 * 2
    recurrent = {"num_hidden_layers": 26, "num_attention_heads": 10, "num_key_value_heads": 1, "head_dim": 256,
                 "hidden_size": 2560, "attention_window_size": 2048, "block_types": ["recurrent", "recurrent", "attention"]}  # fmt: skip
    layers = KVGeometry.from_config(recurrent).layers
    assert len(layers) == 8 and {layer.window for layer in layers} == {2048}  # layers 2, 5, ..., 23: local
    nemotron = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
                "layers_block_type": ["mamba", "moe", "full_attention", "mlp"]}  # (no num_hidden_layers)  # fmt: skip
    assert len(KVGeometry.from_config(nemotron).layers) == 1
    llama4 = {**QWEN3_8B, "num_hidden_layers": 4, "attention_chunk_size": 8192,
              "layer_types": ["chunked_attention"] * 3 + ["full_attention"]}  # fmt: skip
    assert [layer.window for layer in KVGeometry.from_config(llama4).layers] == [8192, 8192, 8192, 0]
    mimo = {**QWEN3_8B, "head_dim": 192, "v_head_dim": 128}
    assert KVGeometry.from_config(mimo).layers[0].head_dim_v == 128
    with pytest.raises(ValueError, match="no attention layer"):
        KVGeometry.from_config({"num_hidden_layers": 32, "hidden_size": 2560, "state_size": 16})  # Mamba


def test_mla_geometry_of_what_is_cached():
    """MLA caches its latent (transformers, vLLM); the CLI's eval and demo run ``KVSession``, which quantizes the
    per-head keys (no-rope + rope) and values the latent expands to, and report those bytes."""
    mla = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 2,
           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64}  # fmt: skip
    expanded = KVGeometry.from_config(mla, latent_cache=False)
    assert expanded.bytes_per_token("fp16") == 2 * 16 * (192 + 128) * 2
    assert expanded.supported("fp8")  # (the latent geometry has no fp8: eval's default methods include it)


def test_parse_bytes():
    assert parse_bytes("40GB") == 40 * 10**9 and parse_bytes("2 GiB") == 2 * 2**30 and parse_bytes("512") == 512
    assert parse_bytes("40G") == parse_bytes("40gb") == 40 * 10**9 and parse_bytes("4kB") == 4000
    for bad in ("forty", "0GB", "-1GB", "40 GX"):
        with pytest.raises(ValueError, match="at least one byte, like 40GB"):
            parse_bytes(bad)


@pytest.mark.parametrize("argv, message", [
    (["plan", "--hf-config", "nope.json", "--kv-memory", "40GB"], "expected a config.json"),
    (["plan", "--hf-config", __file__, "--kv-memory", "0.5"], "at least one byte"),
    (["plan", "--hf-config", __file__, "--kv-memory", "40GB", "--context", "0"], "positive integer"),
    (["eval", "--methods", "fp16, kvarn_k4v2_g128,bogus"], "unknown KV method 'bogus'"),
    (["eval", "--tokens", "1"], "expected an integer of at least 2, got '1'"),  # (n tokens score n - 1)
    (["eval", "--window", "0"], "at least 2"),
    (["eval", "--methods", "fp16,kvarn_k4v2_g128,fp16"], "each method once, got fp16 more than once"),
    (["eval", "--plot", "no-such-folder/p.png"], "folder does not exist"),
    (["demo", "--preset", "kvarn_k3v2_g128"], "not a KVarN preset name"),
    (["inspect", "--hf-config", "nope.json"], "expected a config.json"),
    (["eval", "--tokens", "32k"], "expected an integer of at least 2, got '32k'"),
    (["demo", "--max-new-tokens", "32k"], "expected a positive integer, got '32k'"),
])  # fmt: skip
def test_bad_arguments_fail_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_plan_cli(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_8B))
    main(["plan", "--hf-config", str(cfg), "--kv-memory", "40GB", "--context", "32768", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows][:3] == ["fp16", "fp8", "kvarn_k4v2_g128"]
    # the arguments reach the plan: 40 GB, sequences of 32,768 tokens, the first tile kept exact (as test_plan_dense)
    assert rows[2]["tokens"] == 40_000_000_000 // (36 * 8 * 108)
    assert rows[2]["sequences"] == 40_000_000_000 // (36 * 8 * (255 * 128 * 108 + 2 * 128 * 512))


def test_corpus(tmp_path):
    text = stdlib_text()
    assert len(text) > 200_000 and text == stdlib_text.__wrapped__() and "argument" in text
    f = tmp_path / "t.txt"
    f.write_text("héllo", encoding="utf-8")
    assert load_corpus(str(f)) == "héllo"
    with pytest.raises(FileNotFoundError, match="stdlib"):
        load_corpus(str(tmp_path / "missing.txt"))


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", torch.device("cpu"))


@pytest.mark.long
def test_eval_on_smollm2_orders_the_methods(smollm2):
    model, tokenizer = smollm2
    ids = tokenize(tokenizer, stdlib_text())
    settings = Settings(tokens=512, window=512, prompts=1, prompt_tokens=256, new_tokens=8)
    report = evaluate(model, ids, ["fp16", "kvarn_k4v2_g128", "rtn_k4v2_g128"], settings, progress=False)
    r = {x["method"]: x for x in report["results"]}
    assert r["fp16"]["kl"] == 0 and r["fp16"]["top1"] == 1 and r["fp16"]["greedy_prefix"] == 8
    # measured (2026-12-06): KL 0.0078 against plain RTN's 0.0129, perplexity +0.58%, top-1 0.965
    assert 0 < r["kvarn_k4v2_g128"]["kl"] < 0.8 * r["rtn_k4v2_g128"]["kl"]
    assert r["kvarn_k4v2_g128"]["ppl"] < r["fp16"]["ppl"] * 1.02
    assert r["kvarn_k4v2_g128"]["top1"] > 0.94
    assert len(report["kl_by_position"]["kvarn_k4v2_g128"]) == 511
    # the first two tiles see no quantized history (tile 0 is kept exact): no error there
    assert max(report["kl_by_position"]["kvarn_k4v2_g128"][:255]) == 0
    # the real paged cache gives what its simulation gives
    paged = evaluate(model, ids, ["kvarn_k4v2_g128"], Settings(**{**vars(settings), "paged": True}), progress=False)
    assert paged["results"][0]["kl"] == pytest.approx(r["kvarn_k4v2_g128"]["kl"], rel=0.02)  # 0.3% apart measured


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama with a byte-level BPE tokenizer trained on the stdlib corpus, saved to disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.hf_models import tiny_model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([stdlib_text()[:200_000]], trainers.BpeTrainer(vocab_size=512, special_tokens=["<eos>"]))
    path = tmp_path_factory.mktemp("tiny-llama")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(path)
    tiny_model("llama", vocab_size=512).save_pretrained(path)
    return path


def test_demo_end_to_end(tiny_model_dir, capsys):
    main(["demo", "--model", str(tiny_model_dir), "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert "--- fp16 ---" in out and "--- kvarn_k4v2_g128 ---" in out
    ratio = float(out.split("KV bytes per token (long context)")[1].split("x less")[0].split()[-1])
    # head_dim 64: fp16's 256 B per token per head against the tile's 7,296 B / 128 tokens = 57 B
    assert ratio == pytest.approx(256 / 57, abs=0.01)
    # what the two sessions held: the KVarN one quantized all but its first and current tiles (2.14x on 748 tokens)
    held = float(out.split("KV bytes (")[1].split("x less")[0].split()[-1])
    assert 2 < held < ratio
    assert "perplexity" in out and "generations:" in out


def test_accumulation_averages_the_tiles_that_read_quantized_history(tiny_model_dir):
    """Fed a tile a call, the first call (and the second, where the first tile stays exact) reads no quantized
    history: their errors are zero and stay out of the mean (they lowered it by 12.5% at a 2,048 window). A window
    with no other call says so."""
    from kvarn_compile.cli.evaluate import accumulation

    model, tokenizer = load_model(str(tiny_model_dir))
    ids = tokenize(tokenizer, stdlib_text()[:20_000])
    three = accumulation(model, ids, ["fp8"], Settings(tokens=384, window=384), progress=False)["fp8"]
    assert all(e > 0 for e in three["fed_forward"] + three["recorded"])  # one call left: the third tile's
    with pytest.raises(ValueError, match="more than 2 tiles of 128 tokens"):
        accumulation(model, ids, ["fp8"], Settings(tokens=256, window=256), progress=False)


def test_eval_cli_json_and_plot(tiny_model_dir, tmp_path, capsys):
    png = tmp_path / "eval.png"
    main(["eval", "--model", str(tiny_model_dir), "--tokens", "300", "--methods", "fp16,kvarn_k4v2_g64,kivi2,fp8",
          "--prompts", "1", "--prompt-tokens", "130", "--new-tokens", "4", "--accumulation", "--json", "--plot",
          str(png)])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert {"model", "corpus", "tokens", "results", "accumulation"} <= report.keys()
    assert [r["method"] for r in report["results"]] == ["fp16", "kvarn_k4v2_g64", "kivi2", "fp8"]
    assert set(report["results"][0]) >= {"method", "ppl", "kl", "top1", "greedy_prefix"}
    # the protocol: layer 0 sees the same inputs either way (equal errors); from layer 1 on, fed-forward
    # errors include what earlier layers' quantization did to the inputs (here larger, for every method)
    assert report["accumulation"].keys() == {"kvarn_k4v2_g64", "kivi2", "fp8"}
    for acc in report["accumulation"].values():
        assert len(acc["fed_forward"]) == len(acc["recorded"]) == 2
        assert acc["fed_forward"][0] == pytest.approx(acc["recorded"][0], rel=1e-6) and acc["recorded"][0] > 0
        assert acc["fed_forward"][1] > acc["recorded"][1] > 0
    assert png.stat().st_size > 10_000
    # the table, and the accumulation curves, as text
    main(["eval", "--model", str(tiny_model_dir), "--tokens", "300", "--methods", "fp16,kvarn_k4v2_g64", "--prompts",
          "1", "--prompt-tokens", "130", "--new-tokens", "4", "--accumulation"])  # fmt: skip
    text = capsys.readouterr().out
    table = text.split("relative L2 error")[0].splitlines()  # the header, a row per method (then the curves)
    assert [line.split()[0] for line in table[1:] if line.strip()] == ["fp16", "kvarn_k4v2_g64"]
    fed, recorded = (line for line in text.splitlines() if line.startswith(("fed forward", "recorded only")))
    assert len(fed.split()) == len(recorded.split()) == 2 + 1 + 2  # label words, the method, 2 layers
    with pytest.raises(SystemExit):  # refused while parsing, before the model loads
        main(["eval", "--model", str(tiny_model_dir), "--tokens", "300", "--methods", "fp16,int3"])
    assert "unknown KV method 'int3'" in capsys.readouterr().err
