"""Sample text from an exported model with Hugging Face transformers, to see the model you trained.

python tools/generate.py --model HF_DIR --prompt "To be, or not" [--max-new-tokens 64] [--temperature 0.8]
"""
from __future__ import annotations

import argparse
import sys


def generate(model_dir: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 50,
             seed: int = 0) -> str:
    import torch  # here, not above: --help and a bad flag answer without torch and transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                         top_k=top_k if temperature > 0 else None)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="directory written by python -m tools.convert_checkpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(generate(args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
