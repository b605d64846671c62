"""Synthetic stand-ins for what the DeepSpeedExamples clients download, built locally by
tools/run_clients.py (models from configs with seeded random weights, tokenizers trained on
synthetic words, data files of the clients' own formats). Nothing is fetched."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(200)]


def synthetic_sentence(rng: random.Random, lo: int = 4, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def roberta_like_tokenizer(out: Path) -> Path:
    """A word-level fast tokenizer with roberta-base's special-token ids (``<s>`` 0, ``<pad>`` 1,
    ``</s>`` 2, ``<unk>`` 3, ``<mask>`` 4) over :data:`WORDS`, for HelloDeepSpeed's ``--tokenizer``
    (its model config hard-codes those ids). Returns the folder (``AutoTokenizer.from_pretrained``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    )
    fast.save_pretrained(out)
    return out


def tiny_opt(out: Path, seed: int = 0) -> Path:
    """A 2-layer OPT (hidden 32) with seeded random weights and a byte-level BPE tokenizer trained on
    synthetic sentences (``</s>`` as OPT's bos/eos, ``<pad>`` 1), saved with ``save_pretrained`` for
    DS-Chat's ``--model_name_or_path``. ``_name_or_path`` in config.json is the folder (DS-Chat loads
    the tokenizer from that name)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast, OPTConfig, OPTForCausalLM

    rng = random.Random(seed)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [synthetic_sentence(rng) for _ in range(400)], vocab_size=320, special_tokens=["<s>", "<pad>", "</s>", "<unk>"]
    )
    # OPT's tokenizer class (DS-Chat saves with save_vocabulary, which the generic fast class lacks)
    tok = GPT2TokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = OPTConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    OPTForCausalLM(config).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["_name_or_path"] = str(out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def chat_jsonfile(chat_root: Path, train: int, evaluation: int, seed: int = 0) -> None:
    """DS-Chat's ``local/jsonfile`` data set: ``<chat_root>/data/{train,eval}.json`` with
    prompt/chosen/rejected records (its own format, read by its LocalJsonFileDataset)."""
    rng = random.Random(seed)
    data = chat_root / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", train), ("eval", evaluation)):
        rows = [
            {
                "prompt": f"Human: {synthetic_sentence(rng)} Assistant:",
                "chosen": synthetic_sentence(rng),
                "rejected": synthetic_sentence(rng),
            }
            for _ in range(n)
        ]
        (data / f"{name}.json").write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> None:
    """``python tools/run_clients_fixtures.py opt DIR``: :func:`tiny_opt` in a separate interpreter (run
    with the client's PYTHONPATH, so the files are written by the transformers it will read them with)."""
    import sys

    kind, out = (argv if argv is not None else sys.argv[1:])[:2]
    {"opt": tiny_opt, "roberta": roberta_like_tokenizer}[kind](Path(out))


if __name__ == "__main__":
    main()
