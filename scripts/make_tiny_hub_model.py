"""Write a tiny hub-style model folder: what `save_pretrained` leaves for a Qwen2 instruct model, at the size
of config/micro.yaml, so that every stage can be run on a hub architecture on a CPU in seconds.

- the model: `Qwen2ForCausalLM` from a `transformers.Qwen2Config` (2 layers, hidden size 64, grouped-query
  attention, q/k/v biases), random weights;
- the tokenizer: a byte-level BPE trained on the micro config's training problems, with a ChatML chat
  template (`<|im_start|>role\\ncontent<|im_end|>\\n`), EOS `<|im_end|>`, pad `<|endoftext|>` (as Qwen2.5
  instruct ships them) and no BOS; `--no-pad` leaves the pad token out (as Llama 3 ships it).

    python scripts/make_tiny_hub_model.py                          # models/qwen2-tiny
    python scripts/make_tiny_hub_model.py models/qwen2-tiny-nopad --no-pad
    snakemake --cores all results/gsm8k_rloo.json --configfile config/micro.yaml config/qwen2-tiny.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config  # noqa: E402

from rloo.model import models  # noqa: E402
from rloo_workflow.config import load_config  # noqa: E402
from rloo_workflow.stages.prepare import load_splits  # noqa: E402

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1}


def tokenizer_for(texts, vocab_size: int = 384, pad: bool = True) -> PreTrainedTokenizerFast:
    """ChatML special tokens, EOS <|im_end|>, no BOS; pad <|endoftext|> unless `pad` is False."""
    bpe = models.train_bpe(texts, vocab_size, [ENDOFTEXT, IM_START, IM_END])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=IM_END, pad_token=ENDOFTEXT if pad else None,
                                  extra_special_tokens=[IM_START], padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build(out: str | Path, config: str | Path = ROOT / "config" / "micro.yaml", pad: bool = True,
          seed: int = 0, max_positions: int | None = None) -> Path:
    """The folder `out`, loadable with AutoTokenizer / AutoModelForCausalLM.from_pretrained; its context
    is `max_positions` tokens (default: the config's model.max_length)."""
    cfg = load_config(config, {"tracking": {"enabled": False}})
    train, _, _, _ = load_splits(cfg)
    tok = tokenizer_for((t for r in train for t in (r["question"], r["answer"])), cfg["model"]["tiny"]["vocab_size"],
                        pad)
    qcfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=max_positions or cfg["model"]["max_length"],
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, **SIZES)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qcfg)
    models.set_generation_ids(model, tok)
    models.save_pretrained(model, tok, out)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="models/qwen2-tiny", help="the folder to write")
    ap.add_argument("--config", default=str(ROOT / "config" / "micro.yaml"), help="whose training problems")
    ap.add_argument("--no-pad", action="store_true", help="a tokenizer without a pad token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-positions", type=int, default=None,
                    help="its context in tokens (default: the config's model.max_length); a judge served by "
                         "vLLM needs room for two answers and the question")
    args = ap.parse_args(argv)
    print(build(args.out, args.config, pad=not args.no_pad, seed=args.seed, max_positions=args.max_positions))


if __name__ == "__main__":
    main()
