"""Train the tiny checkpoints' tokenizer once; the result is committed as engine/data/tokenizer.json.

Byte-level BPE (as DeepSeek's own tokenizer), trained on tools/data/corpus.txt, which the
repository ships: docstrings of Python's standard library (PSF licence) plus a few lines
of multilingual text so multi-byte UTF-8 characters are split across tokens in tests.
Run: python -m tools.train_tokenizer [--vocab-size 4000]
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = Path(__file__).parent / "data"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]
MULTILINGUAL = """\
Grüße aus Köln: Äpfel, Öl und Übermut.
Voilà ! Ça coûte 15 € — très cher, n'est-ce pas ?
Привет, мир! Как дела?
こんにちは、世界。今日はいい天気ですね。
你好，世界！深度求索。
안녕하세요 세계
🙂 🚀 ✨ emoji survive detokenization 🎉
"""


def build_corpus(out: Path, max_bytes: int = 1_500_000) -> None:
    """Collect stdlib docstrings, deterministically (sorted module names)."""
    chunks, size = [MULTILINGUAL * 20], 0
    names = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))
    for name in names:
        if size > max_bytes:
            break
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - some stdlib modules need a display, a C lib, ...
            continue
        for obj in [mod, *vars(mod).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                chunks.append(doc.strip())
                size += len(doc)
    out.write_text("\n\n".join(chunks), encoding="utf-8")


def train(corpus: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab-size", type=int, default=4000)
    args = ap.parse_args()
    corpus = DATA / "corpus.txt"
    if not corpus.exists():
        build_corpus(corpus)
    train(corpus, args.vocab_size).save(str(DATA / "tokenizer.json"))
    print(f"wrote {DATA / 'tokenizer.json'}")


if __name__ == "__main__":
    main()
