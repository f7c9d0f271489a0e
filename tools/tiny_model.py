"""Make a tiny random Llama and its tokenizer that ``vllm.LLM(model=path)`` loads.

No download: the weights are random (fixed seed) and the byte-level BPE
tokenizer is trained here.  Hidden 128, 4 heads (head size 32: vLLM's CPU
attention rejects smaller heads), 2 layers, float32, safetensors; a few
seconds.  Positions up to 4096 (RoPE: no weights depend on it), so the
benchmark can run long outputs.

The default vocabulary (512) is trained on a few lines, so most sampled
tokens are lone bytes (their text alone ends in U+FFFD).  ``--vocab N`` trains
an N-token BPE on real English text instead, the docstrings and comments of
the standard library, so that few are: the realistic tokenizer for anything
that decodes text.

    python tools/tiny_model.py DIR [--vocab 4096]
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
from pathlib import Path

VOCAB_SIZE = 512
# Files of the standard library read for --vocab (sorted: the same text on
# every run of one Python).
REAL_TEXT_FILES = 400

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny model used for testing vLLM on a CPU.",
    "Async scheduling overlaps the CPU work of one step with the next step.",
    "Repetition penalty, presence penalty and frequency penalty need the output history.",
    "Bad words are token sequences that the sampler must never produce.",
    "Once upon a time there was a small language model that spoke in random tokens.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000.",
    "Python, Rust, C and C++ are programming languages; vLLM is written in Python.",
    "The scheduler decides which requests run in each step and how many tokens each gets.",
    "A placeholder token id of -1 is replaced once the sampled token ids reach the CPU.",
] * 20


def real_text(num_files: int = REAL_TEXT_FILES) -> list[str]:
    """Docstrings and comments of the standard library's modules, one line each."""
    lines = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted(stdlib.glob("*.py"))[:num_files]:
        text = source.read_text(encoding="utf-8", errors="replace")
        lines += [line.strip()[1:].strip() for line in text.splitlines()
                  if line.strip().startswith("#")]
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    lines += [line.strip() for line in doc.splitlines()]
    return [line for line in lines if line]


def _make_tokenizer(path: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = TRAINING_TEXT if vocab_size == VOCAB_SIZE else real_text()
    tokenizer.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def make_tiny_llama(path: str, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> str:
    """Write config, safetensors weights and tokenizer to ``path``; deterministic."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _make_tokenizer(path, vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # wider weights: clear greedy winners, no float ties
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--vocab", type=int, default=VOCAB_SIZE,
                        help=f"tokenizer vocabulary (default {VOCAB_SIZE}: the byte-level "
                             "one of a few lines; larger: trained on real English text)")
    args = parser.parse_args()
    print(make_tiny_llama(args.path, vocab_size=args.vocab))
