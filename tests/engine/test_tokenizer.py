"""Tokenizer.encode: the ids of the tokenizer.json pipeline, computed without holding the GIL (the
Triton stub tokenizes while its reader and response threads need the GIL)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from engine.tokenizer import Tokenizer

TEXTS = ["The quick brown fox", " leading space", "ünïcödé 漢字 emoji 🙂 and\ttabs\nnewlines", "a" * 3000,
         "<｜begin▁of▁sentence｜>already has a BOS", "x"]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return Tokenizer(tiny_dir)


def test_encode_gives_the_pipelines_ids_and_the_bos_once(tokenizer):
    for text in TEXTS:
        ids = tokenizer._tok.encode(text, add_special_tokens=False).ids
        bos = [tokenizer.bos_token_id] if tokenizer.add_bos and not text.startswith(tokenizer.bos_token) else []
        assert tokenizer.encode(text) == bos + ids
        assert tokenizer.encode(text, add_special_tokens=False) == ids


def test_encode_lets_other_python_threads_run(tokenizer):
    """With a switch interval far longer than the test, a thread waiting for the GIL gets it only
    when the holder lets go of it on its own: a thread woken just before encode runs during it
    only if encode releases the GIL (each call's tokens are ~1 ms of work; 20 tries)."""
    text = " ".join(TEXTS) * 20
    ready, woken, ran = threading.Event(), threading.Event(), threading.Event()

    def waiter():
        ready.set()
        woken.wait()
        ran.set()  # Python: needs the GIL

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    ready.wait()
    time.sleep(0.05)  # lets it block in woken.wait(), where it holds no GIL and wants none
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        woken.set()
        for _ in range(20):
            tokenizer.encode(text)
            if ran.is_set():
                break
        released = ran.is_set()
    finally:
        sys.setswitchinterval(interval)
        thread.join(10)
    assert released
